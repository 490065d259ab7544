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

Checked against real execution on CPU tensors (``tests/test_ladder.py``): autocast against
``torch.autocast("cpu", torch.bfloat16)`` and checkpointing against the plain
``torch.utils.checkpoint``, each recorded by ``torch.profiler``, to the byte.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpprof.backends.emulated import EmulationConfig, probe_model, run_scenario
from dpprof.emulator import fsdp as fsdp2
from dpprof.emulator.fsdp import emulated_ranks, shard_model
from dpprof.fixes.kinds.ddp_in_place import CODE_SETUP
from dpprof.fixes.policy import LADDER_PREFIX as PREFIX
from dpprof.fixes.policy import cost_of
from dpprof.result import STATUS_OK, STATUS_OOM, Fix, RunResult, ScenarioResult
from dpprof.scenarios.names import DDP, DP_LOSS_PRIMARY, SINGLE
from dpprof.scenarios.workloads import Workload, shard_sizes
from dpprof.units import fmt_bytes

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
+for block in {loop}:  # the {count} repeated {kind} blocks
+    checkpointed(block)
"""
CODE_FSDP = """\
+# torchrun --nproc-per-node {gpus} train.py
+from torch.distributed.fsdp import {imports}
+dist.init_process_group("nccl")
+rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
-model = nn.DataParallel(model.cuda())
+model = model.cuda(rank)
"""
# CPUOffloadPolicy requires the parameters on the host when fully_shard runs
CODE_FSDP_HOST = """\
+# torchrun --nproc-per-node {gpus} train.py
+from torch.distributed.fsdp import {imports}
+dist.init_process_group("nccl")
+rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
-model = nn.DataParallel(model.cuda())
+# the model stays on the CPU: fully_shard keeps each rank's shards in pinned host memory
"""
CODE_FSDP_SHARD = """\
+for block in {loop}:  # the {count} repeated {kind} blocks, each sharded
+    fully_shard(block, reshard_after_forward={reshard}{policy})
+fully_shard(model, reshard_after_forward={reshard}{policy})  # the rest, at the root
+optimizer = torch.optim.AdamW(model.parameters())  # yours, made after fully_shard: over the shards
+loader = DataLoader(dataset, batch_size={per_rank},
+                    sampler=DistributedSampler(dataset))  # per-rank batch
"""
# FSDP2's own mixed precision: the all-gathers cast the float32 shards, gradients are
# reduced in float32 (no autocast in the loop)
CODE_FSDP_POLICY = """\
+mp = MixedPrecisionPolicy(param_dtype=torch.{dtype}, reduce_dtype=torch.float32)
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
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step
    # FSDP2: fully_shard per repeated block and at the root; True ZeRO-3
    # (reshard_after_forward), False ZeRO-2; None: no sharding
    reshard_after_forward: bool | None = None
    # FSDP2's own mixed precision: MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)
    param_dtype: str | None = None
    # FSDP2's CPUOffloadPolicy: sharded parameters, gradients, optimizer state on the host
    offload: bool = False


def amp_dtype(compute_capability: tuple[int, int]) -> str:
    """bfloat16 where the GPU computes in it (compute capability 8.0 and up), else float16."""
    return "bfloat16" if compute_capability >= (8, 0) else "float16"


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


def fsdp_rungs(gpus: int, blocks: bool,
               compute_capability: tuple[int, int] = (8, 0),
               offload: bool = True) -> list[Rung]:
    """FSDP2's rungs, on several GPUs with repeated blocks: ZeRO-2 (each block's parameters
    unsharded from its forward to its backward: one all-gather per block per step), ZeRO-3
    (resharded after the forward, all-gathered again for the backward), then ZeRO-3 with
    what FSDP2 users pair it with: FSDP2's own bf16 (``MixedPrecisionPolicy``, where the GPU
    computes in bf16; below compute capability 8.0 fp16 would need a gradient scaler, so
    none) and the same blocks checkpointed, the lightest of the three; last ZeRO-3 with
    ``CPUOffloadPolicy`` (the shards, their gradients and the optimizer state in host
    memory, the optimizer step on the CPU): the last resort before accumulation, since it
    costs step time (an H200 measured the lm step 0.033 s -> 0.089 s)."""
    if gpus < 2 or not blocks or fsdp2.missing() is not None:
        return []
    bf16 = amp_dtype(compute_capability) == "bfloat16"
    out = [Rung(f"{PREFIX}fsdp2-zero2", "FSDP2, ZeRO-2 (fully_shard, reshard_after_forward"
                 "=False)", None, False, reshard_after_forward=False),
            Rung(f"{PREFIX}fsdp2-zero3", "FSDP2, ZeRO-3 (fully_shard per block and root)",
                 None, False, reshard_after_forward=True),
            Rung(f"{PREFIX}fsdp2-zero3{'-bf16' if bf16 else ''}-checkpoint",
                 f"FSDP2, ZeRO-3{', bf16 (MixedPrecisionPolicy)' if bf16 else ''} and "
                 "activation checkpointing", None, True, reshard_after_forward=True,
                 param_dtype="bfloat16" if bf16 else None),
            Rung(f"{PREFIX}fsdp2-zero3-offload", "FSDP2, ZeRO-3 and CPU offload "
                 "(CPUOffloadPolicy)", None, False, reshard_after_forward=True, offload=True)]
    return out if offload else [r for r in out if not r.offload]


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


# torch.nn's own layers (and subclasses: timm's BatchNormAct2d, LayerNorm2d) are never the
# block a user checkpoints: one layer saves its input either way, so checkpointing it alone
# saves nothing. A CNN repeats its Conv2d more often than its residual blocks.
LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.PReLU)
# plain containers group blocks (a ResNet's stages, a ViT's encoder.layers and its head)
# rather than being one; their subclasses (torchvision's MLPBlock) are blocks of their own
CONTAINERS: tuple[type[nn.Module], ...] = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks a user would checkpoint, with their qualified names: the children of
    the model's largest ``nn.ModuleList`` (most children; two at least), else the
    outermost instances of the module type that holds parameters and repeats most (two at
    least), leaving out torch.nn's own layers (:data:`LAYERS`) and plain containers
    (:data:`CONTAINERS`); empty when nothing repeats."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) >= 2]
    if lists:
        name, best = max(lists, key=lambda nm: len(nm[1]))
        return [(f"{name}.{k}" if name else str(k), child)
                for k, child in best.named_children()]
    kinds = Counter(type(m) for m in model.modules()
                    if m is not model and any(True for _ in m.parameters()))
    repeated = [k for k, n in kinds.most_common() if n >= 2
                and not issubclass(k, LAYERS) and k not in CONTAINERS]
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


def _sharded_model(build: Callable[[], nn.Module], reshard_after_forward: bool,
                   param_dtype: str | None, checkpoint: bool, offload: bool = False
                   ) -> nn.Module:
    model = build()
    if checkpoint:  # the blocks' forwards wrapped first, then sharded (as torchtitan does)
        checkpoint_blocks(model)
    return shard_model(model, [b for _, b in repeated_blocks(model)], reshard_after_forward,
                       getattr(torch, param_dtype) if param_dtype is not None else None,
                       offload)


def fully_sharded(wl: Workload, reshard_after_forward: bool = True,
                  param_dtype: str | None = None, checkpoint: bool = False,
                  offload: bool = False) -> Workload:
    """``wl`` with its model under FSDP2: ``fully_shard`` on each repeated block, then the
    root, over the default process group (:func:`dpprof.emulator.fsdp.shard_model`;
    ``reshard_after_forward``: True ZeRO-3, False ZeRO-2; ``param_dtype``: FSDP2's
    ``MixedPrecisionPolicy`` in that dtype, reduced in float32), the blocks checkpointed
    first where ``checkpoint``."""
    return dataclasses.replace(wl, model=functools.partial(
        _sharded_model, wl.model, reshard_after_forward, param_dtype, checkpoint, offload))


def rung_workload(wl: Workload, rung: Rung) -> Workload:
    """``wl`` as ``rung`` changes its model: the repeated blocks checkpointed, sharded by
    FSDP2 (with its mixed precision), or neither (autocast and micro-batches are the
    step's)."""
    if rung.reshard_after_forward is not None:
        return fully_sharded(wl, rung.reshard_after_forward, rung.param_dtype,
                             rung.checkpoint, rung.offload)
    return checkpointed(wl) if rung.checkpoint else wl


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


def accumulation_loop_code(rung: Rung, gpus: int) -> str:
    """The typical loop with ``rung.micro_batches`` micro-batches per optimizer step (under
    DDP the first ones inside ``no_sync()``), with the rung's autocast if any."""
    k = rung.micro_batches
    rank = "rank" if gpus > 1 else ""
    pad = "    " if rung.amp is None else "        "
    lines = ["-for inputs, targets in loader:",
             "+for i, (inputs, targets) in enumerate(loader):",
             "-    loss = loss_fn(model(inputs.cuda()), targets.cuda())",
             "-    optimizer.zero_grad()",
             "-    loss.backward()",
             "-    optimizer.step()",
             f"+    last = (i + 1) % {k} == 0  # {k} micro-batches per optimizer step"]
    if gpus > 1:
        lines.append("+    with contextlib.nullcontext() if last else model.no_sync():  "
                     "# one all-reduce")
    else:
        lines.append("+    with contextlib.nullcontext():")
    if rung.amp is not None:
        lines.append(f'+        with torch.autocast("cuda", dtype=torch.{rung.amp}):')
    lines += [f"+    {pad}loss = loss_fn(model(inputs.cuda({rank})), "
              f"targets.cuda({rank})) / {k}",
              "+        " + ("scaler.scale(loss).backward()" if rung.amp == "float16"
                            else "loss.backward()") + "  # the gradients add up in .grad",
              "+    if last:"]
    if rung.amp == "float16":
        lines += ["+        scaler.step(optimizer)", "+        scaler.update()"]
    else:
        lines.append("+        optimizer.step()")
    lines.append("+        optimizer.zero_grad()")
    if rung.amp == "float16":
        lines.insert(0, '+scaler = torch.amp.GradScaler("cuda")')
    return "\n".join(lines)


def code(rung: Rung, gpus: int, batch: int, model: nn.Module) -> str:
    """The rung's change to the typical DataParallel loop, as a diff."""
    per_rank = shard_sizes(batch, gpus)[0]
    rows = -(-per_rank // rung.micro_batches)  # the loader's batch: one micro-batch
    head = (CODE_SETUP.format(gpus=gpus, per_rank=rows) if gpus > 1 else CODE_SINGLE_LOOP)
    if rung.micro_batches > 1:
        head = head.replace("  # per-rank batch", f"  # {per_rank} rows per rank in "
                            f"{rung.micro_batches}")
        if gpus == 1:
            head += (f"+loader = DataLoader(dataset, batch_size={rows})  # {per_rank} rows "
                     f"in {rung.micro_batches}\n")
    words = blocks_words(model)
    if rung.reshard_after_forward is not None:
        return fsdp_code(rung, gpus, rows, words) + CODE_LOOP_PLAIN
    if rung.checkpoint:
        head += CODE_CHECKPOINT.format(**words)
    if rung.micro_batches > 1:
        # the loop's micro-batches before the last skip DDP's all-reduce, the last does not
        return "+import contextlib\n" + head + accumulation_loop_code(rung, gpus)
    loop = (CODE_LOOP_PLAIN if rung.amp is None else
            CODE_LOOP_BF16 if rung.amp == "bfloat16" else CODE_LOOP_FP16)
    if gpus == 1:
        loop = loop.replace("(rank)", "()")
    return head + loop


def fsdp_code(rung: Rung, gpus: int, per_rank: int, words: dict[str, Any]) -> str:
    """An FSDP2 rung's setup: the process group, the blocks checkpointed first where the
    rung does (the wrapped blocks are then sharded, as torchtitan orders them), FSDP2's
    mixed-precision policy where it has one, ``fully_shard`` per block and at the root."""
    policy = rung.param_dtype is not None
    imports = ", ".join([*(["CPUOffloadPolicy"] if rung.offload else []),
                         *(["MixedPrecisionPolicy"] if policy else []), "fully_shard"])
    out = (CODE_FSDP_HOST if rung.offload else CODE_FSDP).format(gpus=gpus, imports=imports)
    if rung.checkpoint:
        out += CODE_CHECKPOINT.format(**words)
    if policy:
        out += CODE_FSDP_POLICY.format(dtype=rung.param_dtype)
    args = ((", mp_policy=mp" if policy else "")
            + (", offload_policy=CPUOffloadPolicy()" if rung.offload else ""))
    return out + CODE_FSDP_SHARD.format(per_rank=per_rank, reshard=rung.reshard_after_forward,
                                        policy=args, **words)


def blocks_words(model: nn.Module) -> dict[str, Any]:
    """The words of :data:`CODE_CHECKPOINT` and :data:`CODE_FSDP_SHARD` for the model's
    repeated blocks: where they are (``blocks``), how many (``count``), their type
    (``kind``)."""
    blocks = repeated_blocks(model)
    names = [n for n, _ in blocks]
    parent = names[0].rpartition(".")[0] if names else ""
    same_parent = all(n.rpartition(".")[0] == parent for n in names) and parent
    where = parent if same_parent else "modules()  # " + ", ".join(names[:3])
    # whether iterating the parent gives the blocks and nothing else (a ModuleList of them,
    # not a Sequential that also holds a norm), so the code can name the parent alone
    whole = bool(same_parent) and len(list(model.get_submodule(parent).children())) == len(names)
    # the blocks as the code iterates them: the parent where it holds them alone, else each
    # by its qualified name
    loop = (f"model.{parent}" if whole else
            f"map(model.get_submodule, ({''.join(repr(n) + ', ' for n in names).rstrip()}))")
    return {"blocks": where, "count": len(blocks), "loop": loop,
            "kind": type(blocks[0][1]).__name__ if blocks else "",
            "names": names, "whole": whole}


def offload_words(host_bytes: dict[str, int], gpus: int) -> str:
    """CPU offload's part of a rung's detail: the host memory each rank keeps (read from the
    rank's real host tensors after its step, :func:`dpprof.emulator.fsdp.host_bytes`), and
    what it costs."""
    kept = sum(host_bytes.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
    pinned = host_bytes.get("pinned", 0)
    return ("; CPUOffloadPolicy: each rank keeps its shards of the parameters "
            f"({fmt_bytes(host_bytes.get('parameters', 0))}), their gradients "
            f"({fmt_bytes(host_bytes.get('gradients', 0))}) and the optimizer state "
            f"({fmt_bytes(host_bytes.get('optimizer_state', 0))}) in host memory: "
            f"{fmt_bytes(kept)} per rank, {fmt_bytes(pinned)} of it pinned (page-locked), "
            f"{fmt_bytes(kept * gpus)} for the {gpus} ranks of one machine; each all-gather "
            "first copies the rank's shards to its GPU and each reduce-scatter's gradient "
            "shards are copied back, and the optimizer step runs on the CPU, so each step "
            "is slower (an H200 measured the lm workload's ZeRO-3 step at 0.033 s, "
            "0.089 s with CPU offload)")


def detail(rung: Rung, blocks: int, floor: str, per_rank: int = 0,
           host_bytes: dict[str, int] | None = None, gpus: int = 1) -> str:
    parts = []
    if rung.reshard_after_forward is not None:
        return (f"FSDP2 (torch's own fully_shard, emulated per rank over a fake process "
                f"group): {blocks} repeated blocks and the root sharded 1/N with their "
                "gradients and optimizer state; "
                + ("each block's parameters all-gathered for its forward and again for its "
                   "backward" if rung.reshard_after_forward else
                   "each block's parameters kept unsharded from its forward to its backward")
                + (f"; MixedPrecisionPolicy(param_dtype={rung.param_dtype}, reduce_dtype="
                   f"float32): the all-gathers cast the float32 shards to {rung.param_dtype}, "
                   f"so the unsharded parameters, activations and gradients are "
                   f"{rung.param_dtype}, the gradients reduce-scattered in float32; the "
                   "sharded parameters, gradients and optimizer state stay float32"
                   if rung.param_dtype is not None else "")
                + ("; the blocks checkpointed (non-reentrant) before sharding: their "
                   "activations recomputed in backward, one more forward of the blocks"
                   if rung.checkpoint else "")
                + (offload_words(host_bytes or {}, gpus) if rung.offload else "")
                + f"; the same {per_rank} rows per GPU; its reserved memory is simulated "
                "with the blocks of FSDP2's all-gather and reduce-scatter streams pooled "
                "apart, as the caching allocator keeps them (on an H200 "
                + ("7-11 % under with CPU offload" if rung.offload else
                   "within 2 % for three FSDP2 rungs of five, 6-10 % under for two")
                + ": its need may be understated)")
    if rung.micro_batches > 1:
        rows = -(-per_rank // rung.micro_batches)
        parts.append(f"{rung.micro_batches} micro-batches of {rows} rows per optimizer step "
                     f"(the same {per_rank} rows per GPU): {rung.micro_batches} forward/"
                     "backward passes per step"
                     + (f", the first {rung.micro_batches - 1} inside no_sync() (one "
                        "all-reduce per step)" if floor == DDP else ""))
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


def in_process_group() -> bool:
    """Whether this process already has a process group (dpprof's own ranks): FSDP2's rungs
    are emulated over a fake process group of their own, so they are left out there."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def evaluate(run: RunResult, wl: Workload, base: EmulationConfig,
             fsdp: bool = True) -> list[Fix]:
    """Emulate each rung on ``run``'s workload, batch and GPUs (on :func:`floor_scenario`),
    counting reserved memory and the context as the out-of-memory check does; the rungs
    whose step ran, as fixes against ``dp-loss-primary`` where it was measured (else the
    floor)."""
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
        if note not in run.notes:
            run.notes.append(note)
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
        run.notes.append(f"ladder: no FSDP2 rungs: {why}")
    if fsdp and not in_process_group():
        host_why = offload_unmeasurable(model) if base.gpus > 1 and blocks else None
        if host_why is not None:
            run.notes.append(host_why)
        for rung in fsdp_rungs(base.gpus, blocks > 0, base.compute_capability,
                               offload=host_why is None):
            if rung.offload and any(f.need_bytes is not None
                                    and f.need_bytes <= base.gpu_memory_bytes for f in out):
                # never the answer where a rung before it fits (its optimizer step runs on
                # the CPU), and its emulation steps the real host: half the ladder's time
                run.notes.append(OFFLOAD_SKIPPED)
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


def accumulation_rung(rung: Rung, k: int) -> Rung:
    """``rung`` (mixed precision, checkpointing, neither) with ``k`` micro-batches."""
    if rung.amp is None and not rung.checkpoint:
        return Rung(f"{PREFIX}accumulate", f"Gradient accumulation ({k} micro-batches)",
                    None, False, k)
    base_name = rung.name.removeprefix(PREFIX)
    return Rung(f"{PREFIX}{base_name}-accumulate", f"{rung.title}, {k} micro-batches",
                rung.amp, rung.checkpoint, k)


def micro_batch_counts(per_rank: int) -> list[int]:
    """The micro-batch counts tried: 2, 4, 8... below the per-rank rows, then the rows."""
    out, k = [], 2
    while k < per_rank:
        out.append(k)
        k *= 2
    return [*out, per_rank]


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
    fits = [f for f in run.fixes if f.name.startswith(PREFIX) and f.need_bytes is not None
            and f.need_bytes <= run.gpu_memory_bytes]
    return min(fits, key=lambda f: cost_of(f.name).rank, default=None)
