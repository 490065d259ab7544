"""Names bound before a run: a module that took one of the functions the seal (or the
emulator's effects) replaces under a name of its own (``from os import replace``,
``tarfile``'s ``bltn_open``, NumPy's table of openers) has that name patched too, for the run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
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


@dataclass
class _Scan:
    """What was read of ``sys.modules`` for one set of originals: each module's names bound to
    one of them (by the module's name in ``sys.modules``), and the modules as they stood when
    last read (a run that imported nothing new reads none again)."""

    found: dict[str, tuple[Any, list[str]]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    modules: list[Any] = field(default_factory=list)
    with_hits: list[str] = field(default_factory=list)


# the ids of the originals -> what was read; by name, not id(): id() is an audited event,
# and the audit hook (where there is no kernel line) would be called for each of thousands
# of modules a run
_BOUND: dict[frozenset[int], _Scan] = {}
_NOT_SCANNED = ("os", "posix", "nt", "io", "_io", "builtins", "dpprof", "importlib",
                "_frozen_importlib", "_frozen_importlib_external")


def patch_bound_names(patcher: Patcher, wrappers: dict[int, Any], only: str = "") -> None:
    """Every module that holds one of the originals of ``wrappers`` (by id) under a name of
    its own has that name patched to the wrapper. A module is read once per set of
    originals (names are bound at import): thousands of modules would otherwise cost each
    run tens of milliseconds; and ``sys.modules`` is walked in Python only where it changed
    since (compared whole, by identity, in C). ``only``: that package's modules alone."""
    wanted = frozenset(wrappers)
    scan = _BOUND.setdefault(wanted, _Scan())
    now = sys.modules.copy()
    names, modules = list(now), list(now.values())
    try:
        same = names == scan.names and modules == scan.modules
    except Exception:  # an object in sys.modules whose == raises: read it all again
        same = False
    if not same:
        _read(scan, now, wanted)
        scan.names, scan.modules = names, modules
    for key in scan.with_hits:
        module, hits = scan.found[key]
        mod_name = getattr(module, "__name__", "")
        if sys.modules.get(key) is not module or (
                only and not (mod_name == only or mod_name.startswith(only + "."))):
            continue
        bound = module.__dict__
        for attr in hits:
            wrapper = wrappers.get(id(bound.get(attr)))
            if wrapper is not None:
                patcher.patch(module, attr, wrapper)


def _read(scan: _Scan, now: dict[str, Any], wanted: frozenset[int]) -> None:
    """Each module of ``now`` not read yet (or replaced since) read for names bound to the
    originals ``wanted``."""
    found = scan.found
    for key, module in now.items():
        seen = found.get(key)
        if seen is not None and seen[0] is module:
            continue
        mod_name = getattr(module, "__name__", "")
        bound = getattr(module, "__dict__", None)
        hits = [] if (not isinstance(mod_name, str) or not isinstance(bound, dict)
                      or mod_name.split(".")[0] in _NOT_SCANNED) else [
            attr for attr, value in list(bound.items())
            if id(value) in wanted and not attr.startswith("__")]
        found[key] = (module, hits)
    scan.with_hits = [key for key, (_, hits) in found.items() if hits]
