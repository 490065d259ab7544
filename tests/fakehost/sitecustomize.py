"""The tests' seam into child processes: fakes installed behind dpprof's own interfaces.

Python imports ``sitecustomize`` at start-up (``site``, after the site-packages are on
``sys.path``) when one is on ``sys.path``: a test that puts this folder first on
``PYTHONPATH`` (``fake_cuda.fakehost_env``) gets this module run in the ``dpprof`` process it
starts and in every Python process that inherits the environment: DDP ranks started by
``multiprocessing`` (spawn), torchrun's workers, the command under ``dpprof watch``. What it
installs is read from ``DPPROF_FAKEHOST`` (comma-separated):

- ``gpus=N``: :class:`fake_cuda.CpuHost` as ``dpprof.backends.cuda_host.HOST``: N GPUs of CPU
  tensors, ``ddp`` ranks over gloo (the cuda backend's code without a GPU);
- ``nvml=NAME``: ``watch_fakes.NAME()`` as what ``dpprof.nvml.libnvml.default_nvml()`` returns
  (one instance per process, made on the first call).

Nothing is imported at start-up: a finder on ``sys.meta_path`` waits for the dpprof module to
be imported and replaces the interface right after the module has run, before anything else
can import from it. A process that never imports dpprof (the watched command) is untouched.
Production code has no flag, variable or loader for any of this.

This file shadows any other ``sitecustomize`` (a venv normally has none; Debian's system
Python ships one in /usr/lib/python3.X): the next one on ``sys.path`` is run after this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def _settings() -> dict[str, str]:
    items = (p.partition("=") for p in os.environ.get("DPPROF_FAKEHOST", "").split(","))
    return {k.strip(): v.strip() for k, _, v in items if k.strip()}


def _fakes() -> None:
    if TESTS not in sys.path:
        sys.path.append(TESTS)  # last: the tests' modules shadow nothing


def _install_host(module: ModuleType) -> None:
    _fakes()
    import fake_cuda

    module.HOST = fake_cuda.CpuHost(int(_settings()["gpus"]))


def _install_nvml(module: ModuleType) -> None:
    name = _settings()["nvml"]
    made: list[Any] = []

    def default_nvml() -> Any:
        if not made:  # lazily: the fakes import dpprof modules of their own
            _fakes()
            import watch_fakes

            made.append(getattr(watch_fakes, name)())
        return made[0]

    default_nvml.__doc__ = f"The tests' fake NVML (watch_fakes.{name})."
    module.default_nvml = default_nvml


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the installer."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name: str) -> Any:  # get_source etc. for tracebacks
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.hooks = hooks

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        then = self.hooks.get(name)
        if then is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, then)
                return spec
        return None


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one."""
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == HERE:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            shadowed = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(shadowed)
            return


def _main() -> None:
    settings = _settings()
    hooks: dict[str, Callable[[ModuleType], None]] = {}
    if "gpus" in settings:
        hooks["dpprof.backends.cuda_host"] = _install_host
    if "nvml" in settings:
        hooks["dpprof.nvml.libnvml"] = _install_nvml
    if hooks:
        sys.meta_path.insert(0, _AfterImport(hooks))
    _chain()


_main()
