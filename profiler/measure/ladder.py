"""The ladder: what users reach for when even DDP (or one GPU's share) does not fit.

Each rung is measured on the user's workload at their batch and GPU count, on the
data-parallel floor (``ddp``; ``single`` on one GPU), and becomes a :class:`Fix` in the same
table as DataParallel's, with its code as a diff of the typical loop. The rungs, cheapest
first (:func:`rungs`):

* **mixed precision**: forward and loss under ``torch.autocast("cuda")``, bfloat16 where
  the GPU has it (compute capability 8.0 and up), float16 with a ``GradScaler`` elsewhere;
  parameters (the master weights), gradients, optimizer state and the loss stay float32
  (the emulator re-enacts autocast's op lists:
  :class:`dpprof.emulator.emulated_autocast.EmulatedAutocast`);
* **activation checkpointing** of the model's repeated blocks (:func:`repeated_blocks`:
  the children of its largest ``ModuleList``, else the instances of its most repeated
  module type), non-reentrant ``torch.utils.checkpoint``: each block's forward runs again
  in backward, so it costs one more forward of the blocks;
* both together;
* **FSDP2** on several GPUs (:func:`fsdp_rungs`): ``fully_shard`` on each repeated block and
  at the root, ZeRO-2 (``reshard_after_forward=False``) and ZeRO-3; torch's own FSDP2 runs
  on one emulated rank over a fake process group (:mod:`dpprof.emulator.fsdp`), the single
  scenario's rows, its model sharded (``tests/test_fsdp.py`` checks it against gloo ranks);
  then ZeRO-3 with FSDP2's own bf16 (``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``, not autocast; where the GPU computes in bf16) and the blocks
  checkpointed before sharding, also checked against gloo ranks; last ZeRO-3 with
  ``CPUOffloadPolicy`` (the model built on the CPU; each rank's shards, gradients and
  optimizer state in host memory, the optimizer step on the CPU), emulated with a real host
  (``EmulationConfig.host_model``), its host memory read from the rank's tensors
  (:func:`dpprof.emulator.fsdp.host_bytes`), its GPU memory checked against an H200;
* **gradient accumulation**: the same effective batch in k micro-batches per optimizer step
  (:func:`accumulation`: the smallest k of 2, 4, 8... up to the per-rank rows that fits),
  under DDP the first k - 1 backwards inside ``no_sync()``; it costs k forward/backward
  passes of ``rows / k`` rows per step. Where even the most micro-batches do not fit,
  mixed precision and checkpointing with accumulation (the lightest combination).

A rung's figures count what the out-of-memory check counts (reserved memory and the CUDA
context, :attr:`Fix.need_bytes`), so the verdict can name the cheapest rung that fits
(:func:`dpprof.answers.answer.build_answer`). The ladder runs only where the data-parallel
floor is out of memory (:func:`wanted`): a comparison that fits pays nothing for it.

The rungs are :mod:`dpprof.measure.ladder_rungs`, the model each changes
:mod:`dpprof.measure.rung_models`, what each reports (its code, its detail)
:mod:`dpprof.measure.ladder_code`; this module measures them.

Checked against real execution on CPU tensors (``tests/test_ladder.py``): autocast against
``torch.autocast("cpu", torch.bfloat16)`` and checkpointing against the plain
``torch.utils.checkpoint``, each recorded by ``torch.profiler``, to the byte.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from dpprof.backends.emulated import EmulationConfig, probe_model, run_scenario
from dpprof.emulator import fsdp as fsdp2
from dpprof.emulator.fsdp import emulated_ranks
from dpprof.fixes.fix_registry import cost_of
from dpprof.fixes.policy import LADDER_PREFIX
from dpprof.measure.ladder_code import code, detail
from dpprof.measure.ladder_rungs import (
    Rung,
    accumulation_rung,
    fsdp_rungs,
    micro_batch_counts,
    rungs,
)
from dpprof.measure.rung_models import repeated_blocks, rung_workload
from dpprof.result import STATUS_OK, STATUS_OOM, Fix, RunResult, ScenarioResult
from dpprof.scenarios.names import DDP, DP_LOSS_PRIMARY, SINGLE
from dpprof.scenarios.shards import shard_sizes
from dpprof.scenarios.workloads import Workload
from dpprof.units import fmt_bytes

# The share of this machine's free memory an emulated CPU-offload rung may take: it builds
# the whole model on the real host (as the user's code does before fully_shard), so a model
# of hundreds of GiB would exhaust the laptop dpprof plans on.
OFFLOAD_HOST_SHARE = 0.25


OFFLOAD_SKIPPED = ("ladder: FSDP2 with CPU offload not measured: a rung before it fits, and "
                   "offload, whose optimizer step runs on the CPU, is the last resort; "
                   "`dpprof maxbatch --ladder` measures it")


def available_host_bytes() -> int | None:
    """This machine's free physical memory (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def offload_unmeasurable(model: nn.Module) -> str | None:
    """Why the CPU-offload rung is not emulated here (the model's parameters and buffers,
    built on this host, would take more than :data:`OFFLOAD_HOST_SHARE` of its free
    memory), or None."""
    need = (sum(p.nbytes for p in model.parameters())
            + sum(b.nbytes for b in model.buffers()))
    free = available_host_bytes()
    if free is None or need <= free * OFFLOAD_HOST_SHARE:
        return None
    return (f"ladder: FSDP2 with CPU offload not measured: emulating it builds the model in "
            f"this machine's memory, as your code would before fully_shard "
            f"({fmt_bytes(need)} of parameters and buffers, {fmt_bytes(free)} free here); "
            f"on a machine with {fmt_bytes(int(need / OFFLOAD_HOST_SHARE))} free it is measured")


def floor_scenario(gpus: int) -> str:
    """The scenario the rungs change: DDP on several GPUs, the one GPU otherwise."""
    return DDP if gpus > 1 else SINGLE


def wanted(run: RunResult) -> bool:
    """Whether the ladder runs: the data-parallel floor (``ddp``, else ``single``) was
    measured and is out of memory."""
    for name in (DDP, SINGLE):
        s = run.scenario(name)
        if s is not None and s.status in (STATUS_OK, STATUS_OOM) and s.devices:
            return s.status == STATUS_OOM
    return False


def _need(s: ScenarioResult) -> int:
    return max(d.total_peak_bytes for d in s.devices if d.used)


def _peaks(s: ScenarioResult) -> tuple[int, int]:
    used = [d for d in s.devices if d.used]
    return used[0].peak_allocated_bytes, max(d.peak_allocated_bytes for d in used)


def in_process_group() -> bool:
    """Whether this process already has a process group (dpprof's own ranks): FSDP2's rungs
    are emulated over a fake process group of their own, so they are left out there."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def evaluate(run: RunResult, wl: Workload, base: EmulationConfig,
             fsdp: bool = True, notes: list[str] | None = None) -> list[Fix]:
    """Emulate each rung on ``run``'s workload, batch and GPUs (on :func:`floor_scenario`),
    counting reserved memory and the context as the out-of-memory check does; the rungs
    whose step ran, as fixes against ``dp-loss-primary`` where it was measured (else the
    floor). What could not be measured is said in ``notes`` (the run's, with those added)."""
    notes = notes if notes is not None else list(run.notes)
    floor = floor_scenario(base.gpus)

    model = probe_model(wl, base.gpus)
    blocks = len(repeated_blocks(model))
    reference = next((s for name in (DP_LOSS_PRIMARY, floor) if (s := run.scenario(name))
                      is not None and s.status in (STATUS_OK, STATUS_OOM) and s.devices), None)
    cfg = dataclasses.replace(base, count_reserved=True, peaks_only=False)
    per_rank = shard_sizes(base.step.batch, base.gpus)[0]

    host: dict[str, dict[str, int]] = {}  # a CPU-offload rung's host memory per rank

    def measure(rung: Rung) -> ScenarioResult | None:
        if rung.reshard_after_forward is not None:
            # one rank of N: the single scenario's rows (ceil(B / N)), its model sharded
            trace: dict[str, Any] = {}
            with emulated_ranks(base.gpus):  # each rank holds an NCCL communicator too
                s = run_scenario(SINGLE, rung_workload(wl, rung),
                                 dataclasses.replace(cfg.with_step(amp=rung.amp),
                                                     collectives=True,
                                                     host_model=rung.offload),
                                 trace if rung.offload else None)
            host[rung.name] = trace.get("host_bytes", {})
        else:
            s = run_scenario(floor, rung_workload(wl, rung),
                             cfg.with_step(amp=rung.amp, micro_batches=rung.micro_batches))
        if s.status in (STATUS_OK, STATUS_OOM) and s.devices:
            return s
        # a rung that cannot run on this model is said, not dropped in silence
        note = f"ladder: {rung.title} could not be measured on this model: {s.message}"
        if note not in notes:
            notes.append(note)
        return None

    def fix(rung: Rung, s: ScenarioResult) -> Fix:
        q0, qmax = _peaks(s)
        p0, pmax = _peaks(reference) if reference is not None else (q0, qmax)
        need = _need(s)
        return Fix(
            name=rung.name, title=rung.title, primary_peak_bytes=q0, max_peak_bytes=qmax,
            saves_bytes=p0 - q0, heaviest_saves_bytes=pmax - qmax,
            detail=detail(rung, blocks, floor, per_rank, host.get(rung.name), base.gpus),
            code=code(rung, base.gpus, base.step.batch, model), need_bytes=need,
            baseline=reference.name if reference is not None else floor,
            predicted_step_time_s=s.predicted_step_time_s)

    out: list[Fix] = []
    for rung in rungs(base.compute_capability, blocks > 0):
        s = measure(rung)
        if s is not None:
            out.append(fix(rung, s))
    if fsdp and base.gpus > 1 and blocks and (why := fsdp2.missing()) is not None:
        notes.append(f"ladder: no FSDP2 rungs: {why}")
    if fsdp and not in_process_group():
        host_why = offload_unmeasurable(model) if base.gpus > 1 and blocks else None
        if host_why is not None:
            notes.append(host_why)
        for rung in fsdp_rungs(base.gpus, blocks > 0, base.compute_capability,
                               offload=host_why is None):
            if rung.offload and any(f.need_bytes is not None
                                    and f.need_bytes <= base.gpu_memory_bytes for f in out):
                # never the answer where a rung before it fits (its optimizer step runs on
                # the CPU), and its emulation steps the real host: half the ladder's time
                notes.append(OFFLOAD_SKIPPED)
                continue
            s = measure(rung)
            if s is not None:
                out.append(fix(rung, s))
    if wl.step is not None or per_rank < 2:  # its own step, or one row: nothing to split
        return out
    # accumulation alone; where no k fits, with the lightest rung above (the combination)
    lightest = rungs(base.compute_capability, blocks > 0)[-1]
    for plain in (Rung("", "", None, False), lightest):
        found = accumulation(plain, per_rank, base.gpu_memory_bytes, measure)
        if found is not None:
            rung, s = found
            out.append(fix(rung, s))
            if s.status == STATUS_OK:
                break
    return out


def accumulation(rung: Rung, per_rank: int, capacity_bytes: int,
                 measure: Callable[[Rung], ScenarioResult | None]
                 ) -> tuple[Rung, ScenarioResult] | None:
    """The smallest k of :func:`micro_batch_counts` whose step fits (counting reserved
    memory and the context, as the out-of-memory check does), with its result; where none
    does, the last measured. Stops early where twice what the last doubling saved would
    still not fit: the activations shrink about as 1/k, so further doublings save about
    what the last one did in all (twice: a margin, the rounding of reserved memory)."""
    last: tuple[Rung, ScenarioResult] | None = None
    previous: int | None = None
    for k in micro_batch_counts(per_rank):
        r = accumulation_rung(rung, k)
        s = measure(r)
        if s is None:
            return last
        last = (r, s)
        if s.status == STATUS_OK:
            return last
        need = _need(s)
        if previous is not None and need - 2 * (previous - need) > capacity_bytes:
            return last
        previous = need
    return last


def cheapest_fit(run: RunResult) -> Fix | None:
    """The cheapest rung (by the policy's cost, :mod:`dpprof.fixes.policy`) whose fullest
    GPU fits, counting what the out-of-memory check counts."""
    fits = [f for f in run.fixes if f.name.startswith(LADDER_PREFIX) and f.need_bytes is not None
            and f.need_bytes <= run.gpu_memory_bytes]
    return min(fits, key=lambda f: cost_of(f.name).rank, default=None)
