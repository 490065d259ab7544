"""What an emulated scenario measures besides itself, for the fixes
(:mod:`dpprof.measure.fix_savings`): the request (:class:`Alongside`, with the batch's further
splits as :class:`FurtherSplits`), the further steps run in ``dp-loss-primary``'s own loop
after its measured step (:class:`FurtherSteps`), and the result of a variant a ledger
followed beside ``ddp`` (:func:`ledger_result`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from dpprof.backends.emulated_config import EmulationConfig
from dpprof.backends.emulated_figures import ddp_ranks, device_results, judge
from dpprof.backends.emulated_time import fill_predicted_time
from dpprof.emulator.data_parallel import EmulatedDataParallel
from dpprof.emulator.ledgers import VariantLedger
from dpprof.emulator.virtual_devices import VirtualDevices
from dpprof.result import DeviceResult, ScenarioResult
from dpprof.scenarios.names import DDP, DP_LOSS_PRIMARY
from dpprof.scenarios.registry import find
from dpprof.scenarios.shards import shard_sizes
from dpprof.scenarios.workloads import tensors_in

__all__ = [
    "ON_CUDA0",
    "ON_THE_OUTPUT_DEVICE",
    "Alongside",
    "FurtherSplits",
    "FurtherSteps",
    "StepsDone",
    "ledger_result",
]


class StepsDone(Exception):
    """Nothing more to measure after the scenario's step: the loop stops there."""


# What the loop may have left on cuda:0 after dp-loss-primary's step, by category: what
# DataParallel(output_device=k) leaves on cuda:k instead (the gathered outputs, the loss,
# and the targets, marked as they are moved), and what it leaves on cuda:0 as well.
ON_THE_OUTPUT_DEVICE = ("outputs", "loss")
ON_CUDA0 = ("parameters", "gradients", "optimizer_state", "inputs")


class FurtherSteps:
    """``dp-loss-primary``'s loop after its measured step (:class:`Alongside`): the splits
    the plan asks for, then one step of ``DataParallel(output_device=k)``.

    Only after a steady step (:meth:`step_ended`). A split's step starts from what the
    scenario's own step left (it leaves the same, whatever the split). The output
    device's step starts from it too, with the loop's leftovers that live on cuda:k under
    that option (the outputs, the loss, the targets) moved there first
    (:meth:`VirtualDevices.rehome`); where the step left anything else on cuda:0 of no
    known kind, or anything on another GPU, it is not run (the caller emulates it on its
    own). ``tests/test_fixes.py`` checks both against emulating each variant alone, byte
    for byte.
    """

    def __init__(self, rt: VirtualDevices, wrapped: EmulatedDataParallel, alongside: Alongside,
                 cfg: EmulationConfig, name: str) -> None:
        self.rt, self.wrapped, self.alongside, self.cfg = rt, wrapped, alongside, cfg
        self.kind = find(name)
        self.name = name
        self.splits = alongside.splits
        self.splits_open = self.splits is not None
        self.output_device = alongside.output_device
        self.max_steps = ((self.splits.max_steps if self.splits is not None else 0)
                          + (self.output_device is not None))
        self.active: str | None = None  # "split" | "output_device" while one runs
        self._targets: set[int] = set()  # serials of the targets moved (any step)
        self._step_serial = 0  # the first serial of the scenario's measured step
        self._start = 0
        self._last: ScenarioResult | None = None
        self._before: list[int] | None = None  # live bytes after the step before
        self.steady = False
        self._log_start = 0  # the further step's first op in the op log

    @property
    def target_device(self) -> int:
        """Where the step now running moves the targets: the output device's step's."""
        return self.wrapped.output_device if self.active == "output_device" else 0

    def note_targets(self, moved: Any) -> None:
        for t in tensors_in(moved):
            serial = self.rt.storages.serial_of(t)
            if serial is not None:
                self._targets.add(serial)

    def step_began(self) -> None:
        self._step_serial = self.rt.storages.last_serial

    def step_ended(self, measured: bool) -> None:
        """The step before the measured one, or the measured one, ended: each device's
        live bytes. The loop is steady when the measured step left what the one before
        it left; only then is a further step what a variant's own measured step is (a
        user's step that keeps something of every step is not)."""
        live = [self.rt.storages.live_bytes(i) for i in range(self.rt.num_devices)]
        if measured:
            self.steady = live == self._before
        else:
            self._before = live

    def begin(self, scenario: ScenarioResult) -> None:
        """Before a further step: the next variant set up, or :class:`StepsDone`."""
        if not self.steady:
            raise StepsDone
        if self._last is None:
            self._last = scenario
        chunks = self._next_split()
        if chunks is not None:
            self.active = "split"
            self.wrapped.chunk_sizes = chunks
        elif self.output_device is not None and self.alongside.output_device_result is None:
            if not self._move_leftovers(self.output_device):
                raise StepsDone
            self.active = "output_device"
            self.wrapped.chunk_sizes = None
            self.wrapped.output_device = self.output_device
        else:
            raise StepsDone
        self.rt.reset_peaks()
        self._start = len(self.rt.storages.events)
        log = self.rt.op_log
        if log is not None:  # the variant's step, for its predicted time
            self._log_start = len(log.records)
            log.on = True

    def _next_split(self) -> tuple[int, ...] | None:
        if not self.splits_open or self.splits is None or self._last is None:
            return None
        chunks = self.splits(self._last)
        if chunks is None:
            self.splits_open = False
        return chunks

    def _move_leftovers(self, device: int) -> bool:
        rt = self.rt
        if any(rt.storages.live_bytes(i) for i in range(1, rt.num_devices)):
            return False
        moving = []
        for serial, category in rt.storages.live_storages(0):
            if category in ON_THE_OUTPUT_DEVICE or serial in self._targets:
                moving.append(serial)
            elif category not in ON_CUDA0 and serial > self._step_serial:
                return False  # left by the step, of no known kind
        rt.rehome(set(moving), device)
        return True

    def end(self, batch: int) -> None:
        """After a further step: its figures (peaks only)."""
        wrapped = self.wrapped
        chunks = (list(wrapped.chunk_sizes) if wrapped.chunk_sizes is not None
                  else shard_sizes(batch, self.cfg.gpus))
        s = ScenarioResult(name=self.name, batch=batch, devices=tuple(device_results(
            self.rt, dataclasses.replace(self.cfg, peaks_only=True), self.kind, chunks,
            wrapped.used_devices, self._start, {})))
        log = self.rt.op_log
        if log is not None and log.on:
            log.on = False
            s = fill_predicted_time(s, log, self.cfg.gpu, self.cfg.interconnect, False,
                                    self._log_start)
        s = judge(s, self.cfg)
        if self.active == "output_device":
            self.alongside.output_device_result = s
        else:
            self._last = s
        self.active = None

    def finish(self) -> None:
        """Every further step ran: the plan gets the last split's figures."""
        if self.splits_open:
            self._next_split()


@dataclass
class Alongside:
    """What a comparison's scenarios measure besides themselves, over meta tensors, for
    the fixes (:mod:`dpprof.measure.fix_savings`):

    * ``splits``: further splits of the batch, measured in ``further_steps_in``'s own loop
      (``dp-loss-primary``) after its measured step (:class:`FurtherSplits`);
    * ``bucket_view``: ``ddp`` with ``gradient_as_bucket_view=True``, followed in a ledger
      while ``ledger_in`` (``ddp``) runs plain
      (:class:`~dpprof.emulator.ddp.BucketViewFollower`); its figures (peaks only) land
      in ``bucket_view_result``, None where it could not be followed;
    * ``output_device``: ``DataParallel(output_device=k)`` as one more step of
      ``further_steps_in``'s loop, after the splits; its figures (peaks only) land in
      ``output_device_result``, None where it could not run there.

    The fixes (:mod:`dpprof.fixes.fix_registry`) say which scenario hosts each.
    """

    splits: FurtherSplits | None = None
    further_steps_in: str = DP_LOSS_PRIMARY  # a DataParallel scenario with its loss on cuda:0
    bucket_view: bool = False
    ledger_in: str = DDP
    bucket_view_result: ScenarioResult | None = None
    output_device: int | None = None
    output_device_result: ScenarioResult | None = None


class FurtherSplits(Protocol):
    """Splits of the batch measured after ``dp-loss-primary``'s step, in its own loop.

    A DataParallel step leaves the same state whatever the split (the parameters, their
    gradients and optimizer state on cuda:0; the gathered outputs, the loss and the batch,
    all the whole batch's, on cuda:0; nothing on the other GPUs), so the step after the
    measured one, run with other chunk sizes, is what that split's own measured step is
    (``tests/test_fixes.py`` checks it byte for byte). Called with the last measured
    figures (the scenario's, then each split's, peaks only), it returns the next chunk
    sizes, or None to stop; at most :attr:`max_steps` further steps.
    """

    max_steps: int

    def __call__(self, last: ScenarioResult) -> tuple[int, ...] | None: ...


def ledger_result(ledger: VariantLedger, scenario: ScenarioResult,
                   cfg: EmulationConfig) -> ScenarioResult:
    """The variant a ledger followed, as its scenario's result with the ledger's peaks
    (every DDP rank the same; no breakdown, no timeline)."""
    d = scenario.devices[0]
    template = DeviceResult(
        index=0, peak_allocated_bytes=ledger.peak_allocated,
        peak_requested_bytes=ledger.peak_requested, capacity_bytes=d.capacity_bytes,
        used=True, batch_rows=d.batch_rows)
    out = ScenarioResult(name=scenario.name, batch=scenario.batch,
                         devices=tuple(ddp_ranks(template, len(scenario.devices))))
    return judge(out, cfg)
