"""CUDA graphs on the virtual devices: ``torch.cuda.CUDAGraph``, ``graph_pool_handle`` and
``is_current_stream_capturing``, and through them torch's own ``torch.cuda.graph`` and
``make_graphed_callables``, which are Python over these.

What a graph does to memory (``c10/cuda/CUDACachingAllocator.cpp``, Note [Interaction with
CUDA graph capture]; ``aten/src/ATen/cuda/CUDAGraph.cpp``):

* while a stream captures, every allocation made on it is served from the graph's private
  pool (``beginAllocateToPool``): segments of its own, reused only by allocations into the
  same pool (a later capture given the graph's ``pool()`` or a ``graph_pool_handle()``), and
  kept reserved for as long as a graph uses the pool. The ledger tags those allocations with
  the pool (:meth:`dpprof.emulator.storage_ledger.StorageLedger.begin_capture`), and the
  allocator's simulation keeps the pool apart (:func:`dpprof.emulator.allocator.
  private_pool_key`). So the tensors a captured step frees still hold its high-water mark
  reserved: a step run as a graph reserves more than the same step run eagerly.
* a replay allocates nothing: the captured kernels write the memory the capture allocated,
  and the tensors the capture left alive (its outputs, the gradients) are the ones replays
  refill.

A replay re-runs nothing here. Over meta tensors there is nothing to compute, so it is exact
for memory; under ``--compute`` the captured work's values would go stale, so a replay there
stops the run (:class:`dpprof.errors.NotEmulated`) rather than hand back old numbers.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from dpprof.emulator.allocator import private_pool_key
from dpprof.emulator.emulated_cuda import EmulatedCuda
from dpprof.emulator.events import RELEASE_POOL
from dpprof.emulator.patcher import Patch
from dpprof.errors import NotEmulated

__all__ = ["Captures", "install"]

_POOL_IDS = itertools.count(1)  # the process's graph pools, as torch numbers them

# torch's own words where CUDA refuses a capture on the legacy default stream
DEFAULT_STREAM_CAPTURE = (
    "CUDA graphs must be captured on a non-default stream. (However, after capture, it's ok "
    "to replay them on the default stream.)")
REPLAY_UNDER_COMPUTE = (
    "dpprof: a CUDA graph's replay is not re-run under --compute (the captured work's values "
    "would be stale); measure without --compute, where a replay allocates nothing and its "
    "memory is exact, or run the step without CUDA graphs")


class Captures:
    """The CUDA graphs of one virtual CUDA: their pools' ids and the capture under way on
    each device (one at a time per device, as CUDA allows one per stream and torch
    documents one per process)."""

    def __init__(self, vc: EmulatedCuda) -> None:
        self.vc = vc
        self._user_made: set[int] = set()  # the pools graph_pool_handle gave out
        self._underway: dict[int, CUDAGraph] = {}  # runtime device -> the graph capturing
        self._uses: dict[int, int] = {}  # pool id -> the graphs captured into it (use_count)

    def new_handle(self, own: bool) -> tuple[int, int]:
        """A new pool's handle: ``(id, 0)`` for a graph's own pool, ``(0, id)`` for one
        from ``graph_pool_handle`` (``MempoolId_t``'s two kinds). Ids are the process's,
        as torch's are: a handle a module kept from an earlier run names no pool of this
        one's."""
        n = next(_POOL_IDS)
        if not own:
            self._user_made.add(n)
        return (n, 0) if own else (0, n)

    def handle_of(self, pool_id: int) -> tuple[int, int]:
        """The handle of the pool ``pool_id``."""
        return (0, pool_id) if pool_id in self._user_made else (pool_id, 0)

    @staticmethod
    def pool_id(handle: Any) -> int:
        """The id of the pool ``handle`` names (``MempoolId_t``: one of its two ids)."""
        ids = tuple(handle) if isinstance(handle, (tuple, list)) else ()
        if (len(ids) != 2 or not all(isinstance(i, int) and i >= 0 for i in ids)
                or (ids[0] == 0) == (ids[1] == 0)):
            raise RuntimeError(f"not a graph pool handle: {handle!r}")
        return int(ids[0] or ids[1])

    def begin(self, graph: CUDAGraph, handle: tuple[int, int]) -> None:
        stream = self.vc.streams.current()
        if not stream.stream_id:
            raise RuntimeError(DEFAULT_STREAM_CAPTURE)
        device = self.vc.index_of(stream.device_index)
        if device in self._underway:
            raise RuntimeError("a CUDA graph capture is already under way on this device")
        self._underway[device] = graph
        graph.capture_device = device
        graph.capture_stream_id = stream.stream_id
        pool = self.pool_id(handle)
        self._uses[pool] = self._uses.get(pool, 0) + 1  # create_or_incref_pool
        self.vc.rt.storages.begin_capture(
            device, stream.stream_id, private_pool_key(pool, stream.stream_id))

    def release(self, handle: tuple[int, int]) -> None:
        """``releasePool``: a graph captured into the pool of ``handle`` is reset or gone;
        the last one makes the pool freeable, at this point of the allocations (a mark in
        the runtime's log, :data:`dpprof.emulator.events.RELEASE_POOL`)."""
        pool = self.pool_id(handle)
        left = self._uses.get(pool, 0) - 1
        if left < 0:
            return
        self._uses[pool] = left
        if not left:
            log = self.vc.rt.storages.events
            log.marks.append((len(log), (RELEASE_POOL, pool, 0)))

    def end(self, graph: CUDAGraph) -> None:
        device = graph.capture_device
        if device is None or self._underway.get(device) is not graph:
            raise RuntimeError("capture_end without a capture under way for this graph")
        del self._underway[device]
        graph.capture_device = None
        self.vc.rt.storages.end_capture(device)

    def capturing(self) -> bool:
        """``torch.cuda.is_current_stream_capturing()``: the current device's current
        stream is capturing."""
        device = self.vc.index_of(self.vc.current_device())
        return self.vc.rt.storages.capturing(device)

    def stream_capturing(self, stream: Any) -> bool:
        """``Stream.is_capturing()``: a graph is capturing ``stream``."""
        graph = self._underway.get(self.vc.index_of(stream.device_index))
        return graph is not None and graph.capture_stream_id == stream.stream_id

    def replay(self) -> None:
        if self.vc.rt.base.type != "meta":
            raise NotEmulated(REPLAY_UNDER_COMPUTE)


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` on a virtual device: a capture serves its allocations from
    a private pool; a replay allocates nothing (:mod:`dpprof.emulator.cuda_graphs`)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self.capture_device: int | None = None  # the runtime device of a capture under way
        self.capture_stream_id = 0
        self._handle: tuple[int, int] | None = None
        self._captured = False

    @staticmethod
    def _captures() -> Captures:
        from dpprof.emulator.emulated_cuda import active

        vc = active()
        if vc is None:
            raise RuntimeError("a virtual torch.cuda.CUDAGraph was used outside the emulation")
        captures: Captures = vc.graphs  # type: ignore[attr-defined]
        return captures

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                      check_input_liveness: bool = False) -> None:
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(f"Unknown capture error mode. Expected `global`, "
                               f"`thread_local`, or `relaxed`, got {capture_error_mode}")
        captures = self._captures()
        if pool is not None:
            captures.pool_id(pool)
            self._handle = tuple(pool)  # type: ignore[assignment]
        else:
            self._handle = captures.new_handle(own=True)
        captures.begin(self, self._handle)  # type: ignore[arg-type]

    def capture_end(self) -> None:
        self._captures().end(self)
        self._captured = True

    def instantiate(self) -> None:
        if not self._captured:
            raise RuntimeError("instantiate() called on a graph that was not captured")

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful "
                               "capture.")
        self._captures().replay()

    def reset(self) -> None:
        """``CUDAGraph::reset`` (and its destructor): the graph no longer uses its pool, whose
        cached segments go back at the next release of the cache once no graph does."""
        if self._captured and self._handle is not None:
            self._captured = False
            self._captures().release(self._handle)
        self._captured = False

    def __del__(self) -> None:
        from dpprof.emulator.emulated_cuda import active

        if self._captured and active() is not None:
            self.reset()

    def pool(self) -> tuple[int, int]:
        if self._handle is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful "
                               "capture.")
        return self._handle

    def enable_debug_mode(self) -> None:
        return None

    def debug_dump(self, debug_path: str) -> None:
        raise NotEmulated(f"dpprof: CUDAGraph.debug_dump({debug_path!r}) writes the captured "
                          "kernels' graph, and virtual devices capture no kernels")

    def raw_cuda_graph(self) -> int:
        raise NotEmulated("dpprof: a virtual device's CUDA graph has no cudaGraph_t")

    def raw_cuda_graph_exec(self) -> int:
        raise NotEmulated("dpprof: a virtual device's CUDA graph has no cudaGraphExec_t")


def install(vc: EmulatedCuda, p: Patch) -> None:
    """Patch ``torch.cuda``'s graph API (and ``torch.cuda.graphs``', whose
    ``make_graphed_callables`` and ``graph`` call their module's names) to ``vc``'s
    :class:`Captures`."""
    import torch.cuda.graphs as graphs

    captures: Captures = vc.graphs  # type: ignore[attr-defined]

    def graph_pool_handle() -> tuple[int, int]:
        return captures.new_handle(own=False)

    for owner in (torch.cuda, graphs):
        p(owner, "CUDAGraph", CUDAGraph)
        p(owner, "graph_pool_handle", graph_pool_handle)
        p(owner, "is_current_stream_capturing", captures.capturing)
    # torch.cuda.graph keeps its capture stream on the class: a stream of this emulation's
    p(graphs.graph, "default_capture_stream", None)
    if not hasattr(torch._C, "_host_emptyCache"):  # a CPU build: graph's __enter__ calls it
        p(torch._C, "_host_emptyCache", lambda: None)
