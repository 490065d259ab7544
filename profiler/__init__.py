"""dpprof: a DataParallel load-imbalance profiler for PyTorch.

    dpprof compare --batch 512

runs your training step as paired scenarios (DataParallel with the loss on cuda:0, with the
loss inside forward, DistributedDataParallel, one GPU), measures every GPU, says why cuda:0
is heavier and what each fix saves.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dpprof")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpprof.scenarios.base import SCENARIOS, ModelWithLoss
    from dpprof.scenarios.workloads import Workload

__all__ = ["SCENARIOS", "ModelWithLoss", "Workload", "__version__"]


def __getattr__(name: str) -> Any:
    """``dpprof.Workload`` and friends, imported on first use: ``import dpprof`` stays light
    (no torch), so the command line handles Ctrl-C and SIGTERM from its first moment."""
    if name in ("SCENARIOS", "ModelWithLoss"):
        from dpprof.scenarios import base

        return getattr(base, name)
    if name == "Workload":
        from dpprof.scenarios.workloads import Workload

        return Workload
    raise AttributeError(f"module 'dpprof' has no attribute {name!r}")
