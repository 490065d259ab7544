"""Shared fixtures: fast CPU tests by default; ``gpu`` tests skip without a CUDA GPU, and
those also marked ``gpus2`` (what truly needs two: uneven shards over two devices, a rank's
context on a GPU not its own) without two."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # a calibration saved by `dpprof check` on this machine would change the emulated
    # context figures the tests expect: every test (and every process it starts) reads an
    # empty calibration folder unless it sets its own
    os.environ["DPPROF_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="dpprof-calibration-")
    # `dpprof run` in the test process keeps its seal's Python line and audit hook: a process
    # that entered a mount namespace stays there, and whether the first test to run has one
    # thread would decide it for the rest; the kernel line's tests run dpprof in a process
    # of its own (tests/test_seal_kernel.py)
    os.environ["DPPROF_NO_NAMESPACE"] = "1"
    # hypothesis keeps its examples outside the repository: tests that run `dpprof run` with
    # the repository as the working folder check after each run that nothing in it changed,
    # and a property test beside them (pytest-xdist) would write .hypothesis/ there
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(tempfile.mkdtemp(prefix="dpprof-hypothesis-"))
    # pytest-xdist's controller imports the module of each warning a worker reports, to
    # rebuild its category: a Lightning warning imports lightning, then torchmetrics, then
    # torchvision, whose C ops do not load over a CPU torch -- the controller crashed
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.getoption("numprocesses", None)
            and importlib.util.find_spec("torchvision") is not None):
        from torchvision_shim import import_torchvision

        import_torchvision()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest-xdist hands tests out in this order: the files that hold a test marked slow run
    # first (each file whole, so its module-scoped fixtures are still built once), and the
    # run ends on short tests, with no worker left alone on a long one
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" not in item.keywords:
            continue
        need = 2 if "gpus2" in item.keywords else 1
        if gpus < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} CUDA GPU{'s' if need > 1 else ''} (found {gpus})"))
