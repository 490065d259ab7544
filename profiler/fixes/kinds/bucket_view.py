"""``DDP(gradient_as_bucket_view=True)``: ``.grad`` a view of the reducer's bucket, followed
in a ledger while ``ddp`` runs plain."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpprof.fixes.fix_kind import LEDGER, FixKind, Trial, measured_ok, peaks
from dpprof.fixes.policy import Cost
from dpprof.result import Fix
from dpprof.scenarios.names import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY
from dpprof.units import fmt_bytes

if TYPE_CHECKING:
    from dpprof.backends.emulated import Alongside, EmulationConfig

CODE = """\
-model = DDP(model.cuda(rank), device_ids=[rank])
+model = DDP(model.cuda(rank), device_ids=[rank], gradient_as_bucket_view=True)"""


def _with_bucket_view(base: EmulationConfig) -> EmulationConfig:
    return base.with_step(ddp=dataclasses.replace(base.step.ddp, gradient_as_bucket_view=True))


@dataclass(frozen=True)
class BucketView(FixKind):
    def ask(self, alongside: Alongside, batch: int, gpus: int) -> None:
        alongside.bucket_view, alongside.ledger_in = True, DDP
        alongside.bucket_view_result = None

    def alone(self, trial: Trial, fix: Fix) -> tuple[str, EmulationConfig] | None:
        return DDP, _with_bucket_view(trial.base)

    def measure(self, trial: Trial) -> Fix | None:
        ddp = trial.scenario(DDP)
        gabv = (trial.measured.bucket_view_result
                or trial.emulate(DDP, _with_bucket_view(trial.base)))
        if not (measured_ok(gabv) and measured_ok(ddp)):
            return None
        assert ddp is not None
        extra = peaks(ddp)[0] - peaks(gabv)[0]
        return trial.fix(
            self, gabv,
            f".grad becomes a view of the reducer's bucket: {fmt_bytes(extra)} less than "
            "plain DDP per GPU at the peak" + (
                "" if extra > 0 else " (the peak comes before the gradients all exist; the "
                "gradient-sized copy is still saved later in the step)"), CODE)


FIX = BucketView(
    name="gradient-as-bucket-view", title="DDP with gradient_as_bucket_view=True",
    applies_to=(DP_LOSS_PRIMARY, DP_LOSS_FORWARD, DDP), measured=LEDGER, measured_in=DDP,
    cost=Cost(3, "DDP and a flag", "none"),
)
