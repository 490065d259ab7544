"""The policy by which the answer picks one change: by what the change costs the user.

The changes in order, cheapest first (each fix kind's own cost,
:attr:`dpprof.fixes.fix_kind.FixKind.cost`, then :data:`RUNG_COSTS`; docs/scenarios.md says
the same):

0. nothing, where the scenario the user runs fits with the margin and its max/mean is at
   most :data:`IMBALANCE_THRESHOLD`, or its heaviest GPU is above the mean by under
   :data:`IMBALANCE_FLOOR` of the GPU (a small batch on a large GPU: what the imbalance
   costs is the batch it leaves out, which ``dpprof maxbatch`` measures);
1. the loss inside forward (a wrapper around the model);
2. DDP (a launcher: torchrun, a process group, a sampler);
3. DDP's ``gradient_as_bucket_view=True`` (a flag on DDP);
4. DataParallel's ``output_device`` (an argument; it moves the imbalance, not removes it);
5. a smaller share of the batch on cuda:0 (a scatter override of about twenty lines);
6. then the ladder's rungs: bf16 autocast, activation checkpointing, both, gradient
   accumulation (alone, then with both), FSDP2 (ZeRO-2, ZeRO-3, ZeRO-3 with bf16 and
   checkpointing, ZeRO-3 with CPU offload).

The answer is the cheapest change that fits with :data:`MARGIN` of the GPU to spare (where
none does, the cheapest that fits at all, said to be tight); never one that does not fit,
nor one that does not lower the heaviest GPU of the scenario the user ran.

Each change's cost is a :class:`Cost`: its place in that order, what it changes in the
code, and what it does to a step's time in words; ``step_time_s`` is the place for the
predicted step time a time model fills (None: not predicted yet; the order is the code's
cost until then). A light module: it runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

# The scenario the user runs fits with MARGIN to spare and its max/mean is at most this:
# nothing to change (an imbalance of 10 % is a loss tensor and a larger shard, not a bug).
IMBALANCE_THRESHOLD = 1.10
# ... or its heaviest GPU is above the mean by less than this share of the GPU: nothing to
# change either (the PyTorch tutorial's loop at batch 256: 1.84x the mean, 3.71 MiB above it
# on a GPU of 79.2 GiB; DDP would have been recommended for 432 KiB)
IMBALANCE_FLOOR = 0.01
# A change fits with a margin when its fullest GPU needs at most (1 - MARGIN) of the GPU:
# room for the allocator's other segments, a longer sequence, another library's workspace.
MARGIN = 0.05
LADDER_PREFIX = "ladder-"  # the ladder's rungs (dpprof.measure.ladder) are named so


@dataclass(frozen=True)
class Cost:
    """What a change costs the user (see the module)."""

    rank: int  # the policy's order: lower is cheaper
    change: str  # what it changes in the training script, in words
    step_time: str  # what it does to a step's time, in words ("" where nothing is known)
    # the predicted step time it adds, in seconds (a time model fills it; None: not yet)
    step_time_s: float | None = None
    # how far its need may be understated (FSDP2's reserved memory against an H200): the
    # margin asked of it is at least this share of its need
    understated: float = 0.0


NOTHING = Cost(0, "nothing", "")
# the ladder's rungs (names after the prefix; fp16 is costed as bf16); each fix kind carries
# its own (dpprof.fixes.fix_kind.FixKind.cost), cheaper than every rung
RUNG_COSTS: dict[str, Cost] = {
    "bf16": Cost(6, "autocast around forward and the loss", "usually faster on tensor cores"),
    "checkpoint": Cost(7, "checkpoint the repeated blocks",
                       "one more forward of the blocks per step"),
    "bf16-checkpoint": Cost(8, "autocast and checkpointing",
                            "one more forward of the blocks per step"),
    "accumulate": Cost(9, "a loop of micro-batches per optimizer step",
                       "the same rows in smaller passes: less parallel work per pass"),
    "combined-accumulate": Cost(10, "autocast, checkpointing and micro-batches",
                                "one more forward of the blocks; smaller passes"),
    "fsdp2-zero2": Cost(11, "a launcher and fully_shard on each block",
                        "an all-gather per block per step, the gradients reduced in shards",
                        understated=0.10),
    "fsdp2-zero3": Cost(12, "a launcher and fully_shard on each block",
                        "all-gathers in forward and again in backward", understated=0.10),
    "fsdp2-zero3-checkpoint": Cost(13, "fully_shard, its bf16 policy and checkpointing",
                                   "all-gathers twice and one more forward of the blocks",
                                   understated=0.10),
    "fsdp2-zero3-offload": Cost(14, "fully_shard with CPUOffloadPolicy",
                                "the optimizer step on the CPU (an H200: 0.033 s to 0.089 s "
                                "for lm)", understated=0.11),
}
UNKNOWN = Cost(99, "a change this dpprof does not know", "")


def family(name: str) -> str:
    """The key of :data:`RUNG_COSTS` for rung ``name``: its name without the prefix, fp16
    read as bf16 and each combination under its place."""
    rung = name.removeprefix(LADDER_PREFIX).replace("fp16", "bf16")
    if rung.startswith("fsdp2-zero3") and "checkpoint" in rung:
        return "fsdp2-zero3-checkpoint"
    if rung.endswith("-accumulate"):
        return "combined-accumulate"
    return rung


def rung_cost(name: str) -> Cost:
    """The cost of the ladder's rung ``name`` (:data:`UNKNOWN` for a name this dpprof does
    not know; a fix kind's cost is the kind's, :func:`dpprof.fixes.fix_registry.cost_of`)."""
    if not name.startswith(LADDER_PREFIX):
        return UNKNOWN
    return RUNG_COSTS.get(family(name), UNKNOWN)


def lines_changed(code: str) -> int:
    """Lines a fix's diff adds or removes (its code's ``+`` and ``-`` lines)."""
    return sum(1 for line in code.splitlines() if line[:1] in "+-")


def margin_bytes(capacity_bytes: int, need_bytes: int, cost: Cost) -> int:
    """The spare a fit must leave: :data:`MARGIN` of the GPU, or the share of its need by
    which it may be understated, whichever is more."""
    return max(int(MARGIN * capacity_bytes), int(cost.understated * need_bytes))
