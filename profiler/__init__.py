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

from dpprof.scenarios.base import SCENARIOS, ModelWithLoss
from dpprof.scenarios.workloads import Workload

__all__ = ["SCENARIOS", "ModelWithLoss", "Workload", "__version__"]
