"""The training step's options (:class:`StepConfig`, declared once) and the one seed rule.

:class:`StepConfig` holds the knobs of the step every backend runs: the global batch, the
seed, the warm-up and measured steps, the dtype, autocast and DDP's options, each with its
default and its comment. ``CompareConfig`` holds one; the emulator's ``EmulationConfig``,
the cuda backend's ``CudaRunConfig`` and the gloo ranks' ``RankSpec`` embed it as it is
(it is picklable: it travels to gloo and torchrun ranks); the command line reads its
defaults from it.

The seed rule: how every backend builds the model and makes each step's batch.

Every backend (the emulator over meta or CPU tensors, the cpu backend's gloo ranks, the
cuda backend on GPUs or on CPU tensors, the equivalence checks, the largest-batch search)
calls these functions, so the same ``--seed`` gives the same weights, the same step-k
batch and the same random stream of the steps everywhere:

* **the model**: :func:`build_model` runs ``wl.model()`` right after
  ``torch.manual_seed(seed)``: the weights a script gets from ``torch.manual_seed(seed)``
  then ``model()``;
* **step k's batch** (``k`` counts from 0, warm-up steps included; every step gets a fresh
  batch, as a loader gives): :func:`step_batch` runs ``wl.batch(rows, cpu)`` right after
  ``torch.manual_seed(derived_seed(seed, "batch", k))``, floating inputs then cast to the
  workload's dtype. Its ``rows`` are the *global* batch padded as ``DistributedSampler``
  pads (``ceil(B / N) * N``); :func:`scenario_batch` gives each scenario its part:
  DataParallel the first ``B`` rows, DDP rank ``r`` (and ``single``, rank 0) rows
  ``[r * ceil(B / N), (r + 1) * ceil(B / N))``;
* **the steps' own random draws** (dropout, the user's step): :func:`step_stream` seeds
  ``derived_seed(seed, "steps")`` around the loop; every DDP rank seeds the same, as the
  processes of a user's script do.

Each of them restores the caller's CPU generator when it returns: building the model or a
batch, or running the steps, leaves the user's global RNG as it was.
``torch.manual_seed`` also seeds the CUDA generators of a real GPU (the step's dropout on
a GPU draws from them); those are left seeded.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from dpprof.errors import WorkloadError
from dpprof.scenarios.step_config import (  # declared without torch: the CLI reads them
    AMP_DTYPES,
    DEFAULT_MEASURED_STEPS,
    DEFAULT_WARMUP_STEPS,
    DTYPES,
    DdpOptions,
    StepConfig,
)

if TYPE_CHECKING:
    from dpprof.scenarios.workloads import Workload

Batch = tuple[Any, Any]  # (inputs, targets), nested as the workload makes them

# ---- the seed rule -----------------------------------------------------------------------


def derived_seed(seed: int, stream: str, step: int = 0) -> int:
    """A seed for ``stream`` (``"batch"``, ``"steps"``) of ``seed``: the first 63 bits of
    BLAKE2b over ``"dpprof:{stream}:{seed}:{step}"``, so no stream of one seed repeats
    another stream (or the model) of another seed, and any ``seed`` is valid."""
    digest = hashlib.blake2b(f"dpprof:{stream}:{seed}:{step}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``torch.manual_seed(seed)`` for the block; the caller's CPU generator afterwards.

    The saved state is kept as bytes, not as a tensor: a measured CPU run (the gloo ranks'
    profiler) sees no dpprof tensor live across the steps."""
    state = torch.random.get_rng_state().numpy().tobytes()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def build_model(wl: Workload, seed: int) -> nn.Module:
    """The workload's model, as ``torch.manual_seed(seed); wl.model()`` builds it (on the
    host, or wherever the surrounding device context puts it); the caller places it."""
    with seeded(seed):
        model = wl.model()
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"workload {wl.name!r}: model() returned "
                            f"{type(model).__name__}, not an nn.Module; the workload's "
                            "model must be a callable that builds and returns the nn.Module")
    return model


def cast_inputs(x: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of ``x`` in ``dtype`` (the workload's); others as they are."""
    if dtype == torch.float32:
        return x
    return tree_map_only(torch.Tensor,
                         lambda t: t.to(dtype) if t.is_floating_point() else t, x)


def _drawn(wl: Workload, seed: int, step: int, rows: int) -> Batch:
    with seeded(derived_seed(seed, "batch", step)):
        inputs, targets = wl.batch(rows, torch.device("cpu"))
    return inputs, targets


def step_batch(wl: Workload, seed: int, step: int, rows: int) -> Batch:
    """Step ``step``'s global host batch of ``rows`` rows (floating inputs in the
    workload's dtype), from ``derived_seed(seed, "batch", step)``."""
    inputs, targets = _drawn(wl, seed, step, rows)
    return cast_inputs(inputs, wl.dtype), targets


def padded_rows(batch: int, world: int) -> int:
    """The global batch's rows: ``ceil(batch / world) * world`` (``DistributedSampler``
    pads the last shard)."""
    return math.ceil(batch / world) * world


def take_rows(x: Any, start: int, stop: int) -> Any:
    """A copy of rows ``[start, stop)`` of every tensor in ``x`` (0-dim tensors as they
    are): a loader's batch owns its memory."""
    return tree_map_only(
        torch.Tensor, lambda t: t[start:stop].clone() if t.dim() else t, x)


def scenario_batch(wl: Workload, seed: int, step: int, batch: int, world: int,
                   rank: int | None = None) -> Batch:
    """A scenario's part of step ``step``'s global batch (:func:`step_batch` of
    :func:`padded_rows` rows): ``rank=None``, DataParallel's first ``batch`` rows; rank
    ``r`` (DDP; ``single`` is rank 0), rows ``[r * per, (r + 1) * per)`` with
    ``per = ceil(batch / world)``."""
    rows = padded_rows(batch, world)
    per = rows // world
    start, stop = (0, batch) if rank is None else (rank * per, (rank + 1) * per)
    inputs, targets = _drawn(wl, seed, step, rows)
    # each part copied as soon as it is taken, the whole freed, then cast: a loader's order
    if (start, stop) != (0, rows):
        inputs = take_rows(inputs, start, stop)
    inputs = cast_inputs(inputs, wl.dtype)
    if (start, stop) != (0, rows):
        targets = take_rows(targets, start, stop)
    return inputs, targets


@contextlib.contextmanager
def step_stream(seed: int) -> Iterator[None]:
    """The steps' random draws (dropout, the user's step) from
    ``derived_seed(seed, "steps")``; the caller's CPU generator afterwards."""
    with seeded(derived_seed(seed, "steps")):
        yield


__all__ = [
    "AMP_DTYPES",
    "DEFAULT_MEASURED_STEPS",
    "DEFAULT_WARMUP_STEPS",
    "DTYPES",
    "Batch",
    "DdpOptions",
    "StepConfig",
    "build_model",
    "cast_inputs",
    "derived_seed",
    "padded_rows",
    "scenario_batch",
    "seeded",
    "step_batch",
    "step_stream",
    "take_rows",
]
