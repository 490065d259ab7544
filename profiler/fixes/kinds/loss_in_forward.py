"""Compute the loss inside forward: ``DataParallel(ModelWithLoss(model, loss_fn))``, the
``dp-loss-forward`` scenario."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpprof.fixes.fix_kind import AS_SCENARIO, FixKind, Trial, against
from dpprof.fixes.policy import Cost
from dpprof.result import Fix, ScenarioResult
from dpprof.scenarios.names import DP_LOSS_FORWARD, DP_LOSS_PRIMARY

if TYPE_CHECKING:
    from dpprof.backends.emulated import EmulationConfig

CODE = """\
-model = nn.DataParallel(model.cuda())
+model = nn.DataParallel(dpprof.ModelWithLoss(model, loss_fn).cuda())
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    loss = dpprof.ModelWithLoss.combine(model(inputs.cuda(), targets.cuda()))"""

DETAIL = ("DataParallel(ModelWithLoss(model, loss_fn)): cuda:0 gathers one number per GPU "
          "instead of the batch's outputs")


@dataclass(frozen=True)
class LossInForward(FixKind):
    def measure(self, trial: Trial) -> Fix | None:
        return trial.fix(self, trial.scenario(DP_LOSS_FORWARD), DETAIL, CODE)

    def from_scenario(self, s: ScenarioResult | None, primary: ScenarioResult, gpus: int,
                      batch: int) -> Fix | None:
        return against(self.name, self.title, s, primary, DETAIL, CODE)

    def alone(self, trial: Trial, fix: Fix) -> tuple[str, EmulationConfig] | None:
        return DP_LOSS_FORWARD, trial.base


FIX = LossInForward(
    name="loss-in-forward", title="Compute the loss inside forward",
    applies_to=(DP_LOSS_PRIMARY,), measured=AS_SCENARIO, measured_in=DP_LOSS_FORWARD,
    cost=Cost(1, "a wrapper: DataParallel(ModelWithLoss(model, loss_fn)), the loss read from its "
              "output", "the same work, the loss computed on each GPU"),
)
