"""Each fix's ``dpprof run`` strategy, in the fix registry's order
(:data:`dpprof.fixes.fix_registry.FIXES`).

A fix kind sits below the script run in the layers and names nothing of it: its strategy is
found here by the kind's one name, in the module ``dpprof.script.<name>_run`` (the name's
``-`` as ``_``), as that module's ``STRATEGY`` (:class:`~dpprof.script.strategy.RunStrategy`).
A fix without such a module is measured by ``compare`` only. Adding a fix that ``dpprof run``
measures too is its kind, its line in the fix registry and its strategy module: nothing
here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

from dpprof.fixes.fix_kind import FixKind
from dpprof.fixes.fix_registry import FIXES
from dpprof.script.strategy import Alternative, RunStrategy

__all__ = ["alternative_named", "module_of", "strategies"]


def module_of(kind: FixKind) -> str:
    """The module that holds ``kind``'s strategy, where it has one."""
    return f"dpprof.script.{kind.name.replace('-', '_')}_run"


@functools.cache
def strategies() -> tuple[RunStrategy, ...]:
    """The strategies of the fixes ``dpprof run`` measures, in the registry's order."""
    found = []
    for kind in FIXES:
        module = module_of(kind)
        if importlib.util.find_spec(module) is None:
            continue
        strategy = importlib.import_module(module).STRATEGY
        assert isinstance(strategy, RunStrategy) and strategy.kind is kind, module
        found.append(strategy)
    return tuple(found)


def alternative_named(name: str) -> Alternative | None:
    """The alternative whose run is named ``name`` (a fix's name), None for another run."""
    return next((s for s in strategies() if isinstance(s, Alternative) and s.name == name),
                None)
