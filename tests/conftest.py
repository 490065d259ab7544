"""Shared fixtures: fast CPU tests by default; ``gpu`` tests skip without a CUDA GPU, and
those also marked ``gpus2`` (what truly needs two: uneven shards over two devices, a rank's
context on a GPU not its own) without two."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import tempfile
from typing import Any

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # a suite started as a background job of a non-interactive shell (`.ci/run > log &` in a
    # script) inherits SIGINT ignored (POSIX shells ignore it for such jobs, and Python then
    # keeps SIG_IGN instead of raising KeyboardInterrupt), and so would every process a test
    # starts: the tests expect what a terminal or CI gives, Python's own handler
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # a calibration saved by `dpprof check` on this machine would change the emulated
    # context figures the tests expect: every test (and every process it starts) reads an
    # empty calibration folder unless it sets its own
    calibration = tempfile.mkdtemp(prefix="dpprof-calibration-")
    os.environ["DPPROF_CALIBRATION_DIR"] = calibration
    atexit.register(shutil.rmtree, calibration, ignore_errors=True)  # one per run and worker
    # `dpprof run` in the test process keeps its seal's Python line and audit hook: a process
    # that entered a mount namespace stays there, and whether the first test to run has one
    # thread would decide it for the rest; the kernel line's tests run dpprof in a process
    # of its own (tests/test_seal_kernel.py)
    os.environ["DPPROF_NO_NAMESPACE"] = "1"
    share_the_cores(config)
    # hypothesis keeps its examples outside the repository: tests that run `dpprof run` with
    # the repository as the working folder check after each run that nothing in it changed,
    # and a property test beside them (pytest-xdist) would write .hypothesis/ there
    from hypothesis.configuration import set_hypothesis_home_dir

    examples = tempfile.mkdtemp(prefix="dpprof-hypothesis-")
    set_hypothesis_home_dir(examples)
    atexit.register(shutil.rmtree, examples, ignore_errors=True)  # as the calibration's
    # pytest-xdist's controller imports the module of each warning a worker reports, to
    # rebuild its category: a Lightning warning imports lightning, then torchmetrics, then
    # torchvision, whose C ops do not load over a CPU torch -- the controller crashed
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.getoption("numprocesses", None)
            and importlib.util.find_spec("torchvision") is not None):
        from torchvision_shim import import_torchvision

        import_torchvision()


def share_the_cores(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch takes its share of the cores for its intra-op
    threads. Each would take every core, and OpenMP's threads spin for a while after each
    parallel region: with two workers on two cores, the tests that compute for real in the
    worker ran three times slower than alone (measured, tests/test_run_loss_shape_reads.py).
    The processes a test starts keep torch's default, as a user's do (gloo ranks limited to
    one thread each needed tests/test_fsdp.py's relaunch in 2 of 3 loaded runs, against 1
    of 3 with the default: too few runs to say, so nothing of theirs changes)."""
    worker = getattr(config, "workerinput", None)
    if worker is None or "OMP_NUM_THREADS" in os.environ:
        return
    workers = int(worker.get("workercount", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest-xdist hands tests out in this order (see pytest_xdist_make_scheduler): the files
    # that hold a test marked slow run first, and the run ends on short tests, with no worker
    # left alone on a long one
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


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope`` (pyproject's addopts), pytest-xdist hands out one test at a
    time, in the order above, to whichever worker is free; a file whose tests share a
    module-scoped fixture (DDP ranks launched once, a browser) goes whole to one worker.
    Split between workers (as ``--dist worksteal`` split them), each built the fixture
    again: test_fidelity.py's ranks were launched three times in one run. (``xdist_group``
    marks would say it, but pytest-xdist 3.8 groups by renaming the node id, which pytest
    9.2 no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath
    shared: dict[str, bool] = {}

    def shares_a_module_fixture(path: str) -> bool:
        if path not in shared:
            try:
                source = (root / path).read_text()
            except OSError:
                source = ""
            shared[path] = 'scope="module"' in source
        return shared[path]

    class OneTestOrASharedFile(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if shares_a_module_fixture(path) else nodeid

    config.option.loadscopereorder = False  # keep the order above
    return OneTestOrASharedFile(config, log)


@pytest.fixture
def in_script_folder(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The test's folder as the working folder of a script run under dpprof, without the
    machine's CUDA_VISIBLE_DEVICES (the run sees every virtual GPU it is given)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path
