"""Every scenario, once: the one list the backends, the answers and the reports loop over.

Adding a scenario is its module under :mod:`dpprof.scenarios.kinds` (a ``SCENARIO``, see
:mod:`dpprof.scenarios.kind`) and one line in :data:`MODULES`. The order is the order of the
reports and of ``--scenarios``' default, and the order in which the answers pick the
scenario that stands for what the user runs (the first the result holds).
"""

from __future__ import annotations

import importlib

from dpprof.scenarios.kind import Scenario

MODULES = (
    "dpprof.scenarios.kinds.dp_loss_primary",
    "dpprof.scenarios.kinds.dp_loss_forward",
    "dpprof.scenarios.kinds.distributed_data_parallel",
    "dpprof.scenarios.kinds.fsdp2",
    "dpprof.scenarios.kinds.tensor_parallel",
    "dpprof.scenarios.kinds.model_parallel",
    "dpprof.scenarios.kinds.single",
)


def _load(module: str) -> Scenario:
    scenario = importlib.import_module(module).SCENARIO
    assert isinstance(scenario, Scenario), module
    return scenario


REGISTRY: tuple[Scenario, ...] = tuple(_load(m) for m in MODULES)
BY_NAME: dict[str, Scenario] = {s.name: s for s in REGISTRY}
PAIRED: tuple[Scenario, ...] = tuple(s for s in REGISTRY if s.paired)
# compare's scenarios (--scenarios), in the reports' order
SCENARIOS: tuple[str, ...] = tuple(s.name for s in PAIRED)
DESCRIPTIONS: dict[str, str] = {s.name: s.description for s in PAIRED}


def scenario(name: str) -> Scenario:
    """The scenario called ``name``; a ValueError naming the choices for another."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") \
            from None


def find(name: str) -> Scenario | None:
    """The scenario called ``name``, None for a name no scenario has (an older result's)."""
    return BY_NAME.get(name)
