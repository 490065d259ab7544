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

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

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


@dataclass(slots=True)
class OpRecord:
    """One op of the measured step as the GPU runs it."""

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


def _nbytes(t: torch.Tensor) -> int:
    return t.nbytes


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
               sources: set[int], phase: str, mirrors: tuple[int, ...] = ()) -> None:
        """Log ``func`` run on ``device`` (its tensor inputs on ``sources``)."""
        packet = func._overloadpacket
        name = packet.__name__
        thread = self._thread()
        if func is aten._local_scalar_dense.default:
            self.records.append(OpRecord(name, device, device, phase, thread, SYNC, "",
                                         0, 0, 0, mirrors))
            return
        if func.is_view or func in _NO_KERNEL_OPS or (device == HOST and not sources):
            self.records.append(OpRecord(name, device, device, phase, thread, NO_KERNEL, "",
                                         0, 0, 0, mirrors))
            return
        ins: list[torch.Tensor] = []
        lists = _tensors(args, ins)
        if kwargs:
            lists += _tensors(kwargs.values(), ins)
        outs: list[torch.Tensor] = []
        if isinstance(out, torch.Tensor):
            outs.append(out)
        elif isinstance(out, (list, tuple)):
            _tensors(out, outs)
        moved = sum(_nbytes(t) for t in outs)
        others = [s for s in sources if s != device]
        if others:  # a copy between devices: what crosses the link
            self.records.append(OpRecord(name, device, others[0], phase, thread, TRANSFER, "",
                                         0, moved, 1, mirrors))
            return
        nbytes = moved + sum(_nbytes(t) for t in ins)
        formula = flop_registry.get(packet)
        if formula is not None:
            try:
                flops = _flops(formula, args, kwargs, out)
            except Exception:  # a formula that does not cover this overload: bytes only
                flops = 0
            dtype = str(ins[0].dtype).removeprefix("torch.") if ins else ""
            conv = "conv" in name
            if conv:
                # cuDNN's convolutions take TF32 by default (allow_tf32); in 16 bits an
                # NCHW convolution is no faster on an H200 (it measured bf16 autocast's
                # convnet slower than fp32's): TF32's rate for both
                dtype = "tf32"
            self.records.append(OpRecord(name, device, device, phase, thread,
                                         CONV if conv else MATMUL, dtype, flops, nbytes, 1,
                                         mirrors, gemm=gemm_dims(name, args, out)))
            return
        kernels = 1
        if lists and name.startswith("_foreach"):
            per = _FOREACH_TENSORS_PER_LAUNCH[min(lists, len(_FOREACH_TENSORS_PER_LAUNCH)) - 1]
            kernels = max(1, -(-(len(ins) // lists) // per))
        if name in ("zero_", "fill_") and not nbytes:
            kernels = 0
        kind = NORM if "batch_norm" in name else COMPUTE
        self.records.append(OpRecord(name, device, device, phase, thread, kind, "", 0,
                                     nbytes, kernels, mirrors))

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
