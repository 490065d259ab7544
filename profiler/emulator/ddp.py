"""``DistributedDataParallel`` re-enacted as one rank on a virtual device
(``torch/nn/parallel/distributed.py`` and ``c10d/reducer.cpp``, torch 2.13): the model's
broadcast at construction, the reducer's gradient buckets and their all-reduce, and what
``gradient_as_bucket_view=True`` changes (followed in a ledger, or emulated).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._utils import (
    _flatten_dense_tensors,
    _unflatten_dense_tensors,
)
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.ledgers import VariantLedger
from dpprof.emulator.op_log import ALL_REDUCE
from dpprof.emulator.virtual_devices import VirtualDevices

DDP_BUCKET_CAP_MB = 25  # DistributedDataParallel(bucket_cap_mb=None) -> 25 MiB
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # dist._DEFAULT_FIRST_BUCKET_BYTES
# ---- DistributedDataParallel: one rank (c10d/reducer.cpp) ---------------------------------

class UnusedParametersError(RuntimeError):
    """torch's reducer's error where a backward left parameters without their gradient: a
    RuntimeError, as torch raises it, of its own class so that a run can tell it raised it
    (a script may catch it and go on)."""


DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DistributedDataParallel.broadcast_bucket_size
# reducer.cpp's words where a backward left parameters without their gradient (rank 0's)
UNUSED_PARAMETERS = (
    "Expected to have finished reduction in the prior iteration before starting a new one. "
    "This error indicates that your module has parameters that were not used in producing "
    "loss. You can enable unused parameter detection by passing the keyword argument "
    "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \n"
    "making sure all `forward` function outputs participate in calculating loss. \n"
    "If you already have done the above, then the distributed data parallel module wasn't "
    "able to locate the output tensors in the return value of your module's `forward` "
    "function. Please include the loss function and the structure of the return value of "
    "`forward` of your module when reporting this issue (e.g. list, dict, iterable).\n"
    "Parameter indices which did not receive grad for rank 0: {indices}\n In addition, you "
    "can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL to "
    "print out information about which particular parameters did not receive gradient on "
    "this rank as part of this error")
DDP_MAX_IN_FLIGHT = 2  # c10d/comm.cpp broadcast_coalesced: at most two broadcasts in flight
# the kind of transient (StorageLedger.note_transient) the first iteration's buckets are
# under NCCL: replaced by the rebuild, kept by their all-reduce's work until reaped
UNREAPED_BUCKETS = "ddp_unreaped_buckets"


def compute_bucket_assignment_by_size(
    tensors: Sequence[torch.Tensor], limits: Sequence[int],
    tensor_indices: Sequence[int] | None = None,
) -> list[list[int]]:
    """``c10d::compute_bucket_assignment_by_size`` (reducer.cpp), dense tensors.

    One open bucket per (dtype, device); a bucket closes once its size *reaches* its limit,
    and the next bucket of that key takes the next limit (the last one repeats). Open
    buckets follow at the end. Without ``tensor_indices`` the result is sorted by the
    smallest tensor index of each bucket; with them (the gradient-ready order of a rebuild)
    it is left in that order.
    """
    result: list[list[int]] = []
    open_: dict[tuple[torch.dtype, str], list[int]] = {}
    sizes: dict[tuple[torch.dtype, str], int] = {}
    limit_at: dict[tuple[torch.dtype, str], int] = {}
    for i, t in enumerate(tensors):
        index = tensor_indices[i] if tensor_indices else i
        key = (t.dtype, str(t.device))
        bucket = open_.setdefault(key, [])
        bucket.append(index)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        li = limit_at.setdefault(key, 0)
        if sizes[key] >= limits[li]:
            result.append(bucket)
            open_[key] = []
            sizes[key] = 0
            limit_at[key] = min(li + 1, len(limits) - 1)
    result += [b for b in open_.values() if b]
    if not tensor_indices:
        result.sort(key=min)
    return result


def ddp_broadcast_coalesced(
    rt: VirtualDevices, tensors: Sequence[torch.Tensor],
    buffer_size: int = DDP_BROADCAST_BUCKET_BYTES,
) -> None:
    """``c10d::broadcast_coalesced`` (c10d/comm.cpp) as one rank sees it: per bucket of
    ``buffer_size`` a flat copy (``flatten_dense_tensors``: a view for one tensor, else a
    ``cat``) is broadcast in place, then copied back; at most two buckets in flight."""
    if not tensors:
        return
    in_flight: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def finish(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
        for t, out in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            if out.numel():
                t.copy_(out)

    with torch.no_grad(), rt.category("communication"):
        for indices in compute_bucket_assignment_by_size(tensors, [buffer_size]):
            if len(in_flight) >= DDP_MAX_IN_FLIGHT:
                finish(*in_flight.pop(0))
            bucket = [tensors[i] for i in indices]
            in_flight.append((_flatten_dense_tensors(bucket), bucket))
        while in_flight:
            finish(*in_flight.pop(0))


class _DDPSink(torch.autograd.Function):
    """``torch.nn.parallel.distributed._DDPSink``: outputs cloned (``_ddp_sink_clone``),
    gradients passed through."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any):  # type: ignore[no-untyped-def]
        ctx.set_materialize_grads(False)
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any):  # type: ignore[no-untyped-def]
        return grads


class BucketViewFollower:
    """What ``gradient_as_bucket_view=True`` allocates, followed in a
    :class:`~dpprof.emulator.ledgers.VariantLedger` while plain DDP runs the same program.

    The two differ only where reducer.cpp lets ``.grad`` point at the bucket's view
    (``mark_variable_ready_dense``, ``initialize_bucket_views``): there the gradient the
    parameter held dies, if nothing else holds its storage; a bucket whose views some
    gradients still are outlives ``buckets_.clear()`` until the last of them is
    re-pointed. The variant's ``.grad`` of parameter ``i`` is a bucket view exactly when
    plain DDP's ``.grad`` is the storage it re-pointed last (``_grad_serials``): the
    gradient accumulated in place since, or the view kept since. Anything else holding a
    dying gradient's storage makes the ledger ``unsure``.
    """

    def __init__(self, rt: VirtualDevices, ledger: VariantLedger) -> None:
        self.rt, self.ledger = rt, ledger
        self._grad_serials: dict[int, int] = {}  # i -> plain .grad's serial when re-pointed
        self._view_bucket: dict[int, int] = {}  # i -> the bucket serial its variant view is in
        self._holders: dict[int, int] = {}  # an old bucket's serial -> gradients viewing it

    def _is_view(self, i: int, grad: torch.Tensor | None) -> bool:
        return grad is not None and self._grad_serials.get(i) == self.rt.storages.serial_of(grad)

    def regrad(self, i: int, grad: torch.Tensor | None, view: torch.Tensor) -> None:
        """``.grad`` of parameter ``i`` becomes ``view`` in the variant (when it has one)."""
        if grad is None:
            return
        if self._is_view(i, grad):  # the variant's .grad was a view: an old bucket's?
            old = self._view_bucket.get(i)
            if old is not None and old in self._holders:
                self._holders[old] -= 1
                if not self._holders[old]:
                    del self._holders[old]
                    self.ledger.release(old)
        else:  # a gradient of its own dies into the view
            serial = self.rt.storages.serial_of(grad)
            if serial is None or _storage_users(grad) != 1:
                self.ledger.unsure = ("a gradient's storage is shared, so when it dies "
                                      "under gradient_as_bucket_view is not known")
            else:
                self.ledger.release(serial, *self.rt.storages.bytes_of(grad))
        serial, bucket = self.rt.storages.serial_of(grad), self.rt.storages.serial_of(view)
        if serial is not None:
            self._grad_serials[i] = serial
        if bucket is not None:
            self._view_bucket[i] = bucket

    def buckets_cleared(self, params: Sequence[torch.Tensor],
                        views: dict[int, torch.Tensor]) -> None:
        """``buckets_.clear()``: a bucket some variant gradients view lives on in them."""
        for i, p in enumerate(params):
            if i in views and self._is_view(i, p.grad):
                bucket = self.rt.storages.serial_of(views[i])
                if bucket is not None:
                    if bucket not in self._holders:
                        self.ledger.detach(bucket, *self.rt.storages.bytes_of(views[i]))
                    self._holders[bucket] = self._holders.get(bucket, 0) + 1
                    self._view_bucket[i] = bucket


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (its use count, less the handle asked)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata)) - 1


class EmulatedDDP(nn.Module):
    """One rank of ``DistributedDataParallel(module, ...)`` on a virtual device: memory only.

    Mirrors torch 2.13's ``distributed.py`` and ``c10d/reducer.cpp``:

    * construction: ``_sync_module_states`` broadcasts parameters (and buffers with
      ``broadcast_buffers``) from rank 0 in flat 250 MiB buckets, two in flight (a transient);
      ``initialize_buckets`` allocates one flat ``at::empty`` per bucket, kept for good. On
      iteration 1 the bucket limits are ``[sys.maxsize]`` (one bucket per dtype) unless
      ``find_unused_parameters``, then ``[first, cap]`` (first 1 MiB when ``bucket_cap_mb``
      is left unset, else the cap); buckets are assigned over the reversed parameters;
    * ``find_unused_parameters``: ``local_used_map_dev_`` (int32 per parameter) on the
      device; every forward's output tensors are cloned by ``_DDPSink``; no rebuild;
    * every forward with grad enabled: buffers broadcast (``broadcast_buffers``, flat
      copies per 250 MiB bucket); on the first forward after a backward the buckets are
      rebuilt once (``rebuild_buckets``) in gradient-ready order with limits ``[first,
      cap]``: ``sync_bucket_indices`` allocates two small int32 tensors on the device (and
      two on the host), the old buckets are freed, the new ones allocated;
    * ``mark_variable_ready_dense``: the gradient is scaled into its bucket view
      (``mul_out``); with ``gradient_as_bucket_view`` ``.grad`` becomes the view (the
      freshly accumulated gradient dies); ``finalize_bucket_dense`` copies the all-reduced
      bucket back into ``.grad`` in place (``copy_bucket_to_grad``). The all-reduce writes
      the bucket in place (NCCL/gloo allocate nothing that the caching allocator sees);
    * ``nccl_stash``: over NCCL the buckets the rebuild replaces outlive it. The reducer
      all-reduces each bucket through ``ProcessGroupNCCL::allreduce`` (asynchronous), whose
      ``collective()`` stashes its input and output tensors in the work
      (``stashed_for_allocator_safety_``, instead of ``recordStream``) until ``wait()``,
      which DDP never calls (it waits on the work's future), or until the watchdog thread
      drops the completed work (it wakes every ``kWatchdogThreadSleepMillis``, 100 ms).
      So the first iteration's buckets stay allocated beside the rebuilt ones for up to
      ~100 ms: on an H200, through steps 2-6 of 3 ms each (``mlp``) and for step 2 only of
      23 ms steps (``lm``). The worst case is kept: they live on (:meth:`reap`, the
      caller's, ends it) and are noted as a transient (``StorageLedger.note_transient``)
      freed at the rebuild in the steady state. Gloo's work frees them at once.
    """

    def __init__(self, module: nn.Module, rt: VirtualDevices, world_size: int,
                 bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 bucket_view_ledger: VariantLedger | None = None,
                 nccl_stash: bool = False) -> None:
        super().__init__()
        self.nccl_stash = nccl_stash
        self._stashed: list[torch.Tensor] = []  # replaced buckets NCCL's works still hold
        # Plain DDP that also follows, in the ledger, what gradient_as_bucket_view=True would
        # allocate on the same program (:class:`BucketViewFollower`).
        self.follower = (BucketViewFollower(rt, bucket_view_ledger)
                         if bucket_view_ledger is not None and not gradient_as_bucket_view
                         else None)
        self.module = module
        self.rt = rt
        self.world_size = world_size
        default = bucket_cap_mb is None
        self.bucket_bytes_cap = int((DDP_BUCKET_CAP_MB if default else bucket_cap_mb)  # type: ignore[operator]
                                    * 1024 * 1024)
        self.first_bucket_bytes_cap = DDP_FIRST_BUCKET_BYTES if default else self.bucket_bytes_cap
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.iteration = 0
        # distributed.py: no_sync() clears the first; a forward under it clears the second
        # (buffers are broadcast only on a forward after a synchronised one)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.has_rebuilt = False
        self._rebuilt: list[int] = []
        self._expect_hooks = False
        # reducer.cpp's require_finalize_: a synchronised backward, once its first gradient
        # arrived, waits for every parameter's (a forward alone, never backpropagated, does
        # not: dcgan samples its generator under grad); the parameters ready so far
        self._require_finalize = False
        self._ready: set[int] = set()
        # the last synchronised backward finalized, no forward since; the gradients that
        # arrived after it (a second backward over its outputs), never all-reduced
        self._finalized = False
        self.late_gradients = 0
        self._buckets: list[torch.Tensor] = []
        self._views: dict[int, torch.Tensor] = {}
        # for the step-time model: each parameter's bucket, the parameters each bucket
        # still waits for in this backward (its all-reduce starts when none is left)
        self._bucket_of: dict[int, int] = {}
        self._pending: dict[int, int] = {}
        self.local_used_map_dev: torch.Tensor | None = None
        device = rt.storages.device_of(self.params[0]) if self.params else 0
        self.device = device
        with rt.device(device):
            states = [p.detach() for p in module.parameters()]
            if broadcast_buffers:
                states += [b.detach() for b in module.buffers()]
            ddp_broadcast_coalesced(rt, states)
            if self.params:
                limits = ([sys.maxsize] if not find_unused_parameters
                          else [self.first_bucket_bytes_cap, self.bucket_bytes_cap]
                          if self.first_bucket_bytes_cap < self.bucket_bytes_cap
                          else [self.bucket_bytes_cap])
                indices = compute_bucket_assignment_by_size(self.params, limits)
                self._initialize_buckets(list(reversed(indices)))
            if find_unused_parameters and self.params:
                with rt.category("communication"):
                    # reducer.cpp: empty_like(local_used_map_, the parameters' device)
                    self.local_used_map_dev = torch.empty(
                        len(self.params), dtype=torch.int32, device=self.params[0].device)
        # the hooks hold the reducer weakly: a hook on a parameter that holds it strongly
        # makes a cycle through the parameter's hook table that the garbage collector
        # does not follow, so a finished mp.spawn job's model would stay on its GPU
        me = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            ddp = me()
            if ddp is not None:
                ddp._autograd_hook(p)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    # reducer.cpp: initialize_buckets + initialize_bucket_views
    def _initialize_buckets(self, assignment: list[list[int]]) -> None:
        rt = self.rt
        self._buckets, self._views = [], {}
        self._bucket_of = {i: b for b, indices in enumerate(assignment) for i in indices}
        with rt.category("communication"), rt.device(self.device):
            for indices in assignment:
                p0 = self.params[indices[0]]
                total = sum(self.params[i].numel() for i in indices)
                flat = torch.empty(total, dtype=p0.dtype, device=p0.device)
                self._buckets.append(flat)
                offset = 0
                for i in indices:
                    p = self.params[i]
                    if _non_overlapping_and_dense(p):
                        view = flat.as_strided(p.shape, p.stride(), offset)
                    else:
                        view = flat.narrow(0, offset, p.numel()).view(p.shape)
                    self._views[i] = view
                    offset += p.numel()
                    if self.follower is not None:
                        self.follower.regrad(i, p.grad, view)
                    grad = p.grad
                    if (self.gradient_as_bucket_view and grad is not None
                            and grad.untyped_storage() is not view.untyped_storage()):
                        view.copy_(grad)
                        p.grad = view

    def _sync_bucket_indices(self, assignment: list[list[int]]) -> None:
        """``sync_bucket_indices``: the indices and the bucket sizes, broadcast from rank 0
        through int32 tensors on the device (and their host copies), freed on return."""
        rt = self.rt
        total = sum(len(b) for b in assignment)
        with rt.category("communication"):
            with rt.device(HOST):
                idx_host = torch.empty(total + 1, dtype=torch.int32)
            with rt.device(self.device):
                idx_dev = torch.empty(total + 1, dtype=torch.int32)
            with rt.device(HOST):
                sizes_host = torch.empty(len(assignment), dtype=torch.int32)
            with rt.device(self.device):
                sizes_dev = torch.empty(len(assignment), dtype=torch.int32)
        del sizes_dev, sizes_host, idx_dev, idx_host

    def rebuild_buckets(self) -> bool:
        """``Reducer::rebuild_buckets``: once, in gradient-ready order, limits [first, cap]."""
        if self.has_rebuilt or self.find_unused_parameters or not self._rebuilt:
            return False
        order = self._rebuilt
        assignment = compute_bucket_assignment_by_size(
            [self.params[i] for i in order],
            [self.first_bucket_bytes_cap, self.bucket_bytes_cap], order,
        )
        self._sync_bucket_indices(assignment)
        self.has_rebuilt = True
        self._rebuilt = []
        if self.nccl_stash:
            # buckets_.clear(): the old flat buffers outlive it in the first all-reduce's
            # works (in the gradient_as_bucket_view variant as well: no ledger change)
            for bucket in self._buckets:
                self.rt.storages.note_transient(bucket, UNREAPED_BUCKETS)
            self._stashed = self._buckets
        elif self.follower is not None:
            self.follower.buckets_cleared(self.params, self._views)
        self._buckets, self._views = [], {}  # buckets_.clear(): the old flat buffers die
        self._initialize_buckets(assignment)
        return True

    def reap(self) -> None:
        """ProcessGroupNCCL's watchdog drops the first all-reduce's works: the buckets
        they held die now (with ``nccl_stash``; nothing otherwise)."""
        self._stashed = []

    def _autograd_hook(self, p: torch.Tensor) -> None:
        if not self._expect_hooks:
            # reducer.cpp's autograd_hook returns at once: under no_sync, or after
            # finalize_backward, where a second backward over one forward's outputs
            # leaves its gradients in .grad, this rank's own, never all-reduced
            if self._finalized:
                self.late_gradients += 1
            return
        i = self._index[id(p)]
        if not self.has_rebuilt and not self.find_unused_parameters:
            self._rebuilt.append(i)
        self._mark_variable_ready_dense(i)
        self._ready.add(i)
        self._require_finalize = len(self._ready) < len(self.params)  # else finalized
        if not self._require_finalize:
            # finalize_backward (queued for the end of this backward) clears
            # expect_autograd_hooks_ until the next forward's prepare_for_backward
            self._ready = set()
            self._expect_hooks, self._finalized = False, True

    def _mark_variable_ready_dense(self, i: int) -> None:
        self._ready_dense(i)
        log = self.rt.op_log
        if log is None or not log.on or self.world_size < 2:
            return
        # reducer.cpp's mark_variable_ready: a bucket whose last gradient arrived is
        # all-reduced (asynchronously, on NCCL's stream); the model times it
        b = self._bucket_of[i]
        if not self._pending:
            self._pending = dict(Counter(self._bucket_of.values()))
        self._pending[b] -= 1
        if self._pending[b] == 0:
            flat = self._buckets[b]
            log.collective(ALL_REDUCE, flat.numel() * flat.element_size(), self.device,
                           self.world_size, "backward")
            if not any(self._pending.values()):
                self._pending = {}

    def _ready_dense(self, i: int) -> None:
        p = self.params[i]
        view = self._views[i]
        grad = p.grad
        if grad is None:
            view.zero_()
            return
        if grad.untyped_storage() is view.untyped_storage():
            view.div_(self.world_size)
            return
        torch.mul(grad, 1.0 / self.world_size, out=view)
        if self.gradient_as_bucket_view:
            p.grad = view
        elif self.follower is not None:
            self.follower.regrad(i, grad, view)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``DistributedDataParallel.no_sync``: the backwards of the forwards made inside
        leave the gradients in ``.grad`` (accumulating there), neither bucketed nor
        all-reduced; the first forward-backward after it synchronises them all."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward_of(self.module, inputs, kwargs)

    def forward_of(self, part: nn.Module, inputs: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """DDP's forward, around ``part`` of the module called in place of the module: a
        DataParallel that wraps a part of the model (its features) became this rank's DDP
        over the whole model, whose own forward runs around it."""
        rt = self.rt
        grad = torch.is_grad_enabled()
        sync = grad and self.require_backward_grad_sync
        if sync:
            self.iteration += 1  # prepare_for_forward
        if grad:  # _pre_forward: the rebuild does not wait for a synchronised forward
            if self._require_finalize and not self.find_unused_parameters:
                # rebuild_buckets' ensure_prior_reduction_finished: a parameter no loss
                # used never got its gradient, and the prior backward never finished
                unused = sorted(set(range(len(self.params))) - self._ready)
                raise UnusedParametersError(UNUSED_PARAMETERS.format(
                    indices=" ".join(map(str, unused))))
            self.rebuild_buckets()
            if self.broadcast_buffers and self.require_forward_param_sync:
                bufs = [b for b in self.module.buffers()]
                with rt.device(self.device):
                    ddp_broadcast_coalesced(rt, bufs)
        output = part(*inputs, **kwargs)
        if grad:
            # _post_forward; finalize_backward has cleared expect_autograd_hooks_ after the
            # last synchronised backward, and a forward under no_sync does not set it:
            # that backward's autograd hooks return at once
            self.require_forward_param_sync = sync
            self._expect_hooks, self._finalized = sync, False
            if sync:  # prepare_for_backward: the counting starts afresh
                self._ready = set()
            # _DDPSink, with or without no_sync
            if self.find_unused_parameters:
                # distributed.py: pytree-flattened, the outputs with a grad_fn through
                # _DDPSink; the flat list (the outputs before their clones) lives until
                # forward returns
                flat, spec = tree_flatten(output)
                with rt.device(self.device):
                    passed = _DDPSink.apply(*flat)
                output = tree_unflatten(
                    [o if not isinstance(o, torch.Tensor) or o.grad_fn is None else n
                     for o, n in zip(flat, passed, strict=True)], spec)
                del passed
        return output

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self.reap()


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Dense layouts the bucket view can match with ``as_strided`` (contiguous or
    channels-last); anything else gets a contiguous ``narrow().view()``."""
    return t.is_contiguous() or (
        t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    )
