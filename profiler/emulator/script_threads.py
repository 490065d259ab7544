"""Threads the program starts run on the virtual GPUs, as its own thread does.

A real GPU answers every thread of the process. The emulation is a dispatch mode, and torch
keeps the stack of modes per thread (as it keeps the grad mode, autocast and the current
device): a thread the program starts would find no virtual GPU, and its first CUDA tensor
would fail ("Could not run 'aten::empty_strided' with arguments from the 'CUDA' backend")
or go uncounted. So while the emulation runs, every ``threading.Thread`` the program starts
runs with the emulation's mode on its own stack: a criterion applied on each GPU in a thread
of its own (PyTorch-Encoding's ``DataParallelCriterion``), a loader that moves batches to a
GPU in the background, a thread pool's GPU work. The rest of a thread's state starts as
CUDA and torch start it (device 0, the default stream, grad mode on, no autocast: each
thread's own, :class:`~dpprof.emulator.dispatch_state.DispatchState`); what it allocates is
filed under the category and phase of the work that started it.

The runtime takes one op at a time (its accounting is several steps), so threads interleave
between ops as the GIL lets them; the peak is that of the interleaving this run took, as a
GPU's is of the timing its run took. A thread's matmuls share the cuBLAS workspace of the
program's thread (on a GPU, a thread takes a handle from torch's per-device pool,
``CublasHandlePool.cpp``: a new one, with a workspace of its own, where none is free).
Threads started by dpprof itself are left alone.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils._python_dispatch import _pop_mode, _push_mode

if TYPE_CHECKING:
    from dpprof.emulator.emulated_cuda import EmulatedCuda

_OWN_PACKAGE = __name__.split(".")[0] + "."
# each emulation's threads the program started (those alive, weakly)
_STARTED: weakref.WeakKeyDictionary[Any, weakref.WeakSet[threading.Thread]] = (
    weakref.WeakKeyDictionary())


def install(vc: EmulatedCuda, patch: Callable[[Any, str, Any], None]) -> None:
    """Patch ``threading.Thread.start`` (with ``patch``, undone with the emulation's other
    patches) so that each thread the program starts runs on ``vc``'s virtual GPUs."""
    original_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if vc.active and not caller.startswith(_OWN_PACKAGE):
            run = thread.run
            inherited = vc.rt.state.inherited()
            # an instance attribute: the thread's own run (a subclass's too) inside
            thread.run = lambda: _run_on_gpus(vc, run, inherited)  # type: ignore[method-assign]
            _STARTED.setdefault(vc, weakref.WeakSet()).add(thread)
        original_start(thread)

    patch(threading.Thread, "start", start)


def threads_started(vc: EmulatedCuda) -> list[threading.Thread]:
    """The threads the program started under ``vc`` that are still alive."""
    return [t for t in _STARTED.get(vc, ()) if t.is_alive()]


def _run_on_gpus(vc: EmulatedCuda, run: Callable[[], None],
                 inherited: tuple[str, str]) -> None:
    """``run`` with the emulation's mode on this thread's stack, while the emulation that
    started it is still on (a thread that outlives it runs as without dpprof)."""
    if not vc.active:
        run()
        return
    vc.rt.state.adopt(inherited)
    vc.enter_thread()
    _push_mode(vc.rt)
    try:
        run()
    except vc.quiet_thread_ends:
        pass  # the caller's own stop (dpprof run's, after --steps) ends the thread quietly
    finally:
        _pop_mode()
        vc.leave_thread()
