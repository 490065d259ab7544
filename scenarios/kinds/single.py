"""``single``: one GPU with ``ceil(B / N)`` rows, the floor a balanced scheme approaches (a
model that places its layers on several GPUs itself: its share of each)."""

from dpprof.scenarios.kind import OneGpuScenario
from dpprof.scenarios.names import SINGLE

SCENARIO = OneGpuScenario(
    name=SINGLE,
    description="one GPU with batch ceil(B / N): the floor a balanced scheme approaches",
    colour="#999999",
)
