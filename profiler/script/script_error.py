"""The script's error as its user reads it: the traceback Python would print on a GPU, and
the line of the script's own code that raised it.

Over virtual devices an operator's error is raised by its meta kernel, written in Python
(``torch/_meta_registrations.py``, ``torch/_refs``, ``torch._check``), reached through
``torch/_ops.py`` and dpprof's dispatch mode. On a GPU the same error comes from the CUDA
kernel's C++ and the traceback ends at the script's line that called the operator: those
frames are the emulator's, not the script's, and are left out with dpprof's own."""

from __future__ import annotations

import linecache
import traceback
from dataclasses import dataclass

import torch

from dpprof.emulator.call_sites import in_dpprof, in_torch, relative_site, torch_path
from dpprof.emulator.dispatch_state import VirtualDeviceError

__all__ = ["RaisedAt", "raised_at", "script_frames"]

# torch's files an operator reaches only through Python dispatch: a meta kernel, a
# reference implementation, a decomposition (on a GPU: the kernel's C++, no frame)
_DISPATCH_FILES = ("_ops.py", "_meta_registrations.py", "_refs/", "_prims/",
                   "_prims_common/", "_decomp/", "utils/_python_dispatch.py", "_subclasses/",
                   "_library/")
# the errors dpprof raises where a GPU would (tensors of two devices in one operator, out of
# memory): the script's, not dpprof's limits
_AS_ON_A_GPU = (VirtualDeviceError, torch.OutOfMemoryError)
# torch/__init__.py's checks the meta kernels raise through (torch._check and its kin)
_CHECKS = "_check"


@dataclass(frozen=True)
class RaisedAt:
    """Where the script's error was raised."""

    site: str  # file:line of the innermost frame outside torch and dpprof ("" where none)
    text: str  # that line's source, stripped
    in_dpprof: bool  # the innermost frame is dpprof's: dpprof's own limit


def _is_dispatch(frame: traceback.FrameSummary) -> bool:
    inside = torch_path(frame.filename)
    return inside is not None and (inside.startswith(_DISPATCH_FILES) or (
        inside == "__init__.py" and frame.name.startswith(_CHECKS)))


def script_frames(e: BaseException) -> list[traceback.FrameSummary]:
    """``e``'s frames as a GPU run would show them: outside dpprof and runpy, the emulated
    kernels' left out at the end."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not in_dpprof(f.filename) and "runpy" not in f.filename]
    end = len(frames)  # the trailing frames in torch: where the script called into it
    while end and in_torch(frames[end - 1].filename):
        end -= 1
    cut = next((i for i in range(end, len(frames)) if _is_dispatch(frames[i])), len(frames))
    return frames[:cut]


def raised_at(e: BaseException) -> RaisedAt | None:
    """The line of the script's own code (a library's, where it raised there) that raised
    ``e``, and whether dpprof's code raised it (its innermost frame is dpprof's, not torch's
    or the script's, and it is not an error a GPU raises too); None where the traceback has
    no frame."""
    every = [f for f in traceback.extract_tb(e.__traceback__)
             if not f.filename.startswith("<") and "runpy" not in f.filename]
    if not every:
        return None
    own = [f for f in every
           if not in_torch(f.filename) and not in_dpprof(f.filename)]
    where = own[-1] if own else None
    site = "" if where is None else relative_site(f"{where.filename}:{where.lineno}")
    text = "" if where is None else (
        where.line or linecache.getline(where.filename, where.lineno or 0)).strip()
    return RaisedAt(site=site, text=text, in_dpprof=in_dpprof(every[-1].filename)
                    and not isinstance(e, _AS_ON_A_GPU))
