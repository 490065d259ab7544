"""Built-in workloads under FSDP2 (``fully_shard`` per repeated block and at the root), for
the checks against real gloo ranks (loaded by path in the profiled ranks)."""

from __future__ import annotations

import dpprof
from dpprof.measure.rung_models import fully_sharded


def lm_small() -> dpprof.Workload:
    from fidelity_models import lm_small as small

    return small()


def lm_zero3() -> dpprof.Workload:
    return fully_sharded(lm_small(), reshard_after_forward=True)


def lm_zero2() -> dpprof.Workload:
    return fully_sharded(lm_small(), reshard_after_forward=False)


def attention_zero3() -> dpprof.Workload:
    from fidelity_models import attention_small

    return fully_sharded(attention_small(), reshard_after_forward=True)


def lm_zero3_bf16_checkpoint() -> dpprof.Workload:
    return fully_sharded(lm_small(), reshard_after_forward=True,
                         param_dtype="bfloat16", checkpoint=True)

