"""Training engines dpprof does not re-enact, stopped where the script reaches them.

DeepSpeed's engine (ZeRO's partitioned optimizer, its own buckets, streams and
communication backend) is not emulated. Left alone, ``deepspeed.initialize`` under
``dpprof run`` fails deep inside DeepSpeed (MPI discovery, a CUDA accelerator probe), a
traceback that reads as the script's. Instead the run stops there with one line that names
what dpprof measures nearest to it: ZeRO-2 keeps the parameters whole and shards gradients
and optimizer state (``fully_shard(reshard_after_forward=False)``), ZeRO-3 shards the
parameters too (``fully_shard``): FSDP2's rungs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from dpprof.emulator.patcher import Patcher
from dpprof.errors import NotEmulated
from dpprof.script.import_hook import on_each_load

DEEPSPEED_NOT_EMULATED = (
    "dpprof run: DeepSpeed is not emulated; the nearest dpprof measures is FSDP2 (ZeRO-2: "
    "fully_shard(reshard_after_forward=False); ZeRO-3: fully_shard): `dpprof run --ladder` "
    "on the script without DeepSpeed under torchrun, or `dpprof compare --ladder`")

# module -> its entry points that start the engine
REFUSED = {"deepspeed": ("initialize", "init_inference")}


def _refused(*args: Any, **kwargs: Any) -> Any:
    raise NotEmulated(DEEPSPEED_NOT_EMULATED)


def _refuse(module: ModuleType, patcher: Patcher) -> None:
    for name in REFUSED.get(module.__name__, ()):
        if hasattr(module, name):
            patcher.patch(module, name, _refused)


@contextlib.contextmanager
def engines_refused() -> Iterator[None]:
    """For the duration: each engine of :data:`REFUSED` stops the run where it starts,
    whether the script imported it before or imports it during the run."""
    with Patcher() as patcher, on_each_load(REFUSED, functools.partial(_refuse,
                                                                       patcher=patcher)):
        yield
