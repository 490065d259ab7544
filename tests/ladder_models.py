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
