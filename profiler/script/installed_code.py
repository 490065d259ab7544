"""Which source files are an installed package's (a library's) and which are the user's.

A library's code is what pip (or the standard library) put there: the user does not edit it,
so dpprof rewrites none of its lines, names its sites by the package's own path
(``transformers/trainer.py:1029``) and says when a library, not the script, decided
something. It is found where Python installs packages (this interpreter's standard library
and site-packages folders, any ``site-packages`` or ``dist-packages`` folder) and, wherever
else a folder on ``sys.path`` holds them (``pip install --target``, ``PYTHONPATH``, a
user's site folder), by the installed distributions' own records: a file listed in a
``*.dist-info`` RECORD beside its top-level package. A package installed in editable mode
records no source file: its code is the user's, as it is where they edit it.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from importlib import metadata
from pathlib import Path

__all__ = ["installed_site", "is_installed"]

_INSTALL_KEYS = ("stdlib", "platstdlib", "purelib", "platlib")
_PACKAGE_FOLDERS = ("site-packages", "dist-packages")


@functools.lru_cache(maxsize=4096)
def installed_site(path: str) -> str:
    """``path`` relative to the folder its package is installed in
    (``transformers/trainer.py``), or "" where it is not an installed package's file.
    Cached by the path as given: a frame's file name, asked at each batch the DDP
    alternative cuts (the file system asked once)."""
    if not path or path.startswith("<"):
        return ""
    return _installed(os.path.realpath(path))


def is_installed(path: str) -> bool:
    """Whether ``path`` is an installed package's file (see the module)."""
    return bool(installed_site(path))


def _installed(real: str) -> str:
    for root in _install_roots():
        if real.startswith(root + os.sep):
            return real[len(root) + 1:]
    parts = Path(real).parts
    for folder in _PACKAGE_FOLDERS:
        if folder in parts:
            at = len(parts) - 1 - parts[::-1].index(folder)
            return str(Path(*parts[at + 1:]))
    file = Path(real)
    for location in _locations(file):
        relative = file.relative_to(location).as_posix()
        if relative in _recorded_files(str(location)):
            return relative
    return ""


@functools.cache
def _install_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in _INSTALL_KEYS if k in paths}
    return tuple(sorted(roots, key=len, reverse=True))  # the deepest first


def _locations(file: Path) -> list[Path]:
    """The folders ``file`` may be installed in: the nearest above it that is no regular
    package (no ``__init__.py``: where its top-level package or module lies), and two more
    above that, for a namespace package's (``google/protobuf``)."""
    folder = file.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        folder = folder.parent
    return [folder, *list(folder.parents)[:2]]


@functools.lru_cache(maxsize=64)
def _recorded_files(location: str) -> frozenset[str]:
    """Every file the distributions installed in ``location`` record, relative to it."""
    files: set[str] = set()
    try:
        for dist in metadata.distributions(path=[location]):
            files.update(Path(f).as_posix() for f in dist.files or ())
    except (OSError, ValueError):
        return frozenset()
    return frozenset(files)
