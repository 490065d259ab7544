"""A call made on a module as it finishes loading, for modules the script imports while a
run is on (the seal patches the file writers of C-backed libraries, the run stops engines
it does not emulate): a meta path finder that wraps the loader the other finders return."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Collection, Iterator
from types import ModuleType
from typing import Any

__all__ = ["ImportHook", "on_each_load"]


class ImportHook(importlib.abc.MetaPathFinder):
    """Calls ``on_load(module)`` once each module named in ``names`` has loaded."""

    def __init__(self, names: Collection[str], on_load: Callable[[ModuleType], None]) -> None:
        self.names = names
        self.on_load = on_load

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _HookedLoader(spec.loader, self.on_load)
            return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, on_load: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.on_load = on_load

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.on_load(module)

    def __getattr__(self, name: str) -> Any:  # the rest of the loader's protocol
        return getattr(self.loader, name)


@contextlib.contextmanager
def on_each_load(names: Collection[str], on_load: Callable[[ModuleType], None]) -> Iterator[None]:
    """For the duration: ``on_load(module)`` for each module named in ``names``, now where
    it is loaded already, else as soon as it loads."""
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            on_load(module)
    finder = ImportHook(names, on_load)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
