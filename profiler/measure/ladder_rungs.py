"""The ladder's rungs: what each changes in the step, cheapest first.

A :class:`Rung` is mixed precision, activation checkpointing of the repeated blocks, both,
FSDP2 (ZeRO-2, ZeRO-3, with its own bf16 and checkpointing, with CPU offload) or gradient
accumulation in k micro-batches (alone or with the lightest rung): :func:`rungs`,
:func:`fsdp_rungs`, :func:`accumulation_rung`. How a rung changes the model is
:mod:`dpprof.measure.rung_models`; what it reports, :mod:`dpprof.measure.ladder_code`;
measuring them, :mod:`dpprof.measure.ladder`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpprof.emulator import fsdp as fsdp2
from dpprof.fixes.policy import LADDER_PREFIX


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
    out = [Rung(f"{LADDER_PREFIX}fsdp2-zero2", "FSDP2, ZeRO-2 (fully_shard, reshard_after_forward"
                 "=False)", None, False, reshard_after_forward=False),
            Rung(f"{LADDER_PREFIX}fsdp2-zero3", "FSDP2, ZeRO-3 (fully_shard per block and root)",
                 None, False, reshard_after_forward=True),
            Rung(f"{LADDER_PREFIX}fsdp2-zero3{'-bf16' if bf16 else ''}-checkpoint",
                 f"FSDP2, ZeRO-3{', bf16 (MixedPrecisionPolicy)' if bf16 else ''} and "
                 "activation checkpointing", None, True, reshard_after_forward=True,
                 param_dtype="bfloat16" if bf16 else None),
            Rung(f"{LADDER_PREFIX}fsdp2-zero3-offload", "FSDP2, ZeRO-3 and CPU offload "
                 "(CPUOffloadPolicy)", None, False, reshard_after_forward=True, offload=True)]
    return out if offload else [r for r in out if not r.offload]


def rungs(compute_capability: tuple[int, int], blocks: bool) -> list[Rung]:
    """The rungs, cheapest first (mixed precision speeds a step up; checkpointing costs a
    forward of the blocks); checkpointing only where the model has repeated blocks."""
    amp = amp_dtype(compute_capability)
    short = "bf16" if amp == "bfloat16" else "fp16"
    out = [Rung(f"{LADDER_PREFIX}{short}", f"Mixed precision ({short} autocast)", amp, False)]
    if blocks:
        out += [Rung(f"{LADDER_PREFIX}checkpoint",
                     "Activation checkpointing of the repeated blocks", None, True),
                Rung(f"{LADDER_PREFIX}{short}-checkpoint",
                     f"Mixed precision ({short}) and activation checkpointing", amp, True)]
    return out


def accumulation_rung(rung: Rung, k: int) -> Rung:
    """``rung`` (mixed precision, checkpointing, neither) with ``k`` micro-batches."""
    if rung.amp is None and not rung.checkpoint:
        return Rung(f"{LADDER_PREFIX}accumulate", f"Gradient accumulation ({k} micro-batches)",
                    None, False, k)
    base_name = rung.name.removeprefix(LADDER_PREFIX)
    return Rung(f"{LADDER_PREFIX}{base_name}-accumulate", f"{rung.title}, {k} micro-batches",
                rung.amp, rung.checkpoint, k)


def micro_batch_counts(per_rank: int) -> list[int]:
    """The micro-batch counts tried: 2, 4, 8... below the per-rank rows, then the rows."""
    out, k = [], 2
    while k < per_rank:
        out.append(k)
        k *= 2
    return [*out, per_rank]
