"""Where in the program a call comes from: the innermost frame outside torch and dpprof (the
user's line, as reports name it), and whether a file is dpprof's own."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch

__all__ = ["caller_frame", "caller_line", "caller_site", "caller_sites", "constructing_site",
           "dpprof_dirs", "frame_locals", "in_dpprof", "in_torch", "relative_site",
           "torch_path"]



@functools.cache
def dpprof_dirs() -> tuple[str, ...]:
    """dpprof's source folders, real paths each ending in a separator: one in an installed
    wheel; in an editable install of the repository also scenarios/ and reports/ beside
    profiler/ (pyproject.toml's package-dir), whose frames are dpprof's all the same.
    Located without importing the packages above this one."""
    dirs = {os.path.realpath(Path(__file__).parents[1])}
    for package in ("dpprof.scenarios", "dpprof.reports"):
        spec = importlib.util.find_spec(package)
        dirs.update(os.path.realpath(d) for d in (
            spec.submodule_search_locations or [] if spec is not None else []))
    return tuple(sorted(os.path.join(d, "") for d in dirs))


_DPPROF_DIRS = dpprof_dirs()  # a tuple, as str.startswith takes it
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def caller_frame(also_skip: tuple[str, ...] = ()) -> FrameType | None:
    """The innermost frame outside torch and dpprof (the user's), and outside the files
    ``also_skip`` names."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name.startswith(_DPPROF_DIRS)
                or name.startswith("<") or name in also_skip):
            return f
        f = f.f_back
    return None


def caller_site(also_skip: tuple[str, ...] = ()) -> str:
    """``file:line`` of the innermost frame outside torch and dpprof (the user's line), and
    outside the files ``also_skip`` names."""
    f = caller_frame(also_skip)
    return "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


def frame_locals(frame: FrameType) -> dict[str, Any]:
    """A copy of ``frame``'s local names and their values, read without keeping them.

    Before Python 3.13, reading ``f_locals`` of a function's frame leaves a dict on the frame
    holding every local's value at that moment, until the next read: a training loop read at
    its loss statement would keep the last step's loss and its graph alive through the
    backward, memory the program itself does not hold. That dict is emptied after the copy,
    unless the program holds it too (its own ``locals()``, which is the same dict)."""
    names = frame.f_locals
    copy = dict(names)
    if (sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED
            and names is not frame.f_globals
            and sys.getrefcount(names) <= _HELD_BY_FRAME_AND_HERE):
        names.clear()
    return copy


# references to a frame's locals dict that this module's read makes: the frame's own, the
# name ``names`` and getrefcount's argument
_HELD_BY_FRAME_AND_HERE = 3


def constructing_site(obj: object) -> str:
    """:func:`caller_site` of the line that constructed ``obj``: past the ``__init__`` of its
    own class or of a subclass (the user's ``BalancedDataParallel(...)``, not that class's
    ``super().__init__``)."""
    f = caller_frame()
    while (f is not None and f.f_code.co_name == "__init__"
           and frame_locals(f).get("self") is obj):
        f = f.f_back
        while f is not None and (f.f_code.co_filename.startswith((_TORCH_DIR, *_DPPROF_DIRS,
                                                                  "<"))):
            f = f.f_back
    return "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


def caller_sites(limit: int = 64) -> tuple[str, ...]:
    """``file:line`` of every frame outside torch and dpprof, innermost first (at most
    ``limit``): the user's line, then the lines that called it (a library's first, where a
    library called torch, then the script's that called the library); ``("?",)`` where
    there is none, as :func:`caller_site` says."""
    out: list[str] = []
    f = caller_frame()
    while f is not None and len(out) < limit:
        out.append(f"{f.f_code.co_filename}:{f.f_lineno}")
        f = f.f_back
        while f is not None and (f.f_code.co_filename.startswith((_TORCH_DIR, *_DPPROF_DIRS,
                                                                  "<"))):
            f = f.f_back
    return tuple(out) or ("?",)


def torch_path(filename: str) -> str | None:
    """``filename``'s path inside torch's package (``_refs/__init__.py``), where it is one of
    torch's own source files; else None."""
    inside = filename.removeprefix(_TORCH_DIR + os.sep)
    return inside if inside != filename else None


def in_torch(filename: str) -> bool:
    """Whether ``filename`` is one of torch's own source files."""
    return torch_path(filename) is not None


def in_dpprof(filename: str) -> bool:
    """Whether ``filename`` is one of dpprof's own source files."""
    return filename.startswith(_DPPROF_DIRS)


def caller_line() -> str:
    """The source text of :func:`caller_site`'s line ("" where unknown)."""
    import linecache

    path, _, num = caller_site().rpartition(":")
    return linecache.getline(path, int(num)) if num.isdigit() else ""


def relative_site(site: str) -> str:
    """A site of the working directory's files as the user typed it (``train.py:40``, not
    the absolute path Python gives the script's code)."""
    cwd = os.getcwd() + os.sep
    return site.removeprefix(cwd) if site.startswith(cwd) else site
