"""The training step's options (:class:`StepConfig`), declared once and passed down to every
scenario and backend (:mod:`dpprof.scenarios.step` runs the step): torch only where an
option is applied, so that the CLI can declare its flags and defaults without it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from dpprof.scenarios.workloads import Workload

__all__ = ["AMP_DTYPES", "DEFAULT_MEASURED_STEPS", "DEFAULT_WARMUP_STEPS", "DTYPES",
           "DdpOptions", "StepConfig"]


# Steps before the measured one(s) when --warmup is not given, by backend: on the emulator
# and the cpu backend one, so that the optimizer state exists before the measured step; on
# GPUs three (cuDNN autotuning, the caching allocator's blocks and NCCL's buffers settle).
DEFAULT_WARMUP_STEPS = {"emulated": 1, "cpu": 1, "cuda": 3}
# Measured steps when --steps is not given: the emulator measures one step (its steps
# repeat exactly); on GPUs ten, for a median step time.
DEFAULT_MEASURED_STEPS = {"emulated": 1, "cpu": 1, "cuda": 10}
DTYPES = ("float32", "bfloat16", "float16")  # --dtype
AMP_DTYPES = ("bfloat16", "float16")  # --amp


@dataclass(frozen=True)
class DdpOptions:
    """The ``DistributedDataParallel`` reducer options (torch's names and defaults), the same
    for the emulator, the gloo ranks and the GPU ranks."""

    bucket_cap_mb: float | None = None  # None: DDP's default (25 MiB; first bucket 1 MiB)
    gradient_as_bucket_view: bool = False  # .grad as views into the reducer's buckets
    find_unused_parameters: bool = False  # search the graph for unused parameters
    broadcast_buffers: bool = True  # rank 0's buffers broadcast before each forward

    def wrap(self, model: nn.Module, device_ids: list[int] | None) -> nn.Module:
        """``model`` in ``DistributedDataParallel`` with these options."""
        import warnings

        from torch.nn.parallel import DistributedDataParallel

        kwargs: dict[str, Any] = {}
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated
            return DistributedDataParallel(
                model, device_ids=device_ids,
                gradient_as_bucket_view=self.gradient_as_bucket_view,
                find_unused_parameters=self.find_unused_parameters,
                broadcast_buffers=self.broadcast_buffers, **kwargs,
            )


@dataclass(frozen=True)
class StepConfig:
    """The options of the training step every scenario and backend runs, declared once and
    passed down as they are (see the module)."""

    batch: int = 512  # the global batch (rows), split over the GPUs as DataParallel splits it
    seed: int = 0  # the one seed rule (below): the weights, each step's batch, the draws
    # steps before the measured one(s); None: the backend's (DEFAULT_WARMUP_STEPS)
    warmup: int | None = None
    # measured steps (the cuda backend; the emulator measures one); None: the backend's
    steps: int | None = None
    dtype: str | None = None  # float32 | bfloat16 | float16: the workload's dtype, overridden
    amp: str | None = None  # bfloat16 | float16: forward and loss under autocast
    # gradient accumulation: each step's rows in this many micro-batches, one optimizer step
    # (under DDP the first ones' backwards inside no_sync(): one all-reduce per step)
    micro_batches: int = 1
    # DistributedDataParallel's options for the ddp scenario
    ddp: DdpOptions = field(default_factory=DdpOptions)

    def warmup_steps(self, backend: str) -> int:
        """``warmup``, or ``backend``'s default (``"emulated"``, ``"cpu"``, ``"cuda"``)."""
        return DEFAULT_WARMUP_STEPS[backend] if self.warmup is None else self.warmup

    def measured_steps(self, backend: str) -> int:
        """``steps``, or ``backend``'s default."""
        return DEFAULT_MEASURED_STEPS[backend] if self.steps is None else self.steps

    def resolved(self, backend: str) -> StepConfig:
        """The same options with ``warmup`` and ``steps`` filled in for ``backend``: what a
        backend's config embeds (the predictions for a GPU run keep its warm-up)."""
        return dataclasses.replace(self, warmup=self.warmup_steps(backend),
                                   steps=self.measured_steps(backend))

    def workload(self, wl: Workload) -> Workload:
        """``wl`` with ``dtype`` applied (as it is when ``dtype`` is None)."""
        if self.dtype is None:
            return wl
        import torch

        return dataclasses.replace(wl, dtype=getattr(torch, self.dtype))

    def problems(self) -> list[str]:
        """What is wrong with these options, one line each, naming the flag."""
        out = []
        if self.batch < 1:
            out.append(f"--batch must be a positive number of rows, got {self.batch}")
        if self.warmup is not None and self.warmup < 0:
            out.append("--warmup must be 0 or more")
        if self.micro_batches < 1:
            out.append(f"micro_batches must be at least 1, got {self.micro_batches}")
        if self.steps is not None and self.steps < 1:
            out.append(f"--steps must be at least 1, got {self.steps}")
        for opt, val, choices in (("--dtype", self.dtype, DTYPES),
                                  ("--amp", self.amp, AMP_DTYPES)):
            if val is not None and val not in choices:
                out.append(f"{opt} {val!r}: choose from {', '.join(choices)}")
        cap = self.ddp.bucket_cap_mb
        if cap is not None and not cap > 0:
            out.append(f"--bucket-cap-mb must be a positive number of MiB, got {cap}")
        return out
