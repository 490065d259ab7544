"""Built-in workloads with a rung of the ladder applied, for the checks against real
execution (loaded by path in the profiled rank)."""

from __future__ import annotations

import dpprof
from dpprof.measure.rung_models import checkpointed


def lm_checkpointed() -> dpprof.Workload:
    from fidelity_models import lm_small

    return checkpointed(lm_small())


def attention_checkpointed() -> dpprof.Workload:
    from fidelity_models import attention_small

    return checkpointed(attention_small())


def lm_two_blocks() -> dpprof.Workload:
    """The ``lm`` built-in's model at a size whose emulation is cheap (its cost is in the
    ops dispatched: two blocks), still with repeated blocks for the checkpointing and FSDP2
    rungs; its batches fit a GPU of under 2 GiB beside the context and NCCL's memory."""
    from dpprof.scenarios.workloads import LMConfig, lm

    return lm(LMConfig(vocab=8000, seq=64, d_model=128, layers=2))
