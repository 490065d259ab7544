"""What the script's process does as it ends, done as its run ends, in the order of Python's
exit: its threads are waited for, its exit handlers run, its daemonic children end and
its other children are joined, the threads still running are stopped, its objects are
released.

``atexit.register`` in a process of its own runs the handler when that process ends: a
log's last line, a run's summary, a results file written at exit. dpprof runs the script in
its own process, so a handler registered while the script ran would otherwise run at
dpprof's exit, after every run's seal is gone, and write into the user's folders after the
report said they were untouched (and once for all the runs, not once a run). While the script
runs, ``atexit.register`` and ``atexit.unregister`` keep the run's handlers (the script's, and
those of a library it imports then; Python's own modules' stay the process's); when the run
ends (its main module returned or raised, ``sys.exit``, dpprof's stop after ``--steps``,
Ctrl-C) they run, last registered first, inside the run's seal and on its virtual GPUs, each
error printed as Python prints it and ignored.
Then the daemonic processes the run started and left running (a DataLoader's
``persistent_workers``) are terminated and joined, as ``multiprocessing``'s own exit
function ends them: left running, they outlived the run's overlay (their sockets were in it)
and failed at dpprof's exit. Its non-daemonic ones (a checkpoint written in a process of its
own) are joined next, as that function joins them: a while (Python waits for ever; one that
waits for work the stopped script never sends would wait for ever here too), then those
still running are left to the seal's end, which ends them and names them. Last, the script's
objects are released, as Python's finalization releases a process's (its modules' globals
cleared, the frames of what ended it, cycles collected): an object whose ``__del__`` writes
a file (a logger that writes its lines when collected) wrote into the user's folder once
dpprof dropped the run's modules, after its seal.
The threads the script started are waited for a while (Python's exit waits for the
non-daemonic ones for ever; a loop dpprof stopped early may wait for a stop never sent), then
those still running get ``SystemExit`` at their next step in Python: left running, one that
writes now and then wrote into the next run's overlay, and after the last run into the
user's folders. ``os._exit`` ends a process without any of it, and so it ends the run.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from dpprof.emulator.emulated_cuda import active
from dpprof.emulator.heap import frozen_heap
from dpprof.emulator.patcher import Patcher
from dpprof.emulator.script_threads import threads_started
from dpprof.script.hooks import StopScript
from dpprof.script.launch import Launch, ProcessExit, own_modules
from dpprof.script.seal_audit import SealBreach

__all__ = ["run_at_the_end"]

THREAD_GRACE_S = 1.0  # how long the end of a run waits for the script's non-daemonic threads
CHILD_GRACE_S = 5.0  # ... and for its non-daemonic multiprocessing children
Handler = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


@contextlib.contextmanager
def run_at_the_end(launch: Launch) -> Iterator[list[Handler]]:
    """While inside, the exit handlers registered are the run's (the list given); on leaving,
    however the run ended, unless by ``os._exit``, the script's process ends as the module
    says: its threads waited for, the handlers run, its daemonic children ended, its threads
    still running stopped, its objects released."""
    handlers: list[Handler] = []
    real_register, real_unregister = atexit.register, atexit.unregister
    children_before = set(multiprocessing.active_children())
    main_before, modules_before = sys.modules.get("__main__"), set(sys.modules)

    def register(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        caller = sys._getframe(1).f_globals.get("__name__") or ""
        if caller.split(".")[0] in sys.stdlib_module_names:
            # Python's own housekeeping (weakref's finalizers, logging's shutdown) stays
            # the process's: run by one run, it would end them for dpprof and the next runs
            real_register(func, *args, **kwargs)
        else:
            handlers.append((func, args, kwargs))
        return func  # as atexit's: usable as a decorator

    def unregister(func: Callable[..., Any]) -> None:
        handlers[:] = [h for h in handlers if h[0] != func]
        real_unregister(func)  # one registered before the run, as Python would

    # the collection at the end scans what the run made, not dpprof's and torch's objects
    with Patcher() as patcher, frozen_heap():
        patcher.patch(atexit, "register", register)
        patcher.patch(atexit, "unregister", unregister)
        ended: BaseException | None = None
        try:
            yield handlers
        except ProcessExit:
            raise
        except BaseException as e:  # the handlers run after it, not while it is handled
            ended = e
        # in the order of Python's exit: the threads waited for, the handlers, then what
        # still runs ended and the objects released
        threads = _wait_for_threads()
        try:
            _run(handlers, ended)
        finally:  # a handler's Ctrl-C (or dpprof's stop) ends the run; the rest still ends
            _end_daemonic_children(children_before)
            _join_children(children_before)
            _stop(threads)
            main = sys.modules.get("__main__")
            _release([*([main] if main is not main_before else []), *(
                sys.modules[name] for name in _own(set(sys.modules) - modules_before,
                                                   launch.code_root))], ended)
        if ended is not None:
            raise ended


def _run(handlers: list[Handler], ended: BaseException | None = None) -> None:
    """Each handler, last registered first; one registered meanwhile is dropped, as an
    ending process drops it; an error printed as Python's ``atexit`` prints it, and
    ignored (dpprof's own stops and Ctrl-C end the run there). ``ended``: what ended the
    run, which a handler's error is not raised from (the process has it handled)."""
    ending = handlers[:]
    handlers.clear()
    while ending:
        func, args, kwargs = ending.pop()
        try:
            func(*args, **kwargs)
        except (KeyboardInterrupt, ProcessExit, SealBreach, StopScript):
            raise
        except BaseException as e:  # as CPython's atexit_callfuncs: printed, ignored
            if e.__context__ is ended:
                e.__context__ = None
            print(f"Exception ignored in atexit callback: {func!r}", file=sys.stderr)
            # from the handler's own frame, as Python shows it
            traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__
                                      else None, file=sys.stderr)
    handlers.clear()


def _end_daemonic_children(before: set[multiprocessing.process.BaseProcess]) -> None:
    """The daemonic processes started since ``before`` and still running terminated, then
    joined, as ``multiprocessing.util._exit_function`` ends them at a process's exit."""
    ending = [p for p in multiprocessing.active_children() if p not in before and p.daemon]
    for p in ending:
        p.terminate()
    for p in ending:
        p.join()


def _join_children(before: set[multiprocessing.process.BaseProcess],
                   grace_s: float = CHILD_GRACE_S) -> None:
    """The non-daemonic processes started since ``before`` joined, as
    ``multiprocessing.util._exit_function`` joins them at a process's exit, for ``grace_s``
    in all: what then still runs the seal's end ends (:mod:`dpprof.script.leftover_processes`)."""
    deadline = time.monotonic() + grace_s
    for p in multiprocessing.active_children():
        if p not in before and not p.daemon:
            p.join(max(0.0, deadline - time.monotonic()))


def _release(modules: list[Any], ended: BaseException | None) -> None:
    """The script's objects released as Python's finalization releases a process's: the
    locals of the frames of what ended the run (``ended``'s traceback; what it says of them
    is kept) and the globals of the script's own ``modules`` cleared, cycles collected. Each
    object's ``__del__`` (a logger that writes its file when collected) runs now, inside the
    seal and on the virtual GPUs, not once dpprof drops the run's modules after both."""
    if ended is not None and ended.__traceback__ is not None:
        traceback.clear_frames(ended.__traceback__)
    for module in modules:
        names = module.__dict__
        for name in [n for n in names if not (n.startswith("__") and n.endswith("__"))]:
            del names[name]  # its own names: what it is (__file__, __spec__) stays told
    gc.collect()


def _wait_for_threads() -> list[threading.Thread]:
    """The threads the script started that still run, its non-daemonic ones waited for a
    while first, as Python's exit waits for them (for ever there: a loop dpprof stopped
    early may wait for a stop it was never sent)."""
    vc = active()
    threads = [t for t in (threads_started(vc) if vc is not None else [])
               if t is not threading.current_thread()]
    deadline = time.monotonic() + THREAD_GRACE_S
    for t in threads:
        if not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def _stop(threads: list[threading.Thread]) -> None:
    """Each thread still running given ``SystemExit`` at its next step in Python, as a
    process's end stops its threads. Left running, a thread that writes now and then (a
    heartbeat, a log flushed on a timer) wrote into the next run's overlay, and after the
    last run, with Python's file calls its own again, into the user's folders."""
    for t in threads:
        if t.is_alive() and t.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident),
                                                       ctypes.py_object(SystemExit))


def _own(names: set[str], root: str) -> list[str]:
    """The script's own modules among ``names`` (:func:`own_modules`), asked only of those
    whose file or folder is named under ``root``: it resolves each path, and inside the seal
    each resolution is file calls through it (a run imports hundreds of torch's modules)."""
    prefix = os.path.join(root, "")
    near = set()
    for name in names:
        module = sys.modules.get(name)
        files = [getattr(module, "__file__", None), *(getattr(module, "__path__", None) or ())]
        if any(isinstance(f, str) and f.startswith(prefix) for f in files):
            near.add(name)
    return own_modules(near, root)
