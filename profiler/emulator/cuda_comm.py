"""``torch.cuda.comm`` (``torch.nn.parallel.comm``) as a script calls it itself, on virtual
GPUs: its broadcast, scatter, gather and reduce re-enacted by :mod:`dpprof.emulator.comm`
(allocation for allocation, as ``torch/csrc/cuda/comm.cpp`` does them), each device
argument resolved as ``torch.cuda`` resolves it. A CPU build has none of its C++ bindings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dpprof.emulator import comm
from dpprof.emulator.emulated_cuda import EmulatedCuda
from dpprof.emulator.patcher import Patch

__all__ = ["install"]

NAMES = ("broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter",
         "gather")


def install(vc: EmulatedCuda, p: Patch) -> None:
    """Patch ``torch.nn.parallel.comm``'s functions and ``torch.cuda.comm``'s names of them."""
    import torch.cuda.comm as cuda_comm
    import torch.nn.parallel.comm as parallel_comm

    rt = vc.rt

    def devices_of(devices: Sequence[Any] | None) -> list[int]:
        if devices is None:
            raise ValueError("devices must be given")
        return [vc.index_of(d) for d in devices]

    def destination_of(destination: Any) -> int | None:
        """The runtime device (None: the host, ``-1`` or ``"cpu"``)."""
        if destination is None:
            return vc.index_of(None)
        if destination == -1 or str(destination) == "cpu":
            return None
        return vc.index_of(destination)

    def broadcast(tensor: torch.Tensor, devices: Sequence[Any] | None = None, *,
                  out: Any = None) -> tuple[torch.Tensor, ...]:
        _no_out(out)
        return tuple(group[0] for group in comm.broadcast_coalesced(
            rt, [tensor], devices_of(devices)))

    def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[Any],
                            buffer_size: int = comm.BROADCAST_BUFFER_BYTES
                            ) -> tuple[tuple[torch.Tensor, ...], ...]:
        return tuple(tuple(group) for group in comm.broadcast_coalesced(
            rt, list(tensors), devices_of(devices), buffer_size))

    def reduce_add(inputs: Sequence[torch.Tensor], destination: Any = None) -> torch.Tensor:
        return comm.reduce_add(rt, list(inputs), _on_gpu(destination_of(destination)))

    def reduce_add_coalesced(inputs: Sequence[Sequence[torch.Tensor]], destination: Any = None,
                             buffer_size: int = comm.BROADCAST_BUFFER_BYTES
                             ) -> tuple[torch.Tensor, ...]:
        return comm.reduce_add_coalesced(rt, inputs, _on_gpu(destination_of(destination)),
                                         buffer_size)

    def scatter(tensor: torch.Tensor, devices: Sequence[Any] | None = None,
                chunk_sizes: Sequence[int] | None = None, dim: int = 0, streams: Any = None,
                *, out: Any = None) -> tuple[torch.Tensor, ...]:
        _no_out(out)
        return comm.scatter_tensor(rt, tensor, devices_of(devices), chunk_sizes, dim)

    def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: Any = None, *,
               out: Any = None) -> torch.Tensor:
        _no_out(out)
        where = destination_of(destination)
        if where is None:  # to the host: each piece copied there
            return torch.cat([t.cpu() for t in tensors], dim)
        return comm.gather_tensors(rt, list(tensors), dim, where)

    for name, func in zip(NAMES, (broadcast, broadcast_coalesced, reduce_add,
                                  reduce_add_coalesced, scatter, gather), strict=True):
        for owner in (parallel_comm, cuda_comm):
            p(owner, name, func)


def _no_out(out: Any) -> None:
    if out is not None:
        raise NotImplementedError(
            "torch.cuda.comm's out= is not emulated: call it without out= under dpprof")


def _on_gpu(index: int | None) -> int:
    if index is None:
        raise NotImplementedError("torch.cuda.comm.reduce_add to the host is not emulated")
    return index
