"""``DataParallel(output_device=k)``: the gathered outputs and the loss on the last GPU, one
more step of ``dp-loss-primary``'s loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpprof.fixes.fix_kind import FURTHER_STEP, FixKind, Trial, against, measured_ok
from dpprof.fixes.policy import Cost
from dpprof.result import Fix
from dpprof.scenarios.names import DP_LOSS_PRIMARY
from dpprof.scenarios.shards import shard_sizes
from dpprof.units import fmt_bytes

if TYPE_CHECKING:
    from dpprof.backends.emulated import Alongside, EmulationConfig

CODE = """\
-model = nn.DataParallel(model.cuda())
+model = nn.DataParallel(model.cuda(), output_device={dev})
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    loss = loss_fn(model(inputs.cuda()), targets.cuda({dev}))"""


def output_device(batch: int, gpus: int) -> int | None:
    """The output device the fix moves the outputs to: the last GPU used."""
    used = len(shard_sizes(batch, gpus))
    return used - 1 if used >= 2 else None


@dataclass(frozen=True)
class OutputDevice(FixKind):
    def ask(self, alongside: Alongside, batch: int, gpus: int) -> None:
        alongside.output_device = output_device(batch, gpus)
        alongside.further_steps_in = DP_LOSS_PRIMARY
        alongside.output_device_result = None

    def alone(self, trial: Trial, fix: Fix) -> tuple[str, EmulationConfig] | None:
        dev = output_device(trial.batch, trial.gpus)
        return None if dev is None else (DP_LOSS_PRIMARY, trial.variant(dp_output_device=dev))

    def measure(self, trial: Trial) -> Fix | None:
        dev = output_device(trial.batch, trial.gpus)
        if dev is None:
            return None
        out = trial.measured.output_device_result or trial.emulate(
            DP_LOSS_PRIMARY, trial.variant(dp_output_device=dev))
        if not measured_ok(out):
            return None
        used = [d for d in out.devices if d.used]
        heavy = max(used, key=lambda d: (d.peak_allocated_bytes, -d.index))
        moved = next((d for d in used if d.index == dev), heavy)
        where = (f"cuda:{dev} is then the heaviest, at {fmt_bytes(heavy.peak_allocated_bytes)}"
                 if heavy.index == dev else
                 f"cuda:{dev} then peaks at {fmt_bytes(moved.peak_allocated_bytes)} and the "
                 f"heaviest is cuda:{heavy.index}, at {fmt_bytes(heavy.peak_allocated_bytes)}")
        return against(
            self.name, self.title.format(dev=dev), out, trial.primary,
            f"the gathered outputs and the loss move to cuda:{dev}: {where}; it moves the "
            "imbalance, it does not remove it", CODE.format(dev=dev))


FIX = OutputDevice(
    name="output-device", title="DataParallel(output_device={dev})",
    applies_to=(DP_LOSS_PRIMARY,), measured=FURTHER_STEP, measured_in=DP_LOSS_PRIMARY,
    cost=Cost(4, "an argument to DataParallel; the imbalance moves to another GPU", "none"),
)
