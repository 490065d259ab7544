"""``nn.DataParallel`` re-enacted on virtual devices (``torch/nn/parallel/{data_parallel,
replicate,scatter_gather,_functions}.py``, torch 2.13), allocation for allocation:

* scatter: ``tensor.chunk(n, dim)``; a chunk already on its target device stays a view, the
  others are copied (``comm.cpp: scatter``, ``.to(device, copy=False)``);
* replicate: parameters through :class:`Broadcast` (device 0 keeps the originals; the
  others get flat buffers of <= 10 MiB groups and views into them), buffers broadcast
  detached (``replicate.py``, ``comm.cpp: broadcast_coalesced``);
* parallel_apply: each replica on its device (sequentially here: per-device memory does
  not depend on the interleaving of devices); replicas on equal shards mirror one device;
* gather: the full output allocated on the output device, pieces copied in
  (``comm.cpp: gather``); 0-dim outputs become a vector;
* backward: ``Gather.backward`` scatters the gradient (device 0's share a view),
  ``Broadcast.backward`` is ``ReduceAddCoalesced`` onto device 0 (``comm.py``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpprof.emulator.comm import (
    broadcast_coalesced,
    gather_tensors,
    reduce_add_coalesced,
    scatter_tensor,
)
from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.emulated_autocast import (
    EmulatedAutocast,
    autocast_suspended,
    emulated_autocast_dtype,
)
from dpprof.emulator.virtual_devices import VirtualDevices

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
    ctx.out_meta = [_OutputMeta(t.shape, t.dtype, rt.storages.device_of(t), d)
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
        ctx.input_device = rt.storages.device_of(inputs[0])
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
        ctx.target_gpus = [rt.storages.device_of(grads[i])
                           for i in range(0, len(grads), num_inputs)]
        rt.storages.label(grads, "gradients")  # the replicas' gradients, held until all arrive
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
        ctx.input_gpus = tuple(rt.storages.device_of(i) for i in inputs)
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
        target = rt.storages.device_of(grad_output)
        rep = rt.mirrors.mirrored_device(target)  # the output device mirrors this replica's device
        # Its share is a view of grad_output there (no copy): the copy made for ``rep``
        # has no mirror on it, and a view keeps grad_output until that copy dies (when
        # the output device's own replica would drop its view).
        with rt.category("outputs"), \
                rt.mirrors.not_mirrored_on([target] if rep is not None else []):
            scattered = Scatter.apply(
                rt, ctx.input_gpus, ctx.input_sizes, ctx.dim, grad_output, ctx.counts
            )
        if rep is not None and rep in ctx.input_gpus:
            held = [grad_output.narrow(ctx.dim, 0, 0)]
            rt.storages.on_free(scattered[ctx.input_gpus.index(rep)], held.clear)
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
        ctx.input_device = rt.storages.device_of(input)
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
    the others mirror it (:meth:`ReplicaMirrors.set_mirrors`). A device in
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


def replica_autocast(threads: int) -> contextlib.AbstractContextManager[Any]:
    """What a replica runs under inside the caller's emulated CUDA autocast region. With two
    replicas or more torch's ``parallel_apply`` runs each in a thread of its own, which
    enters ``torch.amp.autocast(device_type, enabled=torch.is_autocast_enabled())`` with no
    dtype; ``autocast.__init__`` then reads ``torch.get_autocast_dtype(device_type)``, kept
    per thread (aten/src/ATen/autocast_mode.cpp), so a new thread gets the device's
    default: float16 on CUDA, whatever dtype the caller's region asked. One replica runs
    in the caller's thread and keeps its dtype."""
    dtype = emulated_autocast_dtype()
    if threads < 2 or dtype is None or dtype == torch.float16 or autocast_suspended():
        return contextlib.nullcontext()
    return EmulatedAutocast(torch.float16)


# What a user reads where that happened (dpprof compare's DataParallel scenarios, dpprof run)
REPLICAS_FLOAT16_NOTE = (
    "DataParallel's replicas compute in float16, not {asked}: torch's parallel_apply runs "
    "each replica in a thread of its own and enters autocast there without a dtype, which "
    "reads that thread's default (CUDA's: float16); emulated so. On a GPU that is float16 "
    "without a GradScaler (overflow risk); autocast inside the model's forward, or DDP, "
    "keeps {asked}")


def replicas_float16_note(rt: VirtualDevices) -> str | None:
    """:data:`REPLICAS_FLOAT16_NOTE` where DataParallel's replicas ran in float16 under a
    region that asked for another dtype (what :func:`parallel_apply` recorded on ``rt``)."""
    asked = rt.mirrors.replicas_float16_instead_of
    return None if asked is None else REPLICAS_FLOAT16_NOTE.format(
        asked=str(asked).removeprefix("torch."))


def parallel_apply(
    rt: VirtualDevices, modules: Sequence[nn.Module], inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]], devices: Sequence[int],
    mirrors: Sequence[Sequence[int]] = (), threads: int = 0,
) -> list[Any]:
    """Each replica on its own device; threads in torch, one after another here.

    A replica whose device is mirrored (``mirrors[k]``: the devices mirroring it) must keep
    to its device: its mirrors copy that device's events only. One that touches another
    device sets ``rt.mirrors.dedupe_failure`` and raises :class:`MirrorUnsafe` (the scenario is
    then emulated again with every replica run).
    """
    outputs: list[Any] = []
    log = rt.storages.events.device
    # torch's: one per device used (``threads``: where the caller runs part of them)
    threads = threads or len(modules) + sum(len(m) for m in mirrors)
    for k, module in enumerate(modules):
        inp = inputs[k]
        if not isinstance(inp, (list, tuple)):
            inp = (inp,)
        start = len(log)
        region = replica_autocast(threads)
        if isinstance(region, EmulatedAutocast):
            rt.mirrors.replicas_float16_instead_of = emulated_autocast_dtype()
        # torch runs two replicas or more each in a thread of its own, with its own handle
        thread = rt.worker_thread() if threads > 1 else contextlib.nullcontext()
        with rt.device(devices[k]), rt.category("activations"), thread, region:
            outputs.append(module(*inp, **kwargs_tup[k]))
        if k < len(mirrors) and mirrors[k]:
            own = {devices[k], *mirrors[k]}
            other = next((d for d in log[start:] if d not in own), None)
            if other is not None:
                rt.mirrors.dedupe_failure = (f"the replica on cuda:{devices[k]} touched "
                                     f"{'the host' if other == HOST else f'cuda:{other}'}")
                raise MirrorUnsafe(rt.mirrors.dedupe_failure)
    return outputs


class MirrorUnsafe(RuntimeError):
    """A mirrored replica did something its mirrors would not copy; run them all."""


def balanced_sizes(shares: Sequence[int], rows: int) -> list[int]:
    """``BalancedDataParallel``'s rows per device for a batch of ``rows`` (the code the
    balanced-split fix hands out, :data:`dpprof.fixes.kinds.balanced_split.CODE_BALANCED`): in
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
            if rt.storages.device_of(t) != src:
                raise RuntimeError(
                    "module must have its parameters and buffers on device "
                    f"cuda:{src} (device_ids[0]) but found one of them on device: "
                    f"cuda:{rt.storages.device_of(t)}"
                )
        sizes = self.chunk_sizes
        first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
        if sizes is not None and first is not None:  # a batch of other rows: in proportion
            sizes = balanced_sizes(sizes, first.size(self.dim))
        plan = None
        if (rt.mirrors.dedupe_replicas and rt.base.type == "meta" and torch.is_grad_enabled()
                and len(self.device_ids) > 2):
            plan = shard_plan(inputs, kwargs, self.device_ids, self.dim, sizes,
                              never_first=[self.output_device])
        # replicas on equal shards: one runs, the devices of the others mirror its device
        rt.mirrors.set_mirrors({} if plan is None else dict(zip(plan.devices, plan.mirrors,
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
        rt.mirrors.mirrored_replicas += sum(plan.counts) - len(plan.counts)
        replicas = replicate(rt, self.module, plan.devices, not torch.is_grad_enabled())
        outputs = parallel_apply(rt, replicas, inputs, module_kwargs, plan.devices,
                                 plan.mirrors)
        return gather(rt, outputs, self.output_device, self.dim, plan.counts)
