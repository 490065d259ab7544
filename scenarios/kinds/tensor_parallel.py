"""``tensor-parallel``: not a paired scenario; what ``dpprof run`` names a script that shards
its layers over a device mesh with ``parallelize_module`` (one process per GPU, each its
shard of every parallelized layer's weights, the activations as the plan lays them out)."""

from dpprof.scenarios.kind import DistributedScenario
from dpprof.scenarios.names import TENSOR_PARALLEL

SCENARIO = DistributedScenario(
    name=TENSOR_PARALLEL,
    description="tensor parallelism (parallelize_module), one process per GPU, each its "
                "shard of the layers",
    paired=False,
    alternative_words="tensor parallelism",
)
