"""Composite ops that decide as in plain Python while a dispatch mode is active.

A few of ATen's composite (CompositeImplicitAutograd) ops pick their decomposition with
``_may_require_fw_or_bw_grad`` (``aten/src/ATen/native/BatchLinearAlgebra.cpp``): the
input requires grad, has a forward-mode tangent, or ``isTensorSubclassLike`` holds, and
``isTensorSubclassLike`` is true for *every* tensor while a ``TorchDispatchMode`` is active
(``dispatch_mode_enabled()``, ``ATen/TensorSubclassLikeUtils.h``). Under the emulator's
mode, a host tensor's ``torch.linalg.svdvals`` therefore computes the singular vectors too
(``_linalg_svd(compute_uv=True)``, another LAPACK path, other low bits:
13.76436996459961 instead of 13.764365196228027), and so do everything built on it
(``matrix_norm(ord=2)``, ``norm``, ``cond``, ``matrix_rank``, ``torch.svd(compute_uv=
False)``), ``eigvalsh`` (``_linalg_eigh(compute_v=True)``) and ``eigvals`` (``linalg_eig``).

:data:`KERNELS`, registered while an emulation runs (:mod:`dpprof.emulator.aten_kernels`),
are kernels of these ops that take the same decision without the mode's clause: the mode is
dpprof's, not the program's, so the program gets the path it gets in plain Python, on the
host and on a virtual GPU alike (where the decision also decides what is allocated: a GPU
without a mode computes no singular vectors either). A meta tensor counts as the GPU tensor
it plays, not as a subclass. C++ callers (``matrix_norm`` calls ``at::linalg_svdvals``) go
through the dispatcher, so they get these kernels too.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad

from dpprof.emulator.aten_kernels import Kernel

aten = torch.ops.aten

# isTensorSubclassLike's keys (kTensorSubclassLike) but Meta: functorch's wrappers, batched,
# sparse and Python subclasses
_SUBCLASS_KEYS = tuple(
    getattr(torch._C.DispatchKey, name) for name in (
        "FuncTorchGradWrapper", "FuncTorchBatched", "Functionalize", "Batched", "Sparse",
        "SparseCsr", "Python") if hasattr(torch._C.DispatchKey, name))


def may_require_grad(t: torch.Tensor) -> bool:
    """``_may_require_fw_or_bw_grad`` without its ``dispatch_mode_enabled()`` clause (and
    with a meta tensor taken for the GPU tensor it plays)."""
    if torch.is_grad_enabled() and t.requires_grad:
        return True
    if forward_ad._current_level >= 0 and torch._VF._unpack_dual(t, 0).tangent is not None:
        return True
    keys = torch._C._dispatch_keys(t)
    return any(keys.has(k) for k in _SUBCLASS_KEYS)


def _svdvals(a: torch.Tensor, *, driver: str | None = None) -> torch.Tensor:
    return aten._linalg_svd.default(a, False, may_require_grad(a), driver=driver)[1]


def _eigvalsh(a: torch.Tensor, uplo: str = "L") -> torch.Tensor:
    return aten._linalg_eigh.default(a, uplo, may_require_grad(a))[0]


def _eigvals(a: torch.Tensor) -> torch.Tensor:
    if may_require_grad(a):
        return aten.linalg_eig.default(a)[0]
    return aten._linalg_eigvals.default(a)


# the kernels that decide as in plain Python, as each op's CompositeImplicitAutograd kernel
# (registered while an emulation runs: dpprof.emulator.aten_kernels)
KERNELS: tuple[Kernel, ...] = tuple(
    (name, kernel, "CompositeImplicitAutograd") for name, kernel in (
        ("linalg_svdvals", _svdvals), ("linalg_eigvalsh", _eigvalsh),
        ("linalg_eigvals", _eigvals)))
