"""torch.distributed as a script calls it during an emulated run: ``init_process_group``
(any backend) initialises torch's fake process group, ``get_backend`` answers what the script
asked for, ``broadcast_object_list`` gives a receiving rank rank 0's objects where rank 0's
run sent them (else it keeps its own), ``recv_object_list`` stops the run (what another
rank sends while both run never arrives), ``mp.spawn`` runs
the rank this run plays in place, and FSDP2's ``fully_shard`` and tensor parallelism are
counted once a group exists."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from dpprof.emulator import fsdp
from dpprof.emulator.patcher import Patch, Patcher
from dpprof.emulator.process_group import completed_work
from dpprof.errors import NotEmulated
from dpprof.script.launch import ProcessExit
from dpprof.script.parallel_state import current

if TYPE_CHECKING:
    from dpprof.emulator.virtual_cuda import VirtualCuda


def install_distributed(vc: VirtualCuda, patch: Patch) -> None:
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

        # -1 (the default) is "not given": the launcher's environment says, as torch reads it
        if world_size is None or world_size == -1:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if rank is None or rank == -1:
            rank = int(os.environ.get("RANK", "0"))
        if not 0 <= rank < world_size:
            # as NCCL's and gloo's groups refuse it (gloo: "rank < size. 0 vs -2"), where
            # the emulated group would carry on: pytorch/examples' ImageNet script, given
            # --multiprocessing-distributed without --world-size, asks for world size -2
            raise ValueError(f"init_process_group: rank {rank} of world size {world_size}: a "
                             "rank is at least 0 and below the world size (the real process "
                             "group fails here)")
        orig_init("fake", store=FakeStore(), rank=rank, world_size=world_size)
        # the backend DDP's logging data names: NCCL's, as asked (torch's logger reads a
        # gloo group's C++ backend, which the emulated group has not: then the fake one's)
        asked = str(backend or "nccl")
        current().backend = "nccl" if "nccl" in asked or asked == "cuda" else "fake"
        current().asked_backend = asked
        # the largest of the script's jobs (the DDP tutorial runs 4 ranks, then 2)
        current().log.world_size = max(current().log.world_size, world_size)
        current().log.fake_group = True
        if not fsdp_hooks:
            # FSDP2's hooks once a process group exists (FSDP2 needs one, a default mesh
            # makes one here): importing FSDP2 loads DTensor and sympy, a second or more
            # that neither compare's emulations nor a script without a group should pay
            fsdp_hooks.append(True)
            install_fsdp(vc)

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
        return c10d.Backend(current().asked_backend) if name == "fake" else name

    for owner in (dist, c10d, device_mesh):
        if hasattr(owner, "get_backend"):
            patch(owner, "get_backend", get_backend)
    patch(dist, "is_nccl_available", lambda: True)
    real_gather_single = c10d.all_gather_single

    def all_gather_single(output_tensor: Any, input_tensor: Any, group: Any = None,
                          async_op: bool = False) -> Any:
        """NCCL's all-gather into one tensor (ProcessGroupNCCL::_allgather_base) on the
        emulated group: any output of the world's size times the input's elements
        (SyncBatchNorm gathers into ``[1, W x n]``, which torch's fake group refuses), each
        rank's part its input (the ranks run the same program)."""
        if not current().log.fake_group:
            return real_gather_single(output_tensor, input_tensor, group, async_op)
        world = dist.get_world_size(group)
        if output_tensor.numel() != world * input_tensor.numel():
            raise ValueError("output tensor size must be equal to world_size times input "
                             "tensor size")
        with torch.no_grad():
            for part in output_tensor.view(-1).chunk(world):
                part.copy_(input_tensor.reshape(-1))
        return completed_work([output_tensor]) if async_op else None

    for owner in (dist, c10d):
        patch(owner, "all_gather_single", all_gather_single)
    real_broadcast_objects = c10d.broadcast_object_list

    def broadcast_object_list(object_list: list[Any], src: int | None = None,
                              group: Any = None, device: Any = None,
                              group_src: int | None = None) -> None:
        """The sender's objects pickled as torch does. A receiving rank of the emulated
        group: rank 0's objects where rank 0's run sent them at the same call
        (:mod:`dpprof.script.rank_broadcasts`), else its own (the sender's run is another
        emulated process; torch's unpickling of bytes that did not come would fail),
        each counted as a value made up."""
        if not current().log.fake_group:
            return real_broadcast_objects(object_list, src, group, device, group_src)  # type: ignore[no-any-return]
        within = group if group is not None else dist.group.WORLD
        sender = (src if src is not None
                  else dist.get_global_rank(within, group_src or 0) if within is not None
                  else 0)
        me = dist.get_rank()
        shared = current().broadcasts
        if me == sender:
            real_broadcast_objects(object_list, src, group, device, group_src)
        elif shared is None or me == 0 or not shared.receive(me, sender, object_list):
            vc.rt.stand_ins.add("broadcast object", len(object_list))
        if shared is not None and me == 0:
            shared.record(sender, object_list)
        elif shared is not None and me == sender:
            shared.receive(me, sender, object_list)  # its place in the calls' order
        return None

    for owner in (dist, c10d):
        patch(owner, "broadcast_object_list", broadcast_object_list)
    real_recv_objects = c10d.recv_object_list

    def recv_object_list(object_list: list[Any], src: int | None = None,
                         *args: Any, **kwargs: Any) -> Any:
        """Refused over the emulated group: the sender is another emulated run (earlier, or
        not yet started), so its bytes never come, and torch's unpickling of what did not
        come would fail as if the script were wrong."""
        if not current().log.fake_group:
            return real_recv_objects(object_list, src, *args, **kwargs)
        raise NotEmulated(
            "dpprof run: recv_object_list (objects sent by another rank while both run) is "
            "not emulated: dpprof runs each rank on its own, one after another, so what "
            "another rank sends never arrives; broadcast_object_list from rank 0 is")

    for owner in (dist, c10d):
        patch(owner, "recv_object_list", recv_object_list)

    def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1,
              join: bool = True, daemon: bool = False, start_method: str = "spawn") -> Any:
        """``mp.spawn``: one process per rank; the rank this run plays runs here. A rank
        other than 0 is a process of its own, which ends when its function returns (the
        code after the spawn is the parent's: waiting for rank 0's results, Lightning's
        launchers would wait for ever); rank 0 goes on as the parent, its processes
        joined (``join=False``: a context whose processes have all ended)."""
        current().log.spawned = max(current().log.spawned, nprocs)
        module = getattr(fn, "__module__", None) or "__main__"
        if module != "__main__" and not current().log.spawned_by:
            current().log.spawned_by = (f"{module}'s {getattr(fn, '__qualname__', repr(fn))} "
                                 f"(start method {start_method})")
        rank = min(current().spawn_rank, nprocs - 1)
        start = len(vc.rt.storages.events)
        fn(rank, *args)
        if rank != 0:
            raise ProcessExit(0)
        vc.memory.process_ended(start)  # its cuBLAS handles' workspaces went with it
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


def install_fsdp(vc: VirtualCuda) -> None:
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
        current().log.fsdp += 1

    vc.enter_context(_patched(_fsdp_param_group.FSDPParamGroup, "__init__", counted))

    import torch.distributed.tensor.parallel as tp
    from torch.distributed.tensor.parallel import api as tp_api

    parallelize = tp_api.parallelize_module

    def parallelize_module(*args: Any, **kwargs: Any) -> Any:
        log = current().log
        log.tensor_parallel += 1
        mesh = kwargs.get("device_mesh", args[1] if len(args) > 1 else None)
        size = getattr(mesh, "size", None)
        if callable(size):  # a DeviceMesh: its ranks compute on one batch
            log.tensor_parallel_ranks = max(log.tensor_parallel_ranks, int(size()))
        return parallelize(*args, **kwargs)

    for owner in (tp, tp_api):
        vc.enter_context(_patched(owner, "parallelize_module", parallelize_module))
    vc.enter_context(fsdp.storage_resizes_counted())
    vc.enter_context(fsdp.sharding_propagation_apart())
    vc.enter_context(fsdp.host_states_moved())
    vc.enter_context(fsdp.dtensor_random_ops_run(type(vc.rt)))
    vc.enter_context(fsdp.collectives_labelled())
    vc.enter_context(fsdp.collectives_logged())  # for the predicted step time


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    with Patcher() as p:
        p.patch(owner, name, value)
        yield
