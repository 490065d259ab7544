"""What ``dpprof watch`` says about a command it watched: how it ended, its peaks in one
sentence, and the post-mortem of its first out-of-memory error with the checks to run next.
Pure: each function reads only the :class:`~dpprof.result.WatchResult`."""

from __future__ import annotations

from dpprof.answers.answer_figures import balanced, excess_over_median
from dpprof.result import WatchOom, WatchResult
from dpprof.units import fmt_bytes


def _ending(w: WatchResult) -> str:
    if not w.complete:
        return (f"the samples end at {w.duration_s or 0:.1f} s without the command's end: dpprof "
                "or the machine stopped first")
    if w.signal:
        return f"killed by {w.signal} after {w.duration_s or 0:.1f} s (exit status {w.exit_status})"
    return f"exited with status {w.returncode} after {w.duration_s or 0:.1f} s"


def watch_ending(w: WatchResult) -> str:
    """How the watched command ended, in words."""
    return _ending(w)


def _pct(n: int, total: int | None) -> str:
    return f" ({100 * n / total:.0f}%)" if total else ""


def watch_verdict(w: WatchResult, imbalance: float | None) -> str:
    """One sentence: the peak per GPU, the imbalance, how the command ended."""
    peaks = [d for d in w.devices if d.peak_used_bytes is not None]
    if not peaks:
        return f"No GPU memory reading was taken; the command {_ending(w)}."
    text = "Peak used memory: " + ", ".join(
        f"cuda:{d.cuda_index} {fmt_bytes(d.peak_used_bytes)}" for d in peaks)
    if len(peaks) > 1 and imbalance is not None:
        text += f" (max/mean {imbalance:.2f})"
    if w.ooms:
        where = w.ooms[0].cuda_index
        text += (f"; the command ran out of CUDA memory on cuda:{where}" if where is not None
                 else "; the command ran out of CUDA memory")
    return f"{text}; it {_ending(w)}."


def post_mortem(w: WatchResult) -> tuple[list[str], list[str]]:
    """What happened at the first out-of-memory error, and which dpprof checks to run next.

    Pure: reads only ``w``. Empty when the command's output had no out-of-memory error. The
    GPU that ran out is measured against the median of the others as the comparison measures
    cuda:0 (:func:`excess_over_median`, :func:`balanced`).
    """
    if not w.ooms:
        return [], []
    oom = w.ooms[0]
    lines = _oom_lines(w, oom) + _readings_lines(oom, w)
    balance, unbalanced = _balance_line(oom, w)
    if balance:
        lines.append(balance)
    return lines, _next_steps(w, unbalanced)


def _oom_lines(w: WatchResult, oom: WatchOom) -> list[str]:
    """The first out-of-memory message in words: the GPU, the size asked for, how full it
    was, and whether the GPU it names is the one watched."""
    by_cuda = {d.cuda_index: d for d in w.devices}
    dev = by_cuda.get(oom.cuda_index) if oom.cuda_index is not None else None
    lines: list[str] = []
    if oom.cuda_index is None:
        lines.append(f"The command hit a CUDA out-of-memory error ({oom.text[:120]}) that "
                     "names neither the GPU nor the size.")
    else:
        label = f"cuda:{oom.cuda_index}"
        if dev is not None:
            label += f" ({', '.join(x for x in (dev.name, dev.uuid) if x)})"
        asked = fmt_bytes(oom.requested_bytes) if oom.requested_bytes is not None else "?"
        text = f"PyTorch ran out of memory on {label}: it tried to allocate {asked}"
        if oom.free_bytes is not None and oom.total_bytes is not None:
            text += f" with {fmt_bytes(oom.free_bytes)} of {fmt_bytes(oom.total_bytes)} free"
        if oom.allocated_by_pytorch_bytes is not None:
            text += f"; PyTorch itself held {fmt_bytes(oom.allocated_by_pytorch_bytes)}"
            if oom.reserved_unallocated_bytes:
                text += f" plus {fmt_bytes(oom.reserved_unallocated_bytes)} reserved but unused"
        lines.append(text + ".")
        if dev is None:
            lines.append(f"cuda:{oom.cuda_index} was not watched (watched: "
                         f"{', '.join(f'cuda:{i}' for i in sorted(by_cuda))}).")
        elif dev.total_bytes and oom.total_bytes and (
                abs(dev.total_bytes - oom.total_bytes) > 0.1 * dev.total_bytes):
            lines.append(
                f"PyTorch's GPU {oom.cuda_index} has {fmt_bytes(oom.total_bytes)} but the "
                f"watched cuda:{oom.cuda_index} has {fmt_bytes(dev.total_bytes)}: the command "
                "probably set CUDA_VISIBLE_DEVICES itself, so this may be another GPU.")
    if len(w.ooms) > 1:
        where = sorted({o.cuda_index for o in w.ooms if o.cuda_index is not None})
        lines.append(f"{len(w.ooms)} different out-of-memory messages in the output"
                     + (f" (on {', '.join(f'cuda:{i}' for i in where)})" if where else "")
                     + "; the first one is described here.")
    return lines


def _readings_lines(oom: WatchOom, w: WatchResult) -> list[str]:
    """What NVML's last reading before the message shows of each GPU."""
    lines: list[str] = []
    at = oom.used_at_oom_bytes
    if at:
        cells = [f"cuda:{d.cuda_index} {fmt_bytes(at[k])}{_pct(at[k], d.total_bytes)}"
                 for d in w.devices if (k := f"cuda:{d.cuda_index}") in at]
        lines.append("At the last reading before the message, the GPUs held: "
                     + ", ".join(cells) + ".")
        key = f"cuda:{oom.cuda_index}"
        in_use = (oom.total_bytes - oom.free_bytes
                  if oom.total_bytes is not None and oom.free_bytes is not None else None)
        if key in at and in_use is not None and at[key] < 0.8 * in_use:
            lines.append(
                f"NVML's last reading of {key} ({fmt_bytes(at[key])}) is well below the "
                f"{fmt_bytes(in_use)} in use that PyTorch reports: the memory rose between "
                "two readings (a shorter --interval sees more of it).")
    elif oom.t_s is not None:
        lines.append("No reading was taken before the message.")
    return lines


def _balance_line(oom: WatchOom, w: WatchResult) -> tuple[str | None, bool]:
    """The GPU that ran out against the median of the others at the last reading, and
    whether its excess is nn.DataParallel's imbalance on the first GPU."""
    at = oom.used_at_oom_bytes
    line: str | None = None
    unbalanced = False
    key = f"cuda:{oom.cuda_index}"
    if oom.cuda_index is not None and key in at and len(at) > 1:
        excess = excess_over_median(at[key], [v for k, v in at.items() if k != key])
        primary = min(d.cuda_index for d in w.devices)
        if balanced(excess, at[key]):
            line = (
                f"The GPUs were about equally full ({key} within {fmt_bytes(abs(excess))} of "
                "the median of the others): the step itself does not fit, not one GPU's "
                "share of it.")
        elif excess < 0:
            line = (
                f"{key} held {fmt_bytes(-excess)} less than the median of the other GPUs at "
                "the last reading: it filled up between two readings, or another process "
                "took its memory.")
        elif oom.cuda_index == primary:
            unbalanced = True
            line = (
                f"{key} held {fmt_bytes(excess)} more than the median of the other GPUs: the "
                "load was unbalanced. Under nn.DataParallel the first GPU also holds the "
                "outputs gathered from the whole batch, the loss and its gradient, the "
                "gradients reduced from every replica and the optimizer state.")
        else:
            line = (
                f"{key} held {fmt_bytes(excess)} more than the median of the other GPUs, but it "
                f"is not the first GPU (cuda:{primary}), where nn.DataParallel puts its extra "
                "load: look for tensors or a model part placed on it explicitly.")
    return line, unbalanced


def _next_steps(w: WatchResult, unbalanced: bool) -> list[str]:
    """The dpprof checks to run next."""
    n = max(len(w.devices), 1)
    totals = [d.total_bytes for d in w.devices if d.total_bytes]
    # without NVML's totals the compare default (the catalog's A100 80GB) stands
    memory = f" --gpu-memory {int(min(totals) / 2**30 * 10) / 10:g}GiB" if totals else ""
    compare = ("dpprof compare --workload your_module:workload --batch <your batch> "
               f"--gpus {n}{memory}")
    steps: list[str] = []
    if unbalanced:
        steps.append(
            "If the script uses nn.DataParallel, compute the loss inside forward on every "
            "replica: model = nn.DataParallel(dpprof.ModelWithLoss(model, loss_fn)); "
            "loss = dpprof.ModelWithLoss.combine(model(inputs, targets)); or move to "
            "DistributedDataParallel (one process per GPU).")
    steps.append("Measure what each fix saves before changing the script: write the training "
                 "step as a dpprof.Workload (model, loss, optimizer, a batch) and run "
                 + compare + ".")
    if not unbalanced:
        steps.append(f"{compare} also shows the single-GPU floor: if even 'single' does not "
                     "fit, lower the batch per GPU, use activation checkpointing or more GPUs.")
    return steps
