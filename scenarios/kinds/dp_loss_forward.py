"""``dp-loss-forward``: ``nn.DataParallel(ModelWithLoss(model, loss))``; each replica
computes its loss, cuda:0 gathers one number per GPU."""

from dpprof.scenarios.kind import DataParallelScenario
from dpprof.scenarios.names import DP_LOSS_FORWARD

SCENARIO = DataParallelScenario(
    name=DP_LOSS_FORWARD,
    description="nn.DataParallel(ModelWithLoss(model, loss)); loss on each replica",
    colour="#56b4e9",
    alternative_words="computing the loss inside forward",
    loss_inside=True,
)
