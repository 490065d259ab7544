"""Which integer dtypes CUDA takes as class targets and indices, enforced over meta tensors.

Over meta tensors an op runs torch's Python meta kernel or decomposition, which is not CUDA's
kernel and does not take the same integer dtypes. What PyTorch's own sources say (ATen's
``native/cuda/Loss.cu``, ``native/cuda/NLLLoss2d.cu``, ``native/LossNLL.cpp``,
``native/LossNLL2d.cpp``, the CUDA ``index_select``; ``torch/_decomp/decompositions.py`` and
``torch/_meta_registrations.py`` for the meta side), checked against torch 2.13 on the CPU,
whose kernels take the same dtypes here:

* ``nll_loss`` on 1-D/2-D input (``cross_entropy`` on ``[N, C]`` logits goes there through
  ``nll_loss_nd``): the CUDA kernels dispatch the target over ``Byte`` and ``Long`` only
  (``AT_DISPATCH_NLL_LOSS_INDEX_TYPES``; ``Byte`` was added for uint8 labels), and torch 2.13
  refuses any other dtype first: "expected target dtype to be Long or Byte, but got Int".
  So **uint8 and int64 targets are accepted, int32/int16/int8/bool refused**. The meta
  decomposition computes the loss with ``gather``/``scatter``, which refuse uint8: a uint8
  target is passed to it as int64 (no byte is counted: CUDA makes no such copy).
* ``nll_loss2d`` (``cross_entropy`` on ``[N, C, d1, ...]``: ``nll_loss_nd`` views 3-D and
  5-D+ input as 4-D): the kernels read the target as ``int64_t`` only
  (``packed_accessor64<int64_t>``, ``const_data_ptr<int64_t>``): **int64 only**; a uint8
  target passes the dtype check and fails there ("expected scalar type Long but found
  Byte"). The meta decomposition takes int32 too.
* ``multi_margin_loss``: the CUDA kernel reads ``int64_t`` targets: **int64 only**.
* ``index_select`` and ``index_add``: **int32 or int64** (the CUDA kernels dispatch
  ``AT_DISPATCH_INDEX_TYPES``); the meta kernels take any dtype.
* ``embedding`` (``checkScalarTypes(..., {kLong, kInt})``), ``gather`` / ``scatter`` /
  ``scatter_add`` (``scatter_gather_dtype_check``: int32/int64) and ``take_along_dim``
  (int64) run the same checks over meta as on CUDA: nothing to add.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

# c10::ScalarType names, as torch's messages print dtypes
_SCALAR_TYPE = {
    torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.bool: "Bool", torch.float16: "Half", torch.float32: "Float",
    torch.float64: "Double", torch.bfloat16: "BFloat16",
}


def _name(dtype: torch.dtype) -> str:
    return _SCALAR_TYPE.get(dtype, str(dtype).removeprefix("torch."))


def _nll_target(args: tuple[Any, ...], at: int) -> tuple[Any, ...]:
    target = args[at]
    if target.dtype == torch.int64:
        return args
    if target.dtype != torch.uint8:
        raise RuntimeError(
            f"expected target dtype to be Long or Byte, but got {_name(target.dtype)}")
    # the mode is off inside its own dispatch: this copy is not counted
    return (*args[:at], aten._to_copy.default(target, dtype=torch.int64), *args[at + 1:])


def _long_target(args: tuple[Any, ...], at: int) -> tuple[Any, ...]:
    dtype = args[at].dtype
    if dtype == torch.uint8:  # passes the dtype check; the kernel's int64 accessor refuses it
        raise RuntimeError("expected scalar type Long but found Byte")
    if dtype != torch.int64:
        raise RuntimeError(f"expected target dtype to be Long or Byte, but got {_name(dtype)}")
    return args


def _int_or_long(op: str, at: int) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    def check(args: tuple[Any, ...]) -> tuple[Any, ...]:
        index = args[at]
        if index.dtype not in (torch.int32, torch.int64):
            if op == "index_select":
                raise RuntimeError("index_select(): Expected dtype int32 or int64 for index")
            raise RuntimeError(f"{op}(): Expected dtype int32/int64 for index but got: "
                               f"{_name(index.dtype)}")
        return args

    return check


def _multi_margin(args: tuple[Any, ...]) -> tuple[Any, ...]:
    if args[1].dtype != torch.int64:
        raise RuntimeError(f"expected scalar type Long but found {_name(args[1].dtype)}")
    return args


# op -> (positional args -> the args the meta kernel gets, or the error CUDA raises)
RULES: dict[Any, Callable[[tuple[Any, ...]], tuple[Any, ...]]] = {
    aten.nll_loss_forward.default: lambda a: _nll_target(a, 1),
    aten.nll_loss_backward.default: lambda a: _nll_target(a, 2),
    aten.nll_loss2d_forward.default: lambda a: _long_target(a, 1),
    aten.nll_loss2d_backward.default: lambda a: _long_target(a, 2),
    aten.multi_margin_loss.default: _multi_margin,
    aten.index_select.default: _int_or_long("index_select", 2),
    aten.index_add.default: _int_or_long("index_add_", 2),
    aten.index_add_.default: _int_or_long("index_add_", 2),
}


def as_on_cuda(func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` for ``func``'s meta kernel, with CUDA's integer dtype rules for targets and
    indices applied (raises the error CUDA raises for a dtype it refuses)."""
    rule = RULES.get(func)
    if rule is None or len(args) < 2:
        return args
    return rule(tuple(args))
