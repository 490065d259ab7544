"""What the parallel wrappers of one emulated run share: the log of what the script wrapped
(for the report) and the alternative being run, held by the run's VirtualCuda while active."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpprof.emulator.virtual_cuda import active
from dpprof.script.lightning_launch import LaunchedRanks

if TYPE_CHECKING:
    from dpprof.emulator.ddp import EmulatedDDP
    from dpprof.emulator.virtual_cuda import VirtualCuda
    from dpprof.script.part_of_model import WholeModel
    from dpprof.script.rank_broadcasts import Broadcasts
    from dpprof.script.strategy import Alternative
    from dpprof.script.wrappers import VirtualDataParallel


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
    # DDP's error on parameters no loss used was raised in the DDP alternative's run,
    # whether the script let it end the run or caught it and went on
    ddp_unused_raised: bool = False
    replica_scalars: bool = False  # DataParallel's replicas returned one number each
    # the DDP alternative's rank got gradients after its reducer finalized a backward
    ddp_late_gradients: bool = False
    # the DataParallel subclass's own piece that gave a DDP rank its inputs, in words ("":
    # none): "PerGpuBatches's own scatter", "DataParallel's own forward" (PyG's)
    rank_scatter: str = ""
    # how a DDP rank applied a criterion the script wraps in DataParallel, in words
    # (dpprof.script.losses_on_replicas)
    rank_criteria: list[str] = field(default_factory=list)
    # under the DDP alternative, DataParallel's output_device and its first GPU (logical),
    # where they differ: the rank's GPU stands for both, as the DDP diff rewrites the script
    rank_output_device: tuple[int, int] | None = None
    # the DataParallel wraps a part of the model, whose rank of DDP wraps the whole model, in
    # words ("VGG's features"; "": it wraps what the script calls)
    part_of_model: str = ""
    # who replaced DataParallel's replicate, which dpprof did not call, in words ("": none)
    own_replicate: str = ""
    loss_in_forward: int = 0  # losses computed inside forward (the paired alternative)
    materialized: list[str] = field(default_factory=list)  # deferred outputs used otherwise
    # deferred outputs whose replicas' outputs are held for another loss on them, until the
    # backward begins (the loss inside forward computes every loss on them there)
    holding_replica_outputs: list[Any] = field(default_factory=list)
    most_losses_on_outputs: int = 0  # of one forward's outputs, computed inside forward
    # the last deferred outputs of a wrap, weakly: the next call's forward keeps them alive
    # while it runs, as the fixed code's name for them is rebound only once it returns
    last_outputs: dict[int, Any] = field(default_factory=dict)
    per_element_losses: int = 0  # of those, kept per element (reduction="none")
    # a loss moved inside forward that reads a number equal to the whole batch's rows
    # (out.view(B * T, V)): what the alternative says where it then fails
    whole_rows: str = ""
    fake_group: bool = False  # a fake default process group was initialised
    fsdp: int = 0  # FSDP2 parameter groups made (fully_shard calls with parameters)
    tensor_parallel: int = 0  # parallelize_module calls
    # the most devices a parallelize_module call's mesh held: the ranks that see one batch
    tensor_parallel_ranks: int = 1
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
    shard_dim: int = 0  # the dimension they were split along (DataParallel's dim)

    def note_shards(self, devices: Sequence[int], inputs: Sequence[Any],
                    kwargs: Sequence[dict[str, Any]], dim: int) -> None:
        if self.shard_rows or not torch.is_grad_enabled():
            return
        for device, args, kw in zip(devices, inputs, kwargs, strict=False):
            rows = next((int(t.shape[dim]) for t in tree_leaves((args, kw))
                         if isinstance(t, torch.Tensor) and t.dim() > dim), 0)
            if rows:
                self.shard_rows[device] = rows
                self.shard_dim = dim


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
    # rank 0's broadcast_object_list calls, recorded by rank 0's run and replayed to the
    # later ranks' (dpprof.script.rank_broadcasts); None: no other rank runs
    broadcasts: Broadcasts | None = None
    # nn.parallel.data_parallel's wrappers: id(module) -> (module, placement, wrapper)
    functional: dict[int, tuple[nn.Module, Any, VirtualDataParallel]] = field(
        default_factory=dict)
    # the DDP alternative's rank of a whole model that DataParallel wrappers are parts of:
    # id(model) -> (model, its EmulatedDDP), one reducer for every part
    whole_ddp: dict[int, tuple[nn.Module, EmulatedDDP]] = field(default_factory=dict)
    # each DataParallel wrapper's whole model, where it wraps a part of one (None: it does
    # not): id(wrapper) -> WholeModel, asked once
    parts: dict[int, WholeModel | None] = field(default_factory=dict)


def current() -> ScriptParallel:
    """The wrappers' shared state in the active emulation."""
    vc = active()
    if vc is None or vc.parallel is None:
        raise RuntimeError("the parallel wrappers run only under an active VirtualCuda")
    return vc.parallel  # type: ignore[no-any-return]


def state_of(vc: VirtualCuda) -> ScriptParallel:
    """The wrappers' shared state in the emulation ``vc`` (installed by :func:`install`)."""
    assert isinstance(vc.parallel, ScriptParallel), "wrappers.install(vc) first"
    return vc.parallel
