"""What a script under ``dpprof run`` does outside its own process: files and output.

Two rules hold while it runs:

* **Emulated tensors never reach the user's files.** ``torch.save``, safetensors'
  ``save_file`` / ``save_model`` and ``numpy.save`` / ``savez`` of anything that holds a tensor
  of a virtual GPU (meta bytes with no values, or CPU bytes the emulation computed), or a
  host copy that stands in for one, and Pillow's ``Image.save`` of an image made from such
  an array (torchvision's ``save_image``: dcgan's and the VAE's samples), write nothing:
  the call returns as if it had written, and the report counts it with the script's line.
  Over meta tensors ``torch.save`` would otherwise open (truncate) the file and only then
  fail on the first storage. A script that opens the file itself (``with open(path, "wb")
  as f: torch.save(model, f)``) has truncated it before the save is called: what a file
  held when the run opened it for binary writing is kept aside, and a skipped save into
  that file object puts it back (a file the open created is removed), so the file is as
  it was.
* **An alternative run writes nothing the user can see.** The paired alternatives (DDP in
  place, the loss inside forward) run the same script again; every file it opens for
  writing, every folder it makes, every checkpoint it saves goes under a private folder
  (reads of a path it wrote there read it back), and its standard output and error are kept,
  not shown. So a log or a TensorBoard event file is written once, by the run as written.

The wrappers stay correct when a library binds them by name during one run (transformers'
``from safetensors.torch import save_file``) and calls them in a later one or after the
emulation: they consult the effects active then, or call the original. A module imported
*before* the run that bound the original by name (``from torch import save``, transformers
imported first) has that name patched too, for the run.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import importlib.util
import io
import itertools
import os
import pickle
import shutil
import sys
import tempfile
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpprof.emulator.cuda_devices import caller_site, in_dpprof
from dpprof.emulator.patcher import Patcher

IsEmulated = Callable[[torch.Tensor], bool]

_WRITE_MODES = frozenset("wax+")
_OUTPUT_TAIL_BYTES = 8192  # what an alternative's run printed, kept for its error message
_MAX_WALK = 100_000  # objects looked at in one saved object (a checkpoint's nested state)


@dataclass
class Writes:
    """What the effects held back, by what and where (``"torch.save ckpt.pt at
    train.py:40"`` -> times)."""

    skipped: dict[str, int] = field(default_factory=dict)  # emulated values, not written
    redirected: dict[str, int] = field(default_factory=dict)  # an alternative's own writes
    # folders the run made for skipped writes alone, removed after it (empty, as before)
    removed_folders: list[str] = field(default_factory=list)
    # torch.load of a path whose save was skipped: answered with what the run saved there
    read_back: dict[str, int] = field(default_factory=dict)

    def add(self, table: dict[str, int], what: str, target: Any) -> None:
        key = f"{what} {_name(target)} at {_short_site(caller_site())}"
        table[key] = table.get(key, 0) + 1


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
        return len(s)

    def isatty(self) -> bool:
        return False


class ScriptEffects:
    """The rules of the module for one run of the script; a context manager.

    ``is_emulated`` tells a tensor of a virtual GPU (or a host stand-in for one);
    ``sandbox``: the private folder of an alternative's run (None: the run as written,
    whose writes of host data are the script's own)."""

    def __init__(self, is_emulated: IsEmulated, sandbox: Path | None = None) -> None:
        self.is_emulated = is_emulated
        self.sandbox = sandbox
        self.writes = Writes()
        self._patcher = Patcher()
        self._originals: dict[str, Any] = {}
        self._moved: dict[str, str] = {}  # a path the script wrote -> where it went
        self._made: list[str] = []  # folders the run as written made, parents first
        self._skipped_paths: list[str] = []  # absolute paths of the writes skipped
        # absolute path -> what a skipped torch.save held there, its tensors as shapes
        # (:func:`_skeleton`), for the run's own torch.load of that path
        self._held: dict[str, bytes] = {}
        self._tail: collections.deque[str] = collections.deque()
        self._previous: ScriptEffects | None = None
        # id(file object) -> (the object, its path, a copy of what the file held before the
        # open truncated it, or None where the open created the file)
        self._truncated: dict[int, tuple[weakref.ref[Any], str, str | None]] = {}
        self._kept_dir: str | None = None
        self._kept_names = itertools.count()
        # Pillow images made from emulated arrays (Image.fromarray of a stand-in host copy),
        # by id: an Image compares by value and has no hash
        self._emulated_images: dict[int, weakref.ref[Any]] = {}

    # ---- activation ------------------------------------------------------------------

    def __enter__(self) -> ScriptEffects:
        global _ACTIVE
        self._previous, _ACTIVE = _ACTIVE, self
        p = self._patcher.patch
        self._originals["torch.save"] = torch.save
        p(torch, "save", _torch_save)
        self._originals["torch.load"] = torch.load
        p(torch, "load", _torch_load)
        for name in ("remove", "unlink"):
            self._originals[f"os.{name}"] = getattr(os, name)
            p(os, name, _remover(name))
        np = sys.modules.get("numpy")
        if np is not None:
            for name in ("save", "savez", "savez_compressed"):
                self._originals[f"numpy.{name}"] = getattr(np, name)
                p(np, name, _numpy_writer(name))
        if importlib.util.find_spec("safetensors") is not None:
            st = importlib.import_module("safetensors.torch")
            for name in ("save_file", "save_model"):
                self._originals[f"safetensors.{name}"] = getattr(st, name)
                p(st, name, _safetensors_writer(name))
        if importlib.util.find_spec("PIL") is not None:
            image = importlib.import_module("PIL.Image")
            self._originals["PIL.fromarray"] = image.fromarray
            self._originals["PIL.save"] = image.Image.save
            p(image, "fromarray", _pil_fromarray)
            p(image.Image, "save", _pil_save)
        self._patch_bound_names()
        self._originals["warnings.showwarning"] = warnings.showwarning
        p(warnings, "showwarning", _showwarning)
        self._originals["open"] = builtins.open
        p(builtins, "open", _open)
        p(io, "open", _open)
        if self.sandbox is not None:
            self._originals["os.makedirs"] = os.makedirs
            self._originals["os.mkdir"] = os.mkdir
            p(os, "makedirs", _makedirs)
            p(os, "mkdir", _mkdir)
            p(sys, "stdout", _Silenced(sys.stdout, self._tail))
            p(sys, "stderr", _Silenced(sys.stderr, self._tail))
        else:
            # the folders it makes are followed: one made only for a checkpoint that is
            # not written is removed after the run (left empty, it reads as a checkpoint
            # folder to the script's next run, which then fails to load it)
            self._originals["os.makedirs"] = os.makedirs
            self._originals["os.mkdir"] = os.mkdir
            p(os, "makedirs", _makedirs)
            p(os, "mkdir", _mkdir)
        return self

    def _patch_bound_names(self) -> None:
        """Modules already imported that hold a writer under a name of their own (``from
        torch import save``; transformers' ``safe_save_file``): that name, patched too. A
        module is read once per process (names are bound at import): thousands of modules
        would otherwise cost each run ~25 ms."""
        wrappers = {id(_IMPORTED.get(key, self._originals[key])): getattr(owner, attr)
                    for key, owner, attr in self._writer_owners()}
        wanted = frozenset(wrappers)
        for module in list(sys.modules.values()):
            names = getattr(module, "__dict__", None)
            if not isinstance(names, dict):
                continue
            seen = _BOUND_NAMES.get(id(module))
            if seen is None or seen[0] is not module or not wanted <= seen[1]:
                hits = [attr for attr, value in list(names.items())
                        if id(value) in wanted and not attr.startswith("__")]
                seen = _BOUND_NAMES[id(module)] = (module, wanted, hits)
            for attr in seen[2]:
                wrapper = wrappers.get(id(names.get(attr)))
                if wrapper is not None:
                    self._patcher.patch(module, attr, wrapper)

    def _writer_owners(self) -> list[tuple[str, Any, str]]:
        out: list[tuple[str, Any, str]] = []
        for key in self._originals:
            owner, _, attr = key.rpartition(".")
            module = {"torch": torch, "numpy": sys.modules.get("numpy"),
                      "safetensors": sys.modules.get("safetensors.torch")}.get(owner)
            if module is not None:
                out.append((key, module, attr))
        return out

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        self._patcher.restore()
        _ACTIVE = self._previous
        self._truncated.clear()
        if self._kept_dir is not None:
            shutil.rmtree(self._kept_dir, ignore_errors=True)
            self._kept_dir = None
        self._remove_folders_of_skipped_writes()

    # ---- folders of the run as written -------------------------------------------------

    def skip(self, what: str, target: Any, obj: Any = None) -> None:
        """A write of emulated values not done: counted, a file the run's own ``open``
        truncated for it put back (:meth:`put_back`), and its path remembered (with
        ``obj``'s skeleton, for a ``torch.save`` the script may load back)."""
        self.writes.add(self.writes.skipped, what, target)
        self.put_back(target)
        path = _absolute(target)
        if path is not None:
            self._skipped_paths.append(path)
            if what == "torch.save":
                skeleton = _skeleton(obj, self.is_emulated)
                if skeleton is not None:
                    self._held[path] = skeleton
                else:
                    self._held.pop(path, None)

    def held(self, f: Any) -> bytes | None:
        """What a skipped ``torch.save`` left for the path ``f``, if any."""
        path = _absolute(f)
        return self._held.get(path) if path is not None else None

    def forget(self, f: Any) -> bool:
        """The script removes the file ``f``: True where it was a skipped save's (nothing
        on disk of the run's to remove; a file of the user's there stays)."""
        path = _absolute(f)
        return path is not None and self._held.pop(path, None) is not None

    def made(self, before: list[str]) -> None:
        """The folders of ``before`` (absent before a call that makes folders) that exist
        now: the run made them."""
        self._made.extend(d for d in before if os.path.isdir(d))

    def _remove_folders_of_skipped_writes(self) -> None:
        """The folders the run made that hold nothing but would have held a skipped write,
        removed, deepest first (a folder with anything in it stays)."""
        for folder in reversed(self._made):
            inside = folder + os.sep
            if not any(p.startswith(inside) for p in self._skipped_paths):
                continue
            try:
                os.rmdir(folder)  # only an empty folder
            except OSError:
                continue
            self.writes.removed_folders.append(folder)

    @property
    def output_tail(self) -> str:
        """The end of what an alternative's run printed."""
        text = "".join(self._tail)
        return text[-_OUTPUT_TAIL_BYTES:]

    def trim_output(self) -> None:
        while sum(map(len, self._tail)) > 4 * _OUTPUT_TAIL_BYTES and len(self._tail) > 1:
            self._tail.popleft()

    # ---- what is emulated ------------------------------------------------------------

    def holds_emulated(self, obj: Any) -> bool:
        """Whether ``obj`` (a checkpoint: nested dicts, lists, modules, optimizers, tensors,
        arrays) holds a tensor of a virtual GPU or a stand-in for one."""
        seen: set[int] = set()
        todo = [obj]
        while todo and len(seen) < _MAX_WALK:
            x = todo.pop()
            if id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None))):
                continue
            seen.add(id(x))
            if isinstance(x, torch.Tensor):
                if self.is_emulated(x):
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

    def note_emulated_image(self, image: Any) -> None:
        key = id(image)
        self._emulated_images[key] = weakref.ref(
            image, lambda _: self._emulated_images.pop(key, None))

    def is_emulated_image(self, image: Any) -> bool:
        ref = self._emulated_images.get(id(image))
        return ref is not None and ref() is image

    # ---- files the script opens for writing itself -------------------------------------

    def open_truncating(self, file: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
        """``open(file, "wb")`` in the run as written: what the file holds is copied aside
        first, for :meth:`put_back`."""
        opener = self._originals["open"]
        path = _absolute(file)
        if path is None:  # a file descriptor: not the script's file by name
            return opener(file, mode, *args, **kwargs)
        existed = os.path.isfile(path)
        kept: str | None = None
        if existed:
            if self._kept_dir is None:
                self._kept_dir = tempfile.mkdtemp(prefix="dpprof-kept-")
            kept = os.path.join(self._kept_dir, str(next(self._kept_names)))
            with opener(path, "rb") as src, opener(kept, "wb") as dst:
                shutil.copyfileobj(src, dst)
        elif os.path.lexists(path):  # not a regular file (a FIFO, a device): as it is
            return opener(file, mode, *args, **kwargs)
        f = opener(file, mode, *args, **kwargs)
        key = id(f)
        self._truncated[key] = (weakref.ref(f), path, kept)
        weakref.finalize(f, self._forget, key, kept)
        return f

    def _forget(self, key: int, kept: str | None) -> None:
        self._truncated.pop(key, None)
        if kept is not None:
            with contextlib.suppress(OSError):
                os.remove(kept)

    def put_back(self, f: Any) -> None:
        """A write into ``f`` was skipped: where the run's own ``open`` truncated (or
        created) its file and nothing was written since, the file is made what it was."""
        entry = self._truncated.get(id(f))
        opened = entry[0]() if entry is not None else None
        if entry is None or opened is None or opened is not f:
            return
        _, path, kept = entry
        try:
            if opened.tell() != 0:
                return  # the script wrote into it too: that part is its own
            if kept is None:
                os.remove(path)
            else:
                with self._originals["open"](kept, "rb") as src:
                    shutil.copyfileobj(src, opened)
                opened.flush()
        except (OSError, ValueError):  # closed, unseekable, removed meanwhile: left as is
            return

    # ---- paths of an alternative's run -------------------------------------------------

    def redirect(self, path: Any, writing: bool) -> Any:
        """Where an alternative's run reads or writes ``path``."""
        if self.sandbox is None or isinstance(path, int):
            return path
        try:
            real = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return path
        if real.startswith(str(self.sandbox) + os.sep):
            return path  # os.makedirs making the parents of a path already moved
        if _process_channel(real):
            return path
        moved = self._moved.get(real)
        if moved is None and writing:
            moved = str(self.sandbox / real.lstrip(os.sep))
            self._moved[real] = moved
            self._originals["os.makedirs"](os.path.dirname(moved), exist_ok=True)
            self.writes.add(self.writes.redirected, "write", path)
        return moved if moved is not None else path


def _process_channel(path: str) -> bool:
    """Whether ``path`` is in a folder ``multiprocessing`` makes for the sockets its processes
    talk through (``util.get_temp_dir``: a fresh ``pymp-*`` under the temporary folder; a
    DataLoader worker hands each batch's shared memory to the script through one). Two
    processes meet there, so it stays real: moved into the overlay, the worker binds its
    socket where the script never connects, and the batch is lost (the script then waits
    for it forever). Fresh, named by ``mkdtemp``: none of the user's files is there."""
    # outside the temporary folder the relative path begins with ".."
    return os.path.relpath(path, tempfile.gettempdir()).split(os.sep)[0].startswith("pymp-")


_ACTIVE: ScriptEffects | None = None


def active() -> ScriptEffects | None:
    """The effects of the run now under way, if any."""
    return _ACTIVE


def _name(target: Any) -> str:
    if isinstance(target, (str, os.PathLike)):
        return Path(os.fsdecode(os.fspath(target))).name or str(target)
    name = getattr(target, "name", None)
    return Path(name).name if isinstance(name, str) else type(target).__name__


def _short_site(site: str) -> str:
    path, _, line = site.rpartition(":")
    return f"{Path(path).name}:{line}" if path else site


def _tensor_behind(x: Any) -> torch.Tensor | None:
    """The tensor whose memory a NumPy array (``tensor.numpy()``, a slice of one) shows."""
    if type(x).__module__ != "numpy":
        return None
    for _ in range(64):
        x = getattr(x, "base", None)
        if x is None or isinstance(x, torch.Tensor):
            return x
    return None


# id(module) -> (the module, the writers' ids it was read for, its names bound to one)
_BOUND_NAMES: dict[int, tuple[Any, frozenset[int], list[str]]] = {}
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
    owner, _, attr = name.rpartition(".")
    if owner == "PIL":
        image = sys.modules["PIL.Image"]
        return image.fromarray if attr == "fromarray" else image.Image.save
    if owner == "safetensors":
        owner = "safetensors.torch"
    return getattr(sys.modules[owner or "builtins"], attr)


def _torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    effects = _ACTIVE
    if effects is not None:
        if effects.holds_emulated(obj):
            effects.skip("torch.save", f, obj)
            return
        if effects.sandbox is not None and not hasattr(f, "write"):
            f = effects.redirect(f, writing=True)
    _original("torch.save")(obj, f, *args, **kwargs)


def _torch_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    effects = _ACTIVE
    skeleton = effects.held(f) if effects is not None else None
    if effects is None or skeleton is None:
        return _original("torch.load")(f, map_location, *args, **kwargs)
    # the run saved there a moment ago (the save skipped): on a GPU the script reads it
    # back, whatever was on disk before; the tensors come back where map_location puts them
    effects.writes.add(effects.writes.read_back, "torch.load", f)
    return _rebuilt(skeleton, map_location)


def _remover(name: str) -> Callable[..., Any]:
    def remove(path: Any, *args: Any, **kwargs: Any) -> None:
        effects = _ACTIVE
        if effects is not None and not args and not kwargs and effects.forget(path):
            return None
        return _original(f"os.{name}")(path, *args, **kwargs)  # type: ignore[no-any-return]

    return remove


class _SkeletonPickler(pickle.Pickler):
    """Pickles a checkpoint with each tensor of a virtual GPU (or host stand-in) as its
    geometry, its storage as a key: no bytes, nothing allocated."""

    def __init__(self, file: Any, is_emulated: IsEmulated) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.is_emulated = is_emulated
        self.storages: dict[int, int] = {}

    def reducer_override(self, obj: Any) -> Any:
        if (not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, nn.Parameter)
                or not self.is_emulated(obj)):
            return NotImplemented
        st = obj.untyped_storage()
        key = self.storages.setdefault(id(st), len(self.storages))
        return (_rebuild_tensor, (key, int(st.nbytes()), str(obj.device), obj.dtype,
                                  tuple(obj.shape), tuple(obj.stride()),
                                  int(obj.storage_offset()), obj.requires_grad,
                                  isinstance(obj, nn.Parameter)))


def _skeleton(obj: Any, is_emulated: IsEmulated) -> bytes | None:
    """``obj`` pickled with its emulated tensors as shapes; None where it cannot be (an
    object pickle refuses, a tensor subclass such as a DTensor)."""
    buf = io.BytesIO()
    try:
        _SkeletonPickler(buf, is_emulated).dump(obj)
    except Exception:  # what cannot be held is not read back
        return None
    return buf.getvalue()


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
            from dpprof.emulator.virtual_cuda import active

            vc = active()
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


def _numpy_writer(name: str) -> Callable[..., Any]:
    def write(file: Any, *args: Any, **kwargs: Any) -> Any:
        effects = _ACTIVE
        if effects is not None:
            if effects.holds_emulated([args, kwargs]):
                effects.skip(f"numpy.{name}", file)
                return None
            if effects.sandbox is not None and not hasattr(file, "write"):
                file = effects.redirect(file, writing=True)
        return _original(f"numpy.{name}")(file, *args, **kwargs)

    return write


def _safetensors_writer(name: str) -> Callable[..., Any]:
    def write(obj: Any, filename: Any, *args: Any, **kwargs: Any) -> Any:
        effects = _ACTIVE
        if effects is not None:
            if effects.holds_emulated(obj):
                effects.skip(f"safetensors.{name}", filename)
                return None
            filename = effects.redirect(filename, writing=True)
        return _original(f"safetensors.{name}")(obj, filename, *args, **kwargs)

    return write


def _showwarning(message: Warning | str, category: type[Warning], filename: str,
                 lineno: int, file: Any = None, line: str | None = None) -> None:
    """A warning that torch raised for the script's call (``warnings.warn(stacklevel=2)``
    in ``torch.load``) names the caller's line, which is dpprof's wrapper when dpprof stands
    between them: the script's line instead, as under plain Python."""
    if in_dpprof(filename):
        path, _, num = caller_site(also_skip=(warnings.__file__, __file__)).rpartition(":")
        if path and num.isdigit():
            filename, lineno, line = path, int(num), None
    _original("warnings.showwarning")(message, category, filename, lineno, file, line)


def _pil_fromarray(obj: Any, *args: Any, **kwargs: Any) -> Any:
    image = _original("PIL.fromarray")(obj, *args, **kwargs)
    effects = _ACTIVE
    if effects is not None and effects.holds_emulated(obj):
        effects.note_emulated_image(image)
    return image


def _pil_save(self: Any, fp: Any, *args: Any, **kwargs: Any) -> Any:
    effects = _ACTIVE
    if effects is not None and effects.is_emulated_image(self):
        effects.writes.add(effects.writes.skipped, "Image.save", fp)
        effects.put_back(fp)
        return None
    return _original("PIL.save")(self, fp, *args, **kwargs)


def _open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    effects = _ACTIVE
    if effects is not None:
        if effects.sandbox is not None:
            file = effects.redirect(file, writing=bool(_WRITE_MODES & set(mode)))
            effects.trim_output()
        elif "w" in mode and "b" in mode:  # where torch.save / numpy.save of a file object go
            return effects.open_truncating(file, mode, *args, **kwargs)
    return _original("open")(file, mode, *args, **kwargs)


def _absolute(path: Any) -> str | None:
    """``path`` (a str, bytes or path-like; not a file object or descriptor) made absolute."""
    if isinstance(path, int) or hasattr(path, "write"):
        return None
    try:
        return os.path.abspath(os.fsdecode(os.fspath(path)))
    except TypeError:
        return None


def _absent_folders(path: Any) -> list[str]:
    """``path`` and its parents that do not exist yet, parents first."""
    folder = _absolute(path)
    absent: list[str] = []
    while folder is not None and not os.path.exists(folder):
        absent.append(folder)
        parent = os.path.dirname(folder)
        folder = parent if parent != folder else None
    return absent[::-1]


def _makedirs(name: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
    effects = _ACTIVE
    if effects is not None and effects.sandbox is not None:
        name = effects.redirect(name, writing=True)
        exist_ok = True
    before = _absent_folders(name) if effects is not None else []
    _original("os.makedirs")(name, mode, exist_ok)
    if effects is not None and effects.sandbox is None:
        effects.made(before)


def _mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
    effects = _ACTIVE
    if effects is not None and effects.sandbox is not None and dir_fd is None:
        path = effects.redirect(path, writing=True)
    before = _absent_folders(path) if effects is not None and dir_fd is None else []
    _original("os.mkdir")(path, mode, dir_fd=dir_fd)
    if effects is not None and effects.sandbox is None:
        effects.made(before)
