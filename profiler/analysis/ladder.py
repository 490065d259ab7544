"""The ladder: what users reach for when even DDP (or one GPU's share) does not fit.

Each rung is measured on the user's workload at their batch and GPU count, on the
data-parallel floor (``ddp``; ``single`` on one GPU), and becomes a :class:`Fix` in the same
table as DataParallel's, with its code as a diff of the typical loop. The rungs, cheapest
first (:func:`rungs`):

* **mixed precision**: forward and loss under ``torch.autocast("cuda")``, bfloat16 where
  the GPU has it (compute capability 8.0 and up), float16 with a ``GradScaler`` elsewhere;
  parameters (the master weights), gradients, optimizer state and the loss stay float32
  (the emulator re-enacts autocast's op lists: :class:`dpprof.emulator.kernels.EmulatedAutocast`);
* **activation checkpointing** of the model's repeated blocks (:func:`repeated_blocks`:
  the children of its largest ``ModuleList``, else the instances of its most repeated
  module type), non-reentrant ``torch.utils.checkpoint``: each block's forward runs again
  in backward, so it costs one more forward of the blocks;
* both together.

A rung's figures count what the out-of-memory check counts (reserved memory and the CUDA
context, :attr:`Fix.need_bytes`), so the verdict can name the cheapest rung that fits
(:func:`dpprof.analysis.answers.build_answer`). The ladder runs only where the data-parallel
floor is out of memory (:func:`wanted`): a comparison that fits pays nothing for it.

Checked against real execution on CPU tensors (``tests/test_ladder.py``): autocast against
``torch.autocast("cpu", torch.bfloat16)`` and checkpointing against the plain
``torch.utils.checkpoint``, each recorded by ``torch.profiler``, to the byte.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from dpprof.analysis.answers import LADDER_PREFIX as PREFIX
from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.result import STATUS_OK, STATUS_OOM, Fix, RunResult, ScenarioResult
from dpprof.scenarios.base import DDP, DP_LOSS_PRIMARY, SINGLE
from dpprof.scenarios.workloads import Workload, shard_sizes
from dpprof.units import fmt_bytes

CODE_DDP_LOOP = """\
+# torchrun --nproc-per-node {gpus} train.py
+dist.init_process_group("nccl")
+rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
-model = nn.DataParallel(model.cuda())
+model = DDP(model.cuda(rank), device_ids=[rank])
+loader = DataLoader(dataset, batch_size={per_rank},
+                    sampler=DistributedSampler(dataset))  # per-rank batch
"""
CODE_SINGLE_LOOP = """\
-model = nn.DataParallel(model.cuda())
+model = model.cuda()
"""
CODE_CHECKPOINT = """\
+from torch.utils.checkpoint import checkpoint
+
+def checkpointed(block):  # its activations are recomputed in backward
+    forward = block.forward
+    block.forward = lambda *a, **k: checkpoint(forward, *a, use_reentrant=False, **k)
+
+for block in model.{blocks}:  # the {count} repeated {kind} blocks
+    checkpointed(block)
"""
CODE_LOOP_PLAIN = """\
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))
     optimizer.zero_grad()
     loss.backward()
     optimizer.step()"""
CODE_LOOP_BF16 = """\
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    with torch.autocast("cuda", dtype=torch.bfloat16):  # weights stay float32
+        loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))
     optimizer.zero_grad()
     loss.backward()
     optimizer.step()"""
CODE_LOOP_FP16 = """\
+scaler = torch.amp.GradScaler("cuda")
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    with torch.autocast("cuda", dtype=torch.float16):  # weights stay float32
+        loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))
     optimizer.zero_grad()
-    loss.backward()
-    optimizer.step()
+    scaler.scale(loss).backward()
+    scaler.step(optimizer)
+    scaler.update()"""


@dataclass(frozen=True)
class Rung:
    """One rung: its name (``ladder-...``), its title, and what it changes."""

    name: str
    title: str
    amp: str | None  # autocast's dtype, or None
    checkpoint: bool  # the repeated blocks checkpointed


def amp_dtype(compute_capability: tuple[int, int]) -> str:
    """bfloat16 where the GPU computes in it (compute capability 8.0 and up), else float16."""
    return "bfloat16" if compute_capability >= (8, 0) else "float16"


def rungs(compute_capability: tuple[int, int], blocks: bool) -> list[Rung]:
    """The rungs, cheapest first (mixed precision speeds a step up; checkpointing costs a
    forward of the blocks); checkpointing only where the model has repeated blocks."""
    amp = amp_dtype(compute_capability)
    short = "bf16" if amp == "bfloat16" else "fp16"
    out = [Rung(f"{PREFIX}{short}", f"Mixed precision ({short} autocast)", amp, False)]
    if blocks:
        out += [Rung(f"{PREFIX}checkpoint", "Activation checkpointing of the repeated blocks",
                     None, True),
                Rung(f"{PREFIX}{short}-checkpoint",
                     f"Mixed precision ({short}) and activation checkpointing", amp, True)]
    return out


# ---- the repeated blocks -------------------------------------------------------------------


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks a user would checkpoint, with their qualified names: the children of
    the model's largest ``nn.ModuleList`` (most children; two at least), else the
    outermost instances of the module type that holds parameters and repeats most (two at
    least); empty when nothing repeats."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) >= 2]
    if lists:
        name, best = max(lists, key=lambda nm: len(nm[1]))
        return [(f"{name}.{k}" if name else str(k), child)
                for k, child in best.named_children()]
    kinds = Counter(type(m) for m in model.modules()
                    if m is not model and any(True for _ in m.parameters()))
    repeated = [k for k, n in kinds.most_common() if n >= 2
                and not issubclass(k, (nn.Linear, nn.Embedding, nn.LayerNorm))]
    if not repeated:
        return []
    kind = repeated[0]
    out: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if type(m) is kind and not any(name.startswith(f"{o}.") for o, _ in out):
            out.append((name, m))
    return out


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap each repeated block's forward in non-reentrant ``torch.utils.checkpoint`` (as
    :data:`CODE_CHECKPOINT` shows the user); the number of blocks wrapped."""
    from torch.utils.checkpoint import checkpoint

    blocks = repeated_blocks(model)
    for _, block in blocks:
        forward = block.forward

        def run(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = run  # type: ignore[method-assign]
    return len(blocks)


def _checkpointed_model(build: Callable[[], nn.Module]) -> nn.Module:
    model = build()
    checkpoint_blocks(model)
    return model


def checkpointed(wl: Workload) -> Workload:
    """``wl`` with its model's repeated blocks checkpointed (the same weights: the blocks
    are wrapped after the model is built)."""
    return dataclasses.replace(wl, model=functools.partial(_checkpointed_model, wl.model))


# ---- measuring the rungs ---------------------------------------------------------------------


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


def code(rung: Rung, gpus: int, batch: int, model: nn.Module) -> str:
    """The rung's change to the typical DataParallel loop, as a diff."""
    head = (CODE_DDP_LOOP.format(gpus=gpus, per_rank=shard_sizes(batch, gpus)[0])
            if gpus > 1 else CODE_SINGLE_LOOP)
    if rung.checkpoint:
        blocks = repeated_blocks(model)
        names = [n for n, _ in blocks]
        parent = names[0].rpartition(".")[0] if names else ""
        same_parent = all(n.rpartition(".")[0] == parent for n in names) and parent
        where = parent if same_parent else "modules()  # " + ", ".join(names[:3])
        head += CODE_CHECKPOINT.format(blocks=where, count=len(blocks),
                                       kind=type(blocks[0][1]).__name__ if blocks else "")
    loop = (CODE_LOOP_PLAIN if rung.amp is None else
            CODE_LOOP_BF16 if rung.amp == "bfloat16" else CODE_LOOP_FP16)
    if gpus == 1:
        loop = loop.replace("(rank)", "()")
    return head + loop


def detail(rung: Rung, blocks: int, floor: str) -> str:
    parts = []
    if rung.amp is not None:
        parts.append(f"forward and loss under torch.autocast('cuda', {rung.amp}): matmuls "
                     "and convolutions and the activations they save in "
                     f"{rung.amp}; parameters (master weights), gradients, optimizer state "
                     "and the loss stay float32"
                     + ("; GradScaler's scale and found-inf scalars (a few bytes) are not "
                        "emulated" if rung.amp == "float16" else ""))
    if rung.checkpoint:
        parts.append(f"{blocks} repeated blocks checkpointed (non-reentrant): their "
                     "activations are recomputed in backward, one more forward of the blocks")
    return f"on {floor}: " + "; ".join(parts)


def evaluate(run: RunResult, wl: Workload, base: EmulationConfig) -> list[Fix]:
    """Emulate each rung on ``run``'s workload, batch and GPUs (on :func:`floor_scenario`),
    counting reserved memory and the context as the out-of-memory check does; the rungs
    whose step ran, as fixes against ``dp-loss-primary`` where it was measured (else the
    floor)."""
    floor = floor_scenario(base.gpus)
    from dpprof.backends.emulated import probe_model

    model = probe_model(wl, base.gpus)
    blocks = len(repeated_blocks(model))
    reference = next((s for name in (DP_LOSS_PRIMARY, floor) if (s := run.scenario(name))
                      is not None and s.status in (STATUS_OK, STATUS_OOM) and s.devices), None)
    cfg = dataclasses.replace(base, count_reserved=True, peaks_only=False)
    out: list[Fix] = []
    for rung in rungs(base.compute_capability, blocks > 0):
        s = run_scenario(floor, checkpointed(wl) if rung.checkpoint else wl,
                         cfg.with_step(amp=rung.amp))
        if s.status not in (STATUS_OK, STATUS_OOM) or not s.devices:
            continue
        q0, qmax = _peaks(s)
        p0, pmax = _peaks(reference) if reference is not None else (q0, qmax)
        need = _need(s)
        fits = "fits" if s.status == STATUS_OK else "does not fit"
        out.append(Fix(
            name=rung.name, title=rung.title, primary_peak_bytes=q0, max_peak_bytes=qmax,
            saves_bytes=p0 - q0, heaviest_saves_bytes=pmax - qmax,
            detail=(detail(rung, blocks, floor) + f"; the fullest GPU needs {fmt_bytes(need)} "
                    f"(reserved and context counted): it {fits} in "
                    f"{fmt_bytes(base.gpu_memory_bytes)}"),
            code=code(rung, base.gpus, base.step.batch, model), need_bytes=need))
    return out


def cheapest_fit(run: RunResult) -> Fix | None:
    """The first rung (cheapest first) whose fullest GPU fits, counting what the
    out-of-memory check counts."""
    return next((f for f in run.fixes if f.name.startswith(PREFIX) and f.need_bytes is not None
                 and f.need_bytes <= run.gpu_memory_bytes), None)
