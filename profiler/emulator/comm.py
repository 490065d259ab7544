"""``torch.cuda.comm`` re-enacted on virtual devices: the C++ collectives of one process
(``torch/csrc/cuda/comm.cpp``, ``torch/csrc/utils/tensor_flatten.cpp``) that DataParallel
and DDP's buffer broadcast use, allocation for allocation. Where a CUDA build takes the NCCL
path (``nccl::is_available``: contiguous dense CUDA tensors), so do we.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch._utils import (
    _flatten_dense_tensors,
    _reorder_tensors_as,
    _take_tensors,
    _unflatten_dense_tensors,
)

from dpprof.emulator.device_copies import copy_to
from dpprof.emulator.op_log import BROADCAST, GATHER, REDUCE
from dpprof.emulator.virtual_devices import VirtualDevices

BROADCAST_BUFFER_BYTES = 10 * 1024 * 1024  # comm.broadcast_coalesced / reduce_add_coalesced


# ---- comm primitives (C++ in torch, Python here) ------------------------------------------


def _type_key(t: torch.Tensor) -> tuple[str, torch.dtype]:
    return (t.layout.__repr__(), t.dtype)


def take_tensors_cpp(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``torch::utils::take_tensors`` (not fine-grained): a group per type closes once its
    size *reaches* the limit, so it may overshoot by its last tensor; the groups left open
    at the end follow, ordered by type."""
    results: list[list[torch.Tensor]] = []
    groups: dict[tuple[str, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for t in tensors:
        key = _type_key(t)
        group, size = groups.setdefault(key, ([], [0]))
        group.append(t)
        size[0] += t.numel() * t.element_size()
        if size[0] >= limit:
            results.append(group)
            del groups[key]
    for key in sorted(groups, key=lambda k: str(k)):
        results.append(groups[key][0])
    return results


def broadcast_coalesced(
    rt: VirtualDevices, tensors: Sequence[torch.Tensor], devices: Sequence[int],
    buffer_size: int = BROADCAST_BUFFER_BYTES,
) -> list[list[torch.Tensor]]:
    """``torch::cuda::broadcast_coalesced``: device 0 gets the inputs themselves."""
    outputs: list[list[torch.Tensor]] = [list(tensors)] + [[] for _ in devices[1:]]
    types = {_type_key(t) for t in tensors}
    if tensors:  # every chunk's NCCL call goes over the same devices' communicators
        note_communicators(rt, devices)
    for chunk in take_tensors_cpp(tensors, buffer_size):
        with rt.category("communication"):
            flat = torch._C._nn.flatten_dense_tensors(chunk)  # a view if one tensor, else cat
        results = [flat]
        meta = rt.base.type == "meta"
        for d in devices[1:]:
            with rt.placing_on(d), rt.category("parameters"):
                if meta:  # the same allocation, without dispatching empty + copy_
                    out = rt.storages.new_empty(flat.shape, flat.dtype, d)
                else:
                    out = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device)
                    out.copy_(flat)  # nccl::broadcast
            results.append(out)
        for i in range(1, len(devices)):
            with _no_dispatch(meta):  # views: nothing to count
                views = torch._C._nn.unflatten_dense_tensors(results[i], chunk)
                # make_variable(var.tensor_data(), false): a fresh version counter
                outputs[i] += [t.data for t in views]
            del views
        log_collective(rt, BROADCAST, flat, devices)
        del flat, results
    if len(types) > 1:
        outputs = [outputs[0]] + [reorder_tensors_like(o, tensors) for o in outputs[1:]]
    return outputs


def log_collective(rt: VirtualDevices, kind: str, t: torch.Tensor, devices: Sequence[int],
                   nbytes: int | None = None) -> None:
    """Note an NCCL call over ``devices`` (rooted at the first) for the step-time model: over
    meta tensors the emulation writes nothing, so no op of it is dispatched."""
    log = rt.op_log
    if log is None or not log.on:
        return
    every = _with_mirrors(rt, devices)
    if len(every) > 1:
        moved = t.numel() * t.element_size() if nbytes is None else nbytes
        log.collective(kind, moved, every[0], len(every), rt.current_phase,
                       tuple(every[1:]))


def note_communicators(rt: VirtualDevices, devices: Sequence[int]) -> None:
    """Note the communicators an NCCL call over ``devices`` makes (torch/csrc/cuda/nccl.cpp,
    ``get_communicators``: one per device of the list, made at its first call and kept),
    the devices mirroring them included."""
    every = _with_mirrors(rt, devices)
    if len(every) > 1:
        rt.nccl_cliques.add(every)


def _with_mirrors(rt: VirtualDevices, devices: Sequence[int]) -> tuple[int, ...]:
    """Each device and the devices mirroring it (their replicas stood for, not run)."""
    return tuple(dict.fromkeys(x for d in devices for x in (d, *rt.mirrors.mirrors_of(d))))


def _no_dispatch(meta: bool) -> Any:
    """Views and in-place writes over meta tensors allocate nothing: skip the mode."""
    return torch._C._DisableTorchDispatch() if meta else contextlib.nullcontext()


def _flatten_on_device(rt: VirtualDevices, chunk: Sequence[torch.Tensor]) -> torch.Tensor:
    """``_flatten_dense_tensors(chunk)``: a view of a lone contiguous tensor, else a ``cat``
    on the chunk's device (over meta: the same allocation without dispatching)."""
    if rt.base.type != "meta" or not all(t.is_contiguous() for t in chunk):
        return _flatten_dense_tensors(chunk)
    if len(chunk) == 1:
        with torch._C._DisableTorchDispatch():
            return chunk[0].view(-1)
    numel = sum(t.numel() for t in chunk)
    return rt.storages.new_empty((numel,), chunk[0].dtype, rt.storages.device_of(chunk[0]))


def reorder_tensors_like(
    tensors: Sequence[torch.Tensor], order: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``torch::utils::reorder_tensors_like``: per type, in the order of ``order``."""
    by_type: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_type.setdefault(_type_key(t), []).append(t)
    used: dict[tuple[str, torch.dtype], int] = {}
    out = []
    for t in order:
        k = _type_key(t)
        out.append(by_type[k][used.get(k, 0)])
        used[k] = used.get(k, 0) + 1
    return out


def reduce_add(
    rt: VirtualDevices, inputs: Sequence[torch.Tensor], destination: int
) -> torch.Tensor:
    """``comm.reduce_add`` on the NCCL path: ``empty_like`` on the destination, reduce."""
    root = [rt.storages.device_of(t) for t in inputs].index(destination)
    if len(inputs) == 1:
        return inputs[0]
    result = torch.empty_like(inputs[root])
    devices = [rt.storages.device_of(t) for t in inputs]
    log_collective(rt, REDUCE, result, [destination, *(d for d in devices if d != destination)])
    note_communicators(rt, devices)
    if rt.base.type == "meta":
        return result  # the sum is written in place: over meta there is nothing to write
    with rt.cross_device():
        result.copy_(inputs[root])  # nccl.reduce writes the sum into result
        for i, t in enumerate(inputs):
            if i != root:
                result.add_(t)
    return result


def reduce_add_coalesced(
    rt: VirtualDevices, inputs: Sequence[Sequence[torch.Tensor]], destination: int,
    buffer_size: int = BROADCAST_BUFFER_BYTES,
) -> tuple[torch.Tensor, ...]:
    """``comm.reduce_add_coalesced``: groups close *before* exceeding ``buffer_size``."""
    dense_tensors: list[list[torch.Tensor]] = [[] for _ in inputs]
    output: list[torch.Tensor] = []
    ref_order: list[torch.Tensor] = []
    for tensor_at_gpus in zip(*inputs, strict=True):
        for coll, t in zip(dense_tensors, tensor_at_gpus, strict=True):
            coll.append(t)
        ref_order.append(dense_tensors[0][-1])
    itrs = [_take_tensors(tensors, buffer_size) for tensors in dense_tensors]
    for chunks in zip(*itrs, strict=True):
        flat_tensors = [_flatten_on_device(rt, chunk) for chunk in chunks]
        flat_result = reduce_add(rt, flat_tensors, destination)
        rt.storages.label(flat_result, "gradients")
        for t in _unflatten_dense_tensors(flat_result, chunks[0]):
            output.append(t.data)
        del flat_tensors, flat_result
    return tuple(_reorder_tensors_as(output, ref_order))


def scatter_tensor(
    rt: VirtualDevices, tensor: torch.Tensor, devices: Sequence[int],
    chunk_sizes: Sequence[int] | None, dim: int,
) -> tuple[torch.Tensor, ...]:
    """``torch::cuda::scatter``: chunk or narrow, then ``.to(device, copy=False)``."""
    if chunk_sizes is not None:
        chunks, start = [], 0
        for size in chunk_sizes:
            chunks.append(tensor.narrow(dim, start, size))
            start += size
    else:
        chunks = list(tensor.chunk(len(devices), dim))
    out = []
    for i, c in enumerate(chunks):
        out.append(c if rt.storages.device_of(c) == devices[i] else copy_to(rt, c, devices[i]))
    return tuple(out)


def gather_tensors(
    rt: VirtualDevices, tensors: Sequence[torch.Tensor], dim: int, destination: int,
    counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch::cuda::gather``: one ``empty`` of the full shape, pieces copied in.
    ``counts``: how many devices each piece stands for (mirrored replicas)."""
    first = tensors[0]
    size = list(first.shape)
    size[dim] = sum(t.shape[dim] * (counts[i] if counts else 1) for i, t in enumerate(tensors))
    channels_last = all(
        t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
        and not t.is_contiguous() for t in tensors
    )
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with rt.placing_on(destination):
        result = torch.empty(size, dtype=first.dtype, device=first.device, memory_format=fmt)
    sources = [rt.storages.device_of(t) for t in tensors]
    mirrored = sum(counts) if counts else len(tensors)
    log_collective(rt, GATHER, result, [destination, *(d for d in sources if d != destination)],
                   nbytes=result.numel() * result.element_size() * (mirrored - 1) // mirrored)
    if rt.base.type == "meta":
        return result  # the pieces are copied in place: over meta nothing is written
    start = 0
    with rt.cross_device():
        for t in tensors:
            result.narrow(dim, start, t.shape[dim]).copy_(t)
            start += t.shape[dim]
    return result
