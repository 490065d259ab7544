"""Names bound before a run: a module that took one of the functions the seal (or the
emulator's effects) replaces under a name of its own (``from os import replace``,
``tarfile``'s ``bltn_open``, NumPy's table of openers) has that name patched too, for the run.
"""

from __future__ import annotations

import sys
from typing import Any

from dpprof.emulator.patcher import Patcher

__all__ = ["patch_bound_names", "patch_held_openers"]

# tables that hold Python's ``open`` as a value, made at import: (module, object, attribute)
# NumPy's loadtxt / genfromtxt open through numpy.lib._datasource._file_openers
_OPENER_TABLES = (("numpy.lib._datasource", "_file_openers", "_file_openers"),)


def patch_held_openers(wrappers: dict[int, Any]) -> list[tuple[dict[Any, Any], Any, Any]]:
    """Each entry of :data:`_OPENER_TABLES` that holds an original, set to its wrapper;
    (table, key, original) of each, to put back."""
    done = []
    for module_name, obj_name, attr in _OPENER_TABLES:
        table = getattr(getattr(sys.modules.get(module_name), obj_name, None), attr, None)
        if not isinstance(table, dict):
            continue
        for key, value in list(table.items()):
            wrapper = wrappers.get(id(value))
            if wrapper is not None:
                done.append((table, key, value))
                table[key] = wrapper
    return done


# the ids of the originals -> the module's name in sys.modules -> (the module, its names
# bound to one of them); by name, not id(): id() is an audited event, and the audit hook
# (where there is no kernel line) would be called for each of thousands of modules a run
_BOUND: dict[frozenset[int], dict[str, tuple[Any, list[str]]]] = {}
_NOT_SCANNED = ("os", "posix", "nt", "io", "_io", "builtins", "dpprof", "importlib",
                "_frozen_importlib", "_frozen_importlib_external")


def patch_bound_names(patcher: Patcher, wrappers: dict[int, Any], only: str = "") -> None:
    """Every module that holds one of the originals of ``wrappers`` (by id) under a name of
    its own has that name patched to the wrapper. A module is read once per set of
    originals (names are bound at import): thousands of modules would otherwise cost each
    run tens of milliseconds. ``only``: that package's modules alone."""
    wanted = frozenset(wrappers)
    found = _BOUND.setdefault(wanted, {})
    for key, module in list(sys.modules.items()):
        seen = found.get(key)
        if seen is None or seen[0] is not module:
            mod_name = getattr(module, "__name__", "")
            names = getattr(module, "__dict__", None)
            hits = [] if (not isinstance(mod_name, str) or not isinstance(names, dict)
                          or mod_name.split(".")[0] in _NOT_SCANNED) else [
                attr for attr, value in list(names.items())
                if id(value) in wanted and not attr.startswith("__")]
            seen = found[key] = (module, hits)
        if not seen[1] or (only and not (module.__name__ == only
                                         or module.__name__.startswith(only + "."))):
            continue
        names = module.__dict__
        for attr in seen[1]:
            wrapper = wrappers.get(id(names.get(attr)))
            if wrapper is not None:
                patcher.patch(module, attr, wrapper)
