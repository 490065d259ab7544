"""``fsdp2``: not a paired scenario; what ``dpprof run`` names a script that shards its model
with FSDP2's ``fully_shard`` (one process per GPU, each its shard of the parameters, their
gradients and optimizer state, each block's parameters all-gathered for its forward and
backward)."""

from dpprof.scenarios.kind import DistributedScenario
from dpprof.scenarios.names import FSDP2

SCENARIO = DistributedScenario(
    name=FSDP2,
    description="FSDP2 (fully_shard), one process per GPU, each its shard of the model",
    paired=False,
    alternative_words="FSDP2",
)
