"""A thread the program starts runs on the virtual GPUs as its own thread does.

A real GPU answers every thread of the process; the emulation's dispatch mode is per thread
in torch. The guarantee, over generated programs (GPU work x how the thread is started x
which GPU): the same work done on a thread the program starts (and joins) leaves each GPU
with the same allocations, in the same order, sizes, streams and categories, and the same
``torch.cuda.max_memory_allocated``/``max_memory_reserved``, as done on the program's own
thread. Before, the thread's first CUDA tensor failed ("Could not run 'aten::empty_strided'
with arguments from the 'CUDA' backend") or went uncounted."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dpprof.emulator.virtual_cuda import VirtualCuda

GPUS = 2
Work = Callable[[int, list[Any]], None]


def factory(k: int, keep: list[Any]) -> None:
    keep.append(torch.randn(1000, 257, device=f"cuda:{k}"))


def current_device_context(k: int, keep: list[Any]) -> None:
    with torch.cuda.device(k):
        keep.append(torch.empty(3000, device="cuda"))


def set_device(k: int, keep: list[Any]) -> None:
    before = torch.cuda.current_device()
    torch.cuda.set_device(k)
    keep.append(torch.zeros(777, 33, device="cuda"))
    torch.cuda.set_device(before)


def host_tensor_moved(k: int, keep: list[Any]) -> None:
    keep.append(torch.randn(500, 100).to(f"cuda:{k}", non_blocking=True))


def train_step(k: int, keep: list[Any]) -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(f"cuda:{k}")
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 64, device=f"cuda:{k}")
    nn.functional.cross_entropy(model(x), torch.randint(0, 10, (32,), device=f"cuda:{k}")
                                ).backward()
    opt.step()
    keep.extend((model, opt))


def side_stream(k: int, keep: list[Any]) -> None:
    stream = torch.cuda.Stream(k)
    with torch.cuda.stream(stream):
        keep.append(torch.empty(5000, device=f"cuda:{k}"))
    keep.append(torch.empty(4000, device=f"cuda:{k}"))


def freed(k: int, keep: list[Any]) -> None:
    x = torch.empty(2**20, device=f"cuda:{k}")
    keep.append(x[:10].clone())
    del x


def autocast_matmul(k: int, keep: list[Any]) -> None:
    a = torch.randn(128, 256, device=f"cuda:{k}")
    with torch.autocast("cuda", dtype=torch.float16):
        keep.append(a @ a.T)


WORKS: dict[str, Work] = {f.__name__: f for f in (
    factory, current_device_context, set_device, host_tensor_moved, train_step, side_stream,
    freed, autocast_matmul)}


def on_a_thread(work: Callable[[], None]) -> None:
    t = threading.Thread(target=work)
    t.start()
    t.join()


def on_a_thread_subclass(work: Callable[[], None]) -> None:
    class Worker(threading.Thread):
        def run(self) -> None:
            work()

    t = Worker()
    t.start()
    t.join()


def in_a_pool(work: Callable[[], None]) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pool.submit(work).result()


def on_a_timer(work: Callable[[], None]) -> None:
    t = threading.Timer(0.0, work)
    t.start()
    t.join()


def on_this_thread(work: Callable[[], None]) -> None:
    work()


STARTERS = {f.__name__: f for f in (on_a_thread, on_a_thread_subclass, in_a_pool, on_a_timer)}


def recorded(program: list[tuple[str, int]], start: Callable[[Callable[[], None]], None]
             ) -> dict[str, Any]:
    """Each GPU's allocation sequence (sizes, its stream by order of first use, the
    category its storage is filed under) and the peaks torch.cuda reports, after
    ``program`` ran, each piece of work through ``start``."""
    keep: list[Any] = []
    errors: list[BaseException] = []
    with VirtualCuda(GPUS, honour_visible_devices=False) as vc:
        for name, k in program:
            def work(name: str = name, k: int = k) -> None:
                try:
                    WORKS[name](k, keep)
                except BaseException as e:  # a thread's error is lost unless kept
                    errors.append(e)
            start(work)
        if errors:
            raise errors[0]
        events = vc.rt.storages.events
        ledger = vc.rt.storages
        streams: dict[int, int] = {}
        sequences: dict[int, list[tuple[int, int, int, str]]] = {d: [] for d in range(GPUS)}
        for i in range(len(events)):
            device = events.device[i]
            if device < 0:
                continue
            stream = events.streams.get(i, 0)
            stream = streams.setdefault(stream, len(streams)) if stream else 0
            sequences[device].append((events.requested[i], events.allocated[i], stream,
                                      ledger.label_of(events.serial[i])))
        return {
            "sequences": sequences,
            "allocated": [torch.cuda.max_memory_allocated(d) for d in range(GPUS)],
            "reserved": [torch.cuda.max_memory_reserved(d) for d in range(GPUS)],
        }


@pytest.mark.parametrize("starter", sorted(STARTERS))
@pytest.mark.parametrize("work", sorted(WORKS))
def test_each_work_on_a_thread_counts_as_on_the_programs_own(work: str, starter: str) -> None:
    program = [(work, 1), (work, 0)]
    on_thread = recorded(program, STARTERS[starter])
    assert on_thread == recorded(program, on_this_thread)
    assert on_thread["allocated"][1] > 0 and on_thread["allocated"][0] > 0


@settings(max_examples=25, deadline=None)
@given(program=st.lists(st.tuples(st.sampled_from(sorted(WORKS)), st.integers(0, GPUS - 1)),
                        min_size=1, max_size=4),
       starter=st.sampled_from(sorted(STARTERS)))
def test_any_program_on_threads_counts_as_on_the_programs_own(
        program: list[tuple[str, int]], starter: str) -> None:
    assert recorded(program, STARTERS[starter]) == recorded(program, on_this_thread)


def test_a_thread_keeps_its_own_current_device_and_stream() -> None:
    """CUDA's current device and stream are per thread: a thread's set_device and stream
    leave the program's thread where it was, and a new thread starts on device 0."""
    seen: dict[str, Any] = {}
    with VirtualCuda(GPUS, honour_visible_devices=False):
        torch.cuda.set_device(1)
        main_stream = torch.cuda.current_stream()

        def work() -> None:
            seen["started_on"] = torch.cuda.current_device()
            torch.cuda.set_device(0)
            torch.cuda.set_stream(torch.cuda.Stream(0))
            seen["made_on"] = torch.empty(10, device="cuda").device

        on_a_thread(work)
        assert seen == {"started_on": 0, "made_on": torch.device("cuda", 0)}
        assert torch.cuda.current_device() == 1
        assert torch.cuda.current_stream() == main_stream
        assert torch.empty(10, device="cuda").device == torch.device("cuda", 1)
