"""What the emulation answers for a script under ``dpprof run`` besides its files (which
the seal keeps: :mod:`dpprof.script.seal`): checkpoints of emulated tensors, warnings that
name the script's line, and what an alternative's run prints.

* **A checkpoint of emulated tensors is a stand-in the script can load back.** ``torch.save``
  of anything that holds a tensor of a virtual GPU (meta bytes with no values, or a host copy
  that stands in for one), and safetensors' ``save_file`` / ``save_model`` of such tensors,
  write a stand-in file instead (into the run's overlay, as every write): a marker
  (:data:`~dpprof.script.seal.STAND_IN_MAGIC`) and the object pickled with each tensor as its
  geometry. ``torch.load``, safetensors' ``load_file`` and ``safe_open`` of such a file
  (from a path, a buffer, a gzip stream; after a rename or a copy: the bytes travel) give the
  tensors back where ``map_location`` / ``device`` puts them, as on a GPU the script reads
  back what it saved. Saving real values of the GPU would need them; writing the host's
  zeros for a large model would need its whole size in host memory.
* ``torch.save`` to a path, and ``torch.load`` of one, go through Python's file objects
  (the seal's): torch's own writer opens the path in C++.
* **A warning** torch raises for the script's call names the script's line, not dpprof's
  wrapper.
* **An alternative's run prints nothing**: its standard output and error are kept (their
  tail, for its error message), not shown; so a log line is printed once, by the run as
  written.

The wrappers stay correct when a library binds them by name during one run
(transformers' ``from safetensors.torch import save_file``) and calls them in a later one or
after the emulation: they consult the effects active then, or call the original. A module
imported *before* the run that bound the original by name (``from torch import save``,
transformers imported first) has that name patched too, for the run.
"""

from __future__ import annotations

import collections
import importlib.util
import io
import os
import pickle
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpprof.emulator.call_sites import caller_site, in_dpprof
from dpprof.emulator.identity import storage_key
from dpprof.emulator.patcher import Patcher
from dpprof.script import seal
from dpprof.script.bound_names import patch_bound_names
from dpprof.script.seal import STAND_IN_MAGIC

IsEmulated = Callable[[torch.Tensor], bool]

_OUTPUT_TAIL_BYTES = 8192  # what an alternative's run printed, kept for its error message
_MAX_WALK = 100_000  # objects looked at in one saved object (a checkpoint's nested state)
# an object's identity as a key, for what is asked of every object of a checkpoint: object's
# own hash (its address, the bits rotated: distinct for distinct live objects), not id(),
# an audited event that the seal's audit hook would be called for (dpprof.emulator.identity)
_identity = object.__hash__
# the line after the marker: what the file is, for whoever opens it
_EXPLAINED = (b"A stand-in written by dpprof run: the tensors' shapes, no values (they were "
              b"emulated on virtual GPUs).\n")


class _Silenced(io.TextIOBase):
    """Standard output or error of an alternative's run: kept (its tail), not shown. Rich
    writes its progress bar to the stream it proxies (``rich_proxied_file``), so the bar
    still shows while the script's prints do not."""

    def __init__(self, real: Any, tail: collections.deque[str]) -> None:
        # under a live progress bar, sys.stdout is rich's proxy of the terminal: the bar
        # writes to the terminal itself
        self.rich_proxied_file = getattr(real, "rich_proxied_file", real)
        self._tail = tail

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._tail.append(s)
        while sum(map(len, self._tail)) > 4 * _OUTPUT_TAIL_BYTES and len(self._tail) > 1:
            self._tail.popleft()
        return len(s)

    def isatty(self) -> bool:
        return False


class _ScriptStream:
    """``sys.stdout`` or ``sys.stderr`` as every run of the script sees it: one object for
    the process, which writes where the current run's output goes (shown, or an
    alternative's kept tail). An installed package the script imports stays imported for
    the next runs, with the stream it took in the first (a logging handler made at its
    import): through this object, an alternative's output through it is kept too."""

    def __init__(self) -> None:
        self.target: Any = None

    def write(self, s: str) -> int:
        return self.target.write(s)  # type: ignore[no-any-return]

    def flush(self) -> None:
        self.target.flush()

    def close(self) -> None:
        # the script closing its standard output (open-reid's Logger, copied into
        # torchreid, closes the stream it wraps when collected) ends its process's, not
        # dpprof's, which still shows the report
        self.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)  # isatty, fileno, encoding: the target's


_SCRIPT_STREAMS = {"stdout": _ScriptStream(), "stderr": _ScriptStream()}


class ScriptEffects:
    """The rules of the module for one run of the script; a context manager.

    ``is_emulated`` tells a tensor of a virtual GPU (or a host stand-in for one);
    ``silenced``: an alternative's run, whose output is kept, not shown."""

    def __init__(self, is_emulated: IsEmulated, silenced: bool = False) -> None:
        self.is_emulated = is_emulated
        self.silenced = silenced
        self.stand_ins: dict[str, int] = {}  # "torch.save ckpt.pt at train.py:40" -> times
        self.read_back: dict[str, int] = {}  # the same, for the loads of a stand-in
        self._patcher = Patcher()
        self._originals: dict[str, Any] = {}
        self._tail: collections.deque[str] = collections.deque()
        self._previous: ScriptEffects | None = None
        self._targets: dict[str, Any] = {}  # each stream's target before this run

    # ---- activation ------------------------------------------------------------------

    def __enter__(self) -> ScriptEffects:
        global _ACTIVE
        self._previous, _ACTIVE = _ACTIVE, self
        p = self._patcher.patch
        wrappers: dict[int, Any] = {}
        for key, owner, attr, wrapper in self._writers():
            self._originals[key] = getattr(owner, attr)
            wrappers[id(_IMPORTED.get(key, self._originals[key]))] = wrapper
            p(owner, attr, wrapper)
        patch_bound_names(self._patcher, wrappers)
        self._originals["warnings.showwarning"] = warnings.showwarning
        p(warnings, "showwarning", _showwarning)
        for name, stream in _SCRIPT_STREAMS.items():
            current = getattr(sys, name)
            shown = stream.target if current is stream else current  # within another run
            self._targets[name] = shown
            stream.target = _Silenced(shown, self._tail) if self.silenced else shown
            p(sys, name, stream)
        return self

    def _writers(self) -> list[tuple[str, Any, str, Any]]:
        out: list[tuple[str, Any, str, Any]] = [
            ("torch.save", torch, "save", _torch_save),
            ("torch.load", torch, "load", _torch_load),
        ]
        if importlib.util.find_spec("safetensors") is not None:
            import safetensors.torch as st

            out += [("safetensors.save_file", st, "save_file", _safetensors_save("save_file")),
                    ("safetensors.save_model", st, "save_model",
                     _safetensors_save("save_model")),
                    ("safetensors.load_file", st, "load_file", _safetensors_load),
                    ("safetensors.safe_open", st, "safe_open", _safe_open)]
            import safetensors

            out.append(("safetensors.safe_open", safetensors, "safe_open", _safe_open))
        return out

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        self._patcher.restore()
        for name, stream in _SCRIPT_STREAMS.items():
            # after the last run, what a library kept writes where the output went before
            stream.target = self._targets[name]
        _ACTIVE = self._previous

    @property
    def output_tail(self) -> str:
        """The end of what an alternative's run printed."""
        return "".join(self._tail)[-_OUTPUT_TAIL_BYTES:]

    def count(self, table: dict[str, int], what: str, target: Any) -> None:
        key = f"{what} {_name(target)} at {_short_site(caller_site())}"
        table[key] = table.get(key, 0) + 1

    # ---- what is emulated ------------------------------------------------------------

    def holds_emulated(self, obj: Any) -> bool:
        """Whether ``obj`` (a checkpoint: nested dicts, lists, modules, optimizers, tensors,
        arrays) holds a tensor of a virtual GPU or a stand-in for one."""
        seen: set[int] = set()
        todo = [obj]
        while todo and len(seen) < _MAX_WALK:
            x = todo.pop()
            key = _identity(x)
            if key in seen or isinstance(x, (str, bytes, int, float, bool, type(None))):
                continue
            seen.add(key)
            if isinstance(x, torch.Tensor):
                if self.is_emulated(x):
                    return True
                continue
            storage = _untyped(x)
            if storage is not None:  # pickle of a tensor saves its storage by torch.save
                if self.is_emulated(_over(storage)):
                    return True
                continue
            behind = _tensor_behind(x)
            if behind is not None:
                if self.is_emulated(behind):
                    return True
                continue
            if isinstance(x, torch.nn.Module):
                todo.extend(x.state_dict(keep_vars=True).values())
            elif isinstance(x, dict):
                todo.extend(x.values())
            elif isinstance(x, (list, tuple, set, frozenset)):
                todo.extend(x)
            elif hasattr(x, "__dict__") and not isinstance(x, type):
                todo.extend(vars(x).values())
        return False

    def stand_in_bytes(self, obj: Any) -> bytes:
        """The stand-in file of ``obj``: the marker, a line saying what it is, and ``obj``
        pickled with its emulated tensors as their geometry (:class:`_SkeletonPickler`);
        an object pickle refuses is held as None."""
        buf = io.BytesIO()
        buf.write(STAND_IN_MAGIC + _EXPLAINED)
        try:
            _SkeletonPickler(buf, self.is_emulated).dump(obj)
        except Exception:  # what cannot be pickled cannot be loaded back either
            buf.seek(len(STAND_IN_MAGIC) + len(_EXPLAINED))
            buf.truncate()
            pickle.dump(None, buf)
        return buf.getvalue()


_ACTIVE: ScriptEffects | None = None


def active() -> ScriptEffects | None:
    """The effects of the run now under way, if any."""
    return _ACTIVE


def _name(target: Any) -> str:
    if isinstance(target, (str, os.PathLike)):
        return os.path.basename(os.fsdecode(os.fspath(target))) or str(target)
    name = getattr(target, "name", None)
    return os.path.basename(name) if isinstance(name, str) else type(target).__name__


def _short_site(site: str) -> str:
    path, _, line = site.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else site


def _tensor_behind(x: Any) -> torch.Tensor | None:
    """The tensor whose memory a NumPy array (``tensor.numpy()``, a slice of one) shows."""
    if type(x).__module__ != "numpy":
        return None
    for _ in range(64):
        x = getattr(x, "base", None)
        if x is None or isinstance(x, torch.Tensor):
            return x
    return None


# torch's own writer and reader, as modules bound them at import: a run may already have
# put a wrapper of its own in torch's place (the virtual CUDA's torch.load, new each run),
# which no module binds, and whose new id made every module be read again (~25 ms a run)
_IMPORTED = {"torch.save": torch.save, "torch.load": torch.load}


def _original(name: str) -> Any:
    """The function a wrapper stands for: as the active effects found it, else (no run under
    way, the patches undone) the module's own."""
    effects = _ACTIVE
    if effects is not None and name in effects._originals:
        return effects._originals[name]
    if name.startswith("safetensors."):
        import safetensors.torch as st

        return getattr(st, name.partition(".")[2])
    return getattr(torch, name.partition(".")[2])


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, bytes, os.PathLike))


def _write_stand_in(effects: ScriptEffects, obj: Any, f: Any, what: str) -> None:
    data = effects.stand_in_bytes(obj)
    effects.count(effects.stand_ins, what, f)
    if _is_path(f):
        with open(f, "wb") as out:
            out.write(data)
    else:
        f.write(data)


def _torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    effects = _ACTIVE
    if effects is not None:
        if effects.holds_emulated(obj):
            _write_stand_in(effects, obj, f, "torch.save")
            return
        if _is_path(f):  # through Python's file (the seal's), not torch's C++ writer
            with open(f, "wb") as out:
                _original("torch.save")(obj, out, *args, **kwargs)
            return
    _original("torch.save")(obj, f, *args, **kwargs)


def read_stand_in(f: Any) -> bytes | None:
    """The pickled object of a stand-in file (a path or a readable file object at its
    position), or None where ``f`` is not one (a file object is left where it was)."""
    if _is_path(f):
        try:
            with open(f, "rb") as src:
                head = src.read(len(STAND_IN_MAGIC))
                return src.read() if head == STAND_IN_MAGIC else None
        except OSError:
            return None
    read = getattr(f, "read", None)
    if read is None:
        return None
    try:
        pos = f.tell()
        head = read(len(STAND_IN_MAGIC))
        if head == STAND_IN_MAGIC:
            return bytes(read())
        f.seek(pos)
    except (OSError, ValueError, AttributeError):
        return None
    return None


def stand_in_object(body: bytes, map_location: Any) -> Any:
    """What a stand-in file holds (after its explaining line), its tensors placed as
    ``map_location`` says."""
    _, _, pickled = body.partition(b"\n")
    return _rebuilt(pickled, map_location)


def _torch_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    effects = _ACTIVE
    if effects is None:
        return _original("torch.load")(f, map_location, *args, **kwargs)
    body = read_stand_in(f)
    if body is not None:  # the run saved it a moment ago: read back as on a GPU
        effects.count(effects.read_back, "torch.load", f)
        return stand_in_object(body, map_location)
    sealed = seal.active()
    if sealed is not None and _is_path(f):  # mmap=True opens the path in C++
        f = sealed.read_path(f)
    return _original("torch.load")(f, map_location, *args, **kwargs)


def _safetensors_save(name: str) -> Callable[..., Any]:
    def save(obj: Any, filename: Any, *args: Any, **kwargs: Any) -> Any:
        effects = _ACTIVE
        if effects is not None and effects.holds_emulated(obj):
            tensors = obj.state_dict() if isinstance(obj, nn.Module) else obj
            _write_stand_in(effects, dict(tensors), filename, f"safetensors.{name}")
            return None
        return _original(f"safetensors.{name}")(obj, filename, *args, **kwargs)

    save.__name__ = name
    return save


def _safetensors_load(filename: Any, device: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
    effects = _ACTIVE
    body = read_stand_in(filename) if effects is not None else None
    if effects is None or body is None:
        return _original("safetensors.load_file")(filename, device, *args, **kwargs)
    effects.count(effects.read_back, "safetensors.load_file", filename)
    return stand_in_object(body, device)


class StandInSafeOpen:
    """What ``safe_open`` gives for a stand-in file: its tensors by name, on ``device``."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self._tensors = tensors

    def __enter__(self) -> StandInSafeOpen:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self._tensors)

    def offset_keys(self) -> list[str]:
        return list(self._tensors)

    def metadata(self) -> dict[str, str]:
        return {"format": "pt"}

    def get_tensor(self, name: str) -> Any:
        return self._tensors[name]

    def get_slice(self, name: str) -> Any:
        return self._tensors[name]


def _safe_open(filename: Any, framework: Any = "pt", device: Any = "cpu", *args: Any,
               **kwargs: Any) -> Any:
    effects = _ACTIVE
    body = read_stand_in(filename) if effects is not None else None
    if effects is None or body is None:
        return _original("safetensors.safe_open")(filename, framework, device, *args, **kwargs)
    effects.count(effects.read_back, "safe_open", filename)
    tensors = stand_in_object(body, device)
    return StandInSafeOpen(tensors if isinstance(tensors, dict) else {})


class _SkeletonPickler(pickle.Pickler):
    """Pickles a checkpoint with each tensor of a virtual GPU (or host stand-in) as its
    geometry, its storage as a key: no bytes, nothing allocated."""

    def __init__(self, file: Any, is_emulated: IsEmulated) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.is_emulated = is_emulated
        self.storages: dict[int, int] = {}

    def reducer_override(self, obj: Any) -> Any:
        storage = _untyped(obj)
        if storage is not None and self.is_emulated(_over(storage)):
            return (_rebuild_storage, (int(storage.nbytes()), str(_over(storage).device),
                                       isinstance(obj, torch.TypedStorage),
                                       getattr(obj, "dtype", torch.uint8)))
        if (not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, nn.Parameter)
                or not self.is_emulated(obj)):
            return NotImplemented
        st = obj.untyped_storage()
        key = self.storages.setdefault(storage_key(st), len(self.storages))
        return (_rebuild_tensor, (key, int(st.nbytes()), str(obj.device), obj.dtype,
                                  tuple(obj.shape), tuple(obj.stride()),
                                  int(obj.storage_offset()), obj.requires_grad,
                                  isinstance(obj, nn.Parameter)))


@dataclass
class _Loading:
    map_location: Any
    storages: dict[int, torch.Tensor] = field(default_factory=dict)

    def target(self, location: str) -> Any:
        """Where ``torch.load`` puts a storage saved at ``location``."""
        where = self.map_location
        if isinstance(where, dict):
            return where.get(location, location)
        if isinstance(where, int) and not isinstance(where, bool):
            return torch.device("cuda", where)
        if where is None or callable(where):
            return location
        return where


_LOADING: list[_Loading] = []  # the loads under way (the unpickler calls _rebuild_tensor)


def _rebuilt(skeleton: bytes, map_location: Any) -> Any:
    _LOADING.append(_Loading(map_location))
    try:
        return pickle.loads(skeleton)
    finally:
        _LOADING.pop()


def _rebuild_tensor(key: int, nbytes: int, location: str, dtype: torch.dtype,
                    shape: tuple[int, ...], stride: tuple[int, ...], offset: int,
                    requires_grad: bool, parameter: bool) -> torch.Tensor:
    """A tensor as ``torch.load`` makes it: each storage once, where it is mapped to (a
    virtual GPU's bytes counted there; on the host, a stand-in of zeros)."""
    loading = _LOADING[-1]
    flat = loading.storages.get(key)
    if flat is None:
        where = torch.device(loading.target(location))
        if where.type == "cpu":
            from dpprof.emulator.virtual_cuda import active as active_cuda

            vc = active_cuda()
            host = torch.empty(nbytes, dtype=torch.uint8)
            flat = vc.rt.host_stand_in(host) if vc is not None else host.zero_()
        else:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=where)
        loading.storages[key] = flat
    with torch.no_grad():
        t = flat.view(dtype).as_strided(shape, stride, offset // 1)
    if parameter:
        return nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)


def _untyped(x: Any) -> Any:
    """The untyped storage of a storage object (typed or not), else None."""
    if isinstance(x, torch.TypedStorage):
        return x._untyped_storage
    return x if isinstance(x, torch.UntypedStorage) else None


def _over(storage: Any) -> torch.Tensor:
    """A tensor over ``storage`` (what the emulation tells a virtual GPU's bytes by)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _rebuild_storage(nbytes: int, location: str, typed: bool, dtype: torch.dtype) -> Any:
    """A storage as ``torch.load`` of a pickled one makes it (``pickle.dump`` of a tensor),
    where it is mapped to."""
    flat = _rebuild_tensor(id(object()), nbytes, location, torch.uint8, (nbytes,), (1,), 0,
                           False, False)
    st = flat.untyped_storage()
    return torch.TypedStorage(wrap_storage=st, dtype=dtype, _internal=True) if typed else st


def _showwarning(message: Warning | str, category: type[Warning], filename: str,
                 lineno: int, file: Any = None, line: str | None = None) -> None:
    """A warning that torch raised for the script's call (``warnings.warn(stacklevel=2)``
    in ``torch.load``) names the caller's line, which is dpprof's wrapper when dpprof stands
    between them: the script's line instead, as under plain Python."""
    if in_dpprof(filename):
        path, _, num = caller_site(also_skip=(warnings.__file__, __file__)).rpartition(":")
        if path and num.isdigit():
            filename, lineno, line = path, int(num), None
    effects = _ACTIVE
    show = (effects._originals["warnings.showwarning"] if effects is not None
            else warnings.showwarning)
    show(message, category, filename, lineno, file, line)
