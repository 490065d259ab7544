"""``dp-loss-primary``: ``nn.DataParallel(model)``; the outputs gathered on cuda:0, the loss
there over the whole batch (what most DataParallel scripts do)."""

from dpprof.scenarios.kind import DataParallelScenario
from dpprof.scenarios.names import DP_LOSS_PRIMARY

SCENARIO = DataParallelScenario(
    name=DP_LOSS_PRIMARY,
    description="nn.DataParallel(model); outputs gathered on cuda:0, loss there",
    colour="#e69f00",
    alternative_words="the loss on cuda:0 (dp-loss-primary)",
)
