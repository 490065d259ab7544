"""``model-parallel``: not a paired scenario; what ``dpprof run`` names a script that places
its own work on several GPUs (no DataParallel, no DDP)."""

from dpprof.scenarios.kind import Scenario
from dpprof.scenarios.names import MODEL_PARALLEL, SPLIT_MODEL

SCENARIO = Scenario(
    name=MODEL_PARALLEL,
    description="the script places its own work on several GPUs (no DataParallel, no DDP)",
    setup=SPLIT_MODEL,
    paired=False,
)
