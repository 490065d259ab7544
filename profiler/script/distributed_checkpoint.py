"""A distributed checkpoint (``torch.distributed.checkpoint``) of emulated tensors: a
stand-in, as ``torch.save``'s is (:mod:`dpprof.script.effects`).

On a GPU, ``dcp.save`` agrees a plan with the other ranks (each rank's shards gathered to the
coordinator), copies every shard to the host and writes it; ``dcp.load`` reads the shards back
into the state dict's own tensors, in place. Under the emulation neither can be done as
written: the ranks run one after another, so a gathered plan holds one rank's shards in every
slot (torch refuses it: "invalid fill"), and the host copies of a large model's shards would
take its whole size in host memory, values that do not exist. Neither moves a byte of GPU
memory the script would see (the copies go to the host), so nothing measured is lost by
standing in:

* ``save`` / ``async_save`` / ``save_state_dict`` of a state dict that holds an emulated
  tensor write the checkpoint folder's ``.metadata`` as a stand-in file: the state dict
  (``Stateful`` objects as their ``state_dict()``, as DCP saves them) with each tensor as its
  shape and dtype, and every other value as it is (an epoch, a step, a config). ``async_save``
  gives a future that is done.
* ``load`` / ``load_state_dict`` from a folder whose ``.metadata`` is a stand-in load as DCP
  loads: tensors in place (their values emulated), every other value
  replaced by the saved one, a ``Stateful`` object given its ``load_state_dict``; a key the
  checkpoint lacks fails as DCP fails. From a real checkpoint (the user's, on disk) torch's
  own load reads it.

Everything else (a state dict of real host tensors, a storage without a folder) is torch's.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from dpprof.emulator.patcher import Patch
from dpprof.script.effects import ScriptEffects, active, read_stand_in, stand_in_object
from dpprof.script.import_hook import on_each_load

__all__ = ["SavedTensor", "stand_ins"]

PACKAGE = "torch.distributed.checkpoint"
# the functions stood in for, by the module that defines them (the package binds each by name)
_SAVERS = ("save", "async_save", "save_state_dict")
_LOADERS = ("load", "load_state_dict")
_DEFINED_IN = {**{name: f"{PACKAGE}.state_dict_saver" for name in _SAVERS},
               **{name: f"{PACKAGE}.state_dict_loader" for name in _LOADERS}}
_TAKE_STATEFUL = ("save", "async_save")  # the deprecated save_state_dict saves them whole
METADATA_FILE = ".metadata"  # DCP's own name for the file a checkpoint is read from first

# torch's functions, as first found (a wrapper left bound by a library is never taken for one)
_ORIGINALS: dict[str, Callable[..., Any]] = {}


@dataclass(frozen=True)
class SavedTensor:
    """A tensor of the stand-in checkpoint: what DCP would record of it, no values."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@contextlib.contextmanager
def stand_ins(patch: Patch) -> Iterator[None]:
    """For the duration (a run of the script, under its :class:`ScriptEffects`): DCP's save
    and load functions stand in, now where DCP is loaded, else as soon as the script loads
    it; ``patch`` (the run's patcher) undoes them with the run's other patches."""
    with on_each_load((PACKAGE,), lambda package: _patch(package, patch)):
        yield


def _patch(package: ModuleType, patch: Patch) -> None:
    for name, defined_in in _DEFINED_IN.items():
        module = sys.modules.get(defined_in)
        original = getattr(module, name, None)
        if module is None or original is None:
            continue
        if not getattr(original, "dpprof_stand_in", False):
            _ORIGINALS.setdefault(name, original)
        wrapper = _WRAPPERS[name]
        patch(module, name, wrapper)
        if getattr(package, name, None) is _ORIGINALS.get(name):
            patch(package, name, wrapper)


def _arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, as torch's function would take them (empty where it
    would refuse them: torch's own call then says why)."""
    try:
        return dict(inspect.signature(_ORIGINALS[name]).bind(*args, **kwargs).arguments)
    except TypeError:
        return {}


def _folder(arguments: dict[str, Any], storage: str) -> str | None:
    """The checkpoint's folder: its ``checkpoint_id`` where that is a path, else the path of
    the storage writer or reader (a ``FileSystemWriter``'s); None for any other storage."""
    where = arguments.get("checkpoint_id")
    if where is None:
        where = getattr(arguments.get(storage), "path", None)
    if isinstance(where, (str, os.PathLike)) and "://" not in os.fspath(where):
        return os.fspath(where)
    return None


def _stateful(x: Any) -> bool:
    from torch.distributed.checkpoint.stateful import Stateful

    return isinstance(x, Stateful)


def _skeleton(obj: Any) -> Any:
    """``obj`` with each tensor (a DTensor too) as a :class:`SavedTensor`."""
    if isinstance(obj, torch.Tensor):
        return SavedTensor(tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


def _saver(name: str) -> Callable[..., Any]:
    def save(*args: Any, **kwargs: Any) -> Any:
        effects = active()
        arguments = _arguments(name, args, kwargs)
        state_dict = arguments.get("state_dict")
        if effects is None or not isinstance(state_dict, dict):
            return _ORIGINALS[name](*args, **kwargs)
        # what DCP saves: save and async_save take each Stateful object as its
        # state_dict() (what it holds may be reachable from there alone), once: torch's own
        # save is handed the state dicts made here
        saved = ({k: v.state_dict() if _stateful(v) else v for k, v in state_dict.items()}
                 if name in _TAKE_STATEFUL else state_dict)
        if not effects.holds_emulated(saved):
            return _ORIGINALS[name](**{**arguments, "state_dict": saved})
        _write(effects, name, arguments, saved)
        from torch.distributed.checkpoint.metadata import Metadata

        # the storage layout is the ranks' agreed plan, which no rank alone knows
        metadata = Metadata(state_dict_metadata={})
        if name == "async_save":
            done: Future[Any] = Future()
            done.set_result(metadata)
            return done
        return metadata

    save.__name__ = name
    save.dpprof_stand_in = True  # type: ignore[attr-defined]
    return save


def _write(effects: ScriptEffects, name: str, arguments: dict[str, Any],
           saved: dict[str, Any]) -> None:
    """The stand-in of ``saved`` (the state dict, its Stateful objects as their state
    dicts) written as the checkpoint's ``.metadata``, where the checkpoint has a folder."""
    folder = _folder(arguments, "storage_writer")
    effects.count(effects.stand_ins, f"{PACKAGE}.{name}", folder or "checkpoint")
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)  # as DCP's FileSystemWriter makes it
    with open(os.path.join(folder, METADATA_FILE), "wb") as out:
        out.write(effects.stand_in_bytes({k: _skeleton(v) for k, v in saved.items()}))


def _loader(name: str) -> Callable[..., Any]:
    def load(*args: Any, **kwargs: Any) -> Any:
        effects = active()
        arguments = _arguments(name, args, kwargs)
        state_dict = arguments.get("state_dict")
        folder = _folder(arguments, "storage_reader")
        if effects is None or folder is None or not isinstance(state_dict, dict):
            return _ORIGINALS[name](*args, **kwargs)
        # by the checkpoint, not the state dict: one the run stood in is read back here,
        # whatever it is loaded into (torch's own reader cannot read it)
        body = read_stand_in(os.path.join(folder, METADATA_FILE))
        if body is None:  # the user's real checkpoint, or none: torch's own load says
            return _ORIGINALS[name](*args, **kwargs)
        effects.count(effects.read_back, f"{PACKAGE}.{name}", folder)
        saved = stand_in_object(body, None)
        for key in sorted(state_dict):
            elem = state_dict[key]
            if _stateful(elem):
                elem.load_state_dict(_loaded(elem.state_dict(), saved, key))
            else:
                state_dict[key] = _loaded(elem, saved, key)
        return None

    load.__name__ = name
    load.dpprof_stand_in = True  # type: ignore[attr-defined]
    return load


def _loaded(target: Any, saved: Any, key: Any, path: str = "") -> Any:
    """``target`` (the state dict's value under ``key``) as DCP's load leaves it: tensors
    in place, every other value the saved one. ``saved``: the checkpoint's container that
    holds ``key`` (None where its stand-in could not keep the state dict: nothing to read
    back); ``path``: the keys above, for the error of a key the checkpoint lacks."""
    if saved is None:
        return target
    fqn = f"{path}.{key}" if path else str(key)
    if not isinstance(saved, dict) or key not in saved:
        raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
    value = saved[key]
    if isinstance(target, torch.Tensor):
        return target
    if isinstance(target, dict) and isinstance(value, dict):
        for k in list(target):
            target[k] = _loaded(target[k], value, k, fqn)
        return target
    if (isinstance(target, list) and isinstance(value, list) and len(target) == len(value)
            and any(isinstance(v, torch.Tensor) for v in target)):
        target[:] = [_loaded(t, dict(enumerate(value)), i, fqn) for i, t in enumerate(target)]
        return target
    return value


_WRAPPERS = {**{name: _saver(name) for name in _SAVERS},
             **{name: _loader(name) for name in _LOADERS}}
