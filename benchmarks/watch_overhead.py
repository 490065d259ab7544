"""What ``dpprof watch`` costs: output throughput through its pipes, one sampling tick.

    python benchmarks/watch_overhead.py

Prints, and appends to ``benchmarks/watch_overhead.txt``: the time for a child to write
256 MiB to stdout directly (to /dev/null) and through the watcher; the time of one
``ProcessTree`` /proc scan (done every 0.5 s during a watch); and one ``sample_once`` of
two fake GPUs with per-process memory and a fresh scan. A fake NVML stands in for the
driver here, so the NVML calls themselves are not in the tick time.
"""

from __future__ import annotations

import datetime as _dt
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpprof.nvml.sampler import NvmlSampler
from dpprof.watch.monitor import ProcessTree, WatchConfig, Watcher, select_devices

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fake_nvml import FakeDevice, FakeNvml  # the tests' fake NVML (not shipped)

MIB = 2**20
WRITER = (
    "import sys; b = b'x' * (1 << 20)\n"
    "for _ in range(256): sys.stdout.buffer.write(b)\n"
)


def _direct() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", WRITER], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def _watched(tmp: Path) -> float:
    nvml = FakeNvml([FakeDevice("GPU-0", used=MIB), FakeDevice("GPU-1", used=MIB)])
    devices, _ = select_devices(nvml, None, env={})
    null = os.open(os.devnull, os.O_WRONLY)
    cfg = WatchConfig([sys.executable, "-c", WRITER], tmp / "b.samples.jsonl")
    t = time.perf_counter()
    Watcher(cfg, nvml, devices, stdout_fd=null, stderr_fd=null).run()
    elapsed = time.perf_counter() - t
    os.close(null)
    return elapsed


def _best(fn, n: int = 3) -> float:  # type: ignore[no-untyped-def]
    return min(fn() for _ in range(n))


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        direct = _best(_direct)
        watched = _best(lambda: _watched(Path(d)))
    tree = ProcessTree(os.getpid())
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        tree.pids()
    scan_ms = (time.perf_counter() - t) / n * 1e3
    procs = len([p for p in os.listdir("/proc") if p.isdigit()])
    nvml = FakeNvml([
        FakeDevice("GPU-0", used=MIB, processes=[(os.getpid(), MIB)]),
        FakeDevice("GPU-1", used=MIB, processes=[(os.getpid(), MIB)]),
    ])
    sampler = NvmlSampler(nvml, [0, 1], 0.1, pids=tree.pids, keep_samples=False)
    t = time.perf_counter()
    for _ in range(n):
        sampler.sample_once()
    tick_ms = (time.perf_counter() - t) / n * 1e3
    lines = [
        f"# {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}",
        f"256 MiB to stdout: direct {direct:.2f} s, through dpprof watch {watched:.2f} s "
        f"({256 / watched:.0f} MiB/s; includes the watcher's start and its report build)",
        f"one /proc scan of the process tree, {procs} processes: {scan_ms:.2f} ms",
        f"one sampling tick, 2 fake GPUs, per-process memory, fresh scan: {tick_ms:.2f} ms",
    ]
    text = "\n".join(lines)
    print(text)
    with open(Path(__file__).with_name("watch_overhead.txt"), "a", encoding="utf-8") as f:
        f.write(text + "\n\n")


if __name__ == "__main__":
    main()
