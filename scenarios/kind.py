"""What a scenario is, once: how it wraps the model, the rows each device gets, where the
loss and the targets live, how it is described and named in the answers.

Each scenario is one object (:class:`Scenario`) in its own module under
:mod:`dpprof.scenarios.kinds`, listed once in :mod:`dpprof.scenarios.registry`; the backends
(emulated, cuda, cpu), the comparison, the answers and the reports loop over the registry
instead of switching on names. A backend hands a scenario its own wrappers
(:class:`Wrappers`: the emulator's DataParallel and DDP, or torch's) and the scenario picks
and composes them (:meth:`Scenario.wrap`).

The families here hold the behaviour; a scenario module instantiates one (or subclasses it
where its scenario differs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dpprof.scenarios.names import DATA_PARALLEL, DISTRIBUTED, ONE_GPU

if TYPE_CHECKING:  # what a scenario is, without torch: the reports read it (dpprof report)
    from torch import nn


class Wrappers(Protocol):
    """What a backend wraps a model in: its DataParallel over every GPU, its DDP rank."""

    def data_parallel(self, module: nn.Module) -> Any: ...

    def ddp(self, model: nn.Module) -> Any: ...


@dataclass(frozen=True)
class Scenario:
    """One scenario (see the module). The base is the bare model on one GPU."""

    name: str
    description: str  # one line: what runs
    setup: str = ONE_GPU  # DATA_PARALLEL, DISTRIBUTED, SPLIT_MODEL or ONE_GPU
    colour: str | None = None  # in every chart; None: one of the reports' extra colours
    # one of compare's paired scenarios; False: only what `dpprof run` reports a script as
    paired: bool = True
    # how the verdict names it when the user ran it besides the baseline ("" never named)
    alternative_words: str = ""
    loss_inside: bool = False  # the loss computed inside forward (ModelWithLoss), per replica

    # ---- the model ---------------------------------------------------------------------

    def wrap(self, model: nn.Module, loss_fn: Callable[..., Any], wrappers: Wrappers) -> Any:
        """The model as the scenario runs it (``loss_fn`` inside where :attr:`loss_inside`)."""
        return model

    @property
    def one_process_per_gpu(self) -> bool:
        """Each GPU a process of its own (the cuda backend spawns ranks, cpu runs gloo)."""
        return False

    @property
    def model_on_one_gpu(self) -> bool:
        """Whether the model must live on one GPU (replicated, or one per rank): a model
        that places its layers on several GPUs itself rules the scenario out."""
        return False

    # ---- the rows ----------------------------------------------------------------------

    @property
    def scatters_batch(self) -> bool:
        """The whole batch goes in and is scattered over the GPUs (``tensor.chunk``)."""
        return False

    @property
    def rank(self) -> int | None:
        """The part of each step's global batch the measured process gets
        (:func:`dpprof.scenarios.step.scenario_batch`): None, the whole batch; ``r``, rank
        ``r``'s ``ceil(B / N)`` rows."""
        return 0

    def rows_of(self, shards: list[int], device: int) -> int:
        """Rows device ``device`` works on, from DataParallel's ``shards`` of the batch."""
        return shards[0]

    def samples_per_step(self, batch: int, shards: list[int]) -> int:
        """The samples one step trains (throughput)."""
        return shards[0]

    # ---- where the loss and the targets live --------------------------------------------

    @property
    def targets_on_output_device(self) -> bool:
        """The loss runs on DataParallel's output device, so the targets go there."""
        return False

    # ---- what is shown -----------------------------------------------------------------

    @property
    def ranks_alike(self) -> bool:
        """Every rank runs the same program on as many rows: rank 0 stands for all."""
        return False

    def shown_devices(self, gpus: int, used: list[int]) -> int:
        """The devices an emulation reports (``used``: those the model used)."""
        return max(used) + 1

    def notes(self, batch: int, gpus: int, shards: list[int]) -> list[str]:
        """What an emulation says about the rows (uneven shards, padding)."""
        if batch % gpus:
            return [f"each rank gets ceil({batch} / {gpus}) = {shards[0]} rows "
                    "(DistributedSampler pads)"]
        return []


@dataclass(frozen=True)
class DataParallelScenario(Scenario):
    """``nn.DataParallel`` over every GPU: the whole batch scattered, the outputs (or, with
    :attr:`loss_inside`, one loss per replica) gathered on cuda:0."""

    setup: str = DATA_PARALLEL

    def wrap(self, model: nn.Module, loss_fn: Callable[..., Any], wrappers: Wrappers) -> Any:
        from dpprof.scenarios.model_with_loss import ModelWithLoss

        return wrappers.data_parallel(ModelWithLoss(model, loss_fn) if self.loss_inside
                                      else model)

    @property
    def model_on_one_gpu(self) -> bool:
        return True

    @property
    def scatters_batch(self) -> bool:
        return True

    @property
    def rank(self) -> int | None:
        return None

    def rows_of(self, shards: list[int], device: int) -> int:
        return shards[device] if device < len(shards) else shards[0]

    def samples_per_step(self, batch: int, shards: list[int]) -> int:
        return batch

    @property
    def targets_on_output_device(self) -> bool:
        return not self.loss_inside

    def shown_devices(self, gpus: int, used: list[int]) -> int:
        return gpus

    def notes(self, batch: int, gpus: int, shards: list[int]) -> list[str]:
        if len(shards) < gpus:
            return [f"batch {batch} over {gpus} GPUs: tensor.chunk makes {len(shards)} "
                    f"chunk(s) {shards}, so DataParallel uses only {len(shards)} GPU(s)"]
        if len(set(shards)) > 1:
            return [f"batch {batch} is not divisible by {gpus}: shards {shards}"]
        return []


@dataclass(frozen=True)
class DistributedScenario(Scenario):
    """``DistributedDataParallel``: one process per GPU, each its ``ceil(B / N)`` rows."""

    setup: str = DISTRIBUTED

    def wrap(self, model: nn.Module, loss_fn: Callable[..., Any], wrappers: Wrappers) -> Any:
        return wrappers.ddp(model)

    @property
    def one_process_per_gpu(self) -> bool:
        return True

    @property
    def model_on_one_gpu(self) -> bool:
        return True

    def samples_per_step(self, batch: int, shards: list[int]) -> int:
        return batch  # DistributedSampler's pad rows repeat

    @property
    def ranks_alike(self) -> bool:
        return True

    def shown_devices(self, gpus: int, used: list[int]) -> int:
        return 1


@dataclass(frozen=True)
class OneGpuScenario(Scenario):
    """The bare model on one GPU (or on the GPUs it places its own layers on)."""
