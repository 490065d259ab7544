"""A CUDA that is not there: ``torch.cuda`` played by virtual devices, in any torch build.

While a :class:`VirtualCuda` is active, a program written for GPUs runs unchanged:

* ``torch.cuda`` and ``torch.accelerator`` report ``num_gpus`` GPUs of the chosen model
  (``is_available``, ``device_count``, ``get_device_properties/name/capability``,
  ``mem_get_info``, ``current_device``/``set_device``/``device(...)``), after
  ``CUDA_VISIBLE_DEVICES`` (read when the program first asks, as CUDA reads it at
  initialisation, so a script that sets it before its first CUDA call is honoured);
* tensors created on, or moved to, ``"cuda"``, ``"cuda:k"``, ``torch.device("cuda", k)``
  (``.cuda()``, ``.to(...)``, ``torch.tensor(..., device=...)``, factories' ``device=``,
  ``Module.to/cuda``) live on virtual device ``k`` of a :class:`VirtualDevices` runtime, over
  meta tensors (memory only) or CPU tensors (``base="cpu"``: real numbers); they report
  ``device == cuda:k`` and ``is_cuda``; the host side of the program stays real;
* ``torch.cuda.memory_allocated()`` and friends answer from the emulator (``empty_cache``
  releases the cached segments in its simulations); every public function of ``torch.cuda``
  runs (:mod:`dpprof.emulator.cuda_api`); streams, events,
  ``synchronize``, seeds and ``non_blocking`` behave; ``pin_memory()``
  copies to host memory remembered as pinned (``is_pinned()``), as does a non-blocking
  copy from a GPU to the host;
* ``.item()``, ``bool()``, ``float()``, ``.tolist()``, ``.numpy()`` and ``.cpu()`` of a meta
  tensor answer with stated stand-ins (floats 1.0, integers 1, booleans False, host copies
  zeros), counted per call site; ops whose output shape depends on values (``nonzero``,
  boolean masks) stop with one line naming the fix;
* ``nn.DataParallel`` / ``nn.parallel.data_parallel`` are re-enacted by
  :mod:`dpprof.emulator.data_parallel` and :mod:`dpprof.emulator.ddp`.

Where the hooks are: a CPU-only build raises "Torch not compiled with CUDA enabled" from
``torch.cuda._lazy_init``, which C++ calls (``torch::utils::device_lazy_init``) before a
factory with a CUDA ``device=`` reaches the dispatcher; with it replaced, the factory
reaches the runtime's ``TorchDispatchMode``, which maps the device
(:meth:`VirtualDevices.placement`). ``Tensor.to``/``cuda``/``cpu`` and ``torch.tensor`` /
``as_tensor`` fail earlier (a CUDA device guard in C++), so they are replaced at the Python
API. Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from dpprof.emulator import (
    aten_kernels,
    ctc_loss,
    cuda_api,
    cuda_graphs,
    device_readings,
    emulated_cuda,
    plain_composites,
    profilers,
    script_threads,
    sync_batch_norm,
    tensor_api,
)
from dpprof.emulator.call_sites import caller_site
from dpprof.emulator.catalog import GpuSpec, lookup_gpu
from dpprof.emulator.cuda_api import device_index
from dpprof.emulator.cuda_devices import (
    ORIGINALS,
    CudaDevices,
    on_meta,
    real_device,
)
from dpprof.emulator.cuda_memory import CudaMemory
from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.patcher import Patch, Patcher, own_attribute, put
from dpprof.emulator.standins import load_real, standing_in
from dpprof.emulator.user_meta import CANNOT_COPY_OUT

# ---- crossings with autograd -----------------------------------------------------------------


class _Cross(torch.autograd.Function):
    """``t.to(device)`` between the host and virtual devices: forward copies to the target,
    backward copies the gradient back (as CUDA's ``_to_copy`` backward does)."""

    @staticmethod
    def forward(ctx: Any, vc: VirtualCuda, t: torch.Tensor, index: int,  # type: ignore[override]
                dtype: torch.dtype | None) -> torch.Tensor:
        ctx.vc = vc
        ctx.source = vc.rt.storages.device_of(t)
        ctx.source_dtype = t.dtype
        ctx.source_real = real_device(t)
        return vc.copy(t, index, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        vc: VirtualCuda = ctx.vc
        back = vc.copy(grad, ctx.source, ctx.source_dtype, real=ctx.source_real)
        return None, back, None, None


class _DeviceProperties(SimpleNamespace):
    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // 2**20}MB, "
                f"multi_processor_count={self.multi_processor_count})")



def parse_visible_devices(value: str | None, physical: int) -> list[int]:
    """The physical indices ``CUDA_VISIBLE_DEVICES`` leaves, as CUDA parses it: a comma-
    separated list read up to its first invalid, out-of-range or repeated entry; unset: all."""
    if value is None:
        return list(range(physical))
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        try:
            i = int(part)
        except ValueError:
            break
        if i < 0 or i >= physical or i in out:
            break
        out.append(i)
    return out



class _ThreadOnGpus(threading.local):
    """One thread's CUDA state: its current device, and whether it runs on the virtual
    GPUs (the class's values until the thread sets its own)."""

    device = 0
    on_gpus = False


class VirtualCuda:
    """Context manager: ``torch.cuda`` played by ``num_gpus`` virtual GPUs (see the module).

    ``rt`` may be given (a :class:`CudaDevices`); otherwise one is made over ``base``.
    ``on_data_parallel`` builds what ``nn.DataParallel(...)`` returns (default: the
    re-enactment, :class:`VirtualDataParallel`). ``quiet_thread_ends``: what ends a thread
    the program started without a traceback (the caller's own stop).
    """

    def __init__(self, num_gpus: int = 4, gpu: str | GpuSpec = "a100-80gb",
                 base: str = "meta", rt: CudaDevices | None = None,
                 gpu_memory_bytes: int | None = None, enter_runtime: bool = True,
                 honour_visible_devices: bool = True,
                 installers: Sequence[Callable[[VirtualCuda, Patch], None]] = (),
                 quiet_thread_ends: tuple[type[BaseException], ...] = ()) -> None:
        self.spec = lookup_gpu(gpu) if isinstance(gpu, str) else gpu
        self.physical = num_gpus
        self.rt = rt or CudaDevices(num_gpus, base)
        self.rt.cuda = self
        self.base = self.rt.base
        self.capacity_bytes = gpu_memory_bytes or self.spec.total_memory_bytes
        self._visible: list[int] | None = None
        self.memory = CudaMemory(self.rt, self.capacity_bytes, self._dev,
                                 self.spec.compute_capability)
        # NVML's activity readings answered with stand-ins, by the line that read them
        self.readings = device_readings.Readings()
        # the GPU profiling and tuning the script asked for, left out
        self.profiled = profilers.Profiled()
        # NCCL's memory on a runtime device now, outside the allocator (who runs the script
        # knows its process group and the GPUs' link: dpprof.script.run_figures); none here
        self.nccl_bytes_on: Callable[[int], int] = lambda device: 0
        self._patcher = Patcher()
        self._stack = contextlib.ExitStack()
        # each thread's current device (CUDA's is per thread, 0 on a new one) and whether
        # the thread runs on the virtual GPUs (the emulation's, and the threads the program
        # starts: dpprof.emulator.script_threads)
        self._local = _ThreadOnGpus()
        self.quiet_thread_ends = quiet_thread_ends
        # the script's lines that moved tensors to a GPU on a thread of its own
        self.other_thread_sites: dict[str, None] = {}
        self.enter_runtime = enter_runtime  # False: the caller has entered ``rt``
        self.honour_visible_devices = honour_visible_devices
        # patches installed on entry after torch.cuda's, restored with them
        self.installers = tuple(installers)
        # the parallel wrappers' shared state while active (dpprof.script.wrappers)
        self.parallel: Any = None
        self.active = False
        self.streams = cuda_api.CurrentStreams(self)
        self.graphs = cuda_graphs.Captures(self)
        self.initialised = False  # torch.cuda._lazy_init has run (see is_initialised)

    # ---- devices ------------------------------------------------------------------------

    @property
    def visible(self) -> list[int]:
        """Physical virtual devices the program sees, read once (CUDA's initialisation)."""
        if self._visible is None:
            self._visible = parse_visible_devices(
                os.environ.get("CUDA_VISIBLE_DEVICES") if self.honour_visible_devices
                else None, self.physical)
        return self._visible

    def device_count(self) -> int:
        return len(self.visible)

    def initialise(self) -> None:
        """``torch.cuda._lazy_init``: CUDA is initialised from now on."""
        self.initialised = True

    def is_initialised(self) -> bool:
        """``torch.cuda.is_initialized()``: once ``_lazy_init`` ran, or a tensor was put on
        a GPU by a path that reaches no Python (``Tensor.to``, ``cuda()``)."""
        if not self.initialised:
            self.initialised = any(c.peak_allocated > 0 for c in self.rt.storages.counters)
        return self.initialised

    def current_device(self) -> int:
        """The current device: the replica's inside DataParallel's threads, else the one
        set with ``set_device``."""
        d = self.rt.current_device
        return d if d != HOST else self._local.device

    def index_of(self, device: Any) -> int:
        """The runtime's device index for a cuda device the program names (logical index
        through CUDA_VISIBLE_DEVICES; the runtime counts all devices physically)."""
        i = device_index(device)
        if i is None:
            i = self.current_device() if isinstance(device, (str, torch.device)) else 0
        n = self.device_count()
        if not 0 <= i < n:
            raise RuntimeError(
                "CUDA error: invalid device ordinal (cuda:{} of {} visible GPU{})".format(
                    i, n, "" if n == 1 else "s"))
        return self.visible[i]

    def logical(self, index: int) -> int:
        """The index the program sees for runtime device ``index``."""
        return self.visible.index(index) if index in self.visible else index

    def set_device(self, device: Any) -> None:
        if isinstance(device, (str, torch.device)) and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        i = device_index(device)
        if i is not None and i >= 0:
            self.index_of(i)  # validates
            self._local.device = i

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        i = device_index(device)
        if i is None or i < 0:
            yield
            return
        prev = self._local.device
        self.set_device(i)
        try:
            yield
        finally:
            self._local.device = prev

    def properties(self, device: Any = None) -> _DeviceProperties:
        i = self.index_of(device if device is not None else self.current_device())
        major, minor = self.spec.compute_capability
        return _DeviceProperties(
            name=self.spec.name, major=major, minor=minor, total_memory=self.capacity_bytes,
            multi_processor_count=108, is_integrated=False, is_multi_gpu_board=False,
            uuid=f"GPU-dpprof-virtual-{i}", L2_cache_size=40 * 2**20,
            gcnArchName="", warp_size=32, pci_bus_id=i, pci_device_id=0, pci_domain_id=0,
        )

    def _dev(self, device: Any) -> int:
        """The virtual device a ``torch.cuda`` call's ``device`` argument names (None: the
        current one)."""
        return self.index_of(device if device is not None else self.current_device())

    def other_threads_note(self) -> str:
        """The report's words on tensors moved to a GPU on a thread off the virtual GPUs
        ("": none was): one not started through ``threading`` while the script ran (every
        thread it starts so runs on them, :mod:`dpprof.emulator.script_threads`)."""
        if not self.other_thread_sites:
            return ""
        return (f"the script moved tensors to a GPU on a thread dpprof did not see start "
                f"({', '.join(list(self.other_thread_sites)[:3])}; not a threading.Thread "
                "started while the script ran, which runs on the virtual GPUs as the "
                "script's own thread does): what such a thread allocates is not counted (the "
                "figures are low by it); start it with threading.Thread")

    # ---- tensors -----------------------------------------------------------------------

    def copy(self, t: torch.Tensor, index: int, dtype: torch.dtype | None,
             real: torch.device | None = None) -> torch.Tensor:
        """A copy of ``t`` on runtime device ``index`` (HOST: the host) as ``dtype``."""
        rt = self.rt
        if index != HOST and not self._local.on_gpus:
            self.other_thread_sites.setdefault(caller_site(), None)
        dtype = dtype or t.dtype
        with rt.placing_on(index):
            if index == HOST:
                if rt.real_host and on_meta(t) and (real is None or real.type != "meta"):
                    values = rt.real_values(t)
                    if values is not None:
                        return values.to(dtype)
                    rt.stand_in("host copy", t)
                    return rt.host_stand_in(t, dtype)
                host = real or (torch.device("cpu") if rt.real_host else self.base)
                out = _emulators_to(t, device=host, dtype=dtype, copy=True)
                if rt.storages.device_of(t) != HOST:
                    # --compute: the GPU's values as the emulation computed them, read to
                    # the host; not the user's to write over their files either
                    rt.remember_emulated_on_host(out)
                return out
            if rt.storages.device_of(t) == HOST and not isinstance(t, nn.Parameter):
                with rt.category(rt.current_category if rt.current_category == "parameters"
                                 else "inputs"):
                    return _emulators_to(t, device=self.base, dtype=dtype, copy=True)
            return _emulators_to(t, device=self.base, dtype=dtype, copy=True)

    def to_index(self, t: torch.Tensor, index: int, dtype: torch.dtype | None = None,
                 copy: bool = False, memory_format: Any = None) -> torch.Tensor:
        if self.rt.user_meta.holds(t):  # on a GPU machine too: there is nothing to copy
            raise NotImplementedError(CANNOT_COPY_OUT)
        src = self.rt.storages.device_of(t)
        if src == index and not (src == HOST and on_meta(t) and self.rt.real_host):
            if dtype is None and memory_format is None and not copy:
                return t
            kw: dict[str, Any] = {"copy": copy}
            if dtype is not None:
                kw["dtype"] = dtype
            if memory_format is not None:
                kw["memory_format"] = memory_format
            return _emulators_to(t, **kw)
        if t.requires_grad and torch.is_grad_enabled():
            return _Cross.apply(self, t, index, dtype)
        return self.copy(t, index, dtype)

    def target_of(self, device: Any) -> int | None:
        """Runtime index for a device argument (None: no device change)."""
        if device is None:
            return None
        if isinstance(device, int):
            return self.index_of(device)
        d = torch.device(device) if isinstance(device, str) else device
        if d.type == "cuda":
            return self.index_of(d)
        if d.type == "cpu":
            # compare: the emulator's own "cpu" is its base, placed by the dispatch rules
            return HOST if self.rt.real_host else None
        if d.type == "meta":
            return None
        return None

    def tensor_to(self, t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and isinstance(args[0], torch.Tensor):  # t.to(other)
            other = args[0]
            index = self.rt.storages.device_of(other)
            return self.to_index(t, index, other.dtype, copy=bool(kwargs.get("copy", False)))
        device = kwargs.pop("device", None)
        dtype = kwargs.pop("dtype", None)
        rest = list(args)
        if rest and (rest[0] is None or (isinstance(rest[0], (str, torch.device, int))
                     and not isinstance(rest[0], bool))):
            # to(device=None, dtype=None, non_blocking, copy): Module.to's own call is
            # t.to(None, dtype, False) for a dtype alone
            device = rest.pop(0)
            if rest and (rest[0] is None or isinstance(rest[0], torch.dtype)):
                dtype = rest.pop(0)
        elif rest and isinstance(rest[0], torch.dtype):
            dtype = rest.pop(0)
        non_blocking = kwargs.pop("non_blocking", rest.pop(0) if rest else False)
        copy = kwargs.pop("copy", rest.pop(0) if rest else False)
        memory_format = kwargs.pop("memory_format", None)
        target = self.target_of(device)
        if target is None:  # no device, or the real one (meta): torch's own conversion
            kw: dict[str, Any] = {"copy": copy}
            if device is not None:
                kw["device"] = device
            if dtype is not None:
                kw["dtype"] = dtype
            if memory_format is not None:
                kw["memory_format"] = memory_format
            with self.rt.asking_for(device):  # .to("meta"): the program's own meta tensor
                return ORIGINALS["to"](t, **kw)
        out = self.to_index(t, target, dtype, copy, memory_format)
        # copies are in order on virtual devices; a non-blocking copy from a GPU lands in
        # page-locked host memory, as torch's _to_copy allocates it
        if (non_blocking and target == HOST and out is not t
                and self.rt.storages.device_of(t) != HOST):
            self.rt.pin(out)
        return out

    def load(self, orig_load: Callable[..., Any], f: Any, map_location: Any, *args: Any,
             **kwargs: Any) -> Any:
        """``torch.load`` onto virtual GPUs: a CPU build cannot make a CUDA storage
        (``map_location="cuda"``, or a checkpoint saved on a GPU), so every storage is
        restored on the host and then moved, once, to the GPU that ``map_location`` (or
        the checkpoint) names; tensors that shared a storage (tied weights) share its copy."""
        targets: dict[int, tuple[Any, Any]] = {}  # id(storage) -> (storage, where it goes)

        def on_host(storage: Any, location: str) -> Any:
            where: Any = location
            if isinstance(map_location, dict):
                where = map_location.get(location, location)
            elif isinstance(map_location, int) and not isinstance(map_location, bool):
                where = torch.device("cuda", map_location)
            elif map_location is not None:
                where = map_location
            targets[id(storage)] = (storage, where)
            return storage

        obj = orig_load(f, on_host, *args, **kwargs)
        moved: dict[int, torch.Tensor] = {}  # id(host storage) -> its bytes on the GPU

        def index_of(t: torch.Tensor) -> int | None:
            found = targets.get(id(t.untyped_storage()))
            return self.target_of(found[1]) if found is not None else None

        def place(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            index = index_of(t)
            if index is None or index == HOST:
                return t
            flat = moved.get(id(st))
            if flat is None:
                host = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
                flat = moved[id(st)] = self.copy(host, index, None)
            out = flat.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
            if isinstance(t, nn.Parameter):
                return nn.Parameter(out, requires_grad=t.requires_grad)
            return out.requires_grad_(t.requires_grad)

        def place_module(m: nn.Module) -> nn.Module:
            # a pickled module (torch.save(model)): its parameters and buffers go where their
            # storages were, as Module.to moves them (an RNN's flat weights follow)
            tensors = chain(m.parameters(), m.buffers())
            if all(index_of(t) in (None, HOST) for t in tensors):
                return m
            with self.rt.category("parameters"):
                return m._apply(lambda t: place(t).detach())

        return _map_tensors(obj, place, place_module)

    def rng_state_stand_in(self) -> torch.Tensor:
        """``torch.cuda.get_rng_state()``: 16 bytes (Philox's seed and offset) of zeros, a
        host stand-in (:meth:`CudaDevices.is_emulated`), so a checkpoint that holds it is
        not written as if it were the GPU's."""
        return self.rt.host_stand_in(torch.empty(16, dtype=torch.uint8))

    def virtual_device(self, t: torch.Tensor) -> torch.device:
        real = ORIGINALS["device"].__get__(t)
        if real != self.base or self.rt.state.in_dispatch:
            return real
        # a functorch wrapper (vmap's batched tensor, grad's) has no storage of its own: the
        # device is its innermost tensor's (FlexAttention vmaps its masks over the devices')
        functorch = torch._C._functorch
        while functorch.is_functorch_wrapped_tensor(t):
            t = functorch.get_unwrapped(t)
        i = self.rt.storages.device_of(t)
        if i == HOST:
            if real.type != "meta" or self.rt.user_meta.holds_or_wraps(t):
                return real
            return torch.device("cuda", self.current_device())
        return torch.device("cuda", self.logical(i))

    # ---- activation --------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patcher.patch(owner, name, value)

    def enter_thread(self) -> None:
        """This thread runs on the virtual GPUs from now on (one the program started)."""
        self._local.on_gpus = True

    def leave_thread(self) -> None:
        self._local.on_gpus = False

    def enter_context(self, cm: contextlib.AbstractContextManager[Any]) -> Any:
        """Enter ``cm`` until this emulation ends (its patches undone with the others)."""
        return self._stack.enter_context(cm)

    def __enter__(self) -> VirtualCuda:
        self._local.on_gpus = True
        emulated_cuda.activate(self)
        self.active = True
        try:
            # torch._dynamo and symbolic_shapes: stand-ins until something needs the real
            # ones (an eager step imports them for nothing, dpprof.emulator.standins); a
            # real one is loaded with torch's originals in place, since dynamo indexes
            # torch's functions once.
            self._stack.enter_context(standing_in(self._real_module))
            if self.enter_runtime:
                self._stack.enter_context(self.rt)
                self._stack.enter_context(self.rt.device(HOST))
                # the runtime's mode makes torch's composites take their paths for
                # subclasses (other low bits of svdvals): the paths of plain Python instead;
                # SyncBatchNorm's CUDA-only kernels, over meta and CPU tensors; CTC loss's
                # GPU path and its backward's Meta kernel
                self._stack.enter_context(aten_kernels.registered(
                    (*plain_composites.KERNELS, *sync_batch_norm.KERNELS, *ctc_loss.KERNELS)))
            self._install()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _real_module(self, module: str) -> ModuleType:
        """The real module ``module`` (a stand-in's), imported with torch's originals in
        place of the hooks and with no mode counting what its import makes."""
        current = []
        for owner, name, original in reversed(self._patcher.originals()):
            current.append((owner, name, own_attribute(owner, name)))
            put(owner, name, original)
        try:
            with torch._C._DisableTorchDispatch():
                return load_real(module)
        finally:
            for owner, name, value in reversed(current):
                put(owner, name, value)

    def __exit__(self, *exc: object) -> None:
        self._patcher.restore()
        self._stack.close()
        self.active = False
        self._local.on_gpus = False
        emulated_cuda.deactivate()
        keras_core = sys.modules.get("keras.src.backend.torch.core")
        if (keras_core is not None and str(getattr(keras_core, "DEFAULT_DEVICE", "")) ==
                "cuda" and not torch.cuda.is_available()):
            # Keras was first imported under the emulation
            setattr(keras_core, "DEFAULT_DEVICE", "cpu")  # noqa: B010 - a module mypy cannot see

    def _install(self) -> None:
        """Patch torch for the program: ``torch.cuda`` and ``torch.accelerator``
        (:mod:`dpprof.emulator.cuda_api`), the tensor API
        (:mod:`dpprof.emulator.tensor_api`), then the frameworks that hold a device or a
        value of their own, and the parallel wrappers."""
        vc = self
        p = self._patch
        cuda_api.install(vc, p)
        tensor_api.install(vc, p)
        script_threads.install(vc, p)

        # Keras 3 on torch picks its device once, at import: a Keras imported before the
        # GPUs appeared must place its variables and inputs on them too
        keras_core = sys.modules.get("keras.src.backend.torch.core")
        if keras_core is not None and hasattr(keras_core, "DEFAULT_DEVICE"):
            p(keras_core, "DEFAULT_DEVICE", "cuda")

        # GradScaler: over meta tensors no gradient is inf, so the step is taken (the
        # stand-in 1.0 for found_inf would skip every step)
        import torch.amp.grad_scaler as grad_scaler

        orig_opt_step = grad_scaler.GradScaler._maybe_opt_step

        def maybe_opt_step(scaler: Any, optimizer: Any, optimizer_state: dict[str, Any],
                           *args: Any, **kwargs: Any) -> Any:
            found = list(optimizer_state["found_inf_per_device"].values())
            if found and all(on_meta(v) for v in found):
                vc.rt.stand_ins.add("found_inf (none)")
                return optimizer.step(*args, **kwargs)
            return orig_opt_step(scaler, optimizer, optimizer_state, *args, **kwargs)

        p(grad_scaler.GradScaler, "_maybe_opt_step", maybe_opt_step)

        # what the caller installs besides (dpprof run: the parallel wrappers)
        for install in vc.installers:
            install(vc, p)

def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor],
                 module_fn: Callable[[nn.Module], nn.Module]) -> Any:
    """``obj`` (what ``torch.load`` gives: nested containers of tensors, modules and values)
    with every tensor replaced by ``fn(tensor)`` and every module by ``module_fn(module)``;
    each once (a shared one stays shared)."""
    done: dict[int, Any] = {}

    def once(x: Any) -> Any:
        if isinstance(x, nn.Module):
            if id(x) not in done:
                done[id(x)] = module_fn(x)
            return done[id(x)]
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in done:
            done[id(x)] = fn(x)
        return done[id(x)]

    return tree_map(once, obj)


def active() -> VirtualCuda | None:
    """The active :class:`VirtualCuda`, if any."""
    found = emulated_cuda.active()
    return found if isinstance(found, VirtualCuda) else None


def _emulators_to(t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``Tensor.to`` as the emulation's own step (a copy onto a virtual device's base):
    not a call of the program's, so no torch function mode sees it (a ``DeviceContext``
    would hand it to the patched ``Tensor.to``, which reads ``device=meta`` as the
    program's meta tensors; a counting mode of the user's would count it twice)."""
    with torch._C.DisableTorchFunction():
        return ORIGINALS["to"](t, **kwargs)  # type: ignore[no-any-return]
