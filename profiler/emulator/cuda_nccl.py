"""``torch.cuda.nccl`` on virtual GPUs: the collectives of one process over several of its
GPUs (all-reduce, reduce, broadcast, all-gather, reduce-scatter), which a CUDA build binds
as ``torch._C._nccl_*`` (``torch/csrc/cuda/python_nccl.cpp`` over
``torch/csrc/cuda/nccl.cpp``) and a CPU build lacks. torch's own Python wrappers
(``torch/cuda/nccl.py``) run as written; the bindings under them are re-enacted: the same
checks on their tensors (``check_inputs``: one per device, contiguous, one dtype, sizes that
match), the results written into the tensors given (NCCL allocates nothing from the caching
allocator: over meta tensors nothing is written, over CPU tensors the values are), and the
communicators each call makes on its devices (``get_communicators``: one a GPU, kept),
whose memory outside the allocator the figures count. A communicator made by hand across
processes (``unique_id`` / ``init_rank``) is not emulated: ``torch.distributed`` is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dpprof.emulator import comm
from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.emulated_cuda import EmulatedCuda
from dpprof.emulator.op_log import BROADCAST, GATHER, REDUCE
from dpprof.emulator.patcher import Patch
from dpprof.errors import NotEmulated

__all__ = ["install"]

# ncclRedOp_t (nccl.h): what torch.cuda.nccl's ``op`` names
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4


class NcclCallError(RuntimeError):
    """What nccl.cpp's TORCH_CHECKs raise (a RuntimeError, as on a GPU)."""


def install(vc: EmulatedCuda, p: Patch) -> None:
    """Give ``torch._C`` the ``_nccl_*`` bindings a CUDA build has, answering for ``vc``'s
    GPUs (``torch.cuda.nccl.is_available`` then says yes, as on a GPU)."""
    rt = vc.rt

    def devices_of(tensors: Sequence[torch.Tensor]) -> list[int]:
        return [rt.storages.device_of(t) for t in tensors]

    def checked(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor | None],
                in_multiplier: int = 1, out_multiplier: int = 1, op: int = SUM) -> list[int]:
        """nccl.cpp's check_inputs (and the reduction op NCCL takes): the inputs' devices, in
        order."""
        if op not in (SUM, PROD, MAX, MIN, AVG):
            raise NcclCallError(f"torch.cuda.nccl: reduction op {op} is not one of SUM (0), "
                                "PROD (1), MAX (2), MIN (3), AVG (4)")
        if not inputs:
            raise NcclCallError("input sequence can't be empty")
        if len(outputs) != len(inputs):
            raise NcclCallError(
                "inputs and outputs sequences have to be of the same length, but got input "
                f"of length {len(inputs)} and output of length {len(outputs)}")
        devices = devices_of(inputs)
        given = [t for t in (*inputs, *outputs) if t is not None]
        if any(rt.storages.device_of(t) == HOST for t in given):
            raise NcclCallError("input and output elements have to be cuda dense Tensors")
        if len(set(devices)) != len(devices):
            raise NcclCallError("inputs must be on unique devices")
        numel, dtype = inputs[0].numel(), inputs[0].dtype
        for t, out in zip(inputs, outputs, strict=True):
            for x in (t, out):
                if x is None:
                    continue
                if x.dtype != dtype:
                    raise NcclCallError("all inputs and outputs must be of the same Tensor dtype")
                if not x.is_contiguous():
                    raise NcclCallError("all inputs and outputs have to be contiguous")
            if t.numel() != numel:
                raise NcclCallError("all inputs must have the same number of elements")
            if out is not None:
                if rt.storages.device_of(out) != rt.storages.device_of(t):
                    raise NcclCallError("input and output must be on the same device")
                if out.numel() * out_multiplier != numel * in_multiplier:
                    raise NcclCallError("output must be of size input_size * size_multiplier")
        return devices

    def called(kinds: Sequence[str], inputs: Sequence[torch.Tensor], devices: list[int],
               root: int = 0) -> bool:
        """Note the call's communicators and its traffic; whether values are to be written
        (CPU tensors: yes; meta: nothing to write)."""
        order = [devices[root], *(d for i, d in enumerate(devices) if i != root)]
        for kind in kinds:
            comm.log_collective(rt, kind, inputs[root], order)
        comm.note_communicators(rt, devices)
        return rt.base.type != "meta"

    def reduce_into(target: torch.Tensor, parts: Sequence[torch.Tensor], op: int) -> None:
        """``target`` = ``op`` over ``parts``, in place (``target`` may be ``parts[0]``)."""
        if target is not parts[0]:
            target.copy_(parts[0])
        for part in parts[1:]:
            if op in (SUM, AVG):
                target.add_(part)
            elif op == PROD:
                target.mul_(part)
            elif op == MAX:
                torch.maximum(target, part, out=target)
            else:
                torch.minimum(target, part, out=target)
        if op == AVG:
            target.div_(len(parts))

    def all_reduce(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: int,
                   streams: Any, comms: Any) -> None:
        devices = checked(inputs, outputs, op=op)
        if called((REDUCE, BROADCAST), inputs, devices):
            with rt.cross_device():
                reduce_into(outputs[0], [outputs[0], *inputs[1:]]
                            if outputs[0] is inputs[0] else list(inputs), op)
                for out in outputs[1:]:
                    out.copy_(outputs[0])

    def reduce(inputs: Sequence[torch.Tensor], output: torch.Tensor, root: int, op: int,
               streams: Any, comms: Any) -> None:
        if not 0 <= root < len(inputs):
            raise NcclCallError("invalid root")
        devices = checked(inputs, [output if i == root else None for i in range(len(inputs))],
                          op=op)
        if called((REDUCE,), inputs, devices, root):
            with rt.cross_device():
                reduce_into(output, [inputs[root], *(t for i, t in enumerate(inputs)
                                                     if i != root)], op)

    def broadcast(inputs: Sequence[torch.Tensor], root: int, streams: Any, comms: Any) -> None:
        if not 0 <= root < len(inputs):
            raise NcclCallError("invalid root")
        devices = checked(inputs, [None] * len(inputs))
        if called((BROADCAST,), inputs, devices, root):
            with rt.cross_device():
                for i, t in enumerate(inputs):
                    if i != root:
                        t.copy_(inputs[root])

    def all_gather(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                   streams: Any, comms: Any) -> None:
        n = len(inputs)
        devices = checked(inputs, outputs, in_multiplier=n)
        if called((GATHER, BROADCAST), inputs, devices):
            k = inputs[0].numel()
            with rt.cross_device():
                for out in outputs:
                    flat = out.view(-1)
                    for j, t in enumerate(inputs):
                        flat[j * k:(j + 1) * k].copy_(t.view(-1))

    def reduce_scatter(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                       op: int, streams: Any, comms: Any) -> None:
        n = len(inputs)
        devices = checked(inputs, outputs, out_multiplier=n, op=op)
        if called((REDUCE,), inputs, devices):
            k = inputs[0].numel() // n
            with rt.cross_device():
                for i, out in enumerate(outputs):
                    reduce_into(out.view(-1), [t.view(-1)[i * k:(i + 1) * k] for t in inputs],
                                op)

    def by_hand(*args: Any, **kwargs: Any) -> Any:
        raise NotEmulated(
            "dpprof: torch.cuda.nccl.unique_id / init_rank (an NCCL communicator made by hand "
            "across processes) is not emulated: torch.distributed's process group "
            "(init_process_group('nccl')) is")

    for name, func in (("_nccl_all_reduce", all_reduce), ("_nccl_reduce", reduce),
                       ("_nccl_broadcast", broadcast), ("_nccl_all_gather", all_gather),
                       ("_nccl_reduce_scatter", reduce_scatter), ("_nccl_unique_id", by_hand),
                       ("_nccl_init_rank", by_hand)):
        p(torch._C, name, func)
