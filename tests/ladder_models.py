"""Built-in workloads with a rung of the ladder applied, for the checks against real
execution (loaded by path in the profiled rank)."""

from __future__ import annotations

import dpprof
from dpprof.measure.ladder import checkpointed
from dpprof.scenarios.workloads import load_workload


def lm_checkpointed() -> dpprof.Workload:
    return checkpointed(load_workload("lm"))


def attention_checkpointed() -> dpprof.Workload:
    from fidelity_models import attention_small

    return checkpointed(attention_small())
