"""The NVML sampler, driven by FakeNvml and an injected clock."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fake_nvml import FakeDevice, FakeNvml

from dpprof.nvml.libnvml import RealNvml
from dpprof.nvml.queries import MemoryInfo, NvmlQueryError, Utilization
from dpprof.nvml.sampler import (
    DeviceStopped,
    JsonlSink,
    Marker,
    NvmlSampler,
    ProcessSample,
    Sample,
    event_to_dict,
)


class FakeClock:
    """A clock that moves only when told to (or when the fake sleep runs)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def sleep(self, dt: float) -> None:
        self.sleeps.append(dt)
        self.t += dt


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeDevice("GPU-a", used=[100, 300, 200], util=[10, 20, 30]),
            FakeDevice("GPU-b", used=[50, 60, 70]),  # no utilisation support
        ]
    )


class CountingNvml(FakeNvml):
    """Counts the sampler's utilisation queries, failed ones included."""

    util_asks: list[int]

    def utilization(self, index: int) -> Utilization | None:
        self.util_asks = [*getattr(self, "util_asks", []), index]
        return super().utilization(index)


def test_sample_once_records_used_memory_and_utilization() -> None:
    clock = FakeClock()
    nvml = CountingNvml(two_gpus().fake_devices)
    sampler = NvmlSampler(nvml, [0, 1], clock=clock)
    for _ in range(3):
        sampler.sample_once()
        clock.advance(0.02)
    assert [tuple(s) for s in sampler.samples] == [
        (0.0, 0, 100, 10),
        (0.0, 1, 50, None),
        (pytest.approx(0.02), 0, 300, 20),
        (pytest.approx(0.02), 1, 60, None),
        (pytest.approx(0.04), 0, 200, 30),
        (pytest.approx(0.04), 1, 70, None),
    ]
    assert sampler.peak_used_bytes(0) == 300
    assert sampler.peak_used_bytes(1) == 70
    assert sampler.peak_used_bytes(5) is None
    assert [u for _, u in sampler.timeline(0)] == [100, 300, 200]
    assert sampler.sample_count(1) == 3
    # an unsupported utilisation query is asked once, noted, and not asked again
    assert nvml.util_asks.count(0) == 3
    assert nvml.util_asks.count(1) == 1
    assert any("Not Supported" in n for n in sampler.notes[1])
    assert len(sampler.notes[1]) == 1


def test_utilization_can_be_switched_off() -> None:
    nvml = two_gpus()
    sampler = NvmlSampler(nvml, [0], clock=FakeClock(), utilization=False)
    sampler.sample_once()
    assert sampler.samples[0].util_percent is None
    assert nvml.calls("utilization", 0) == 0


def test_nvml_error_stops_only_that_device_with_the_reason() -> None:
    clock = FakeClock()
    nvml = FakeNvml(
        [
            FakeDevice("GPU-a", used=[100, NvmlQueryError("GPU is lost", "gpu_lost"), 999]),
            FakeDevice("GPU-b", used=[1, 2, 3]),
        ]
    )
    sampler = NvmlSampler(nvml, [0, 1], clock=clock, utilization=False)
    sampler.sample_once()
    clock.advance(0.02)
    events = sampler.sample_once()
    clock.advance(0.02)
    sampler.sample_once()
    assert DeviceStopped(pytest.approx(0.02), 0, "GPU is lost") in events
    assert sampler.errors == {0: "GPU is lost"}
    assert sampler.active_devices == [1]
    assert nvml.calls("memory", 0) == 2  # not asked again after the failure
    assert [s.used_bytes for s in sampler.samples if s.device == 1] == [1, 2, 3]
    assert sampler.peak_used_bytes(0) == 100  # 999 was never read


class ExplodingBackend(FakeNvml):
    """A backend that breaks the never-raise contract, to test the sampler's own guard."""

    def memory(self, index: int) -> MemoryInfo | None:
        if index == 0:
            raise RuntimeError("driver exploded")
        return super().memory(index)


def test_a_raising_backend_does_not_escape_the_sampler() -> None:
    nvml = ExplodingBackend([FakeDevice("GPU-a"), FakeDevice("GPU-b", used=5)])
    sampler = NvmlSampler(nvml, [0, 1], clock=FakeClock(), utilization=False)
    sampler.sample_once()
    assert sampler.errors[0] == "RuntimeError: driver exploded"
    assert [s.used_bytes for s in sampler.samples] == [5]


def test_process_memory_for_selected_pids() -> None:
    nvml = FakeNvml(
        [
            FakeDevice(
                "GPU-a", used=10, processes=lambda n: [(42, 1000 * (n + 1)), (7, 5), (43, None)]
            )
        ]
    )
    sampler = NvmlSampler(nvml, [0], clock=FakeClock(), utilization=False, pids=[42, 43])
    sampler.sample_once()
    sampler.sample_once()
    got = [(p.pid, p.used_bytes) for p in sampler.process_samples]
    assert got == [(42, 1000), (43, None), (42, 2000), (43, None)]  # pid 7 is not ours
    assert sampler.peak_process_bytes(0, 42) == 2000
    assert sampler.peak_process_bytes(0, 43) is None
    assert sampler.peak_process_bytes(0, 7) is None


def test_pids_callable_is_asked_every_tick_and_its_failure_is_noted() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", processes=[(1, 10), (2, 20)])])
    wanted = [{1}, {1, 2}]
    sampler = NvmlSampler(nvml, [0], clock=FakeClock(), utilization=False, pids=wanted.pop)
    sampler.sample_once()  # {1, 2}
    sampler.sample_once()  # {1}
    assert [p.pid for p in sampler.process_samples] == [1, 2, 1]
    sampler.sample_once()  # pop from an empty list: noted, sampling goes on
    assert "IndexError" in sampler.notes[-1][0]
    assert sampler.sample_count(0) == 3


def test_process_query_failure_stops_process_sampling_only() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", used=3, fail={"processes": "Insufficient Permissions"})])
    sampler = NvmlSampler(nvml, [0], clock=FakeClock(), utilization=False, pids=[1])
    sampler.sample_once()
    sampler.sample_once()
    assert sampler.sample_count(0) == 2
    assert sampler.errors == {}
    assert sampler.notes[0] == ["per-process memory: Insufficient Permissions"]


def test_markers_and_peaks_by_phase() -> None:
    clock = FakeClock()
    nvml = FakeNvml([FakeDevice("GPU-a", used=[5, 10, 40, 20, 30, 8])])
    sampler = NvmlSampler(nvml, [0], clock=clock, utilization=False)
    sampler.sample_once()  # t=0: 5, before any marker
    clock.advance(0.01)
    assert sampler.mark("warmup") == Marker(pytest.approx(0.01), "warmup")
    for _ in range(2):
        clock.advance(0.01)
        sampler.sample_once()  # 10, 40
    sampler.mark("step")
    for _ in range(3):
        clock.advance(0.01)
        sampler.sample_once()  # 20, 30, 8
    # the reading taken at the clock time of the "step" marker, before it, stays in warmup
    assert sampler.samples[2].t_s == sampler.markers[1].t_s
    assert [m.name for m in sampler.markers] == ["warmup", "step"]
    assert sampler.peaks_by_phase() == {"": {0: 5}, "warmup": {0: 40}, "step": {0: 30}}


def test_sink_gets_every_event_and_a_failing_sink_is_dropped() -> None:
    got: list[Any] = []
    nvml = FakeNvml([FakeDevice("GPU-a", used=[1, 2])])
    sampler = NvmlSampler(nvml, [0], clock=FakeClock(), utilization=False, sink=got.append)
    sampler.sample_once()
    sampler.mark("x")
    assert [type(e) for e in got] == [Sample, Marker]

    def broken(event: Any) -> None:
        raise OSError("disk full")

    sampler2 = NvmlSampler(nvml, [0], clock=FakeClock(), utilization=False, sink=broken)
    sampler2.sample_once()
    sampler2.sample_once()
    assert sampler2.sink_error == "OSError: disk full"
    assert sampler2.sample_count(0) == 2


def test_jsonl_sink_appends_and_flushes_each_line(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "timeline.jsonl"
    sink = JsonlSink(path)
    assert not path.exists()  # nothing recorded, no file
    sink(Sample(0.5, 1, 2048, 7))
    sink(ProcessSample(0.5, 1, 42, None))
    # flushed: readable before close
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"kind": "sample", "t_s": 0.5, "device": 1, "used_bytes": 2048, "util_percent": 7},
        {"kind": "process", "t_s": 0.5, "device": 1, "pid": 42, "used_bytes": None},
    ]
    with sink:
        sink(Marker(1.0, "step"))
        sink(DeviceStopped(1.5, 1, "GPU is lost"))
    assert sink.lines == 4
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds == ["sample", "process", "mark", "stopped"]
    assert event_to_dict(Marker(2.0, "a")) == {"kind": "mark", "t_s": 2.0, "name": "a"}


def test_thread_with_injected_clock_and_sleep_is_deterministic() -> None:
    clock = FakeClock()
    ticks = threading.Event()

    def sleep(dt: float) -> None:
        clock.sleep(dt)
        if len(clock.sleeps) >= 5:
            ticks.set()
            time.sleep(0.001)  # let stop() get in

    nvml = FakeNvml([FakeDevice("GPU-a", used=lambda n: 100 + n)])
    sampler = NvmlSampler(nvml, [0], 0.05, clock=clock, sleep=sleep, utilization=False)
    sampler.start()
    assert ticks.wait(60)  # a bound, not a window: set after the fifth tick
    sampler.stop()
    assert not sampler.running
    assert sampler.thread_error is None
    assert clock.sleeps[:5] == pytest.approx([0.05] * 5)  # on schedule: no drift
    samples = sampler.samples
    assert [s.t_s for s in samples[:6]] == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.25])
    assert [s.used_bytes for s in samples] == list(range(100, 100 + len(samples)))
    # stop() takes one last reading after the loop ends
    assert len(samples) == len(clock.sleeps) + 1


def test_thread_with_real_time_stops_promptly() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", used=7)])
    with NvmlSampler(nvml, [0], 0.001) as sampler:
        deadline = time.monotonic() + 60  # a bound for a loaded machine, not a window
        while sampler.sample_count(0) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert not sampler.running
    assert sampler.sample_count(0) >= 3
    assert sampler.peak_used_bytes(0) == 7
    assert all(a.t_s <= b.t_s for a, b in zip(sampler.samples, sampler.samples[1:], strict=False))


def test_thread_ends_by_itself_when_every_device_failed() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", used=[NvmlQueryError("Unknown Error")])])
    sampler = NvmlSampler(nvml, [0], 10.0).start()  # a 10 s interval: must not wait for it
    assert sampler._thread is not None
    sampler._thread.join(5)
    assert not sampler.running
    assert sampler.errors == {0: "Unknown Error"}
    assert sampler.samples == []


def test_sampler_over_an_unavailable_backend_records_the_reason() -> None:
    nvml = RealNvml(module=object())  # no nvmlInit at all: NVML is not usable
    sampler = NvmlSampler(nvml, [0], clock=FakeClock())
    sampler.sample_once()
    assert sampler.errors[0].startswith("NVML not available")


def test_keep_samples_false_keeps_peaks_only() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", used=[3, 9, 4])])
    sampler = NvmlSampler(nvml, [0], clock=FakeClock(), keep_samples=False, utilization=False)
    for _ in range(3):
        sampler.sample_once()
    assert sampler.samples == []
    assert sampler.peak_used_bytes(0) == 9
    assert sampler.sample_count(0) == 3


def test_misuse_is_rejected() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        NvmlSampler(FakeNvml(), [0], 0)
    sampler = NvmlSampler(FakeNvml([FakeDevice("GPU-a")]), [0], 0.001).start()
    with pytest.raises(RuntimeError, match="already started"):
        sampler.start()
    sampler.stop()
