"""What every renderer says the same way: device labels, OOM lines, provenance, the fix.

Pure functions of a :class:`RunResult`; no formatting beyond plain text. The choice of the
fix (:func:`fixes`) is deliberately small: the authoritative advice may replace it (same
signature) without touching the renderers.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpprof.analysis.excess import Excess, cause_label, excess_by_cause
from dpprof.result import STATUS_OK, STATUS_OOM, DeviceResult, RunResult, ScenarioResult
from dpprof.scenarios.base import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY, SINGLE
from dpprof.units import fmt_bytes

MEASURED = ("ok", "oom")


def measured(s: ScenarioResult) -> bool:
    return s.status in (STATUS_OK, STATUS_OOM)


def used_devices(s: ScenarioResult) -> list[DeviceResult]:
    return [d for d in s.devices if d.used]


def nodes(s: ScenarioResult) -> list[str]:
    """The distinct hosts of a scenario's devices, in order (empty: one unnamed host)."""
    seen: list[str] = []
    for d in s.devices:
        if d.node and d.node not in seen:
            seen.append(d.node)
    return seen


def device_label(s: ScenarioResult, d: DeviceResult) -> str:
    """``cuda:1``; across several hosts ``host/cuda:1``; plain text (escape it to show it)."""
    if len(nodes(s)) > 1 and d.node:
        return f"{d.node}/cuda:{d.index}"
    return f"cuda:{d.index}"


def is_real(run: RunResult) -> bool:
    return run.backend == "cuda"


def provenance(run: RunResult) -> str:
    """One sentence: were these numbers measured on GPUs or emulated?"""
    if is_real(run):
        return (
            f"Measured on {run.gpus} CUDA GPU(s): peaks from the CUDA caching allocator, "
            "timelines from NVML samples."
        )
    kind = "CPU tensors (real numbers)" if run.backend == "cpu" or run.config.get(
        "compute") else "meta tensors (memory only)"
    return (
        f"Emulated: {run.gpus} virtual GPU(s) of {fmt_bytes(run.gpu_memory_bytes)} over "
        f"{kind}; no GPU was used. Out-of-memory results are predictions."
    )


def oom_lines(run: RunResult) -> list[str]:
    """One line per scenario that ran out of memory or failed."""
    word = "ran out of memory" if is_real(run) else "would run out of memory"
    lines = []
    for s in run.scenarios:
        if s.status == STATUS_OOM:
            dev = f"cuda:{s.oom_device}" if s.oom_device is not None else "a GPU"
            verb = "tried to allocate" if is_real(run) else "needs"
            need = f" ({verb} {fmt_bytes(s.oom_bytes)})" if s.oom_bytes else ""
            lines.append(f"{s.name} {word} on {dev}{need}: {s.message}".rstrip(": "))
        elif s.status not in MEASURED:
            lines.append(f"{s.name} failed: {s.message}")
    return lines


def failure_tracebacks(run: RunResult, max_chars: int = 20_000) -> list[tuple[str, str]]:
    """(scenario, traceback) for each failed scenario that kept one (DDP: the rank that
    caused the failure, not the peers that lost their connection to it); the end of a long
    traceback, where the error is."""
    out = []
    for s in run.scenarios:
        if s.status not in MEASURED and s.traceback:
            tb = s.traceback.rstrip()
            out.append((s.name, tb if len(tb) <= max_chars else "...\n" + tb[-max_chars:]))
    return out


def excess_of(run: RunResult, s: ScenarioResult) -> Excess | None:
    """cuda:0's excess by cause in ``s``: the result's own attribution where it has one.

    ``RunResult.attribution`` (issue 6, read by name so that results without it work) wins
    when its causes add up to the same excess; :func:`dpprof.analysis.excess.excess_by_cause`
    otherwise, and always for the two peaks the waterfall starts and ends at.
    """
    ex = excess_by_cause(s)
    if ex is None:
        return None
    att = (getattr(run, "attribution", None) or {}).get(s.name)
    causes = getattr(att, "causes_bytes", None)
    if causes and sum(causes.values()) == ex.excess_bytes:
        return Excess(ex.scenario, ex.primary_bytes, ex.reference_bytes, dict(causes))
    return ex


def excesses(run: RunResult) -> list[Excess]:
    return [ex for s in run.scenarios if (ex := excess_of(run, s)) is not None]


def top_causes(run: RunResult, scenario: str, n: int = 3) -> list[tuple[str, int]]:
    """The largest positive causes of cuda:0's excess in ``scenario``: (cause, bytes)."""
    s = run.scenario(scenario)
    ex = excess_of(run, s) if s is not None else None
    if ex is None:
        return []
    pos = sorted(((v, c) for c, v in ex.by_category.items() if v > 0), reverse=True)
    return [(cause_label(c), v) for v, c in pos[:n]]


@dataclass(frozen=True)
class Fix:
    """A change to the user's code that the findings support."""

    title: str
    why: str  # one or two sentences with the numbers behind it
    code: str  # Python the user can paste


MODEL_WITH_LOSS_CODE = """\
import dpprof  # or copy dpprof.ModelWithLoss into your code: it is 20 lines
from torch import nn

model = nn.DataParallel(dpprof.ModelWithLoss(model, loss_fn).cuda())

for inputs, targets in loader:
    inputs, targets = inputs.cuda(), targets.cuda()
    # every replica computes its own loss: cuda:0 gets one number per GPU, not the outputs
    loss = dpprof.ModelWithLoss.combine(model(inputs, targets))  # weighted by shard size
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
"""

DDP_CODE = """\
# torchrun --nproc-per-node=NUM_GPUS train.py
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)  # without it every rank also puts a CUDA context on cuda:0

model = DDP(model.cuda(rank), device_ids=[rank])
optimizer = torch.optim.AdamW(model.parameters())  # built after DDP, on this rank
sampler = DistributedSampler(dataset)  # each rank its own shard: batch_size per GPU
loader = DataLoader(dataset, batch_size=per_gpu_batch, sampler=sampler)

for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # gradients all-reduced in buckets, the same on every rank
        optimizer.step()
"""


def _peak0(s: ScenarioResult | None) -> int | None:
    if s is None or not measured(s) or not s.devices:
        return None
    return s.devices[0].peak_allocated_bytes


def _max_peak(s: ScenarioResult | None) -> int | None:
    if s is None or not measured(s) or not used_devices(s):
        return None
    return max(d.peak_allocated_bytes for d in used_devices(s))


def max_batches(run: RunResult) -> list[tuple[str, int]]:
    """(scenario, largest global batch that fits) where computed.

    From the result's max-batch search (``RunResult.maxbatch``, issue 6, read by name) when
    it has one, else from ``ScenarioResult.max_batch``.
    """
    entries = getattr(getattr(run, "maxbatch", None), "entries", None)
    if entries:
        return [(str(e.scenario), int(e.max_batch)) for e in entries
                if getattr(e, "max_batch", None) is not None]
    return [(s.name, s.max_batch) for s in run.scenarios if s.max_batch is not None]


def fixes(run: RunResult) -> list[Fix]:
    """The code changes that fit the findings, most useful first (empty: nothing to fix).

    The result's own fixes (``RunResult.fixes``, issue 6, read by name: emulated with the
    change applied) when it has them; otherwise chosen here from the scenarios' peaks.
    """
    given = getattr(run, "fixes", None)
    if given:
        out = []
        for f in given:
            why = str(getattr(f, "detail", "") or "")
            saves = getattr(f, "saves_bytes", None)
            if saves is not None:
                why = (why + " " if why else "") + f"Saves {fmt_bytes(saves)} on cuda:0."
            out.append(Fix(title=str(f.title), why=why, code=str(getattr(f, "code", "") or "")))
        return out
    return _own_fixes(run)


def _own_fixes(run: RunResult) -> list[Fix]:
    out: list[Fix] = []
    prim, fwd, ddp = (run.scenario(n) for n in (DP_LOSS_PRIMARY, DP_LOSS_FORWARD, DDP))
    p0, f0, dmax = _peak0(prim), _peak0(fwd), _max_peak(ddp)
    cap = run.gpu_memory_bytes
    if p0 is not None and f0 is not None and p0 - f0 > 0.05 * p0:
        causes = ", ".join(f"{c} {fmt_bytes(b)}" for c, b in top_causes(run, DP_LOSS_PRIMARY))
        fits = "" if f0 <= cap else f" (still above the {fmt_bytes(cap)} per GPU)"
        out.append(Fix(
            title="Compute the loss inside forward (keep DataParallel)",
            why=(
                f"Under {DP_LOSS_PRIMARY} cuda:0 peaks at {fmt_bytes(p0)}"
                + (f"; its excess is mostly {causes}" if causes else "")
                + f". Wrapping model and loss in ModelWithLoss brings cuda:0 to "
                f"{fmt_bytes(f0)}{fits}, a saving of {fmt_bytes(p0 - f0)}."
            ),
            code=MODEL_WITH_LOSS_CODE,
        ))
    if dmax is not None:
        worst_dp = min((x for x in (p0, f0) if x is not None), default=None)
        if worst_dp is None or dmax < worst_dp * 1.05:
            rest = top_causes(run, DP_LOSS_FORWARD) if f0 is not None else []
            because = (
                "; under DataParallel cuda:0 keeps "
                + ", ".join(f"{c} ({fmt_bytes(b)})" for c, b in rest)
                + " that the other GPUs do not hold"
            ) if rest else ""
            n = len(used_devices(ddp)) if ddp is not None else run.gpus
            fits = "" if dmax <= cap else f" (still above the {fmt_bytes(cap)} per GPU)"
            out.append(Fix(
                title="Switch to DistributedDataParallel",
                why=(
                    f"DDP balances all {n} GPUs at {fmt_bytes(dmax)} each{fits}"
                    + (f", {fmt_bytes(worst_dp - dmax)} less than DataParallel's best "
                       "cuda:0" if worst_dp is not None and worst_dp > dmax else "")
                    + " (no gradient reduction onto one GPU, no replication of the model "
                    "every step)"
                    + because + "."
                ),
                code=DDP_CODE,
            ))
    single = run.scenario(SINGLE)
    s0 = _peak0(single)
    if s0 is not None and s0 > cap:
        out.append(Fix(
            title="Make the step itself smaller",
            why=(
                f"Even one GPU with ceil(B / N) rows needs {fmt_bytes(s0)} (more than "
                f"{fmt_bytes(cap)}): no way of splitting the batch fits. Lower the batch per "
                "GPU, use mixed precision (torch.autocast) or activation checkpointing."
            ),
            code=(
                "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
                "    loss = loss_fn(model(inputs), targets)\n"
            ),
        ))
    return out


MEMORY_COLUMNS = (
    ("peak_allocated_bytes", "allocated"),
    ("peak_requested_bytes", "requested"),
    ("peak_reserved_bytes", "reserved"),
    ("workspace_bytes", "of which workspaces"),
    ("context_bytes", "context"),
    ("nvml_peak_used_bytes", "NVML used"),
)


def memory_rows(run: RunResult) -> tuple[list[str], list[list[str]]]:
    """Per scenario and device: allocated, reserved, context and NVML peaks (plain text).

    Columns that no device has are left out; empty when only allocated is known.
    """
    devs = [(s, d) for s in run.scenarios if measured(s) for d in used_devices(s)]
    cols = [(k, name) for k, name in MEMORY_COLUMNS
            if any(getattr(d, k) for _, d in devs)]
    if [k for k, _ in cols] in ([], ["peak_allocated_bytes"],
                                ["peak_allocated_bytes", "peak_requested_bytes"]):
        return [], []
    head = ["scenario", "device", *(name for _, name in cols), "phase of the peak"]
    rows = []
    for s, d in devs:
        vals = [getattr(d, k) for k, _ in cols]
        rows.append([s.name, device_label(s, d),
                     *(fmt_bytes(v) if v is not None else "-" for v in vals),
                     d.peak_phase.replace("_", " ") or "-"])
    return head, rows
