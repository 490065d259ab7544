"""dpprof: a DataParallel load-imbalance profiler for PyTorch.

    dpprof compare --batch 512

runs your training step as paired scenarios (DataParallel with the loss on cuda:0, with the
loss inside forward, DistributedDataParallel, one GPU), measures every GPU, says why cuda:0
is heavier and what each fix saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpprof.scenarios.model_with_loss import ModelWithLoss
    from dpprof.scenarios.registry import SCENARIOS
    from dpprof.scenarios.workloads import Workload
    from dpprof.version import __version__

__all__ = ["SCENARIOS", "ModelWithLoss", "Workload", "__version__"]


def __getattr__(name: str) -> Any:
    """``dpprof.Workload`` and friends, imported on first use (deferred: they import torch,
    and ``import dpprof`` stays light, so the command line handles Ctrl-C and SIGTERM from
    its first moment)."""
    if name == "__version__":  # importlib.metadata: a twentieth of a second
        from dpprof.version import __version__

        return __version__
    if name == "SCENARIOS":
        from dpprof.scenarios.registry import SCENARIOS

        return SCENARIOS
    if name == "ModelWithLoss":
        from dpprof.scenarios.model_with_loss import ModelWithLoss

        return ModelWithLoss
    if name == "Workload":
        from dpprof.scenarios.workloads import Workload

        return Workload
    raise AttributeError(f"module 'dpprof' has no attribute {name!r}")
