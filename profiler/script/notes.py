"""What ``dpprof run``'s result says of the script's runs: the notes (how a run ended,
what dpprof kept it from writing, where a library branched on a stand-in value), the fixes
an alternative run measured, with the change as a diff of the script's own lines, the
verdict, and the assumptions."""

from __future__ import annotations

import os
import re

from dpprof.emulator.stand_in_values import STAND_INS
from dpprof.fixes.fix_kind import FixKind
from dpprof.result import STATUS_ERROR, Fix, ScriptWrite, SealCheck
from dpprof.script import namespace
from dpprof.script.installed_code import installed_site
from dpprof.script.runner import ScriptConfig, ScriptRun
from dpprof.script.seal_audit import WHERE_NAMESPACES

__all__ = [
    "alternative_fix",
    "alternative_notes",
    "how_it_ended",
    "library_branches",
    "nothing_on_a_gpu",
    "raised_on_a_share",
    "script_assumptions",
    "seal_fields",
    "seal_notes",
    "shown_path",
    "write_notes",
]


def library_branches(sites: dict[str, int]) -> list[str]:
    """Where a library (not the script: :mod:`dpprof.script.installed_code`) decided
    something on a stand-in: the GPU, which has the real value, may take the other path
    there."""
    found = []
    for key in sites:
        site, _, kind = key.rpartition(" (")
        path, _, line = site.rpartition(":")
        relative = installed_site(path)
        if kind.startswith("bool") and relative:
            found.append(f"{relative}:{line}")
    if not found:
        return []
    return [f"a library decided a branch on a stand-in value at {', '.join(found[:5])}: on a "
            "GPU, which has the real value, it may take the other path (and allocate "
            "otherwise); --compute runs it on real numbers"]


def outside_python(path: str) -> str:
    """Why a file the run wrote was missing to the script (see
    :func:`dpprof.script.sealed_run.written_but_missing`), and what to do."""
    threaded = namespace.why_not() == namespace.THREADED
    return (f"it failed to open {path}, which the run itself had made: without a mount "
            + ("namespace (the process was running threads before dpprof started)"
               if threaded else
               "namespace on this machine")
            + " the run's writes are kept where Python's file calls find them, and code "
            "outside Python (a C, C++ or Rust library opening the file itself) looks on the "
            "real filesystem instead; "
            + (namespace.WHERE_UNTHREADED if threaded else WHERE_NAMESPACES))


def nothing_on_a_gpu(run: ScriptRun) -> str:
    """One line for a run that put nothing on a GPU: how the script ended."""
    if run.ended == "script raised":
        # the commands the seal saw started, and the one a CalledProcessError names
        found = (_LAUNCHES_RANKS.search(text) for text in (
            *run.seal.subprocesses, (run.script_traceback or "").strip().rsplit("\n", 1)[-1]))
        launcher = next((m.group(2).replace("'", "").replace(",", "") for m in found if m),
                        None)
        return (f"the script failed (exit status {run.exit_status}) before it put anything on "
                "a GPU: nothing was measured" + (
                    f"; {outside_python(run.written_but_missing)}"
                    if run.written_but_missing else "") + (
                    f"; it started its ranks itself, as processes of their own ({launcher}): "
                    "dpprof plays the GPUs in its own process, and in those torch finds none. "
                    "Run the script on one GPU with a rank's share of the batch (what a DDP "
                    "rank holds, but for DDP's gradient buckets), or give dpprof the "
                    "launcher's command (dpprof run --gpus N -- torchrun --nproc-per-node N "
                    "script.py)"
                    if launcher else ""))
    if run.ended == "steps":  # a model trained on the host (--device=cpu and the like)
        done = (f"{run.backwards - 1} backward pass(es)" if run.by_backwards
                else f"{run.steps_done} optimizer step(s)")
        return (f"the script ran its {done} (--steps; stopped there) without putting "
                "anything on a GPU (no tensor or module moved to cuda; does a setting of the "
                "script keep it on the CPU?): nothing was measured")
    return ("the script ended without putting anything on a GPU (no tensor or module moved "
            "to cuda): nothing was measured")


# a command that starts a script's DDP ranks as processes of their own
# (a command line, or a list's repr in a CalledProcessError)
_LAUNCHES_RANKS = re.compile(r"(^|[\s/'\"])(torchrun|torch\.distributed\.(?:run|launch)|"
                             r"accelerate'?,? '?launch|deepspeed)(?=['\"\s,]|$)")


def write_notes(run: ScriptRun) -> list[str]:
    """The checkpoints of emulated tensors a run wrote as stand-ins, in a line; what it read
    back of them."""
    if not run.stand_in_files:
        return []
    calls = "; ".join(f"{k} x{v}" if v > 1 else k for k, v in run.stand_in_files.items())
    read_back = ""
    if run.read_back:
        loads = "; ".join(f"{k} x{v}" if v > 1 else k for k, v in run.read_back.items())
        read_back = f"; read back as the run saved it, as on a GPU: {loads}"
    return [f"checkpoints of emulated tensors written as stand-ins (the tensors' shapes, no "
            f"values), into the run's private overlay: {calls}{read_back}"]


def alternative_notes(alt: ScriptRun) -> list[str]:
    """An alternative's run: its stand-in checkpoints, its output not shown."""
    notes = write_notes(alt)
    notes.append("its output is not shown (the run as written printed it)")
    shown = _as_on_a_terminal(alt.output_tail).strip()
    if alt.ended == "script raised" and shown:
        last = shown[-_LAST_OUTPUT_CHARS:]
        if len(last) < len(shown) and "\n" in last:  # from a line's start, not mid-word
            last = last.split("\n", 1)[1]
        notes.append("its last output: " + last)
    return notes


_LAST_OUTPUT_CHARS = 400  # of an alternative's output, where its run raised


def raised_on_a_share(alt: ScriptRun, main: ScriptRun, gpus: int, who: str) -> str | None:
    """Where an alternative's run, each ``who`` ("rank", "replica") given its share of the
    batch on its own GPU, raised in the script's own code while the run as written, with
    the whole batch on cuda:0 there, did not: its words (why, where the error is about the
    share: :func:`about_the_share`), else None (dpprof's own code raised, or nothing
    did)."""
    at, rows = alt.raised_at, main.batch_rows
    if (at is None or at.in_dpprof or not at.site or rows < 2
            or main.scenario.status == STATUS_ERROR):
        return None
    line = f"{at.site}" + (f" ({at.text})" if at.text else "")
    if alt.devices_mixed:
        return (f"on a {who}'s GPU the script raised at {line}; as written, on cuda:0, it "
                "did not: a tensor the code holds on cuda:0 (not a parameter or buffer of a "
                f"module, which DataParallel copies to every GPU) meets a {who}'s there")
    share = -(-rows // gpus)
    if not about_the_share(alt, main, gpus):
        # another cause (DDP's own rules: a second backward over one forward's outputs
        # with find_unused_parameters): where, not why
        return (f"with each {who} on its own GPU the script raised at {line}, where as "
                "written it did not")
    return (f"on a {who}'s share of the batch ({share} of {rows} rows) the script raised at "
            f"{line}; as written, with the whole batch there, it did not: code that holds "
            f"tensors made for the whole batch's rows fails so, and must take a {who}'s rows "
            "instead")


def about_the_share(alt: ScriptRun, main: ScriptRun, gpus: int) -> bool:
    """Whether the error an alternative's run ended with is about tensors' sizes and names
    the share's or the whole batch's rows (torch's "The size of tensor a (32) must match
    the size of tensor b (64) at non-singleton dimension 0", "shape '[64, 10]' is invalid
    for input of size 320"): the share of the batch broke it."""
    rows = main.batch_rows
    numbers = {int(n) for n in re.findall(r"\d+", alt.scenario.message)}
    return bool({-(-rows // gpus), rows} & numbers) and re.search(
        r"size|shape|dimension|match", alt.scenario.message, re.IGNORECASE) is not None


# a terminal's control sequences: CSI (colours, "erase line"), OSC (a title, a link), and
# the single-character escapes
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")


def _as_on_a_terminal(text: str) -> str:
    """``text`` as a terminal leaves it on screen: without its control sequences (a
    progress bar's colours and "erase line"), of each line rewritten with carriage returns
    its last part (tqdm's updates)."""
    lines = _ESCAPES.sub("", text).split("\n")
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines)


MAX_WRITES_LISTED = 1000  # per run, in the result's writes


def seal_fields(runs: list[tuple[str, ScriptRun]],
                keep_writes: str | None) -> tuple[list[ScriptWrite], SealCheck]:
    """The result's ``writes`` (every run's, paths as the user names them) and ``seal``
    (how the runs were sealed, and what the check after each found)."""
    writes: list[ScriptWrite] = []
    kernel = all(r.seal.kernel for _, r in runs)
    omitted, checked, checked_all = 0, 0, True
    changed: list[str] = []
    subprocesses: list[str] = []
    ended: list[str] = []
    for name, run in runs:
        outcome = run.seal
        for w in outcome.writes[:MAX_WRITES_LISTED]:
            writes.append(ScriptWrite(run=name, path=shown_path(w.path), kind=w.kind,
                                      size_bytes=w.size_bytes,
                                      emulated_values=w.emulated_values, replaced=w.replaced))
        omitted += max(0, len(outcome.writes) - MAX_WRITES_LISTED)
        checked = max(checked, outcome.checked_entries)
        checked_all = checked_all and outcome.checked_complete
        for d in outcome.differences:
            changed.append(f"{shown_path(d.path)}: {d.what} after the {name} run")
        for cmd in outcome.subprocesses:
            if cmd not in subprocesses:
                subprocesses.append(cmd)
        ended += [f"{cmd} (the {name} run's)" for cmd in outcome.ended_processes]
    return writes, SealCheck(
        lines=("python", "kernel" if kernel else "audit hook"), checked_entries=checked,
        checked_all=checked_all, changed=tuple(changed), subprocesses=tuple(subprocesses),
        ended_processes=tuple(ended), omitted_writes=omitted,
        kept_in=os.path.abspath(keep_writes) if keep_writes else None)


def shown_path(path: str) -> str:
    """``path`` as the user names it: relative to the working directory where inside it,
    ``~/...`` inside the home folder, else absolute."""
    cwd = os.getcwd()
    if path == cwd:
        return "."
    if path.startswith(cwd + os.sep):
        return os.path.relpath(path, cwd)
    home = os.path.expanduser("~")
    if home not in ("", "/") and path.startswith(home + os.sep):
        return "~" + path[len(home):]
    return path


def seal_notes(check: SealCheck) -> list[str]:
    """The result's notes on the seal (the writes and the check have the reports' own
    section): loudly, any file of the user's found changed after a run; the subprocesses
    the Python line does not reach."""
    notes = []
    if check.changed:
        notes.append(f"SEAL BROKEN: {len(check.changed)} file(s) of yours changed while the "
                     "script ran: " + "; ".join(check.changed[:10]))
    if check.subprocesses and "kernel" not in check.lines:
        notes.append("the script started subprocesses, which Python's seal does not reach "
                     "(their writes were not redirected; the check after the run covers the "
                     "working directory and the script's folder): "
                     + "; ".join(check.subprocesses[:5]))
    if check.ended_processes:
        notes.append("processes the script started still ran when their run ended, and were "
                     "ended with it (left running, they would write into your files after its "
                     "seal; a process's end does not wait for them): "
                     + "; ".join(check.ended_processes[:5]))
    return notes


def alternative_fix(kind: FixKind, main: ScriptRun, alt: ScriptRun, detail: str,
                    code: str) -> Fix | None:
    """What the alternative ``alt`` (the script with fix ``kind`` made) saves on cuda:0
    against the script as written, ``main``; ``code``: its change to the script's lines.
    None where it was not measured: an alternative that failed measured only what it held up
    to its failure (running out of memory is a measurement: it does not fit)."""
    if (not main.scenario.devices or not alt.scenario.devices
            or alt.scenario.status == STATUS_ERROR):
        return None
    p0 = main.scenario.devices[0].peak_allocated_bytes
    q0 = alt.scenario.devices[0].peak_allocated_bytes
    heaviest = max(d.peak_allocated_bytes for d in alt.scenario.devices)
    return Fix(name=kind.name, title=kind.title, primary_peak_bytes=q0, max_peak_bytes=heaviest,
               saves_bytes=p0 - q0, detail=detail, code=code)


def how_it_ended(run: ScriptRun, cfg: ScriptConfig) -> str:
    """One line for the as-written run's notes: how it ended, after how many steps, in how
    many seconds, and what that means for the peaks."""
    steps = f"{run.steps_done} optimizer step(s)"
    manual = run.no_optimizer and run.backwards > 0  # a step per backward pass (Stepper)
    if run.by_backwards:
        return (f"stopped after {cfg.steps} backward pass(es) (--steps {cfg.steps}: the script "
                "makes no optimizer and updates its parameters itself, a step per backward; "
                f"the first is the warm-up, peaks are over the others); {run.seconds:.1f} s")
    if manual:
        steps = f"{run.backwards} backward pass(es)"
    if run.ended == "steps":
        how = f"stopped after {steps} (--steps {cfg.steps}; the first is the warm-up, " \
              "peaks are over the others)"
    elif run.ended == "interrupted":
        how = f"interrupted after {steps}"
    elif run.ended == "script ended":
        how = f"the script ended after {steps}"
    else:
        how = f"the script raised after {steps} (exit status {run.exit_status})"
        if run.written_but_missing:
            how += f": {outside_python(run.written_but_missing)}"
    if manual:
        how += ("; it makes no optimizer and updates its parameters itself, a step per "
                "backward pass; " + ("the first is the warm-up, peaks are over the others"
                                     if run.backwards > 1 else
                                     "only one: the peaks include the warm-up"))
    elif run.steps_done == 0:
        how += (f"; it never called optimizer.step() (dpprof saw {run.forwards} forward "
                f"pass(es) and {run.backwards} backward pass(es) instead), so the peaks are "
                "over the whole run (no warm-up step to leave out)")
    elif run.steps_done == 1:
        how += "; only one step: the peaks include the warm-up"
    return how + f"; {run.seconds:.1f} s"


def script_assumptions(cfg: ScriptConfig) -> list[str]:
    """The result's assumptions: how the script's run was emulated and what is counted."""
    kind = "CPU tensors (real numbers)" if cfg.compute else "meta tensors (memory only)"
    return [
        f"Emulated: the script ran unchanged in dpprof's process with {cfg.gpus} virtual "
        f"{cfg.gpu.name} GPUs played by {kind}; no GPU was used. The host side (data "
        "loading, the model built on the CPU) ran for real.",
        "Allocated = live tensor storages on each virtual GPU, each rounded up to 512 B as "
        "the CUDA caching allocator rounds them; peaks are over the optimizer steps after the "
        "first (the warm-up) and what follows them, and include what was resident before "
        "them; where the warm-up peaks higher, its peak is the GPU's (never below what "
        "torch.cuda's memory functions told the script).",
        "DataParallel is re-enacted step by step from torch.nn.parallel (scatter, replicate, "
        "parallel_apply, gather, reduce-add of gradients onto cuda:0); "
        "DistributedDataParallel as one rank (the reducer's buckets re-enacted) over a fake "
        "process group: every rank runs the same program, rank 0 stands for all.",
        "Categories: parameters, gradients and optimizer state as the optimizers hold them; "
        "inputs = tensors the script moved to a GPU; outputs = DataParallel's gathered "
        "outputs; activations = everything else the step computed.",
        STAND_INS + ".",
        "Reserved (the caching allocator simulated over each GPU's allocations, cuBLAS "
        "workspaces included) and the CUDA context are shown separately from allocated.",
    ]
