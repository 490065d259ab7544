"""Shared fixtures: fast CPU tests by default; ``gpu`` tests skip without two GPUs."""

from __future__ import annotations

import pytest
import torch

# A known, unresolved bug: a torchrun rank sometimes dies of SIGABRT ("terminate called
# without an active exception") while its interpreter shuts down, after its work is done and
# gathered (seen in about 1 of 8 full runs, on different torchrun tests). Tests marked
# ``torchrun`` rerun, at most twice, on that failure only; any other failure fails.
TORCHRUN_TEARDOWN_ABORT = pytest.mark.flaky(
    reruns=2, only_rerun=[r"SIGABRT", r"exitcode: -6", r"terminate called without an active"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason=f"needs at least two CUDA GPUs (found {gpus})")
    for item in items:
        if "torchrun" in item.keywords:
            item.add_marker(TORCHRUN_TEARDOWN_ABORT)
        if "gpu" in item.keywords and gpus < 2:
            item.add_marker(skip_gpu)
