"""The parallel wrappers a script names, re-enacted while a :class:`VirtualCuda` is active.

``nn.DataParallel`` (every spelling: ``torch.nn.DataParallel``,
``torch.nn.parallel.DataParallel``, ``nn.parallel.data_parallel(...)``) becomes
:class:`VirtualDataParallel`: a subclass of the real class (``isinstance`` and ``.module``
work as in the script's own code) whose forward is :mod:`dpprof.emulator.data_parallel`'s
re-enactment of scatter, replicate, parallel_apply and gather on the virtual devices.

``DistributedDataParallel`` becomes :class:`VirtualDDP`: torch's own class, its ``__init__``,
reducer and logger run as on a GPU (one emulated rank), over a fake process group
(``torch.testing._internal.distributed.fake_pg``: collectives return at once, tensors keep
their shapes) with the reducer's all-reduce over
:class:`~dpprof.emulator.process_group.EmulatedRankGroup`. ``init_process_group`` with any
backend initialises that fake group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpprof.emulator import fsdp
from dpprof.emulator.cuda_devices import caller_site
from dpprof.emulator.data_parallel import gather, parallel_apply, replicate, scatter, scatter_kwargs
from dpprof.emulator.ddp import UNREAPED_BUCKETS, EmulatedDDP
from dpprof.emulator.ledgers import VariantLedger
from dpprof.emulator.patcher import Patch, Patcher
from dpprof.emulator.process_group import rank_group, reap_all
from dpprof.emulator.virtual_cuda import active
from dpprof.scenarios.measured_loop import ModelWithLoss
from dpprof.scenarios.step import DdpOptions
from dpprof.script.engines import engines_refused
from dpprof.script.launch import ProcessExit
from dpprof.script.lightning_launch import LaunchedRanks, lightning_launcher_played

if TYPE_CHECKING:
    from dpprof.emulator.virtual_cuda import VirtualCuda
    from dpprof.script.strategy import Alternative


_DataParallel = nn.DataParallel
PLAIN_DDP = DdpOptions()  # DDP's own defaults
_DDP = nn.parallel.DistributedDataParallel


@dataclass
class ParallelLog:
    """What the script wrapped, for the report."""

    data_parallel: int = 0  # DataParallel forwards
    ddp: int = 0  # DistributedDataParallel wrappers built
    used_devices: list[int] = field(default_factory=list)  # runtime indices DP computed on
    world_size: int = 1  # of the (fake) process group, where one was initialised
    spawned: int = 0  # nprocs of mp.spawn / start_processes, where called
    # the function a library's launcher spawned ("module's qualname", start method), where
    # one did (Lightning's ddp_spawn / ddp_notebook); "": none, or the script's own
    spawned_by: str = ""
    # the ranks Lightning's own launcher would have started as processes, where it ran
    launched: LaunchedRanks | None = None
    ddp_devices: list[int] = field(default_factory=list)  # runtime index of each DDP wrapper
    replica_scalars: bool = False  # DataParallel's replicas returned one number each
    loss_in_forward: int = 0  # losses computed inside forward (the paired alternative)
    materialized: list[str] = field(default_factory=list)  # deferred outputs used otherwise
    fake_group: bool = False  # a fake default process group was initialised
    fsdp: int = 0  # FSDP2 parameter groups made (fully_shard calls with parameters)
    tensor_parallel: int = 0  # parallelize_module calls
    dp_sites: list[str] = field(default_factory=list)  # "file:line" of nn.DataParallel(...)
    call_sites: list[str] = field(default_factory=list)  # of the DataParallel model's call
    loss_sites: list[str] = field(default_factory=list)  # of the loss on its outputs
    # the loss-in-forward alternative: each loss on an expression of the outputs as (its
    # callee, the batch tensor it took its targets from): ("criterion", "y") of
    # ``criterion(out.view(-1, V), y.view(-1))``; "file:line" -> ("", "") where the loss
    # took the outputs themselves. Where the outputs were used otherwise, why the loss
    # could not move inside forward (the first reason)
    loss_expressions: dict[str, tuple[str, str]] = field(default_factory=dict)
    no_loss_forward: str = ""
    # rows each device got of the first batch a training forward split (DataParallel's
    # scatter) or moved (DDP), positional and keyword inputs alike: runtime index -> rows
    shard_rows: dict[int, int] = field(default_factory=dict)

    def note_shards(self, devices: Sequence[int], inputs: Sequence[Any],
                    kwargs: Sequence[dict[str, Any]], dim: int) -> None:
        if self.shard_rows or not torch.is_grad_enabled():
            return
        for device, args, kw in zip(devices, inputs, kwargs, strict=False):
            rows = next((int(t.shape[dim]) for t in tree_leaves((args, kw))
                         if isinstance(t, torch.Tensor) and t.dim() > dim), 0)
            if rows:
                self.shard_rows[device] = rows


class VirtualDataParallel(_DataParallel):  # type: ignore[misc,type-arg]
    """``nn.DataParallel`` on virtual devices (see the module)."""

    def __init__(self, module: nn.Module, device_ids: Sequence[Any] | None = None,
                 output_device: Any = None, dim: int = 0) -> None:
        vc = active()
        if vc is None:
            raise RuntimeError("VirtualDataParallel needs an active VirtualCuda")
        # torch's own __init__: the virtual CUDA answers its questions (the devices, their
        # balance), so every attribute is the one torch sets
        super().__init__(module, device_ids, output_device, dim)
        self._vc = vc
        _log().dp_sites.append(caller_site())

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        _log().data_parallel += 1
        alternative = _state().alternative  # the fix the script runs with (None: as written)
        if alternative is not None:
            return alternative.dp_forward(self, inputs, kwargs)
        return self.run(self.module, inputs, kwargs)

    def run(self, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """DataParallel's forward (``data_parallel.py``) on virtual devices, for ``module``
        (the wrapped module, or it with the loss inside)."""
        vc = self._vc
        rt = vc.rt
        ids = [vc.index_of(i) for i in self.device_ids]
        src = ids[0]
        self._check_placement(src)
        with rt.category("inputs"):
            inputs, module_kwargs = scatter_kwargs(rt, inputs, kwargs, ids, self.dim)
        _log().note_shards(ids, inputs, module_kwargs, self.dim)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        if len(ids) == 1:
            _log().used_devices = [src]
            with rt.device(src):
                return module(*inputs[0], **module_kwargs[0])
        used = ids[: len(inputs)]
        _log().used_devices = used
        replicas = replicate(rt, module, used, not torch.is_grad_enabled())
        outputs = parallel_apply(rt, replicas, inputs, module_kwargs, used)
        # per-replica losses: the loss is inside forward (with ModelWithLoss's keep_outputs,
        # beside the outputs)
        if isinstance(module, ModelWithLoss) or all(
                t.numel() == 1 for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)):
            _log().replica_scalars = True
        with rt.category("outputs"):
            return gather(rt, outputs, vc.index_of(self.output_device), self.dim)

    def _check_placement(self, src: int) -> None:
        rt = self._vc.rt
        for t in chain(self.module.parameters(), self.module.buffers()):
            if rt.storages.device_of(t) != src:
                raise RuntimeError(
                    "module must have its parameters and buffers on device "
                    f"{self.src_device_obj} (device_ids[0]) but found one of them on "
                    f"device: {t.device}"
                )

    def as_ddp_rank(self, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                    options: DdpOptions = PLAIN_DDP) -> Any:
        """The forward as one rank of DDP on cuda:0, with DDP's ``options`` (the DDP
        alternative's; lazily built: the script may move the module after wrapping it)."""
        vc = self._vc
        rt = vc.rt
        src = vc.index_of(self.device_ids[0])
        self._check_placement(src)
        impl = self.__dict__.get("_ddp_impl")
        if impl is None:
            # DDP(gradient_as_bucket_view=True) followed in a ledger of the rank's device,
            # from what the device holds now (the model, moved before it was wrapped)
            ledger = VariantLedger()
            counters = rt.storages.counters[src]
            ledger.live_requested = ledger.peak_requested = counters.live_requested
            ledger.live_allocated = ledger.peak_allocated = counters.live_allocated
            rt.ledgers[src] = ledger
            with rt.device(src):
                impl = EmulatedDDP(self.module, rt, world_size=len(self.device_ids),
                                   bucket_cap_mb=options.bucket_cap_mb,
                                   gradient_as_bucket_view=options.gradient_as_bucket_view,
                                   find_unused_parameters=options.find_unused_parameters,
                                   broadcast_buffers=options.broadcast_buffers,
                                   bucket_view_ledger=ledger, nccl_stash=True)  # GPUs' DDP
            object.__setattr__(self, "_ddp_impl", impl)
            _log().ddp_devices.append(src)
        _log().used_devices = [src]

        with rt.category("inputs"):
            moved = scatter(rt, (inputs, kwargs), [src], self.dim)[0] if inputs or kwargs \
                else ((), {})
        inputs, kwargs = moved
        _log().note_shards([src], [inputs], [kwargs], self.dim)
        with rt.device(src):
            return impl(*inputs, **kwargs)


# the names torch's classes have: a framework names the wrapper it was given by its class
# (Lightning's summaries, the module named in torch's own errors and DDP's logging data)
VirtualDataParallel.__name__ = VirtualDataParallel.__qualname__ = "DataParallel"

def data_parallel(module: nn.Module, inputs: Any, device_ids: Sequence[Any] | None = None,
                  output_device: Any = None, dim: int = 0,
                  module_kwargs: dict[str, Any] | None = None) -> Any:
    """``nn.parallel.data_parallel`` on virtual devices. One wrapper per module and
    placement for the run: dcgan calls it in every forward, and the DDP alternative is then
    that module wrapped once in DDP (one reducer, one set of buckets), not once per call."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    placement = (None if device_ids is None else tuple(device_ids), output_device, dim)
    wrappers = _state().functional
    found = wrappers.get(id(module))
    if found is not None and found[0] is module and found[1] == placement:
        wrapper = found[2]
    else:
        wrapper = VirtualDataParallel(module, device_ids, output_device, dim)
        wrappers[id(module)] = (module, placement, wrapper)
    return wrapper(*inputs, **(module_kwargs or {}))


class VirtualDDP(_DDP):  # type: ignore[misc,type-arg]
    """torch's own ``DistributedDataParallel`` on one emulated rank (see the module): its
    ``__init__``, reducer (the C++ buckets, their rebuild, ``no_sync``, ``join``, static
    graphs, communication hooks), logger and every attribute are torch's. What dpprof adds:
    the reducer all-reduces over :func:`~dpprof.emulator.process_group.rank_group` (the
    script's group is the fake one, whose works carry no tensors for the reducer to read),
    the buckets and broadcasts are filed under communication on the rank's device, and each
    forward's rows are noted for the report."""

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        vc = active()
        if vc is None:
            raise RuntimeError("VirtualDDP needs an active VirtualCuda")
        rt = vc.rt
        first = next(module.parameters(), None)
        index = rt.storages.device_of(first) if first is not None else vc.index_of(
            vc.current_device())
        index = index if index >= 0 else vc.index_of(vc.current_device())
        import torch.distributed as dist

        # torch's __init__ over the rank's emulated group (its check that every rank has
        # the same parameters reads back what the group gathered, which the fake group
        # gathers where the emulation cannot follow the values); the script's group after
        users = kwargs.pop("process_group", args[5] if len(args) > 5 else None)
        if len(args) > 5:
            args = args[:5] + args[6:]
        if kwargs.get("device_mesh") is None:
            given = users if users is not None else dist.distributed_c10d._get_default_group()
            kwargs["process_group"] = rank_group(given, _state().backend)
        with rt.meta_on(index), rt.category("communication"), _warnings_at_caller():
            super().__init__(module, *args, **kwargs)
        if kwargs.get("device_mesh") is None:
            self.process_group = given
        # set after torch's __init__, which begins with nn.Module's (it would clear them)
        self.__dict__["_dpprof_vc"] = vc
        self.__dict__["_dpprof_index"] = index
        _log().ddp += 1
        _log().world_size = max(_log().world_size, int(self.process_group.size()))
        _log().ddp_devices.append(index)

    def _ddp_init_helper(self, *args: Any, **kwargs: Any) -> None:
        # the reducer's group: the rank's emulated one (works that carry their tensors);
        # the rest of DDP keeps the script's group (a device mesh's, here)
        users = self.process_group
        self.process_group = rank_group(users, _state().backend)
        try:
            super()._ddp_init_helper(*args, **kwargs)
        finally:
            self.process_group = users

    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # the reducer's rebuilt buckets and the buffers' broadcast are communication on the
        # rank's device (inputs moved from the host are filed as inputs by the move itself)
        rt = self.__dict__["_dpprof_vc"].rt
        # over NCCL the buckets a rebuild replaces outlive it (_keep_unreaped)
        rebuilt_before = self._has_rebuilt_buckets
        events_before = len(rt.storages.events)
        with rt.meta_on(self.__dict__["_dpprof_index"]), rt.category("communication"), \
                _without_c10_warning(_META_TIMER_WARNING):
            out = super()._pre_forward(*inputs, **kwargs)
        _keep_unreaped(self, rt, self._has_rebuilt_buckets and not rebuilt_before,
                       events_before)
        return out

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        _log().note_shards([self.__dict__["_dpprof_index"]], [inputs], [kwargs], self.dim)
        return super().forward(*inputs, **kwargs)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        # torch's hooks take a state of None for the default group: the reducer's group
        # here, whose works carry the tensors the hook's future hands on
        if state is None:
            state = rank_group(self.process_group, _state().backend)
        super().register_comm_hook(state, hook)


def _keep_unreaped(ddp: VirtualDDP, rt: Any, rebuilt: bool, events_before: int) -> None:
    """Over NCCL (:class:`~dpprof.emulator.process_group.EmulatedRankGroup`'s ``unreaped``):
    the first iteration's buckets, which the rebuild just replaced (``rebuilt``), live on in
    their all-reduce's works until the watchdog reaps them (within ~100 ms: on an H200, the
    early steps of a fast loop). The worst case is kept, as
    :class:`~dpprof.emulator.ddp.EmulatedDDP`'s ``nccl_stash`` keeps it: held as long as
    ``ddp``, noted as a transient (``UNREAPED_BUCKETS``) that the steady state frees at the
    rebuild (after the ``events_before`` events that preceded it). Any other forward: the
    last iteration's works are reaped (their buckets are the reducer's own, alive anyway)."""
    held = rank_group(ddp.process_group, _state().backend).reap()
    if not rebuilt:
        return
    # what only the works still hold (the reducer let go of it at the rebuild): the tensor
    # held here and the storage object made to ask are its only references
    kept = [t for t in held if torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2]
    for t in kept:
        rt.storages.note_transient(t, UNREAPED_BUCKETS, at_event=events_before)
    ddp.__dict__["_dpprof_unreaped"] = kept


@contextlib.contextmanager
def _warnings_at_caller() -> Iterator[None]:
    """torch's warnings from the block (``stacklevel=2``: the line that built DDP) named at
    the script's line that called dpprof's subclass, as without it."""
    import sys
    import warnings

    caller = sys._getframe(3)  # the script's frame: _warnings_at_caller <- __enter__ <- init
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    here = __file__.removesuffix("c")
    for w in caught:
        where = ((caller.f_code.co_filename, caller.f_lineno) if w.filename == here
                 else (w.filename, w.lineno))
        warnings.warn_explicit(w.message, w.category, *where,
                               module=caller.f_globals.get("__name__"),
                               registry=caller.f_globals.setdefault("__warningregistry__", {}))


# DDP's logger times the steps of CPU and CUDA parameters only; over meta tensors it warns
# once (c10's own handler, straight to the process's stderr), which on a GPU never shows
_META_TIMER_WARNING = "Time stats are currently only collected for CPU and CUDA devices"
_WARNED: list[str] = []  # the warnings dropped (each is c10's TORCH_WARN_ONCE)


@contextlib.contextmanager
def _without_c10_warning(text: str) -> Iterator[None]:
    """Standard error at the file descriptor, for the block: every line kept but the warning
    of C++ that holds ``text``, until it has been dropped once (it is printed once)."""
    import os
    import sys
    import tempfile

    if text in _WARNED:
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if text not in line]
            if len(kept) < len(lines):
                _WARNED.append(text)
            if kept:
                os.write(2, "".join(kept).encode())


VirtualDDP.__name__ = VirtualDDP.__qualname__ = "DistributedDataParallel"


@dataclass
class ScriptParallel:
    """What the parallel wrappers of one emulated run share (the run's VirtualCuda holds it
    while active): the paired alternative being run, and what the wrappers saw."""

    # the fix the script runs with (dpprof.script.strategy): its DataParallel forward; None:
    # the script as written
    alternative: Alternative | None = None
    # the loss inside forward for a script that uses the outputs besides the loss: the
    # replicas return them too (ModelWithLoss(keep_outputs=True), the code the fix hands out),
    # gathered on the output device beside the loss numbers
    keep_outputs: bool = False
    log: ParallelLog = field(default_factory=ParallelLog)
    backend: str = "nccl"  # the backend the script's init_process_group asked for
    asked_backend: str = "nccl"  # as the script named it (what get_backend answers)
    # the rank mp.spawn's function is called with (the run plays that rank; a job of fewer
    # processes plays its last)
    spawn_rank: int = 0
    # nn.parallel.data_parallel's wrappers: id(module) -> (module, placement, wrapper)
    functional: dict[int, tuple[nn.Module, Any, VirtualDataParallel]] = field(
        default_factory=dict)


def _state() -> ScriptParallel:
    vc = active()
    if vc is None or vc.parallel is None:
        raise RuntimeError("the parallel wrappers run only under an active VirtualCuda")
    return vc.parallel  # type: ignore[no-any-return]


def current() -> ScriptParallel:
    """The wrappers' shared state in the active emulation."""
    return _state()


def _log() -> ParallelLog:
    return _state().log


def state_of(vc: VirtualCuda) -> ScriptParallel:
    """The wrappers' shared state in the emulation ``vc`` (installed by :func:`install`)."""
    assert isinstance(vc.parallel, ScriptParallel), "wrappers.install(vc) first"
    return vc.parallel


def install(vc: VirtualCuda, patch: Patch) -> None:
    """Replace the wrappers for the duration of ``vc`` (``patch`` records and restores)."""
    vc.parallel = ScriptParallel()
    import torch.nn.parallel as par
    import torch.nn.parallel.data_parallel as dp_mod
    import torch.nn.parallel.distributed as ddp_mod

    for owner in (nn, par, dp_mod):
        patch(owner, "DataParallel", VirtualDataParallel)
    patch(par, "data_parallel", data_parallel)
    patch(dp_mod, "data_parallel", data_parallel)
    for owner in (nn.parallel, ddp_mod):
        patch(owner, "DistributedDataParallel", VirtualDDP)
    # a library imported before the run holds the real classes by name (Lightning's DDP
    # strategy: ``from torch.nn.parallel.distributed import DistributedDataParallel``), and
    # the real DDP over the fake group reads back a stand-in from its parameter check
    for real, virtual in ((_DataParallel, VirtualDataParallel), (_DDP, VirtualDDP)):
        patch(real, "__init__", _making_virtual(real, virtual))
    _install_distributed(vc, patch)
    vc.enter_context(engines_refused())
    log = vc.parallel.log

    def record(launched: LaunchedRanks) -> None:
        log.launched = launched

    vc.enter_context(lightning_launcher_played(record))


def _install_distributed(vc: VirtualCuda, patch: Patch) -> None:
    import os

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        return
    orig_init = dist.init_process_group
    fsdp_hooks: list[bool] = []  # installed (once, by the first init_process_group)

    def init_process_group(backend: Any = None, init_method: str | None = None,
                           timeout: Any = None, world_size: int = -1, rank: int = -1,
                           store: Any = None, group_name: str = "", pg_options: Any = None,
                           device_id: Any = None, **_: Any) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if world_size is None or world_size < 0:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if rank is None or rank < 0:
            rank = int(os.environ.get("RANK", "0"))
        orig_init("fake", store=FakeStore(), rank=rank, world_size=world_size)
        # the backend DDP's logging data names: NCCL's, as asked (torch's logger reads a
        # gloo group's C++ backend, which the emulated group has not: then the fake one's)
        asked = str(backend or "nccl")
        _state().backend = "nccl" if "nccl" in asked or asked == "cuda" else "fake"
        _state().asked_backend = asked
        # the largest of the script's jobs (the DDP tutorial runs 4 ranks, then 2)
        _log().world_size = max(_log().world_size, world_size)
        _log().fake_group = True
        if not fsdp_hooks:
            # FSDP2's hooks once a process group exists (FSDP2 needs one, a default mesh
            # makes one here): importing FSDP2 loads DTensor and sympy, a second or more
            # that neither compare's emulations nor a script without a group should pay
            fsdp_hooks.append(True)
            _install_fsdp(vc)

    patch(dist, "init_process_group", init_process_group)
    # torch's own callers hold it by name: init_device_mesh initialises the default group
    # itself when the script has not (else a real rendezvous waits for ranks that never
    # come), as does FSDP2's default mesh
    import torch.distributed.distributed_c10d as c10d

    patch(c10d, "init_process_group", init_process_group)
    from torch.distributed import device_mesh

    if hasattr(device_mesh, "init_process_group"):
        patch(device_mesh, "init_process_group", init_process_group)
    real_get_backend = c10d.get_backend

    def get_backend(group: Any = None) -> Any:
        """The backend the script asked for where its group is the fake one: code reads
        it (DeviceMesh sets each rank's device from LOCAL_RANK, except on the fake
        backend; Lightning and accelerate branch on NCCL)."""
        name = real_get_backend(group)
        return c10d.Backend(_state().asked_backend) if name == "fake" else name

    for owner in (dist, c10d, device_mesh):
        if hasattr(owner, "get_backend"):
            patch(owner, "get_backend", get_backend)
    patch(dist, "is_nccl_available", lambda: True)
    real_broadcast_objects = c10d.broadcast_object_list

    def broadcast_object_list(object_list: list[Any], src: int | None = None,
                              group: Any = None, device: Any = None,
                              group_src: int | None = None) -> None:
        """The sender's objects pickled as torch does; a receiving rank of the emulated
        group keeps its own (the sender's run is another emulated process: its objects
        never arrive; torch's unpickling of the bytes that did not come would fail), each
        counted as a value made up."""
        if _log().fake_group:
            within = group if group is not None else dist.group.WORLD
            sender = (src if src is not None or within is None
                      else dist.get_global_rank(within, group_src or 0))
            if dist.get_rank() != sender:
                vc.rt.stand_ins.add("broadcast object", len(object_list))
                return None
        return real_broadcast_objects(object_list, src, group, device, group_src)  # type: ignore[no-any-return]

    for owner in (dist, c10d):
        patch(owner, "broadcast_object_list", broadcast_object_list)

    def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1,
              join: bool = True, daemon: bool = False, start_method: str = "spawn") -> Any:
        """``mp.spawn``: one process per rank; the rank this run plays runs here. A rank
        other than 0 is a process of its own, which ends when its function returns (the
        code after the spawn is the parent's: waiting for rank 0's results, Lightning's
        launchers would wait for ever); rank 0 goes on as the parent, its processes
        joined (``join=False``: a context whose processes have all ended)."""
        _log().spawned = max(_log().spawned, nprocs)
        module = getattr(fn, "__module__", None) or "__main__"
        if module != "__main__" and not _log().spawned_by:
            _log().spawned_by = (f"{module}'s {getattr(fn, '__qualname__', repr(fn))} "
                                 f"(start method {start_method})")
        rank = min(_state().spawn_rank, nprocs - 1)
        fn(rank, *args)
        if rank != 0:
            raise ProcessExit(0)
        return None if join else mp.ProcessContext([], [])

    def start_processes(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1,
                        join: bool = True, daemon: bool = False,
                        start_method: str = "spawn") -> Any:
        return spawn(fn, args, nprocs, join, daemon, start_method)

    import torch.multiprocessing.spawn as spawn_mod

    patch(mp, "spawn", spawn)
    patch(mp, "start_processes", start_processes)
    patch(spawn_mod, "spawn", spawn)
    patch(spawn_mod, "start_processes", start_processes)


def _install_fsdp(vc: VirtualCuda) -> None:
    """FSDP2's ``fully_shard`` as the script calls it: torch's own code over the fake
    process group, with what :func:`dpprof.emulator.fsdp.emulated_ranks` patches for the
    ladder's rungs (its in-place storage resizes counted, DTensor's sharding propagation
    on the real devices), for as long as ``vc`` is active."""
    if fsdp.missing() is not None:
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    group_init = _fsdp_param_group.FSDPParamGroup.__init__

    def counted(group: Any, *args: Any, **kwargs: Any) -> None:
        group_init(group, *args, **kwargs)
        _log().fsdp += 1

    vc.enter_context(_patched(_fsdp_param_group.FSDPParamGroup, "__init__", counted))

    import torch.distributed.tensor.parallel as tp
    from torch.distributed.tensor.parallel import api as tp_api

    parallelize = tp_api.parallelize_module

    def parallelize_module(*args: Any, **kwargs: Any) -> Any:
        _log().tensor_parallel += 1
        return parallelize(*args, **kwargs)

    for owner in (tp, tp_api):
        vc.enter_context(_patched(owner, "parallelize_module", parallelize_module))
    vc.enter_context(fsdp.storage_resizes_counted())
    vc.enter_context(fsdp.sharding_propagation_apart())
    vc.enter_context(fsdp.host_states_moved())
    vc.enter_context(fsdp.dtensor_random_ops_run(type(vc.rt)))
    vc.enter_context(fsdp.collectives_labelled())
    vc.enter_context(fsdp.collectives_logged())  # for the predicted step time


def _making_virtual(real: type, virtual: type) -> Callable[..., None]:
    """``real.__init__`` while emulating: an instance of ``real`` itself becomes one of
    ``virtual`` (its subclass, of the same layout) and is initialised as that; ``virtual``'s
    own ``super().__init__`` runs the real one. (Not ``__new__``: CPython keeps the slot of an
    assigned ``__new__`` after it is deleted, and ``object.__new__`` then refuses arguments.)"""
    real_init = real.__dict__["__init__"]

    @functools.wraps(real_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if type(self) is real:
            object.__setattr__(self, "__class__", virtual)
            virtual.__init__(self, *args, **kwargs)  # type: ignore[misc]
        else:
            real_init(self, *args, **kwargs)

    return __init__


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    with Patcher() as p:
        p.patch(owner, name, value)
        yield


def cleanup(vc: VirtualCuda) -> None:
    """Destroy the fake process group a stopped script left behind; drop what the emulated
    groups' works still held."""
    import torch.distributed as dist

    reap_all()  # what the run's all-reduces held dies with the run
    log = state_of(vc).log
    if log.fake_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    log.fake_group = False
