"""``model-parallel``: not a paired scenario; what ``dpprof run`` names a script that places
its own work on several GPUs (no DataParallel, no DDP)."""

from dpprof.scenarios.base import MODEL_PARALLEL
from dpprof.scenarios.kind import SPLIT_MODEL, Scenario

SCENARIO = Scenario(
    name=MODEL_PARALLEL,
    description="the script places its own work on several GPUs (no DataParallel, no DDP)",
    setup=SPLIT_MODEL,
    paired=False,
)
