"""Code that opens the path it is given outside Python (safetensors' Rust writer and
``safe_open``, h5py, sqlite3, OpenCV): handed the overlay's path at the call while a run is
under way (:data:`OUTSIDE_PYTHON`); a module the script imports during the run is patched as
it loads (:func:`patch_loaded`).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from dpprof.emulator.patcher import Patcher
from dpprof.script.bound_names import patch_bound_names
from dpprof.script.sealed_calls import active

__all__ = ["OUTSIDE_PYTHON", "patch_loaded", "patch_outside"]

# Code that opens the path it is given outside Python: (module, name, position of the
# path, its keyword, what the call does with the file: "r" reads it, else as
# Seal.write_path's ``how``; "h5py": as h5py.File's mode says)
OUTSIDE_PYTHON: tuple[tuple[str, str, int, str, str], ...] = (
    ("safetensors", "serialize_file", 1, "filename", "w"),
    ("safetensors", "safe_open", 0, "filename", "r"),
    ("sqlite3", "connect", 0, "database", "a"),
    ("cv2", "imwrite", 0, "filename", "w"),
    ("cv2", "imread", 0, "filename", "r"),
    ("h5py", "File", 0, "name", "h5py"),
)


def _mapped(pos: int, kw: str, how: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    seal = active()
    if seal is None:
        return args, kwargs
    if kw in kwargs:
        given = kwargs[kw]
    elif pos < len(args):
        given = args[pos]
    else:
        return args, kwargs
    if not isinstance(given, (str, bytes, os.PathLike)):
        return args, kwargs
    if how == "h5py":
        mode = kwargs.get("mode", args[pos + 1] if len(args) > pos + 1 else "r")
        how = {"r": "r", "r+": "r+", "w": "w", "w-": "x", "x": "x", "a": "a"}.get(mode, "r")
    if how == "a" and os.fsdecode(os.fspath(given)) in (":memory:", ""):
        return args, kwargs
    concrete = seal.read_path(given) if how == "r" else seal.write_path(given, how)
    if kw in kwargs:
        return args, {**kwargs, kw: concrete}
    return (*args[:pos], concrete, *args[pos + 1:]), kwargs


# id(original) -> (the original, its wrapper): one wrapper per original for every run (a
# new one each run would make every module be read again for names bound to it)
_OUTSIDE_WRAPPERS: dict[int, tuple[Any, Any]] = {}


def patch_outside(patcher: Patcher, module: ModuleType, name: str, pos: int, kw: str,
                   how: str, wrappers: dict[int, Any] | None = None) -> None:
    original = getattr(module, name, None)
    if original is None:
        return
    known = _OUTSIDE_WRAPPERS.get(id(original))
    if known is not None and known[0] is original:
        wrapper = known[1]
    else:
        wrapper = _outside_wrapper(original, name, pos, kw, how)
        _OUTSIDE_WRAPPERS[id(original)] = (original, wrapper)
    patcher.patch(module, name, wrapper)
    if wrappers is not None:
        wrappers[id(original)] = wrapper


def _outside_wrapper(original: Any, name: str, pos: int, kw: str, how: str) -> Any:
    """``original`` (a function, or h5py's File class) with its path argument handed the
    overlay's path while a run is under way."""
    if isinstance(original, type) and how == "h5py":
        class Sealed(original):  # type: ignore[valid-type, misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                args, kwargs = _mapped(pos, kw, how, args, kwargs)
                super().__init__(*args, **kwargs)

        Sealed.__name__ = Sealed.__qualname__ = original.__name__
        Sealed.__module__ = original.__module__
        return Sealed

    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _mapped(pos, kw, how, args, kwargs)
        return original(*args, **kwargs)

    call.__name__ = getattr(original, "__name__", name)
    call.__doc__ = getattr(original, "__doc__", None)
    return call


def patch_loaded(patcher: Patcher, module: ModuleType) -> None:
    """Patch a module of :data:`OUTSIDE_PYTHON` the script imports during the run, as it
    loads."""
    if active() is None:
        return
    wrappers: dict[int, Any] = {}
    for name, attr, pos, kw, how in OUTSIDE_PYTHON:
        if name == module.__name__:
            patch_outside(patcher, module, attr, pos, kw, how, wrappers)
    # its submodules loaded with it bound the originals by name (safetensors.torch)
    patch_bound_names(patcher, wrappers, only=module.__name__)
