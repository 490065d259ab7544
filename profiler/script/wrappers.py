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
import contextvars
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpprof.emulator.call_sites import constructing_site
from dpprof.emulator.data_parallel import gather, parallel_apply, replicate, scatter, scatter_kwargs
from dpprof.emulator.ddp import UNREAPED_BUCKETS, EmulatedDDP, UnusedParametersError
from dpprof.emulator.patcher import Patch
from dpprof.emulator.process_group import rank_group, reap_all
from dpprof.emulator.virtual_cuda import active
from dpprof.scenarios.step import DdpOptions
from dpprof.script.ddp_rank import rank_of
from dpprof.script.distributed_calls import install_distributed
from dpprof.script.engines import engines_refused
from dpprof.script.lightning_launch import LaunchedRanks, lightning_launcher_played
from dpprof.script.losses_on_replicas import (
    criterion_on_the_rank,
    note_loss_on_each_gpu,
    note_replica_losses,
    wraps_a_criterion,
)
from dpprof.script.parallel_state import ScriptParallel, current, state_of
from dpprof.script.part_of_model import WholeModel, whole_model

if TYPE_CHECKING:
    from dpprof.emulator.virtual_cuda import VirtualCuda


_DataParallel = nn.DataParallel
PLAIN_DDP = DdpOptions()  # DDP's own defaults
_DDP = nn.parallel.DistributedDataParallel


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
        site = constructing_site(self)
        current().log.dp_sites.append(site)
        alternative = current().alternative
        if alternative is not None:
            alternative.dp_made(self, site)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # a script's subclass with a forward of its own (transformer-xl's
        # BalancedDataParallel: its own split of the batch, then torch's replicate,
        # parallel_apply and gather) runs it as written, counted as DataParallel's forward
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("forward")
        if own is not None and own is not VirtualDataParallel.forward:
            cls._own_forward = own
            cls.forward = VirtualDataParallel.forward  # type: ignore[method-assign]

    _own_forward: Callable[..., Any] | None = None  # a subclass's own forward (see above)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        if self.__dict__.get("_in_own_forward"):  # the subclass's forward calls DataParallel's
            return self.run(self.module, inputs, kwargs)
        current().log.data_parallel += 1
        alternative = current().alternative  # the fix the script runs with (None: as written)
        if alternative is not None:
            return alternative.dp_forward(self, inputs, kwargs)
        return self.as_written(inputs, kwargs)

    def own_piece(self, name: str) -> bool:
        """Whether the script's subclass, or the script on this instance, replaces one of the
        pieces DataParallel's forward calls (``scatter``, ``replicate``, ``parallel_apply``,
        ``gather``): CSAIL's UserScatteredDataParallel scatters a list of per-GPU batches,
        patch_replication_callback sets ``replicate`` on the instance."""
        return name in self.__dict__ or getattr(type(self), name) is not getattr(
            _DataParallel, name)

    @property
    def own_split(self) -> str:
        """How the script's subclass splits the batch its own way, its name first ("":
        DataParallel's split)."""
        if type(self)._own_forward is not None:
            return f"{self.class_words()} splits the batch in a forward of its own"
        if self.own_piece("scatter"):
            return f"{self.class_words()} splits the batch with a scatter of its own"
        return ""

    def class_words(self) -> str:
        """The subclass's name; a library's of torch's own name with its module
        (``torch_geometric.nn.data_parallel.DataParallel``)."""
        cls = type(self)
        return (cls.__name__ if cls.__name__ != "DataParallel"
                else f"{cls.__module__}.{cls.__qualname__}")

    def as_written(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The forward as the script's class defines it: DataParallel's, or a subclass's own."""
        own = type(self)._own_forward
        if own is None:
            return self.run(self.module, inputs, kwargs)
        with self._own_forward_running():
            result = own(self, *inputs, **kwargs)
        note_loss_on_each_gpu(self, result)
        return result

    @contextlib.contextmanager
    def _own_forward_running(self) -> Iterator[None]:
        """While the subclass's own forward runs: its call of DataParallel's forward is
        DataParallel's, and torch's parallel_apply splits along its ``dim``."""
        self.__dict__["_in_own_forward"] = True
        token = _SPLIT_DIM.set(self.dim)
        try:
            yield
        finally:
            _SPLIT_DIM.reset(token)
            self.__dict__["_in_own_forward"] = False

    def run(self, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """DataParallel's forward (``data_parallel.py``) on virtual devices, for ``module``
        (the wrapped module, or it with the loss inside)."""
        vc = self._vc
        rt = vc.rt
        ids = [vc.index_of(i) for i in self.device_ids]
        src = ids[0]
        self._check_placement(src)
        with rt.category("inputs"):
            # torch's forward calls the instance's pieces: a subclass's scatter and gather
            # run as written (they split the batch and place the outputs); its replicate is
            # DataParallel's (see _replicas)
            inputs, module_kwargs = (self.scatter(inputs, kwargs, self.device_ids)
                                     if self.own_piece("scatter") else
                                     scatter_kwargs(rt, inputs, kwargs, ids, self.dim))
        current().log.note_shards(ids, inputs, module_kwargs, self.dim)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        if len(ids) == 1:
            current().log.used_devices = [src]
            with rt.device(src):
                return module(*inputs[0], **module_kwargs[0])
        used = ids[: len(inputs)]
        current().log.used_devices = used
        replicas = self._replicas(module, used)
        if self.own_piece("parallel_apply"):
            outputs = self.parallel_apply(replicas, inputs, module_kwargs)
        else:
            outputs = parallel_apply(rt, replicas, inputs, module_kwargs, used)
        note_replica_losses(module, outputs)
        with rt.category("outputs"):
            if self.own_piece("gather"):
                return self.gather(outputs, self.output_device)
            return gather(rt, outputs, vc.index_of(self.output_device), self.dim)

    def _replicas(self, module: nn.Module, used: list[int]) -> list[nn.Module]:
        """DataParallel's replicate, whether or not the script replaces it: a replacement
        runs replication callbacks (``DataParallelWithCallback``, patch_replication_callback:
        a synchronized BatchNorm's), whose replicas wait on each other in forward, where
        here they run one after another; noted, their exchange not counted."""
        if self.own_piece("replicate"):
            log = current().log
            log.own_replicate = log.own_replicate or (
                "the script replaces its DataParallel's replicate on the instance"
                if "replicate" in self.__dict__ else
                f"the script's DataParallel subclass {self.class_words()} replaces "
                "DataParallel's replicate")
        return cast("list[nn.Module]", replicate(self._vc.rt, module, used,
                                                 not torch.is_grad_enabled()))

    def _check_placement(self, src: int) -> None:
        rt = self._vc.rt
        for t in chain(self.module.parameters(), self.module.buffers()):
            if rt.storages.device_of(t) != src:
                raise RuntimeError(
                    "module must have its parameters and buffers on device "
                    f"{self.src_device_obj} (device_ids[0]) but found one of them on "
                    f"device: {t.device}"
                )

    def rank_at_wrap(self, options: DdpOptions, whole: WholeModel | None = None) -> None:
        """The DDP alternative's rank built now, where the script wraps: around its module,
        or the ``whole`` model it is set into, moved to the rank's GPU first, as the fix's
        ``DDP(<module>.cuda(rank), ...)`` does there."""
        model = self.module if whole is None else whole.model
        model.to(self.src_device_obj)
        object.__setattr__(self, "_ddp_impl", rank_of(
            self._vc, self._vc.index_of(self.device_ids[0]), model, len(self.device_ids),
            options, whole))

    def as_ddp_rank(self, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                    options: DdpOptions = PLAIN_DDP) -> Any:
        """The forward as one rank of DDP on cuda:0, with DDP's ``options`` (the DDP
        alternative's): the rank built at the wrap (:meth:`rank_at_wrap`), else now
        (:mod:`dpprof.script.ddp_rank`)."""
        vc = self._vc
        rt = vc.rt
        src = vc.index_of(self.device_ids[0])
        self._check_placement(src)
        own = type(self)._own_forward
        if wraps_a_criterion(self):  # no DDP around it: dpprof.script.losses_on_replicas
            with rt.category("inputs"):
                inputs, kwargs = scatter(rt, (inputs, kwargs), [src], self.dim)[0] if (
                    inputs or kwargs) else ((), {})
            with rt.device(src):
                return criterion_on_the_rank(self, own is not None, inputs, kwargs)
        impl: EmulatedDDP | None = self.__dict__.get("_ddp_impl")
        if impl is None:
            # a DataParallel around a part of the model: the rank's DDP wraps the whole (one
            # reducer for all its parameters), its forward around this part's
            whole = whole_model(self)
            impl = rank_of(vc, src, self.module if whole is None else whole.model,
                           len(self.device_ids), options, whole)
            object.__setattr__(self, "_ddp_impl", impl)
        log = current().log
        log.used_devices = [src]
        # the last forward's second backward (read at the next forward: a run stops after
        # its steps, each with a forward after the one before)
        log.ddp_late_gradients = log.ddp_late_gradients or impl.late_gradients > 0

        if own is not None and not any(isinstance(t, torch.Tensor)
                                       for t in tree_leaves((inputs, kwargs))):
            # inputs no scatter can split (PyG's list of graphs): the subclass's forward,
            # on the rank's one GPU, makes them (a Batch of the rank's graphs)
            log.rank_scatter = f"{self.class_words()}'s own forward"
            return self._own_forward_as_rank(own, impl, src, inputs, kwargs)
        with rt.category("inputs"):
            if self.own_piece("scatter") and own is None:
                # a rank is DataParallel on its one GPU, torch's forward calling the
                # script's scatter (a forward of the script's own calls it its own way)
                log.rank_scatter = f"{self.class_words()}'s own scatter"
                shards, shard_kwargs = self.scatter(inputs, kwargs, self.device_ids[:1])
                moved = (tuple(shards[0]), dict(shard_kwargs[0])) if shards else ((), {})
            else:
                moved = scatter(rt, (inputs, kwargs), [src], self.dim)[0] if (
                    inputs or kwargs) else ((), {})
        inputs, kwargs = moved
        log.note_shards([src], [inputs], [kwargs], self.dim)
        with rt.device(src), _unused_noted():
            if impl.module is not self.module:  # the whole model's DDP (see above)
                return impl.forward_of(self.module, inputs, kwargs)
            return impl(*inputs, **kwargs)

    def _own_forward_as_rank(self, own: Callable[..., Any], impl: nn.Module, src: int,
                             inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The subclass's own forward as DataParallel over the rank's one GPU, whose module
        is the rank's DDP."""
        held = self.device_ids, self._modules["module"]
        self.device_ids, self._modules["module"] = held[0][:1], impl
        log = current().log
        # the rank's rows: those its module is given
        noting = impl.register_forward_pre_hook(
            lambda _, args, kw: log.note_shards([src], [args], [kw], self.dim),
            with_kwargs=True)
        try:
            with self._own_forward_running(), self._vc.rt.device(src), _unused_noted():
                return own(self, *inputs, **kwargs)
        finally:
            noting.remove()
            self.device_ids, self._modules["module"] = held


@contextlib.contextmanager
def _unused_noted() -> Iterator[None]:
    """DDP's error on parameters no loss used, noted as it passes (the script may catch it
    and go on)."""
    try:
        yield
    except UnusedParametersError:
        current().log.ddp_unused_raised = True
        raise


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
    wrappers = current().functional
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
            kwargs["process_group"] = rank_group(given, current().backend)
        with rt.meta_on(index), rt.category("communication"), _warnings_at_caller():
            super().__init__(module, *args, **kwargs)
        if kwargs.get("device_mesh") is None:
            self.process_group = given
        # set after torch's __init__, which begins with nn.Module's (it would clear them)
        self.__dict__["_dpprof_vc"] = vc
        self.__dict__["_dpprof_index"] = index
        current().log.ddp += 1
        current().log.world_size = max(current().log.world_size, int(self.process_group.size()))
        current().log.ddp_devices.append(index)

    def _ddp_init_helper(self, *args: Any, **kwargs: Any) -> None:
        # the reducer's group: the rank's emulated one (works that carry their tensors);
        # the rest of DDP keeps the script's group (a device mesh's, here)
        users = self.process_group
        self.process_group = rank_group(users, current().backend)
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
        current().log.note_shards([self.__dict__["_dpprof_index"]], [inputs], [kwargs], self.dim)
        return super().forward(*inputs, **kwargs)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        # torch's hooks take a state of None for the default group: the reducer's group
        # here, whose works carry the tensors the hook's future hands on
        if state is None:
            state = rank_group(self.process_group, current().backend)
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
    held = rank_group(ddp.process_group, current().backend).reap()
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


def install(vc: VirtualCuda, patch: Patch) -> None:
    """Replace the wrappers for the duration of ``vc`` (``patch`` records and restores)."""
    vc.parallel = ScriptParallel()
    import torch.nn.parallel as par
    import torch.nn.parallel.distributed as ddp_mod

    # the module (``import torch.nn.parallel.data_parallel as m`` names the package's
    # function of that name)
    dp_mod = sys.modules["torch.nn.parallel.data_parallel"]

    for owner in (nn, par, dp_mod):
        patch(owner, "DataParallel", VirtualDataParallel)
    patch(par, "data_parallel", data_parallel)
    patch(dp_mod, "data_parallel", data_parallel)
    for owner in (par, sys.modules["torch.nn.parallel.parallel_apply"], dp_mod):
        patch(owner, "parallel_apply", parallel_apply_on_virtual_devices)
    for owner in (nn.parallel, ddp_mod):
        patch(owner, "DistributedDataParallel", VirtualDDP)
    # a library imported before the run holds the real classes by name (Lightning's DDP
    # strategy: ``from torch.nn.parallel.distributed import DistributedDataParallel``), and
    # the real DDP over the fake group reads back a stand-in from its parameter check
    for real, virtual in ((_DataParallel, VirtualDataParallel), (_DDP, VirtualDDP)):
        patch(real, "__init__", _making_virtual(real, virtual))
    install_distributed(vc, patch)
    vc.enter_context(engines_refused())
    log = vc.parallel.log

    def record(launched: LaunchedRanks) -> None:
        log.launched = launched

    vc.enter_context(lightning_launcher_played(record))


# the dimension a subclass's own forward splits its batch along (its DataParallel's ``dim``)
_SPLIT_DIM: contextvars.ContextVar[int] = contextvars.ContextVar("split_dim", default=0)


def parallel_apply_on_virtual_devices(modules: Sequence[nn.Module], inputs: Sequence[Any],
                                      kwargs_tup: Sequence[dict[str, Any]] | None = None,
                                      devices: Sequence[Any] | None = None) -> list[Any]:
    """torch's ``nn.parallel.parallel_apply`` on virtual devices: each replica in turn, on
    this thread (torch starts a thread per replica, where the emulation, this thread's, is
    not), on its device as torch picks it (the given one, else its input's); a replica's
    exception is raised as torch raises it ("Caught ... in replica i on device d")."""
    from torch._utils import ExceptionWrapper
    from torch.nn.parallel.parallel_apply import get_a_var

    vc = active()
    if vc is None:
        raise RuntimeError("parallel_apply_on_virtual_devices needs an active VirtualCuda")
    rt = vc.rt
    if len(modules) != len(inputs):
        raise AssertionError(f"The number of modules {len(modules)} is not equal to the "
                             f"number of inputs {len(inputs)}")
    kwargs_tup = list(kwargs_tup) if kwargs_tup is not None else [{}] * len(modules)
    indices = []
    for k, given in enumerate(devices if devices is not None else [None] * len(modules)):
        first = get_a_var(inputs[k]) if given is None else None
        indices.append(vc.index_of(given) if given is not None else
                       rt.storages.device_of(first) if first is not None else 0)
    log = current().log
    log.used_devices = indices
    log.note_shards(indices, [i if isinstance(i, (list, tuple)) else (i,) for i in inputs],
                    kwargs_tup, _SPLIT_DIM.get())
    outputs = []
    for k, module in enumerate(modules):
        try:
            outputs.append(parallel_apply(rt, [module], [inputs[k]], [kwargs_tup[k]],
                                          [indices[k]], threads=len(modules))[0])
        except Exception:
            ExceptionWrapper(where=f"in replica {k} on device {indices[k]}").reraise()
    if modules and torch.is_grad_enabled():  # a subclass's forward, or its parallel_apply
        note_replica_losses(modules[0], outputs)
    return outputs


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


def replicate_note(vc: VirtualCuda) -> str:
    """The words on a DataParallel subclass's own replicate, which the run did not call
    ("": none)."""
    replaced = state_of(vc).log.own_replicate
    if not replaced:
        return ""
    return (f"{replaced} (with replication callbacks, as DataParallelWithCallback and "
            "patch_replication_callback add for a synchronized BatchNorm): its replicas "
            "were made as DataParallel's own replicate makes them, without the callbacks, "
            "since here they run one after another and a synchronized BatchNorm's replicas "
            "wait on each other; each BatchNorm normalized its replica's rows alone, and "
            "what they would exchange (a few numbers a channel) is not counted")


def cleanup(vc: VirtualCuda) -> None:
    """Destroy the fake process group a stopped script left behind; drop what the emulated
    groups' works still held."""
    import torch.distributed as dist

    reap_all()  # what the run's all-reduces held dies with the run
    log = state_of(vc).log
    if log.fake_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    log.fake_group = False
