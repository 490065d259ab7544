"""DistributedDataParallel in place of DataParallel: the ``ddp`` scenario."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpprof.fixes.fix_kind import AS_SCENARIO, FixKind, Trial, against
from dpprof.fixes.policy import Cost
from dpprof.result import Fix, ScenarioResult
from dpprof.scenarios.names import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY
from dpprof.scenarios.shards import shard_sizes

if TYPE_CHECKING:
    from dpprof.backends.emulated import EmulationConfig

# the DataParallel model and loader turned into DDP's (the ladder's rungs start from it too)
CODE_SETUP = """\
+# torchrun --nproc-per-node {gpus} train.py
+dist.init_process_group("nccl")
+rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
-model = nn.DataParallel(model.cuda())
+model = DDP(model.cuda(rank), device_ids=[rank])
+loader = DataLoader(dataset, batch_size={per_rank},
+                    sampler=DistributedSampler(dataset))  # per-rank batch
"""
CODE = CODE_SETUP + """\
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))"""

DETAIL = ("every GPU holds its own parameters, gradients and optimizer state and its "
          "shard")


@dataclass(frozen=True)
class Distributed(FixKind):
    def measure(self, trial: Trial) -> Fix | None:
        return self.from_scenario(trial.scenario(DDP), trial.primary, trial.gpus, trial.batch)

    def from_scenario(self, s: ScenarioResult | None, primary: ScenarioResult, gpus: int,
                      batch: int) -> Fix | None:
        code = CODE.format(gpus=gpus, per_rank=shard_sizes(batch, gpus)[0])
        return against(self.name, self.title, s, primary, DETAIL, code)

    def alone(self, trial: Trial, fix: Fix) -> tuple[str, EmulationConfig] | None:
        return DDP, trial.base


FIX = Distributed(
    name="ddp", title="DistributedDataParallel",
    applies_to=(DP_LOSS_PRIMARY, DP_LOSS_FORWARD), measured=AS_SCENARIO, measured_in=DDP,
    cost=Cost(2, "a launcher: torchrun, a process group and a DistributedSampler",
              "no scatter, replicate or gather per step; the all-reduce overlaps backward"),
)
