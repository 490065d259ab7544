"""``ddp``: ``DistributedDataParallel``, one process per GPU, each its ``ceil(B / N)`` rows
(``DistributedSampler`` pads the last shard)."""

from dpprof.scenarios.kind import DistributedScenario
from dpprof.scenarios.names import DDP

SCENARIO = DistributedScenario(
    name=DDP,
    description="DistributedDataParallel, one process per GPU, each its shard",
    colour="#009e73",
    alternative_words="DDP",
)
