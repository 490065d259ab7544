"""What the virtual devices' dispatch mode has set now (the current device, category and
phase, a forced placement), read by the mode and by the ledger of storages it holds; the
device index of the host; the error a real GPU's refusal becomes."""

from __future__ import annotations

import threading

HOST = -1  # the device index of the host


class VirtualDeviceError(RuntimeError):
    """The program did something a real GPU would refuse (tensors on two devices)."""


class DispatchState(threading.local):
    """The contexts the dispatch mode's callers have entered (one object, shared by the
    mode and its parts: every storage allocated reads the category, the phase and the stream).

    Each thread has its own, as CUDA keeps the current device and stream per thread: a thread the
    program starts (:mod:`dpprof.emulator.script_threads`) places its copies and factories
    by its own contexts while the program's thread is inside others."""

    def __init__(self) -> None:
        self.category = "activations"
        self.device = HOST
        self.forced: int | None = None  # place every new storage here (copies between devices)
        self.allow_cross = False
        self.phase = ""
        # torch's own code that names the device of an emulated tensor (``device=x.device``,
        # which is meta underneath) means this virtual device (None: the rules of dispatch)
        self.meta_device: int | None = None
        # the device of the last op with device tensor inputs (a factory inside a backward
        # node goes there, as CUDA's engine runs each node under its device's guard)
        self.last_device: int | None = None
        # depth of the emulation's own dispatch on this thread (tensors show their real,
        # meta device meanwhile)
        self.in_dispatch = 0
        # device -> the stream current on it (absent: the default stream), and device -> the
        # key its allocations are tagged with where that is not the default stream's (the
        # current stream, or the private pool of a CUDA graph it captures)
        self.streams: dict[int, int] = {}
        self.stream_tags: dict[int, int] = {}
        # whose cuBLAS handle the thread's ops run with: the program's own thread's, or a
        # thread it (or DataParallel's parallel_apply) starts, which takes a handle of
        # its own from torch's per-device pool (CublasHandlePool.cpp: one a thread)
        self.worker_thread = False

    def inherited(self) -> tuple[str, str]:
        """What a thread started now takes of this thread's state, for :meth:`adopt` on the
        new thread: the category and the phase (its allocations are filed as the work that
        started it); the device and the rest start afresh, as CUDA's do."""
        return self.category, self.phase

    def adopt(self, inherited: tuple[str, str]) -> None:
        self.category, self.phase = inherited
        self.worker_thread = True
