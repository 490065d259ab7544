"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on one emulated rank: torch's own code.

The rank runs torch's real ``fully_shard`` (``torch/distributed/fsdp/_fully_shard``, torch
2.13) over a fake process group of the world's size
(``torch.testing._internal.distributed.fake_pg``: collectives return at once, tensors keep
their shapes), as torchtitan's memory estimation does; so the sharded parameters (DTensors,
1/N of each parameter, padded), the all-gather's input and output buffers, the unsharded
parameters, the reduce-scatter's input and output and the sharded gradients and optimizer
state are torch's own allocations, each counted by the virtual-device runtime as it is made
and freed. The emulator's dispatch mode sees the DTensors' local ops because a DTensor op
reaches it again from DTensor's own ``__torch_dispatch__``.

One thing the dispatcher does not see: FSDP2 frees each parameter's all-gather output after
its forward and backward (``reshard``) and re-allocates it for the next all-gather by
resizing the storage in place (``UntypedStorage.resize_``, ``_fsdp_param.free_storage`` /
``alloc_storage``), which no aten op does. :func:`storage_resizes_counted` reports those
resizes to the runtime (:meth:`dpprof.emulator.storage_ledger.StorageLedger.storage_resized`).

The same :func:`shard_model` runs on a real gloo rank over CPU tensors (the check, in
``tests/test_fsdp.py``): only the process group differs.

CPU offload (``CPUOffloadPolicy``) runs under a real host (the emulated backend's
``host_model``): the model is built on the host as the user's code builds it, ``fully_shard``
moves each parameter to the GPU and copies its shard back into pinned host memory
(:func:`host_states_moved`; ``pin_memory()`` as :mod:`dpprof.emulator.tensor_api` plays it),
each all-gather copies the shards host-to-device and each reduce-scatter's gradient shards
are copied back (``.to("cpu", non_blocking=True)``, pinned), all of it torch's code; the
optimizer then steps real CPU tensors. :func:`host_bytes` reads what they hold. Checked
against an H200 (``tests/test_measured_ladder.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dpprof.emulator.op_log import ALL_GATHER, REDUCE_SCATTER, OpLog
from dpprof.emulator.patcher import Patcher
from dpprof.emulator.virtual_devices import VirtualDevices


def shard_model(model: nn.Module, blocks: Sequence[nn.Module],
                reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None, offload: bool = False) -> nn.Module:
    """``fully_shard`` each of ``blocks``, then the root (what the user's code does), over
    the default process group's ranks on the parameters' device type (``cuda`` under the
    emulator, ``cpu`` on a gloo rank). ``reshard_after_forward``: True is ZeRO-3 (each
    block's parameters all-gathered again for its backward), False ZeRO-2 (kept unsharded
    from its forward to its backward). ``param_dtype``: FSDP2's own mixed precision
    (``MixedPrecisionPolicy(param_dtype, reduce_dtype=torch.float32)``): the sharded
    parameters, their gradients and the optimizer state stay float32; each all-gather
    casts the shards to ``param_dtype`` first, so the unsharded parameters, the forward
    and backward compute in it, and the gradients are reduce-scattered in float32.
    ``offload``: ``CPUOffloadPolicy()``: the sharded parameters, their gradients and so
    the optimizer state live in pinned host memory; each all-gather copies its shards to
    the GPU first, each reduce-scatter's output is copied back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    first = next(model.parameters(), None)
    # with CPU offload the parameters start on the host and the mesh names the GPUs
    device_type = ("cuda" if offload else
                   first.device.type if first is not None else "cpu")
    from torch.utils._python_dispatch import _disable_current_modes

    # the mesh's rank table is the host's (a real CPU tensor): the mesh reads its values
    with _disable_current_modes():
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
              if param_dtype is not None else MixedPrecisionPolicy())
    where = CPUOffloadPolicy() if offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy, offload_policy=where)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=policy, offload_policy=where)
    return model


def host_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The host memory that ``model``'s parameters, their gradients and their optimizer
    state hold after a step, read from the tensors themselves: each host storage counted
    once at its full size (FSDP2's shards with their padding), a DTensor by its local
    shard; ``pinned``: the part of them in page-locked memory (``is_pinned()``: FSDP2's
    ``CPUOffloadPolicy`` pins the shards and copies the gradients into pinned memory; the
    optimizer's state, made by ``zeros_like``, is pageable). Zeros where nothing is on the
    host."""
    seen: dict[int, Any] = {}  # id -> the storage, held while counting
    out = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "pinned": 0}

    def add(kind: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type != "cpu":
            return
        st = local.untyped_storage()
        if id(st) in seen:
            return
        seen[id(st)] = st
        out[kind] += st.nbytes()
        if local.is_pinned():
            out["pinned"] += st.nbytes()

    with torch.no_grad():
        for p in model.parameters():
            add("parameters", p)
            add("gradients", p.grad)
            for value in optimizer.state.get(p, {}).values():
                add("optimizer_state", value)
    return out


def missing() -> str | None:
    """Why FSDP2 cannot be emulated with this torch (its ``fully_shard``, the fake process
    group and the internals patched here arrived in torch 2.6), or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch was built without torch.distributed"
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
        from torch.distributed.fsdp._fully_shard import _fsdp_param  # noqa: F401
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError as exc:
        return f"this torch ({torch.__version__}) has no FSDP2 to emulate ({exc})"
    if not hasattr(ShardingPropagator, "_propagate_tensor_meta_non_cached"):
        return f"this torch ({torch.__version__}) computes DTensor shapes another way"
    return None


def _runtime() -> VirtualDevices | None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((m for m in reversed(_get_current_dispatch_mode_stack())
                 if isinstance(m, VirtualDevices)), None)


@contextlib.contextmanager
def storage_resizes_counted() -> Iterator[None]:
    """FSDP2's in-place storage resizes (its unsharded parameters freed and re-allocated)
    reported to the virtual-device runtime active where they happen."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def counted(resize: Any) -> Any:
        def run(tensor: torch.Tensor) -> None:
            resize(tensor)
            rt = _runtime()
            if rt is not None:
                rt.storages.storage_resized(tensor)
        return run

    with Patcher() as p:
        p.patch(_fsdp_param, "alloc_storage", counted(alloc))
        p.patch(_fsdp_param, "free_storage", counted(free))
        p.patch(_fsdp_param_group, "alloc_storage", counted(alloc))
        yield


@contextlib.contextmanager
def host_states_moved() -> Iterator[None]:
    """``fully_shard``'s move of a module built on the host (what ``CPUOffloadPolicy``
    requires) to its GPU, under a real host: torch assigns ``tensor.data`` a GPU copy,
    which a real CPU tensor cannot take from a meta one (a virtual GPU's bytes); the tensor
    is swapped with its GPU copy instead (``torch.utils.swap_tensors``, as torch itself does
    for tensor subclasses there), so the same objects end on the GPU, the copy counted
    there as torch allocates it (each parameter whole, before it is sharded)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    move = _fsdp_init._move_states_to_device

    def moved(params: list[nn.Parameter], buffers: list[torch.Tensor],
              device: torch.device) -> None:
        if _runtime() is None:  # a real GPU, or a gloo rank: torch's own move
            return move(params, buffers, device)
        rest: tuple[list[Any], list[Any]] = ([], [])
        given: tuple[list[Any], list[Any]] = (params, buffers)
        for tensors, left in zip(given, rest, strict=True):
            for t in tensors:
                if (device.type != "cuda" or t.device.type != "cpu"
                        or type(t) not in (torch.Tensor, nn.Parameter)):
                    left.append(t)
                    continue
                with torch.no_grad():
                    on_gpu = t.to(device)
                if isinstance(t, nn.Parameter):
                    on_gpu = nn.Parameter(on_gpu, requires_grad=t.requires_grad)
                torch.utils.swap_tensors(t, on_gpu)
        return move(*rest, device)

    with Patcher() as p:
        p.patch(_fsdp_init, "_move_states_to_device", moved)
        yield


@contextlib.contextmanager
def sharding_propagation_apart() -> Iterator[None]:
    """DTensor's sharding propagation (output shapes computed on fake tensors, no memory)
    run outside the runtime's dispatch mode, with tensors showing their real device (meta),
    as FakeTensorMode requires."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    from dpprof.emulator.cuda_devices import CudaDevices

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    # random ops' propagations under way for a runtime (whose mode is off meanwhile)
    random_ops = [0]

    def apart(self: Any, op_schema: Any, *args: Any, **kwargs: Any) -> Any:
        rt = _runtime()
        if not isinstance(rt, CudaDevices):  # under no runtime, or compare's
            return propagate(self, op_schema, *args, **kwargs)
        rt.state.in_dispatch += 1  # the virtual CUDA shows real devices meanwhile
        random = torch.Tag.nondeterministic_seeded in getattr(op_schema.op, "tags", ())
        random_ops[0] += random
        try:
            with _disable_current_modes():
                return propagate(self, op_schema, *args, **kwargs)
        finally:
            random_ops[0] -= random
            rt.state.in_dispatch -= 1

    from torch.distributed.tensor import _op_schema

    rebuild = _op_schema._rebuild_tensor_from_dtensor_meta

    def on_meta(arg: Any) -> object:
        # a random op's fake inputs on a virtual GPU's mesh on the meta device: its
        # decomposition asks the device for a generator, which a CPU build of torch has
        # not for "cuda" (the shapes are the same on any device; other ops keep "cuda",
        # where a kernel's fake output may differ from meta's)
        if not random_ops[0] or arg.mesh.device_type != "cuda" or arg.tensor_meta is None:
            return rebuild(arg)
        meta = arg.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")

    with Patcher() as p:
        p.patch(ShardingPropagator, "_propagate_tensor_meta_non_cached", apart)
        p.patch(_op_schema, "_rebuild_tensor_from_dtensor_meta", on_meta)
        yield


@contextlib.contextmanager
def collectives_labelled() -> Iterator[None]:
    """What FSDP2's collectives allocate filed by what it is: the all-gather's and the
    reduce-scatter's flat buffers under ``communication``, the unsharded parameters the
    all-gather's output is copied out into under ``parameters`` (the new sharded gradients
    the reduce-scatter makes are filed as ``gradients`` where the optimizer steps)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    def filed(fn: Any, category: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            rt = _runtime()
            if rt is None:
                return fn(*args, **kwargs)
            with rt.category(category):
                return fn(*args, **kwargs)
        return run

    with Patcher() as p:
        for name, category in (("foreach_all_gather", "communication"),
                               ("foreach_all_gather_copy_out", "parameters"),
                               ("foreach_reduce", "communication")):
            if hasattr(_fsdp_param_group, name):
                p.patch(_fsdp_param_group, name, filed(getattr(_fsdp_param_group, name),
                                                       category))
        yield


@contextlib.contextmanager
def collectives_logged() -> Iterator[None]:
    """FSDP2's all-gathers and reduce-scatters noted in the runtime's op log, with their
    unsharded buffers' bytes, for the step-time model (:mod:`dpprof.emulator.step_time`):
    the fake process group runs them as no-ops, so no op of theirs is dispatched. Where the
    compute stream waits for an all-gather (``wait_for_unshard``, before its output is
    copied out into the parameters) is noted too."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    def log_of() -> tuple[VirtualDevices, OpLog] | None:
        rt = _runtime()
        log = rt.op_log if rt is not None else None
        return (rt, log) if rt is not None and log is not None and log.on else None

    def note(rt: VirtualDevices, log: OpLog, kind: str, t: torch.Tensor, world: int) -> None:
        log.collective(kind, t.numel() * t.element_size(), rt.storages.device_of(t), world,
                       rt.current_phase)

    def all_gather(fn: Any) -> Any:
        def run(fsdp_params: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
            result = fn(fsdp_params, group, *args, **kwargs)
            if result is not None and (found := log_of()) is not None and group.size() > 1:
                note(*found, ALL_GATHER, result.all_gather_output, group.size())
            return result
        return run

    def copy_out(fn: Any) -> Any:
        def run(result: Any, *args: Any, **kwargs: Any) -> Any:
            if (found := log_of()) is not None:
                rt, log = found
                log.wait_for_gather(rt.storages.device_of(result.all_gather_output),
                                    rt.current_phase)
            return fn(result, *args, **kwargs)
        return run

    def reduce(fn: Any) -> Any:
        def run(fsdp_params: Any, grads: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
            result = fn(fsdp_params, grads, group, *args, **kwargs)
            world = group.size() if group is not None else 1
            if (found := log_of()) is not None and world > 1:
                note(*found, REDUCE_SCATTER, result[0], world)  # the reduce-scatter's input
            return result
        return run

    with Patcher() as p:
        for name, wrap in (("foreach_all_gather", all_gather),
                           ("foreach_all_gather_copy_out", copy_out),
                           ("foreach_reduce", reduce)):
            if hasattr(_fsdp_param_group, name):
                p.patch(_fsdp_param_group, name, wrap(getattr(_fsdp_param_group, name)))
        yield


@contextlib.contextmanager
def dtensor_random_ops_run(mode_type: type) -> Iterator[None]:
    """DTensor's random ops on a CUDA mesh (``nn.init`` of sharded parameters, dropout),
    which torch wraps in a higher-order operator that sets the GPU's Philox offsets
    (``run_dtensor_rng_op``), run by a ``mode_type`` mode as the plain op: the virtual GPUs'
    random numbers have no values, so only the memory the op allocates is counted."""
    try:
        from torch._prims.rng_prims import run_dtensor_rng_op
    except ImportError:  # a torch without the operator calls the op itself
        yield
        return

    def plain(mode: Any, start_offset: Any, end_offset: Any, op: Any, *args: Any,
              **kwargs: Any) -> Any:
        with mode:  # torch takes the mode off the stack for the handler; the op is counted
            return op(*args, **kwargs)

    table = run_dtensor_rng_op.python_key_table
    before = table.get(mode_type)
    table[mode_type] = plain
    try:
        yield
    finally:
        if before is None:
            table.pop(mode_type, None)
        else:
            table[mode_type] = before


@contextlib.contextmanager
def emulated_ranks(world_size: int) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0) and
    FSDP2's storage resizes counted, for one emulated FSDP2 run; the group is destroyed
    after. Refused where a process group is already initialised (dpprof's own ranks):
    the rung is then measured by no emulation here."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("FSDP2 is emulated over a fake process group of its own; "
                           "this process already has a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with storage_resizes_counted(), sharding_propagation_apart(), host_states_moved(), \
                collectives_logged():
            yield
    finally:
        dist.destroy_process_group()
