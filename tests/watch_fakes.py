"""Fake NVML backends for the ``dpprof watch`` tests: passed to the watcher in this process,
or installed in a ``dpprof`` child by ``tests/fakehost/sitecustomize.py`` (``nvml=NAME``).

They run inside the watching dpprof process: per-process memory is reported for the real
descendants of that process (the command dpprof started and its children), plus PID 1, which
is never the command's, so the tests see whether dpprof keeps only the command's processes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fake_nvml import FakeDevice, FakeNvml

from dpprof.nvml import libnvml
from dpprof.nvml.queries import NvmlBackend
from dpprof.watch.monitor import descendants

if TYPE_CHECKING:
    import pytest

GIB = 2**30
MIB = 2**20


def install(monkeypatch: pytest.MonkeyPatch, nvml: NvmlBackend) -> None:
    """Make ``nvml`` this process's NVML backend (what ``libnvml.default_nvml()`` returns);
    a child process gets one through ``fake_cuda.fakehost_env(nvml=NAME)``."""
    monkeypatch.setattr(libnvml, "default_nvml", lambda: nvml)


def _procs(per_process: int):
    def read(_n: int) -> list[tuple[int, int | None]]:
        mine = sorted(descendants(os.getpid()))
        return [(1, 7 * GIB)] + [(pid, per_process) for pid in mine]

    return read


def two_gpus() -> FakeNvml:
    """cuda:0 fills up (1 GiB, then +8 GiB per reading, up to 78 GiB); cuda:1 stops at
    40 GiB: the picture of a DataParallel OOM."""
    return FakeNvml(
        [
            FakeDevice(
                "GPU-aaaaaaaa-0000-0000-0000-000000000000", name="NVIDIA Fake 80GB",
                total_bytes=80 * GIB, used=lambda n: min(GIB + n * 8 * GIB, 78 * GIB),
                processes=_procs(600 * MIB),
            ),
            FakeDevice(
                "GPU-bbbbbbbb-0000-0000-0000-000000000000", name="NVIDIA Fake 80GB",
                total_bytes=80 * GIB, used=lambda n: min(GIB + n * 4 * GIB, 40 * GIB),
                processes=_procs(300 * MIB),
            ),
        ]
    )


def three_gpus() -> FakeNvml:
    """Three GPUs with constant readings 10, 20, 30 GiB."""
    return FakeNvml(
        [
            FakeDevice(f"GPU-cccccccc-0000-0000-0000-00000000000{i}", used=(i + 1) * 10 * GIB)
            for i in range(3)
        ]
    )


def unavailable() -> FakeNvml:
    """A machine without the NVIDIA driver."""
    return FakeNvml.unavailable("libnvidia-ml.so.1 not found (fake)")
