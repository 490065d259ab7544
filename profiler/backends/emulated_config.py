"""The emulated backend's configuration: :class:`EmulationConfig`, what every emulated
scenario of a run shares (the virtual GPUs, the step's options, the variants the fixes
emulate)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dpprof.emulator.kernels import DEFAULT_COMPUTE_CAPABILITY
from dpprof.scenarios.step import StepConfig

__all__ = ["EmulationConfig"]


@dataclass
class EmulationConfig:
    gpus: int  # virtual devices
    gpu_memory_bytes: int  # capacity of each
    # the step's options as they are (batch, seed, warm-up, dtype, autocast, DDP's options)
    step: StepConfig = field(default_factory=StepConfig)
    compute: bool = False  # CPU tensors (real numbers) instead of meta tensors
    debug: bool = False  # keep tracebacks of failing scenarios
    # the target GPU's compute capability: which kernels it runs (SDPA, fused dropout)
    compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY
    # Variants the fixes analysis emulates (dpprof.measure.fix_savings); the defaults are
    # plain PyTorch (gradient_as_bucket_view above serves it too).
    dp_output_device: int | None = None  # DataParallel(output_device=...); targets go there
    # BalancedDataParallel: rows per device at the batch (a micro-batch in proportion)
    dp_chunk_sizes: tuple[int, ...] | None = None
    # Over CPU tensors (compute): also simulate reserved memory and the context, as over meta
    # (dpprof.emulator.reserved.gpu_overheads), and count them in the out-of-memory check.
    count_reserved: bool = False
    # The run stands for one rank of a process group over NCCL beside DDP's (FSDP2's
    # fully_shard): its context counts NCCL's memory, as a DDP rank's does.
    collectives: bool = False
    # DataParallel replicas on equal shards: one runs, the others' devices mirror its device
    # (meta only; every device's own events are the same, see ReplicaMirrors.set_mirrors)
    dedupe_replicas: bool = True
    # Peaks only: each device's peaks and its categories at the peak, no timeline and no
    # reserved/context simulation (the fixes' variants, which report nothing else).
    peaks_only: bool = False
    # Whose autocast op lists --amp re-enacts: the GPU's ("cuda"), or torch's CPU autocast
    # ("cpu"), which the checks compare with torch.autocast("cpu") on real tensors.
    autocast_ops: str = "cuda"
    # The model is built on the host and stays there as the user's code leaves it (FSDP2's
    # CPUOffloadPolicy: fully_shard keeps the parameter shards, their gradients and so the
    # optimizer state in host memory): the host side is real (CPU tensors hold values and
    # are computed, as under dpprof run), only the GPUs are emulated.
    host_model: bool = False
    # The process group DDP's ranks run over: "nccl" (GPUs) keeps the buckets DDP's rebuild
    # replaces until the watchdog reaps their all-reduce (a transient, counted at its worst:
    # dpprof.emulator.ddp.EmulatedDDP's nccl_stash); "gloo" frees them at the rebuild, as
    # the CPU checks' gloo ranks do.
    ddp_backend: str = "nccl"
    # The step's time predicted for this catalog GPU ("": the default GPU) over this link
    # ("nvlink", "pcie"; "": the board's usual one); off for runs that report no time.
    gpu: str = ""
    interconnect: str = ""
    predict_time: bool = True

    def with_step(self, **changes: Any) -> EmulationConfig:
        """A copy with the step's options changed (``batch=...``, ``ddp=...``)."""
        return dataclasses.replace(self, step=dataclasses.replace(self.step, **changes))
