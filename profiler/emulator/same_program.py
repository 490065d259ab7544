"""What a reduction (or an all-to-all) over torch's fake process group leaves in its
tensors, as one rank of ranks that all run the same program sees it.

A script's process group under ``dpprof run`` is torch's fake one (``FakeProcessGroup``,
``c10d/FakeProcessGroup.hpp``): every collective returns at once and gives the rank its own
contribution, so an all-reduce leaves the tensor as it was and a reduce-scatter gives the
rank's own chunk. Ranks that run the same program contribute equally, and NCCL gives them the
reduction of ``size`` equal contributions: ``SUM`` the contribution times ``size``,
``PRODUCT`` to the power ``size``, ``AVG``, ``MIN``, ``MAX`` and the bitwise ones the
contribution itself (:func:`reduce_`). DDP's group
(:class:`dpprof.emulator.process_group.EmulatedRankGroup`) reduces by it in Python itself;
here it is applied after the fake group's collective, to what the script reads back (a loss
averaged across ranks: ``all_reduce(loss); loss / world_size``). An all-to-all gives each
slot what every rank sends this rank: its own chunk for it (the fake group gives the rank
its whole input back), so counts exchanged to size an expert's buffers are those the ranks
of the same program exchange.

:func:`contributions` says which tensors should hold a reduction after such a collective,
and where each one's contribution is; :func:`reduced` and :func:`reduce_in_place` give the
reduction's values. NCCL writes into the tensors given: nothing here is GPU memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

_c10d = torch.ops.c10d
_funcol = torch.ops._c10d_functional

_SUM, _AVG, _PRODUCT = 0, 1, 2  # c10d's RedOpType (ReduceOp.op())
_FUNCTIONAL_OPS = {"sum": _SUM, "avg": _AVG, "product": _PRODUCT}

_ALL_TO_ALL = (_c10d.alltoall_base_.default, _c10d.alltoall_.default,
               _funcol.all_to_all_single.default)
# the ops whose results the fake group leaves otherwise: the reductions, in place (c10d)
# and out of place (functional collectives), and the all-to-alls (the fake group gives the
# rank its own input back, where every rank sends it its own chunk for it)
COLLECTIVES = (
    _c10d.allreduce_.default, _c10d.reduce_.default, _c10d._reduce_scatter_base_.default,
    _c10d.reduce_scatter_.default, _funcol.all_reduce.default,
    _funcol.all_reduce_coalesced.default, _funcol.reduce_scatter_tensor.default,
    _funcol.reduce_scatter_tensor_coalesced.default, *_ALL_TO_ALL,
)
_AS_SENT = -1  # no reduction: the contribution itself


def _fake(pg: Any) -> bool:
    """Whether ``pg`` (a Python process group) is torch's fake one."""
    from torch._C._distributed_c10d import FakeProcessGroup  # type: ignore[attr-defined]

    try:
        return isinstance(pg._get_backend(torch.device("cpu")), FakeProcessGroup)
    except RuntimeError:  # a process group of Python's own (DDP's emulated one): no backend
        return False


def _group(handle: Any) -> Any:
    """The process group an op's argument names: a script object or a group's name."""
    if isinstance(handle, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(handle)  # type: ignore[arg-type]
    return dist.ProcessGroup.unbox(handle)


def contributions(func: Any, args: tuple[Any, ...], out: Any
                  ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
    """After ``func`` (one of :data:`COLLECTIVES`) ran over the fake group: each tensor that
    should hold the reduction, paired with the tensor holding this rank's contribution to
    it (itself, for an all-reduce in place), the reduction's kind (``ReduceOp.op()``) and
    the group's size. Nothing where the group is not the fake one, or where the rank gets
    no result (a reduce to another rank)."""
    functional = func.namespace == "_c10d_functional"
    handle = args[-1] if functional else args[1] if func in (
        _c10d.allreduce_.default, _c10d.reduce_.default) else args[2]
    try:
        pg = _group(handle)
    except (RuntimeError, ValueError, KeyError, TypeError):
        return [], 0, 0
    if not _fake(pg):
        return [], 0, 0
    rank, size = pg.rank(), pg.size()
    if func in _ALL_TO_ALL:
        return _all_to_all(func, args, out, rank, size), _AS_SENT, size
    if functional:
        kind = _FUNCTIONAL_OPS.get(str(args[1]).lower(), -1)
        outs = out if isinstance(out, (list, tuple)) else [out]
        ins = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        if func in (_funcol.all_reduce.default, _funcol.all_reduce_coalesced.default):
            return list(zip(outs, ins, strict=True)), kind, size
        return [(o, i.chunk(size)[rank]) for o, i in zip(outs, ins, strict=True)], kind, size
    if func is _c10d.allreduce_.default:
        return [(t, t) for t in args[0]], args[2].op(), size
    if func is _c10d.reduce_.default:
        return ([(t, t) for t in args[0]] if rank == args[3] else []), args[2].op(), size
    if func is _c10d._reduce_scatter_base_.default:
        return [(args[0], args[1].reshape(-1).chunk(size)[rank].view(args[0].shape))], \
            args[3].op(), size
    return [(o, i[rank]) for o, i in zip(args[0], args[1], strict=True)], args[3].op(), size


def _all_to_all(func: Any, args: tuple[Any, ...], out: Any, rank: int, size: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An all-to-all's slots, each paired with what ranks of the same program send this
    rank there: every rank its own chunk for this rank (the ``rank``-th of its input).
    Nothing where the slots do not have that chunk's shape (ranks that send other
    sizes)."""
    if func is _c10d.alltoall_.default:
        slots, mine = list(args[0]), args[1][rank]
    else:
        output, given, out_sizes, in_sizes = (
            (args[0], args[1], args[3], args[4]) if func is _c10d.alltoall_base_.default
            else (out, args[0], args[1], args[2]))
        slots = list(_split(output, out_sizes, size))
        mine = _split(given, in_sizes, size)[rank]
    if any(s.shape != mine.shape for s in slots):
        return []
    return [(s, mine) for s in slots]


def _split(t: torch.Tensor, sizes: Any, size: int) -> tuple[torch.Tensor, ...]:
    """``t`` split along its first dimension as an all-to-all splits it: by ``sizes``, or
    in ``size`` equal parts where none are given."""
    return t.split([int(n) for n in sizes]) if sizes else t.chunk(size)


def reduce_(t: torch.Tensor, kind: int, size: int) -> torch.Tensor:
    """``t``, holding one contribution, made the reduction of ``size`` equal ones in place
    (``kind``: ``ReduceOp``'s ``RedOpType`` as an int): the rule itself."""
    if kind == _SUM:
        t.mul_(size)
    elif kind == _PRODUCT:
        t.pow_(size)
    # AVG, MIN, MAX, BAND, BOR, BXOR of equal contributions: the contribution itself
    return t


def reduced(contribution: torch.Tensor, kind: int, size: int) -> torch.Tensor:
    """The reduction of ``size`` contributions equal to ``contribution`` (host values)."""
    return reduce_(contribution.clone(), kind, size)


def reduce_in_place(pairs: list[tuple[torch.Tensor, torch.Tensor]], kind: int,
                    size: int) -> None:
    """Each target of ``pairs`` (tensors with values: CPU tensors under ``--compute``) given
    the reduction of ``size`` contributions equal to its contribution."""
    with _disable_current_modes(), torch.no_grad():
        for target, contribution in pairs:
            if contribution is not target:
                target.copy_(contribution)
            reduce_(target, kind, size)
