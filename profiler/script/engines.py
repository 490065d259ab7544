"""Training engines dpprof does not re-enact, stopped where the script reaches them.

DeepSpeed's engine (ZeRO's partitioned optimizer, its own buckets, streams and
communication backend) is not emulated. Left alone, ``deepspeed.initialize`` under
``dpprof run`` fails deep inside DeepSpeed (MPI discovery, a CUDA accelerator probe), a
traceback that reads as the script's. Instead the run stops there with one line that names
what dpprof measures nearest to it: ZeRO-2 keeps the parameters whole and shards gradients
and optimizer state (``fully_shard(reshard_after_forward=False)``), ZeRO-3 shards the
parameters too (``fully_shard``): FSDP2's rungs.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from dpprof.emulator.patcher import Patcher
from dpprof.errors import NotEmulated

DEEPSPEED_NOT_EMULATED = (
    "dpprof run: DeepSpeed is not emulated; the nearest dpprof measures is FSDP2 (ZeRO-2: "
    "fully_shard(reshard_after_forward=False); ZeRO-3: fully_shard): `dpprof run --ladder` "
    "on the script without DeepSpeed under torchrun, or `dpprof compare --ladder`")

# module -> its entry points that start the engine
REFUSED = {"deepspeed": ("initialize", "init_inference")}


def _refused(*args: Any, **kwargs: Any) -> Any:
    raise NotEmulated(DEEPSPEED_NOT_EMULATED)


class _RefusingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patcher: Patcher) -> None:
        self.loader = loader
        self.patcher = patcher

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _refuse(module, self.patcher)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of a module of :data:`REFUSED` the script imports during the run."""

    def __init__(self, patcher: Patcher) -> None:
        self.patcher = patcher

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in REFUSED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RefusingLoader(spec.loader, self.patcher)
            return spec
        return None


def _refuse(module: ModuleType, patcher: Patcher) -> None:
    for name in REFUSED.get(module.__name__, ()):
        if hasattr(module, name):
            patcher.patch(module, name, _refused)


@contextlib.contextmanager
def engines_refused() -> Iterator[None]:
    """For the duration: each engine of :data:`REFUSED` stops the run where it starts,
    whether the script imported it before or imports it during the run."""
    with Patcher() as patcher:
        for name in REFUSED:
            module = sys.modules.get(name)
            if module is not None:
                _refuse(module, patcher)
        finder = _Finder(patcher)
        sys.meta_path.insert(0, finder)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(finder)
