"""ATen kernels of dpprof's own, registered for as long as an emulation runs and torch's
own restored after: a composite that decides as in plain Python
(:mod:`dpprof.emulator.plain_composites`), kernels of CUDA-only ops over meta and CPU
tensors (:mod:`dpprof.emulator.sync_batch_norm`), a GPU's path where torch has no Meta
kernel (:mod:`dpprof.emulator.ctc_loss`, the fused RNN cells of
:mod:`dpprof.emulator.kernels`). Each module lists its kernels as :data:`Kernel` triples."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["Kernel", "registered"]

# (the aten op, with its overload where not the default; the kernel; the dispatch key)
Kernel = tuple[str, Callable[..., Any], str]


@contextlib.contextmanager
def registered(kernels: Iterable[Kernel]) -> Iterator[None]:
    """``kernels`` registered while entered, in one library; unregistered on exit."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": that is the point, and undone
            warnings.simplefilter("ignore")
            for name, kernel, key in kernels:
                lib.impl(name, kernel, key)
        yield
    finally:
        lib._destroy()
