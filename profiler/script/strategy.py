"""A fix as ``dpprof run`` measures it in the user's script: the fix kind's strategy.

A fix kind (:mod:`dpprof.fixes.kinds`) says what a fix is and how ``compare`` measures it;
the fixes sit below the script run in the layers, so the part of a fix that needs the
running script lives here, in the script layer: one :class:`RunStrategy` per fix that
``dpprof run`` measures, in a module of its own named after the fix
(``dpprof.script.<name>_run``, its ``-`` as ``_``; :mod:`dpprof.script.strategy_registry`
finds it by the kind's one name). A strategy is either

* an :class:`Alternative`: the script run once more with the fix made as it runs (its
  patches, :meth:`Alternative.install`; DataParallel's forward, :meth:`Alternative.dp_forward`;
  what the run followed besides, :meth:`Alternative.after_run`), then measured against the
  script as written, with its change as a diff of the script's own lines; or
* a strategy that reads its fix from what another alternative's run followed (DDP's
  ``gradient_as_bucket_view``, followed in a ledger while the DDP alternative runs plain).

The runs, the session and the wrappers loop over the registry and call these methods; no
fix's name is compared outside the fix's own module.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpprof.emulator.patcher import Patcher
    from dpprof.emulator.virtual_cuda import VirtualCuda
    from dpprof.fixes.fix_kind import FixKind
    from dpprof.result import Fix
    from dpprof.script.runner import ScriptConfig, ScriptRun
    from dpprof.script.wrappers import VirtualDataParallel

StepCallback = Callable[[int], None]


@dataclass
class AlternativeState:
    """What one run of an alternative follows: its patches write it as the script runs,
    :meth:`Alternative.after_run` once it has ended, and the run keeps it
    (:attr:`~dpprof.script.runner.ScriptRun.alternative_state`) for the fix's strategy to read.
    Each alternative's record is its own subclass (:meth:`Alternative.new_state`), read
    through its strategy's module; here is only what the run itself reads of any."""

    batch_rows: int = 0  # the rows of a batch the alternative made (0: it made none)

    @property
    def losses_inside_forward(self) -> bool:
        """The alternative computed the script's loss inside forward on every replica (its
        run is ``dp-loss-forward``, as a script whose replicas return their losses)."""
        return False


def data_parallel_gpus(main: ScriptRun) -> int:
    """The GPUs the DataParallel script as written used (``device_ids=[0, 1]`` of four:
    two; BalancedDataParallel's cuda:0 with no rows of the batch counts): its alternatives
    run on the same GPUs, DDP with a rank on each."""
    return sum(1 for d in main.scenario.devices if d.used) or len(main.scenario.devices)


def scattered_as_in(cfg: ScriptConfig, main: ScriptRun, **changes: Any) -> ScriptConfig:
    """``cfg`` for an alternative's (or a rung's) run of the script as written ``main``,
    with ``changes``: the batch DataParallel scattered there (its rows, the dimension it
    split them along, the GPUs it used), from which the DDP alternative gives each rank its
    share."""
    return dataclasses.replace(cfg, scattered_rows=main.batch_rows,
                               scattered_dim=main.batch_dim,
                               scattered_gpus=data_parallel_gpus(main), **changes)


@dataclass
class AlternativeRuns:
    """The session's runs of a DataParallel script, as the strategies add to them: the
    configuration, the script as written (``main``) and its GPUs, each alternative's run
    (by the fix's name), the fixes measured and why one could not be."""

    cfg: ScriptConfig
    main: ScriptRun
    gpus: int
    step_cb: Callable[[str], StepCallback]
    runs: list[tuple[str, ScriptRun]]
    notes: list[str]
    fixes: list[Fix]


class RunStrategy(ABC):
    """How ``dpprof run`` measures one fix kind (see the module)."""

    def __init__(self, kind: FixKind) -> None:
        self.kind = kind

    @property
    def name(self) -> str:
        """The fix's one name (its kind's): its run's and its result's."""
        return self.kind.name

    @abstractmethod
    def measure(self, runs: AlternativeRuns) -> None:
        """Measure the fix on the script ``runs`` ran as written: its run into
        ``runs.runs``, what it saves into ``runs.fixes``, why it could not into
        ``runs.notes``."""


class Alternative(RunStrategy):
    """A strategy that runs the script once more with the fix made as it runs."""

    # the run plays one rank of DDP, of as many ranks as the script sees GPUs
    as_ranks = False
    # the ladder's rungs start from this alternative's run where it ran (they start from DDP)
    ladder_floor = False

    def new_state(self, cfg: ScriptConfig) -> AlternativeState:
        """The record of one run of this alternative (``cfg``'s), before the script runs."""
        return AlternativeState()

    def install(self, state: AlternativeState, vc: VirtualCuda, patcher: Patcher) -> None:
        """The alternative's patches, through the run's ``patcher`` (undone with the run's);
        what they see goes into ``state``."""

    def dp_made(self, dp: VirtualDataParallel, site: str) -> None:
        """The script made a DataParallel wrapper at ``site`` ("file:line"): nothing, unless
        the alternative acts on it."""

    def dp_forward(self, dp: VirtualDataParallel, inputs: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """DataParallel's forward in this alternative (as written, unless it changes it)."""
        return dp.as_written(inputs, kwargs)

    def after_run(self, state: AlternativeState, vc: VirtualCuda,
                  ddp_devices: list[int]) -> None:
        """What the run followed besides its peaks, read into ``state`` (the run's record)
        once it has ended (``ddp_devices``: the devices DDP ran on)."""
