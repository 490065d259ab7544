"""What the measured step asks of each virtual GPU, op by op: the record the step-time model
(:mod:`dpprof.emulator.step_time`) turns into seconds.

Every aten op the emulator dispatches while the log is on becomes one :class:`OpRecord`:
the device it runs on, the phase of the step, the host thread that issues it, what kind of
work it is, its floating-point operations (torch's own formulas,
``torch.utils.flop_counter.flop_registry``, the ones ``FlopCounterMode`` uses) and the bytes
its kernel reads and writes (its tensor inputs and outputs). Collectives that allocate
nothing, and so dispatch no op (DDP's bucket all-reduce), are noted by their emulators
(:meth:`OpLog.collective`).

The log is off (``None`` on the runtime) unless a prediction is asked for: it costs a few
microseconds per op, nothing otherwise.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Set
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.flop_counter import flop_registry

from dpprof.emulator.identity import op_key

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "BROADCAST",
    "COLLECTIVES",
    "COMPUTE",
    "CONV",
    "GATHER",
    "GATHER_WAIT",
    "MATMUL",
    "NORM",
    "NO_KERNEL",
    "REDUCE",
    "REDUCE_SCATTER",
    "SYNC",
    "TRANSFER",
    "OpLog",
    "OpRecord",
    "gemm_dims",
]

# kinds of work
MATMUL = "matmul"  # an op with a FLOP formula (matmuls, attention)
CONV = "conv"  # a convolution (cuDNN's kernels, far from the peak on few channels)
NORM = "norm"  # a batch norm (cuDNN's: several passes over its tensors)
COMPUTE = "memory"  # any other kernel: elementwise, reductions, copies on one device
NO_KERNEL = "none"  # views, metadata and bare allocations: host work only
TRANSFER = "transfer"  # a copy between two devices (GPU-GPU over the interconnect, host-GPU)
ALL_REDUCE = "all_reduce"  # a collective over the ranks (DDP's bucket)
# FSDP2's collectives over the ranks (bytes: the unsharded buffer, all ranks' shards)
ALL_GATHER = "all_gather"  # the parameters of a block, before its forward or backward
REDUCE_SCATTER = "reduce_scatter"  # a block's gradients, after its backward
# the compute stream waits for the oldest all-gather not waited for yet (FSDP2's
# wait_for_unshard, before the all-gather's output is copied out into the parameters)
GATHER_WAIT = "gather_wait"
# collectives of one process over its devices (torch.cuda.comm's NCCL calls: DataParallel)
BROADCAST = "broadcast"  # from the first device to the others (replicate)
REDUCE = "reduce"  # onto the first device (the gradients' reduce-add)
GATHER = "gather"  # pieces from the others onto the first device (bytes: the pieces moved)
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE, GATHER)
SYNC = "sync"  # the host waits for the device (.item(), a copy to the host)
HOST = -1  # the device index of the host (dpprof.emulator.dispatch_state.HOST)

aten = torch.ops.aten

# Ops that launch no kernel although they are not views: a bare allocation, metadata.
_NO_KERNEL_OPS = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.detach.default,
    aten.lift_fresh.default, aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset, aten.resize_.default,
}

# multi_tensor_apply's tensors per launch by the depth (number of tensor lists) of a foreach
# op (aten/src/ATen/native/cuda/MultiTensorApply.cuh, depth_to_max_tensors)
_FOREACH_TENSORS_PER_LAUNCH = (110, 64, 48, 36, 30)


class OpRecord(NamedTuple):
    """One op of the measured step as the GPU runs it (a tuple: the log makes one per op)."""

    name: str  # the aten op (its overload packet's name)
    device: int  # where it runs (-1: the host); a transfer's target
    source: int  # a transfer's source device; else == device
    phase: str  # the step's phase (forward, backward, ...)
    thread: int  # the host thread that issues it (an id; DDP's ranks: one process each)
    kind: str  # MATMUL, COMPUTE, NO_KERNEL, TRANSFER, ALL_REDUCE
    dtype: str  # the dtype its matmul runs in ("float32", "bfloat16", ...); "" otherwise
    flops: int
    bytes: int  # read + written by its kernels (a transfer: the bytes moved)
    kernels: int  # launches (a foreach op launches one per chunk of tensors)
    mirrors: tuple[int, ...] = ()  # devices that run the same op (mirrored replicas)
    world: int = 1  # a collective's ranks
    # a matmul's or convolution's matrix product (M, N, K): M x K times K x N, per batch
    # element; () where the op is no such product (attention's fused kernels)
    gemm: tuple[int, int, int] | tuple[()] = ()


# A record made without OpRecord's generated __new__ (a Python call per op): the tuple of
# its 13 fields, in their order, as the class's own instance.
_new_record = functools.partial(tuple.__new__, OpRecord)


@dataclass(frozen=True, slots=True)
class _OpTraits:
    """What the log needs of an op that does not depend on its arguments."""

    func: Any  # the op itself (kept alive: the table is keyed by its id)
    name: str
    no_kernel: bool  # a view, metadata or a bare allocation
    sync: bool  # the host reads a value back (.item())
    formula: Any  # its FLOP formula (flop_registry), or None
    foreach: bool
    fill: bool  # zero_/fill_: no kernel on an empty tensor
    kind: str  # of an op with no formula and no transfer: NORM or COMPUTE


def _traits_of(func: Any) -> _OpTraits:
    packet = func._overloadpacket
    name = packet.__name__
    return _OpTraits(func, name, func.is_view or func in _NO_KERNEL_OPS,
                     func is aten._local_scalar_dense.default, flop_registry.get(packet),
                     name.startswith("_foreach"), name in ("zero_", "fill_"),
                     NORM if "batch_norm" in name else COMPUTE)


# op's key (dpprof.emulator.identity) -> its traits; an op (an OpOverload) lives as long
# as torch's op tables
_TRAITS: dict[int, _OpTraits] = {}
# (op, its arguments with each tensor as its shape, its output's shapes) -> (FLOPs, GEMM):
# both functions of the shapes alone (torch's formulas take nothing else), computed once
# per distinct call; a program repeats few (its layers, its replicas, each scenario's step)
_WORK: dict[Any, tuple[int, tuple[int, int, int] | tuple[()]]] = {}
_WORK_ENTRIES = 1 << 14  # cleared when full: a bound on what a long session keeps
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _tensors(args: Any, out: list[torch.Tensor]) -> int:
    """Append the tensors among ``args`` (flat, or in lists) to ``out``; the deepest list
    count (a foreach op's depth)."""
    lists = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            lists += 1
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return lists


def _shape_key(x: Any) -> Any:
    """``x`` hashable, each tensor (flat, or in a list) replaced by its shape: a call's
    arguments as its FLOPs and GEMM depend on them (a schema's position holds a tensor or a
    list of ints, never either, so a shape does not stand for a list it equals)."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return tuple([_shape_key(v) for v in x])
    return x


def _shapes(x: Any) -> Any:
    """``x`` with each tensor (flat, or in a list) replaced by its shape: what the formulas
    behind ``flop_registry``'s wrappers take (the wrappers' own pytree walk costs more than
    the rest of the log)."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(v) for v in x)
    return x


def gemm_dims(name: str, args: Any, out: Any) -> tuple[int, int, int] | tuple[()]:
    """The matrix product (M, N, K) behind a matmul or convolution op, from its arguments'
    shapes: ``mm(a, b)``, ``addmm(c, a, b)``, ``bmm``/``baddbmm`` per batch element, and a
    convolution as the GEMM it lowers to (im2col: M = batch x output pixels, N = output
    channels, K = input channels per group x kernel size), its backward by its forward's.
    ``()`` for any other op."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm", "bmm", "addmm", "baddbmm"):
        if len(tensors) < 2:
            return ()
        a, b = tensors[-2], tensors[-1]
        if a.dim() < 2 or b.dim() < 2:
            return ()
        return (int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1]))
    if "convolution" in name:
        if name.endswith("backward") or "backward" in name:
            # (grad_output, input, weight, ...): the output's shape is grad_output's
            if len(tensors) < 3:
                return ()
            output, weight = tensors[0], tensors[2]
        else:
            # (input, weight, ...): the output's shape is out's
            if len(tensors) < 2 or not isinstance(out, torch.Tensor):
                return ()
            output, weight = out, tensors[1]
        if output.dim() < 3 or weight.dim() < 3:
            return ()
        pixels = 1
        for d in output.shape[2:]:
            pixels *= int(d)
        kernel = 1
        for d in weight.shape[1:]:
            kernel *= int(d)
        return (int(output.shape[0]) * pixels, int(weight.shape[0]), kernel)
    return ()


def _flops(formula: Any, args: Any, kwargs: dict[str, Any], out: Any) -> int:
    raw = getattr(formula, "__wrapped__", None)  # shape_wrapper keeps it (functools.wraps)
    if raw is None:
        return int(formula(*args, **kwargs, out_val=out))
    return int(raw(*_shapes(args), **{k: _shapes(v) for k, v in kwargs.items()},
                   out_shape=_shapes(out)))


class OpLog:
    """The ops of one measured step, in the order the program issued them."""

    def __init__(self) -> None:
        self.records: list[OpRecord] = []
        self.on = False
        self._threads: dict[int, int] = {}

    def _thread(self) -> int:
        ident = threading.get_ident()
        found = self._threads.get(ident)
        if found is None:
            found = self._threads[ident] = len(self._threads)
        return found

    def record(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, device: int,
               sources: Set[int], phase: str, mirrors: tuple[int, ...] = ()) -> None:
        """Log ``func`` run on ``device`` (its tensor inputs on ``sources``)."""
        # once per op of the emulated step: what it costs is the prediction's cost
        key = op_key(func)  # not id(): an audited event (dpprof.emulator.identity)
        traits = _TRAITS.get(key)
        if traits is None or traits.func is not func:
            traits = _TRAITS[key] = _traits_of(func)
        name = traits.name
        ident = threading.get_ident()
        thread = self._threads.get(ident)
        if thread is None:
            thread = self._threads[ident] = len(self._threads)
        if traits.sync:
            self.records.append(_new_record((name, device, device, phase, thread, SYNC, "",
                                             0, 0, 0, mirrors, 1, ())))
            return
        if traits.no_kernel or (device == HOST and not sources):
            self.records.append(_new_record((name, device, device, phase, thread, NO_KERNEL,
                                             "", 0, 0, 0, mirrors, 1, ())))
            return
        ins: list[torch.Tensor] = []
        lists = 0
        for a in args:  # _tensors, inline: most ops take tensors only
            if isinstance(a, torch.Tensor):
                ins.append(a)
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                lists += 1
                ins.extend(x for x in a if isinstance(x, torch.Tensor))
        if kwargs:
            lists += _tensors(kwargs.values(), ins)
        moved = 0
        if isinstance(out, torch.Tensor):
            moved = out.nbytes
        elif isinstance(out, (list, tuple)):
            outs: list[torch.Tensor] = []
            _tensors(out, outs)
            for t in outs:
                moved += t.nbytes
        if sources and (len(sources) > 1 or device not in sources):
            # a copy between devices: what crosses the link
            source = next(s for s in sources if s != device)
            self.records.append(_new_record((name, device, source, phase, thread, TRANSFER,
                                             "", 0, moved, 1, mirrors, 1, ())))
            return
        nbytes = moved
        for t in ins:
            nbytes += t.nbytes
        formula = traits.formula
        if formula is not None:
            flops, gemm = self._work(func, name, formula, args, kwargs, out)
            conv = "conv" in name
            if conv:
                # cuDNN's convolutions take TF32 by default (allow_tf32); in 16 bits an
                # NCHW convolution is no faster on an H200 (it measured bf16 autocast's
                # convnet slower than fp32's): TF32's rate for both
                dtype = "tf32"
            elif ins:
                dtype = _DTYPE_NAMES.get(ins[0].dtype) or _DTYPE_NAMES.setdefault(
                    ins[0].dtype, str(ins[0].dtype).removeprefix("torch."))
            else:
                dtype = ""
            self.records.append(_new_record((name, device, device, phase, thread,
                                             CONV if conv else MATMUL, dtype, flops, nbytes, 1,
                                             mirrors, 1, gemm)))
            return
        kernels = 1
        if lists and traits.foreach:
            per = _FOREACH_TENSORS_PER_LAUNCH[min(lists, len(_FOREACH_TENSORS_PER_LAUNCH)) - 1]
            kernels = max(1, -(-(len(ins) // lists) // per))
        if traits.fill and not nbytes:
            kernels = 0
        self.records.append(_new_record((name, device, device, phase, thread, traits.kind, "",
                                         0, nbytes, kernels, mirrors, 1, ())))

    @staticmethod
    def _work(func: Any, name: str, formula: Any, args: Any, kwargs: dict[str, Any],
              out: Any) -> tuple[int, tuple[int, int, int] | tuple[()]]:
        """The FLOPs and GEMM of ``func``'s call, computed once per distinct call."""
        try:
            key: Any = (func, _shape_key(args),
                        _shape_key(tuple(kwargs.items())) if kwargs else (), _shape_key(out))
            found = _WORK.get(key)
        except TypeError:  # an argument that does not hash: computed every time
            key, found = None, None
        if found is not None:
            return found
        try:
            flops = _flops(formula, args, kwargs, out)
        except Exception:  # a formula that does not cover this overload: bytes only
            flops = 0
        found = (flops, gemm_dims(name, args, out))
        if key is not None:
            if len(_WORK) >= _WORK_ENTRIES:
                _WORK.clear()
            _WORK[key] = found
        return found

    def wait_for_gather(self, device: int, phase: str) -> None:
        """``device``'s compute stream waits for its oldest all-gather (:data:`GATHER_WAIT`)."""
        self.records.append(OpRecord(GATHER_WAIT, device, device, phase, self._thread(),
                                     GATHER_WAIT, "", 0, 0, 0))

    def collective(self, kind: str, nbytes: int, device: int, world: int, phase: str,
                   others: tuple[int, ...] = ()) -> None:
        """A collective issued now over ``nbytes``: on ``device`` as one of ``world`` ranks
        (DDP), or rooted at ``device`` over ``others`` too (DataParallel's devices)."""
        self.records.append(OpRecord(kind, device, device, phase, self._thread(), kind, "", 0,
                                     nbytes, 1, others, world))
