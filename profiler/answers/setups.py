"""Which scenario of a result stands for what the user runs (:func:`baseline`), and the
setup each scenario is (DataParallel, DDP, model parallel, one GPU), in the words the
answer uses."""

from __future__ import annotations

from dpprof.answers.answer_figures import measured
from dpprof.result import RunResult, ScenarioResult
from dpprof.scenarios.registry import REGISTRY

WATCH, MAXBATCH, NOTHING = "watch", "maxbatch", "none"
# each scenario's setup (dpprof.scenarios.registry: DATA_PARALLEL, DISTRIBUTED, ...)
SETUPS = {s.name: s.setup for s in REGISTRY}
# the scenario that stands for what the user runs, the first of these a result holds
BASELINES = tuple(s.name for s in REGISTRY)
# how the verdict names another scenario the user ran, against the baseline
ALTERNATIVE_WORDS = {s.name: s.alternative_words for s in REGISTRY if s.alternative_words}



def baseline(run: RunResult) -> ScenarioResult | None:
    """The scenario that stands for what the user runs: DataParallel with the loss on cuda:0
    where it was measured, else the first of :data:`BASELINES` measured; of a result that
    measured none, its first scenario."""
    for name in BASELINES:
        s = run.scenario(name)
        if measured(s):
            return s
    return run.scenarios[0] if run.scenarios else None


def distributed_words(name: str) -> str:
    """How the verdict names a one-process-per-GPU scenario: DDP, or FSDP2 for a script that
    shards its model with fully_shard."""
    return ALTERNATIVE_WORDS.get(name) or "DDP"
