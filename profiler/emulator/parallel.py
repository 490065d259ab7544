"""DataParallel and DistributedDataParallel re-enacted on virtual devices.

Each function here mirrors one piece of ``torch.nn.parallel`` (torch 2.13), allocation for
allocation; the C++ parts (``torch/csrc/cuda/comm.cpp``, ``torch/csrc/utils/
tensor_flatten.cpp``, ``c10d/reducer.cpp``) are mirrored from their source. Where a CUDA
build takes the NCCL path (``nccl::is_available``: contiguous dense CUDA tensors), so do we.

* scatter: ``tensor.chunk(n, dim)``; a chunk already on its target device stays a view, the
  others are copied (``comm.cpp: scatter``, ``.to(device, copy=False)``);
* replicate: parameters through :class:`Broadcast` (device 0 keeps the originals; the
  others get flat buffers of <= 10 MiB groups and views into them), buffers broadcast
  detached (``replicate.py``, ``comm.cpp: broadcast_coalesced``);
* parallel_apply: each replica on its device (sequentially here: per-device memory does
  not depend on the interleaving of devices);
* gather: the full output allocated on the output device, pieces copied in
  (``comm.cpp: gather``); 0-dim outputs become a vector;
* backward: ``Gather.backward`` scatters the gradient (device 0's share a view),
  ``Broadcast.backward`` is ``ReduceAddCoalesced`` onto device 0 (``comm.py``).
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Sequence
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._utils import (
    _flatten_dense_tensors,
    _reorder_tensors_as,
    _take_tensors,
    _unflatten_dense_tensors,
)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from dpprof.emulator.vdevice import HOST, VariantLedger, VirtualDevices, copy_to

BROADCAST_BUFFER_BYTES = 10 * 1024 * 1024  # comm.broadcast_coalesced / reduce_add_coalesced
DDP_BUCKET_CAP_MB = 25  # DistributedDataParallel(bucket_cap_mb=None) -> 25 MiB
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # dist._DEFAULT_FIRST_BUCKET_BYTES


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
    for chunk in take_tensors_cpp(tensors, buffer_size):
        with rt.category("communication"):
            flat = torch._C._nn.flatten_dense_tensors(chunk)  # a view if one tensor, else cat
        results = [flat]
        meta = rt.base.type == "meta"
        for d in devices[1:]:
            with rt.placing_on(d), rt.category("parameters"):
                if meta:  # the same allocation, without dispatching empty + copy_
                    out = rt.new_empty(flat.shape, flat.dtype, d)
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
        del flat, results
    if len(types) > 1:
        outputs = [outputs[0]] + [reorder_tensors_like(o, tensors) for o in outputs[1:]]
    return outputs


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
    return rt.new_empty((numel,), chunk[0].dtype, rt.device_of(chunk[0]))


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
    root = [rt.device_of(t) for t in inputs].index(destination)
    if len(inputs) == 1:
        return inputs[0]
    result = torch.empty_like(inputs[root])
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
        rt.label(flat_result, "gradients")
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
        out.append(c if rt.device_of(c) == devices[i] else copy_to(rt, c, devices[i]))
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
    if rt.base.type == "meta":
        return result  # the pieces are copied in place: over meta nothing is written
    start = 0
    with rt.cross_device():
        for t in tensors:
            result.narrow(dim, start, t.shape[dim]).copy_(t)
            start += t.shape[dim]
    return result


# ---- autograd functions (torch/nn/parallel/_functions.py) ---------------------------------


class _OutputMeta(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    device: int
    differentiable: bool


def _note_outputs(ctx: Any, rt: VirtualDevices, outputs: Sequence[torch.Tensor],
                  differentiable: Sequence[bool]) -> None:
    """Keep what the engine needs to make a zero gradient for each output (not the
    outputs), and make them here: see :func:`_materialize`."""
    ctx.set_materialize_grads(False)
    ctx.out_meta = [_OutputMeta(t.shape, t.dtype, rt.device_of(t), d)
                    for t, d in zip(outputs, differentiable, strict=True)]


def _materialize(ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[Any]:
    """The zero gradients the autograd engine makes for a Python function's differentiable
    outputs that got none (``PyNode::apply``: ``output_info[i].zeros(device_guard)``),
    in output order, each on its output's device: over virtual devices the engine's own
    ``zeros`` would land on the current device, not the replica's."""
    rt: VirtualDevices = ctx.rt
    out: list[Any] = []
    for g, meta in zip(grads, ctx.out_meta, strict=True):
        if g is None and meta.differentiable:
            with rt.placing_on(meta.device):
                g = torch.zeros(meta.shape, dtype=meta.dtype, device=rt.base)
        out.append(g)
    return out


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rt: VirtualDevices, target_gpus: list[int], *inputs: torch.Tensor):  # type: ignore[no-untyped-def]
        ctx.rt = rt
        ctx.target_gpus = target_gpus
        if len(inputs) == 0:
            return ()
        ctx.num_inputs = len(inputs)
        ctx.input_device = rt.device_of(inputs[0])
        outputs = broadcast_coalesced(rt, inputs, target_gpus)
        non_differentiables: list[torch.Tensor] = []
        for idx, input_requires_grad in enumerate(ctx.needs_input_grad[2:]):
            if not input_requires_grad:
                non_differentiables.extend(output[idx] for output in outputs)
        ctx.mark_non_differentiable(*non_differentiables)
        _note_outputs(ctx, rt, list(chain.from_iterable(outputs)),
                      list(ctx.needs_input_grad[2:]) * len(outputs))
        return tuple(chain.from_iterable(outputs))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None):  # type: ignore[no-untyped-def]
        return (None, None, *ReduceAddCoalesced.apply(
            ctx.rt, ctx.input_device, ctx.num_inputs, *_materialize(ctx, grad_outputs)
        ))


class ReduceAddCoalesced(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rt: VirtualDevices, destination: int, num_inputs: int,  # type: ignore[no-untyped-def]
                *grads: torch.Tensor):
        ctx.rt = rt
        ctx.target_gpus = [rt.device_of(grads[i]) for i in range(0, len(grads), num_inputs)]
        rt.label(grads, "gradients")  # the replicas' gradients, held until all arrive
        grads_ = [grads[i : i + num_inputs] for i in range(0, len(grads), num_inputs)]
        return reduce_add_coalesced(rt, grads_, destination)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor):  # type: ignore[no-untyped-def]
        return (None, None, None, *Broadcast.apply(ctx.rt, ctx.target_gpus, *grad_outputs))


class Gather(torch.autograd.Function):
    """``_functions.Gather``; ``counts`` (or None): how many devices each input stands for
    (one replica run for several mirrored ones), so that the output has the full size."""

    @staticmethod
    def forward(ctx: Any, rt: VirtualDevices, target_device: int, dim: int,  # type: ignore[no-untyped-def]
                counts: Sequence[int] | None, *inputs: torch.Tensor):
        ctx.rt = rt
        ctx.target_device = target_device
        ctx.dim = dim
        ctx.counts = counts
        ctx.input_gpus = tuple(rt.device_of(i) for i in inputs)
        if all(t.dim() == 0 for t in inputs) and dim == 0:
            inputs = tuple(t.view(1) for t in inputs)  # torch warns and returns a vector
            ctx.unsqueezed_scalar = True
        else:
            ctx.unsqueezed_scalar = False
        ctx.input_sizes = tuple(i.size(ctx.dim) for i in inputs)
        with rt.category("outputs"):
            return gather_tensors(rt, inputs, ctx.dim, target_device, counts)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[no-untyped-def]
        rt = ctx.rt
        target = rt.device_of(grad_output)
        rep = rt.mirrored_device(target)  # the output device mirrors this replica's device
        # Its share is a view of grad_output there (no copy): the copy made for ``rep``
        # has no mirror on it, and a view keeps grad_output until that copy dies (when
        # the output device's own replica would drop its view).
        with rt.category("outputs"), rt.not_mirrored_on([target] if rep is not None else []):
            scattered = Scatter.apply(
                rt, ctx.input_gpus, ctx.input_sizes, ctx.dim, grad_output, ctx.counts
            )
        if rep is not None and rep in ctx.input_gpus:
            held = [grad_output.narrow(ctx.dim, 0, 0)]
            rt.on_free(scattered[ctx.input_gpus.index(rep)], held.clear)
        if ctx.unsqueezed_scalar:
            scattered = tuple(g[0] for g in scattered)
        return (None, None, None, None, *scattered)


class Scatter(torch.autograd.Function):
    """``_functions.Scatter``; ``counts`` as for :class:`Gather` (its backward)."""

    @staticmethod
    def forward(ctx: Any, rt: VirtualDevices, target_gpus: Sequence[int],  # type: ignore[no-untyped-def]
                chunk_sizes: Sequence[int] | None, dim: int, input: torch.Tensor,
                counts: Sequence[int] | None):
        ctx.rt = rt
        ctx.dim = dim
        ctx.counts = counts
        ctx.input_device = rt.device_of(input)
        outputs = scatter_tensor(rt, input, target_gpus, chunk_sizes, dim)
        _note_outputs(ctx, rt, outputs, [True] * len(outputs))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor | None):  # type: ignore[no-untyped-def]
        return (None, None, None, None,
                Gather.apply(ctx.rt, ctx.input_device, ctx.dim, ctx.counts,
                             *_materialize(ctx, grad_output)), None)


# ---- scatter_gather.py, replicate.py, parallel_apply.py ----------------------------------


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(rt: VirtualDevices, inputs: Any, target_gpus: Sequence[int], dim: int = 0,
            chunk_sizes: Sequence[int] | None = None, plan: ShardPlan | None = None) -> Any:
    """``scatter_gather.scatter``; ``chunk_sizes`` (rows per device) as a
    BalancedDataParallel-style override passes them to ``Scatter.apply``. With ``plan``,
    only its representatives get their shards (their mirrors stand for the others)."""
    def scatter_map(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            sizes = chunk_sizes if chunk_sizes is not None and obj.dim() > dim else None
            if plan is not None:
                rows = _rows(obj, len(target_gpus), dim, sizes)
                return Scatter.apply(rt, plan.devices, [rows[i] for i in plan.positions],
                                     dim, obj, plan.counts)
            return Scatter.apply(rt, list(target_gpus), sizes, dim, obj, None)
        if _is_namedtuple(obj):
            return [type(obj)(*args) for args in zip(*map(scatter_map, obj), strict=False)]
        if isinstance(obj, tuple) and len(obj) > 0:
            return list(zip(*map(scatter_map, obj), strict=False))
        if isinstance(obj, list) and len(obj) > 0:
            return [list(i) for i in zip(*map(scatter_map, obj), strict=False)]
        if isinstance(obj, dict) and len(obj) > 0:
            return [type(obj)(i) for i in zip(*map(scatter_map, obj.items()), strict=False)]
        return [obj for _ in (plan.devices if plan is not None else target_gpus)]

    return scatter_map(inputs)


def _rows(t: torch.Tensor, n: int, dim: int, sizes: Sequence[int] | None) -> list[int]:
    """The rows :func:`scatter_tensor` gives each device of ``n`` from ``t``."""
    if sizes is not None:
        return list(sizes)
    with torch._C._DisableTorchDispatch():
        return [c.shape[dim] for c in t.chunk(n, dim)]


class ShardPlan(NamedTuple):
    """DataParallel's devices in classes of equal shards: ``devices`` run a replica each
    (``positions``: their places among the used devices), ``mirrors[i]`` are the devices
    whose replicas ``devices[i]`` stands for, ``counts[i]`` = 1 + their number."""

    devices: list[int]
    positions: list[int]
    mirrors: list[list[int]]
    counts: list[int]


def shard_plan(inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
               devices: Sequence[int], dim: int, chunk_sizes: Sequence[int] | None,
               never_first: Sequence[int]) -> ShardPlan | None:
    """The classes of replicas that see equal shards (the same shape of every scattered
    tensor, the same other arguments), from the second used device on; None when no two
    replicas are alike. A run of equal neighbours is one class: its first device runs,
    the others mirror it (:meth:`VirtualDevices.set_mirrors`). A device in
    ``never_first`` (the output device: it has events of its own) may mirror but never
    runs for others."""
    leaves = [t for t in tree_leaves((inputs, kwargs or {})) if isinstance(t, torch.Tensor)]
    if not leaves:
        return None
    rows = [_rows(t, len(devices), dim, chunk_sizes if t.dim() > dim else None)
            for t in leaves]
    used = min(len(r) for r in rows)
    signature = [tuple(r[i] for r in rows) for i in range(used)]
    plan = ShardPlan([], [], [], [])
    i = 0
    while i < used:
        stop = i + 1
        if i > 0 and devices[i] not in never_first:
            while stop < used and signature[stop] == signature[i]:
                stop += 1
        plan.devices.append(devices[i])
        plan.positions.append(i)
        plan.mirrors.append(list(devices[i + 1: stop]))
        plan.counts.append(stop - i)
        i = stop
    return plan if len(plan.devices) < used else None


def scatter_kwargs(
    rt: VirtualDevices, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
    target_gpus: Sequence[int], dim: int = 0, chunk_sizes: Sequence[int] | None = None,
    plan: ShardPlan | None = None,
) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    scattered_inputs = scatter(rt, inputs, target_gpus, dim, chunk_sizes, plan) if inputs else []
    scattered_kwargs = scatter(rt, kwargs, target_gpus, dim, chunk_sizes, plan) if kwargs else []
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def gather(rt: VirtualDevices, outputs: Any, target_device: int, dim: int = 0,
           counts: Sequence[int] | None = None) -> Any:
    def gather_map(outputs: Any) -> Any:
        out = outputs[0]
        if isinstance(out, torch.Tensor):
            return Gather.apply(rt, target_device, dim, counts, *outputs)
        if out is None:
            return None
        if isinstance(out, dict):
            return type(out)((k, gather_map([d[k] for d in outputs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outputs, strict=True)))
        return type(out)(map(gather_map, zip(*outputs, strict=True)))

    with rt.category("outputs"):  # what an output's own class makes of its parts, too
        return gather_map(outputs)


def _broadcast_coalesced_reshape(
    rt: VirtualDevices, tensors: Sequence[torch.Tensor], devices: Sequence[int],
    detach: bool = False,
) -> list[list[torch.Tensor]]:
    if len(tensors) == 0:
        return []
    if detach:
        return broadcast_coalesced(rt, tensors, devices)
    tensor_copies = Broadcast.apply(rt, list(devices), *tensors)
    return [
        list(tensor_copies[i : i + len(tensors)])
        for i in range(0, len(tensor_copies), len(tensors))
    ]


def replicate(
    rt: VirtualDevices, network: nn.Module, devices: Sequence[int], detach: bool = False
) -> list[nn.Module]:
    """``torch.nn.parallel.replicate``, line for line, over emulated broadcasts."""
    num_replicas = len(devices)
    params = list(network.parameters())
    param_indices = {param: idx for idx, param in enumerate(params)}
    param_copies = _broadcast_coalesced_reshape(rt, params, devices, detach)

    buffers = list(network.buffers())
    buffers_rg = [b for b in buffers if b.requires_grad and not detach]
    buffers_not_rg = [b for b in buffers if not (b.requires_grad and not detach)]
    buffer_indices_rg = {buf: idx for idx, buf in enumerate(buffers_rg)}
    buffer_indices_not_rg = {buf: idx for idx, buf in enumerate(buffers_not_rg)}
    buffer_copies_rg = _broadcast_coalesced_reshape(rt, buffers_rg, devices, detach=detach)
    buffer_copies_not_rg = _broadcast_coalesced_reshape(rt, buffers_not_rg, devices, detach=True)

    modules = list(network.modules())
    module_copies: list[list[nn.Module]] = [[] for _ in devices]
    module_indices: dict[nn.Module, int] = {}
    for i, module in enumerate(modules):
        module_indices[module] = i
        for j in range(num_replicas):
            replica = module._replicate_for_data_parallel()
            replica._former_parameters = OrderedDict()  # type: ignore[assignment]
            module_copies[j].append(replica)

    for i, module in enumerate(modules):
        for key, child in module._modules.items():
            if child is None:
                for j in range(num_replicas):
                    module_copies[j][i]._modules[key] = None
            else:
                module_idx = module_indices[child]
                for j in range(num_replicas):
                    setattr(module_copies[j][i], key, module_copies[j][module_idx])
        for key, param in module._parameters.items():
            if param is None:
                for j in range(num_replicas):
                    module_copies[j][i]._parameters[key] = None
            else:
                param_idx = param_indices[param]
                for j in range(num_replicas):
                    replica = module_copies[j][i]
                    param_copy = param_copies[j][param_idx]
                    setattr(replica, key, param_copy)
                    replica._former_parameters[key] = param_copy  # type: ignore[index,operator]
        for key, buf in module._buffers.items():
            if buf is None:
                for j in range(num_replicas):
                    module_copies[j][i]._buffers[key] = None
            else:
                if buf.requires_grad and not detach:
                    buffer_copies, buffer_idx = buffer_copies_rg, buffer_indices_rg[buf]
                else:
                    buffer_copies, buffer_idx = buffer_copies_not_rg, buffer_indices_not_rg[buf]
                for j in range(num_replicas):
                    setattr(module_copies[j][i], key, buffer_copies[j][buffer_idx])
    return [module_copies[j][0] for j in range(num_replicas)]


def parallel_apply(
    rt: VirtualDevices, modules: Sequence[nn.Module], inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]], devices: Sequence[int],
    mirrors: Sequence[Sequence[int]] = (),
) -> list[Any]:
    """Each replica on its own device; threads in torch, one after another here.

    A replica whose device is mirrored (``mirrors[k]``: the devices mirroring it) must keep
    to its device: its mirrors copy that device's events only. One that touches another
    device sets ``rt.dedupe_failure`` and raises :class:`MirrorUnsafe` (the scenario is
    then emulated again with every replica run).
    """
    outputs: list[Any] = []
    log = rt.events.device
    for k, module in enumerate(modules):
        inp = inputs[k]
        if not isinstance(inp, (list, tuple)):
            inp = (inp,)
        start = len(log)
        with rt.device(devices[k]), rt.category("activations"):
            outputs.append(module(*inp, **kwargs_tup[k]))
        if k < len(mirrors) and mirrors[k]:
            own = {devices[k], *mirrors[k]}
            other = next((d for d in log[start:] if d not in own), None)
            if other is not None:
                rt.dedupe_failure = (f"the replica on cuda:{devices[k]} touched "
                                     f"{'the host' if other == HOST else f'cuda:{other}'}")
                raise MirrorUnsafe(rt.dedupe_failure)
    return outputs


class MirrorUnsafe(RuntimeError):
    """A mirrored replica did something its mirrors would not copy; run them all."""


def balanced_sizes(shares: Sequence[int], rows: int) -> list[int]:
    """``BalancedDataParallel``'s rows per device for a batch of ``rows`` (the code the
    balanced-split fix hands out, :data:`dpprof.analysis.fixes.CODE_BALANCED`): in
    proportion to ``shares``, rounded down, the remainder to the last device."""
    total = sum(shares)
    sizes = [rows * s // total for s in shares]
    sizes[-1] += rows - sum(sizes)
    return sizes


class EmulatedDataParallel(nn.Module):
    """``nn.DataParallel(module, device_ids, output_device)`` on virtual devices."""

    def __init__(self, module: nn.Module, rt: VirtualDevices,
                 device_ids: Sequence[int] | None = None, output_device: int | None = None,
                 dim: int = 0) -> None:
        super().__init__()
        self.module = module
        self.rt = rt
        self.device_ids = list(device_ids if device_ids is not None else range(rt.num_devices))
        self.output_device = self.device_ids[0] if output_device is None else output_device
        self.dim = dim
        self.used_devices: list[int] = []
        # Rows per device at the batch (BalancedDataParallel's shares); None: tensor.chunk.
        self.chunk_sizes: Sequence[int] | None = None

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        rt = self.rt
        src = self.device_ids[0]
        for t in chain(self.module.parameters(), self.module.buffers()):
            if rt.device_of(t) != src:
                raise RuntimeError(
                    "module must have its parameters and buffers on device "
                    f"cuda:{src} (device_ids[0]) but found one of them on device: "
                    f"cuda:{rt.device_of(t)}"
                )
        sizes = self.chunk_sizes
        first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
        if sizes is not None and first is not None:  # a batch of other rows: in proportion
            sizes = balanced_sizes(sizes, first.size(self.dim))
        plan = None
        if (rt.dedupe_replicas and rt.base.type == "meta" and torch.is_grad_enabled()
                and len(self.device_ids) > 2):
            plan = shard_plan(inputs, kwargs, self.device_ids, self.dim, sizes,
                              never_first=[self.output_device])
        # replicas on equal shards: one runs, the devices of the others mirror its device
        rt.set_mirrors({} if plan is None else dict(zip(plan.devices, plan.mirrors,
                                                        strict=True)),
                       own=[self.output_device])
        with rt.category("inputs"):
            inputs, module_kwargs = scatter_kwargs(rt, inputs, kwargs, self.device_ids, self.dim,
                                                   sizes, plan)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        if len(self.device_ids) == 1:
            self.used_devices = [src]
            return self.module(*inputs[0], **module_kwargs[0])
        if plan is None:
            used = self.device_ids[: len(inputs)]
            self.used_devices = used
            replicas = replicate(rt, self.module, used, not torch.is_grad_enabled())
            outputs = parallel_apply(rt, replicas, inputs, module_kwargs, used)
            return gather(rt, outputs, self.output_device, self.dim)
        self.used_devices = sorted(chain(plan.devices, *plan.mirrors))
        rt.mirrored_replicas += sum(plan.counts) - len(plan.counts)
        replicas = replicate(rt, self.module, plan.devices, not torch.is_grad_enabled())
        outputs = parallel_apply(rt, replicas, inputs, module_kwargs, plan.devices,
                                 plan.mirrors)
        return gather(rt, outputs, self.output_device, self.dim, plan.counts)


# ---- DistributedDataParallel: one rank (c10d/reducer.cpp) ---------------------------------

DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DistributedDataParallel.broadcast_bucket_size
DDP_MAX_IN_FLIGHT = 2  # c10d/comm.cpp broadcast_coalesced: at most two broadcasts in flight


def compute_bucket_assignment_by_size(
    tensors: Sequence[torch.Tensor], limits: Sequence[int],
    tensor_indices: Sequence[int] | None = None,
) -> list[list[int]]:
    """``c10d::compute_bucket_assignment_by_size`` (reducer.cpp), dense tensors.

    One open bucket per (dtype, device); a bucket closes once its size *reaches* its limit,
    and the next bucket of that key takes the next limit (the last one repeats). Open
    buckets follow at the end. Without ``tensor_indices`` the result is sorted by the
    smallest tensor index of each bucket; with them (the gradient-ready order of a rebuild)
    it is left in that order.
    """
    result: list[list[int]] = []
    open_: dict[tuple[torch.dtype, str], list[int]] = {}
    sizes: dict[tuple[torch.dtype, str], int] = {}
    limit_at: dict[tuple[torch.dtype, str], int] = {}
    for i, t in enumerate(tensors):
        index = tensor_indices[i] if tensor_indices else i
        key = (t.dtype, str(t.device))
        bucket = open_.setdefault(key, [])
        bucket.append(index)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        li = limit_at.setdefault(key, 0)
        if sizes[key] >= limits[li]:
            result.append(bucket)
            open_[key] = []
            sizes[key] = 0
            limit_at[key] = min(li + 1, len(limits) - 1)
    result += [b for b in open_.values() if b]
    if not tensor_indices:
        result.sort(key=min)
    return result


def ddp_broadcast_coalesced(
    rt: VirtualDevices, tensors: Sequence[torch.Tensor],
    buffer_size: int = DDP_BROADCAST_BUCKET_BYTES,
) -> None:
    """``c10d::broadcast_coalesced`` (c10d/comm.cpp) as one rank sees it: per bucket of
    ``buffer_size`` a flat copy (``flatten_dense_tensors``: a view for one tensor, else a
    ``cat``) is broadcast in place, then copied back; at most two buckets in flight."""
    if not tensors:
        return
    in_flight: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def finish(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
        for t, out in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            if out.numel():
                t.copy_(out)

    with torch.no_grad(), rt.category("communication"):
        for indices in compute_bucket_assignment_by_size(tensors, [buffer_size]):
            if len(in_flight) >= DDP_MAX_IN_FLIGHT:
                finish(*in_flight.pop(0))
            bucket = [tensors[i] for i in indices]
            in_flight.append((_flatten_dense_tensors(bucket), bucket))
        while in_flight:
            finish(*in_flight.pop(0))


class _DDPSink(torch.autograd.Function):
    """``torch.nn.parallel.distributed._DDPSink``: outputs cloned (``_ddp_sink_clone``),
    gradients passed through."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any):  # type: ignore[no-untyped-def]
        ctx.set_materialize_grads(False)
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any):  # type: ignore[no-untyped-def]
        return grads


class BucketViewFollower:
    """What ``gradient_as_bucket_view=True`` allocates, followed in a
    :class:`~dpprof.emulator.vdevice.VariantLedger` while plain DDP runs the same program.

    The two differ only where reducer.cpp lets ``.grad`` point at the bucket's view
    (``mark_variable_ready_dense``, ``initialize_bucket_views``): there the gradient the
    parameter held dies, if nothing else holds its storage; a bucket whose views some
    gradients still are outlives ``buckets_.clear()`` until the last of them is
    re-pointed. The variant's ``.grad`` of parameter ``i`` is a bucket view exactly when
    plain DDP's ``.grad`` is the storage it re-pointed last (``_grad_serials``): the
    gradient accumulated in place since, or the view kept since. Anything else holding a
    dying gradient's storage makes the ledger ``unsure``.
    """

    def __init__(self, rt: VirtualDevices, ledger: VariantLedger) -> None:
        self.rt, self.ledger = rt, ledger
        self._grad_serials: dict[int, int] = {}  # i -> plain .grad's serial when re-pointed
        self._view_bucket: dict[int, int] = {}  # i -> the bucket serial its variant view is in
        self._holders: dict[int, int] = {}  # an old bucket's serial -> gradients viewing it

    def _is_view(self, i: int, grad: torch.Tensor | None) -> bool:
        return grad is not None and self._grad_serials.get(i) == self.rt.serial_of(grad)

    def regrad(self, i: int, grad: torch.Tensor | None, view: torch.Tensor) -> None:
        """``.grad`` of parameter ``i`` becomes ``view`` in the variant (when it has one)."""
        if grad is None:
            return
        if self._is_view(i, grad):  # the variant's .grad was a view: an old bucket's?
            old = self._view_bucket.get(i)
            if old is not None and old in self._holders:
                self._holders[old] -= 1
                if not self._holders[old]:
                    del self._holders[old]
                    self.ledger.release(old)
        else:  # a gradient of its own dies into the view
            serial = self.rt.serial_of(grad)
            if serial is None or _storage_users(grad) != 1:
                self.ledger.unsure = ("a gradient's storage is shared, so when it dies "
                                      "under gradient_as_bucket_view is not known")
            else:
                self.ledger.release(serial, *self.rt.bytes_of(grad))
        serial, bucket = self.rt.serial_of(grad), self.rt.serial_of(view)
        if serial is not None:
            self._grad_serials[i] = serial
        if bucket is not None:
            self._view_bucket[i] = bucket

    def buckets_cleared(self, params: Sequence[torch.Tensor],
                        views: dict[int, torch.Tensor]) -> None:
        """``buckets_.clear()``: a bucket some variant gradients view lives on in them."""
        for i, p in enumerate(params):
            if i in views and self._is_view(i, p.grad):
                bucket = self.rt.serial_of(views[i])
                if bucket is not None:
                    if bucket not in self._holders:
                        self.ledger.detach(bucket, *self.rt.bytes_of(views[i]))
                    self._holders[bucket] = self._holders.get(bucket, 0) + 1
                    self._view_bucket[i] = bucket


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (its use count, less the handle asked)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata)) - 1


class EmulatedDDP(nn.Module):
    """One rank of ``DistributedDataParallel(module, ...)`` on a virtual device: memory only.

    Mirrors torch 2.13's ``distributed.py`` and ``c10d/reducer.cpp``:

    * construction: ``_sync_module_states`` broadcasts parameters (and buffers with
      ``broadcast_buffers``) from rank 0 in flat 250 MiB buckets, two in flight (a transient);
      ``initialize_buckets`` allocates one flat ``at::empty`` per bucket, kept for good. On
      iteration 1 the bucket limits are ``[sys.maxsize]`` (one bucket per dtype) unless
      ``find_unused_parameters``, then ``[first, cap]`` (first 1 MiB when ``bucket_cap_mb``
      is left unset, else the cap); buckets are assigned over the reversed parameters;
    * ``find_unused_parameters``: ``local_used_map_dev_`` (int32 per parameter) on the
      device; every forward's output tensors are cloned by ``_DDPSink``; no rebuild;
    * every forward with grad enabled: buffers broadcast (``broadcast_buffers``, flat
      copies per 250 MiB bucket); on the first forward after a backward the buckets are
      rebuilt once (``rebuild_buckets``) in gradient-ready order with limits ``[first,
      cap]``: ``sync_bucket_indices`` allocates two small int32 tensors on the device (and
      two on the host), the old buckets are freed, the new ones allocated;
    * ``mark_variable_ready_dense``: the gradient is scaled into its bucket view
      (``mul_out``); with ``gradient_as_bucket_view`` ``.grad`` becomes the view (the
      freshly accumulated gradient dies); ``finalize_bucket_dense`` copies the all-reduced
      bucket back into ``.grad`` in place (``copy_bucket_to_grad``). The all-reduce writes
      the bucket in place (NCCL/gloo allocate nothing that the caching allocator sees).
    """

    def __init__(self, module: nn.Module, rt: VirtualDevices, world_size: int,
                 bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 bucket_view_ledger: VariantLedger | None = None) -> None:
        super().__init__()
        # Plain DDP that also follows, in the ledger, what gradient_as_bucket_view=True would
        # allocate on the same program (:class:`BucketViewFollower`).
        self.follower = (BucketViewFollower(rt, bucket_view_ledger)
                         if bucket_view_ledger is not None and not gradient_as_bucket_view
                         else None)
        self.module = module
        self.rt = rt
        self.world_size = world_size
        default = bucket_cap_mb is None
        self.bucket_bytes_cap = int((DDP_BUCKET_CAP_MB if default else bucket_cap_mb)  # type: ignore[operator]
                                    * 1024 * 1024)
        self.first_bucket_bytes_cap = DDP_FIRST_BUCKET_BYTES if default else self.bucket_bytes_cap
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.iteration = 0
        self.has_rebuilt = False
        self._rebuilt: list[int] = []
        self._expect_hooks = False
        self._buckets: list[torch.Tensor] = []
        self._views: dict[int, torch.Tensor] = {}
        self.assignments: list[list[list[int]]] = []  # every bucket assignment, for tests
        self.local_used_map_dev: torch.Tensor | None = None
        device = rt.device_of(self.params[0]) if self.params else 0
        self.device = device
        with rt.device(device):
            states = [p.detach() for p in module.parameters()]
            if broadcast_buffers:
                states += [b.detach() for b in module.buffers()]
            ddp_broadcast_coalesced(rt, states)
            if self.params:
                limits = ([sys.maxsize] if not find_unused_parameters
                          else [self.first_bucket_bytes_cap, self.bucket_bytes_cap]
                          if self.first_bucket_bytes_cap < self.bucket_bytes_cap
                          else [self.bucket_bytes_cap])
                indices = compute_bucket_assignment_by_size(self.params, limits)
                self._initialize_buckets(list(reversed(indices)))
            if find_unused_parameters and self.params:
                with rt.category("communication"):
                    self.local_used_map_dev = torch.empty(len(self.params), dtype=torch.int32)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._autograd_hook) for p in self.params
        ]

    # reducer.cpp: initialize_buckets + initialize_bucket_views
    def _initialize_buckets(self, assignment: list[list[int]]) -> None:
        rt = self.rt
        self._buckets, self._views = [], {}
        self.assignments.append([list(b) for b in assignment])
        with rt.category("communication"), rt.device(self.device):
            for indices in assignment:
                p0 = self.params[indices[0]]
                total = sum(self.params[i].numel() for i in indices)
                flat = torch.empty(total, dtype=p0.dtype, device=p0.device)
                self._buckets.append(flat)
                offset = 0
                for i in indices:
                    p = self.params[i]
                    if _non_overlapping_and_dense(p):
                        view = flat.as_strided(p.shape, p.stride(), offset)
                    else:
                        view = flat.narrow(0, offset, p.numel()).view(p.shape)
                    self._views[i] = view
                    offset += p.numel()
                    if self.follower is not None:
                        self.follower.regrad(i, p.grad, view)
                    grad = p.grad
                    if (self.gradient_as_bucket_view and grad is not None
                            and grad.untyped_storage() is not view.untyped_storage()):
                        view.copy_(grad)
                        p.grad = view

    def _sync_bucket_indices(self, assignment: list[list[int]]) -> None:
        """``sync_bucket_indices``: the indices and the bucket sizes, broadcast from rank 0
        through int32 tensors on the device (and their host copies), freed on return."""
        rt = self.rt
        total = sum(len(b) for b in assignment)
        with rt.category("communication"):
            with rt.device(HOST):
                idx_host = torch.empty(total + 1, dtype=torch.int32)
            with rt.device(self.device):
                idx_dev = torch.empty(total + 1, dtype=torch.int32)
            with rt.device(HOST):
                sizes_host = torch.empty(len(assignment), dtype=torch.int32)
            with rt.device(self.device):
                sizes_dev = torch.empty(len(assignment), dtype=torch.int32)
        del sizes_dev, sizes_host, idx_dev, idx_host

    def rebuild_buckets(self) -> bool:
        """``Reducer::rebuild_buckets``: once, in gradient-ready order, limits [first, cap]."""
        if self.has_rebuilt or self.find_unused_parameters or not self._rebuilt:
            return False
        order = self._rebuilt
        assignment = compute_bucket_assignment_by_size(
            [self.params[i] for i in order],
            [self.first_bucket_bytes_cap, self.bucket_bytes_cap], order,
        )
        self._sync_bucket_indices(assignment)
        self.has_rebuilt = True
        self._rebuilt = []
        if self.follower is not None:
            self.follower.buckets_cleared(self.params, self._views)
        self._buckets, self._views = [], {}  # buckets_.clear(): the old flat buffers die
        self._initialize_buckets(assignment)
        return True

    def _autograd_hook(self, p: torch.Tensor) -> None:
        if not self._expect_hooks:
            return
        i = self._index[id(p)]
        if not self.has_rebuilt and not self.find_unused_parameters:
            self._rebuilt.append(i)
        self._mark_variable_ready_dense(i)

    def _mark_variable_ready_dense(self, i: int) -> None:
        p = self.params[i]
        view = self._views[i]
        grad = p.grad
        if grad is None:
            view.zero_()
            return
        if grad.untyped_storage() is view.untyped_storage():
            view.div_(self.world_size)
            return
        torch.mul(grad, 1.0 / self.world_size, out=view)
        if self.gradient_as_bucket_view:
            p.grad = view
        elif self.follower is not None:
            self.follower.regrad(i, grad, view)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        rt = self.rt
        grad = torch.is_grad_enabled()
        if grad:
            self.iteration += 1  # prepare_for_forward
            self.rebuild_buckets()
            if self.broadcast_buffers:
                bufs = [b for b in self.module.buffers()]
                with rt.device(self.device):
                    ddp_broadcast_coalesced(rt, bufs)
        output = self.module(*inputs, **kwargs)
        if grad:
            self._expect_hooks = True  # prepare_for_backward
            if self.find_unused_parameters:
                # distributed.py: pytree-flattened, the outputs with a grad_fn through
                # _DDPSink; the flat list (the outputs before their clones) lives until
                # forward returns
                flat, spec = tree_flatten(output)
                with rt.device(self.device):
                    passed = _DDPSink.apply(*flat)
                output = tree_unflatten(
                    [o if not isinstance(o, torch.Tensor) or o.grad_fn is None else n
                     for o, n in zip(flat, passed, strict=True)], spec)
                del passed
        return output

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Dense layouts the bucket view can match with ``as_strided`` (contiguous or
    channels-last); anything else gets a contiguous ``narrow().view()``."""
    return t.is_contiguous() or (
        t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    )


__all__ = [
    "BucketViewFollower",
    "EmulatedDDP",
    "EmulatedDataParallel",
    "balanced_sizes",
    "broadcast_coalesced",
    "compute_bucket_assignment_by_size",
    "ddp_broadcast_coalesced",
    "gather_tensors",
    "reduce_add_coalesced",
    "replicate",
    "scatter_kwargs",
    "take_tensors_cpp",
]

