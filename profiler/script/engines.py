"""Training engines dpprof does not re-enact, stopped where the script reaches them.

DeepSpeed's engine (ZeRO's partitioned optimizer, its own buckets, streams and
communication backend) is not emulated. Left alone, ``deepspeed.initialize`` under
``dpprof run`` fails deep inside DeepSpeed (MPI discovery, a CUDA accelerator probe), a
traceback that reads as the script's. Instead the run stops there with one line that names
what dpprof measures nearest to it: ZeRO-2 keeps the parameters whole and shards gradients
and optimizer state (``fully_shard(reshard_after_forward=False)``), ZeRO-3 shards the
parameters too (``fully_shard``): FSDP2's rungs.

Pipeline parallelism (``torch.distributed.pipelining``) across ranks is not emulated either:
its stages send each other their outputs' shapes, a warm-up vote, activations and gradients
while they run, and each emulated rank runs on its own, one after another, so a stage would
wait for what an earlier rank's run sent, or for what a later one has not sent yet. Left
alone, the first shapes a stage receives are bytes that never came (torch's unpickling
fails, a traceback that reads as the script's). A stage made over a group of one rank runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from dpprof.emulator.patcher import Patcher
from dpprof.errors import NotEmulated
from dpprof.script.import_hook import on_each_load

DEEPSPEED_NOT_EMULATED = (
    "dpprof run: DeepSpeed is not emulated; the nearest dpprof measures is FSDP2 (ZeRO-2: "
    "fully_shard(reshard_after_forward=False); ZeRO-3: fully_shard): `dpprof run --ladder` "
    "on the script without DeepSpeed under torchrun, or `dpprof compare --ladder`")

PIPELINING_NOT_EMULATED = (
    "dpprof run: pipeline parallelism across ranks (torch.distributed.pipelining) is not "
    "emulated: its stages exchange shapes, activations and gradients while they run, and "
    "dpprof runs each rank on its own; the nearest dpprof measures is the model whole on "
    "each rank: the script without the pipeline under torchrun (DDP, or FSDP2 with "
    "`dpprof run --ladder`)")


def _refused(message: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise NotEmulated(message)
    return refused


def _refuse_deepspeed(module: ModuleType, patcher: Patcher) -> None:
    for name in ("initialize", "init_inference"):
        if hasattr(module, name):
            patcher.patch(module, name, _refused(DEEPSPEED_NOT_EMULATED))


def _refuse_pipelining(module: ModuleType, patcher: Patcher) -> None:
    """Every pipeline stage (``_PipelineStageBase``: ``PipelineStage`` and the stages
    ``pipeline()``'s split makes) refused where its group has more than one rank."""
    base = getattr(module, "_PipelineStageBase", None)
    if base is None:
        return
    init = base.__init__

    def stage_init(stage: Any, *args: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        group = kwargs.get("group", args[4] if len(args) > 4 else None)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            raise NotEmulated(PIPELINING_NOT_EMULATED)
        init(stage, *args, **kwargs)

    patcher.patch(base, "__init__", stage_init)


# module -> what stops its engine where the script starts it
REFUSED: dict[str, Callable[[ModuleType, Patcher], None]] = {
    "deepspeed": _refuse_deepspeed,
    "torch.distributed.pipelining.stage": _refuse_pipelining,
}


def _refuse(module: ModuleType, patcher: Patcher) -> None:
    REFUSED[module.__name__](module, patcher)


@contextlib.contextmanager
def engines_refused() -> Iterator[None]:
    """For the duration: each engine of :data:`REFUSED` stops the run where it starts,
    whether the script imported it before or imports it during the run."""
    with Patcher() as patcher, on_each_load(REFUSED, functools.partial(_refuse,
                                                                       patcher=patcher)):
        yield
