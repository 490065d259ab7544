"""Out-of-memory errors recognised in what torch raises: :func:`is_oom`, :func:`find_oom`
(device and bytes asked for, by :mod:`dpprof.backends.oom_messages`), and :func:`one_line`,
the line of an error the user needs (DataParallel re-raises a replica's error with its
traceback inside the message)."""

from __future__ import annotations

import torch

from dpprof.backends.oom_messages import parse_oom_line
from dpprof.result import WatchOom

__all__ = ["OOM_ERRORS", "find_oom", "is_oom", "one_line"]


def _oom_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = []
    for owner in (torch, torch.cuda):
        t = getattr(owner, "OutOfMemoryError", None)
        if isinstance(t, type) and t not in types:
            types.append(t)
    return tuple(types)


OOM_ERRORS = _oom_error_types()


def is_oom(exc: BaseException) -> bool:
    """``torch.cuda.OutOfMemoryError``, or an allocation failure that torch raises as a
    ``RuntimeError``: ``CUDA error: out of memory`` (a ``cudaMalloc`` outside the caching
    allocator, a context or kernel workspace), cuBLAS / cuDNN ``*_STATUS_ALLOC_FAILED``,
    NCCL's out of memory: the formats ``dpprof watch`` recognises in a program's output."""
    if isinstance(exc, OOM_ERRORS):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        find_oom(text) is not None
        or "CUDA out of memory" in text
        or ("NCCL error" in text and "out of memory" in text.lower())
    )


def find_oom(text: str) -> WatchOom | None:
    """The out-of-memory error stated in ``text``, read by the one parser of PyTorch's
    messages (:func:`dpprof.backends.oom_messages.parse_oom_line`): device and bytes asked for
    where the caching allocator's message gives them. DataParallel re-raises a replica's
    error with the replica's traceback in the message, so the last such line wins."""
    for line in reversed(text.splitlines()):
        found = parse_oom_line(line)
        if found is not None:
            return found
    return None


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line. DataParallel's worker threads re-raise a replica's
    error as ``Caught X in replica 0 on device 0.`` followed by the original traceback;
    the original error's own line (the traceback's last) is what the user needs."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and "Original Traceback" in text:
        return lines[-1]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
