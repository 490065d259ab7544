"""One module per scenario, each its :class:`~dpprof.scenarios.kind.Scenario` as ``SCENARIO``;
:mod:`dpprof.scenarios.registry` lists them."""
