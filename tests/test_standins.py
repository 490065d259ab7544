"""torch._dynamo, symbolic_shapes and sympy stood in for during an emulation
(dpprof.emulator.standins): the same results, the real modules whenever something needs them,
nothing left behind. Each check runs in a fresh interpreter (the test process may have
imported the real modules already, and then nothing is stood in for)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy")


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


EMULATE = """
    import dataclasses, json, sys
    {before}
    from dpprof.pipeline import CompareConfig, run_compare
    from dpprof.result import json_safe
    from dpprof.scenarios.step import StepConfig
    out = {{}}
    for wl, batch, gpus in [("lm", 30, 4), ("convnet", 8, 2), ("attention", 8, 4)]:
        run = run_compare(CompareConfig(workload=wl, step=StepConfig(batch=batch), gpus=gpus,
                                        fixes=True))
        d = json_safe(dataclasses.asdict(run))
        for k in ("created", "environment"):
            d.pop(k)
        out[wl] = d
    real = {{m: type(sys.modules[m]).__name__ == "module" for m in {heavy} if m in sys.modules}}
    print(json.dumps({{"results": out, "loaded": real}}, sort_keys=True))
"""


def test_an_emulation_imports_none_of_them_and_gives_the_same_results() -> None:
    fresh = json.loads(_run(EMULATE.format(before="", heavy=HEAVY)))
    real = json.loads(_run(EMULATE.format(
        before="import torch._dynamo  # the real modules: nothing stood in for", heavy=HEAVY)))
    assert fresh["loaded"] == {}  # none of the three was imported, nothing left behind
    assert real["loaded"] == dict.fromkeys(HEAVY, True)
    assert fresh["results"] == real["results"]


def test_what_the_stand_ins_cannot_answer_loads_the_real_modules() -> None:
    out = _run("""
        import sys, types
        import torch
        from dpprof.emulator.standins import StandIn, load_real, standing_in

        def real(name):
            return type(sys.modules.get(name)) is types.ModuleType

        with standing_in(load_real):
            import torch._dynamo
            assert isinstance(torch._dynamo, StandIn)
            torch._dynamo.graph_break()
            calls = []
            f = torch._dynamo.disable(lambda x: calls.append(x) or x + 1, True, wrapping=False)
            assert f(1) == 2 and calls == [1] and not real("torch._dynamo")
            from torch.fx.experimental.symbolic_shapes import expect_true, sym_eq
            assert expect_true(True) is True and sym_eq([2, (3,)], [2, (3,)]) is True
            assert not real("torch.fx.experimental.symbolic_shapes") and not real("sympy")
            # a name, a submodule, a from-import: the real modules, loaded once
            import torch._dynamo.config as config
            from torch._dynamo.utils import counters
            assert real("torch._dynamo") and real("sympy")
            assert config is sys.modules["torch._dynamo.config"]
            assert sys.modules["torch._dynamo"].utils.counters is counters
            assert f(2) == 3  # through the real torch._dynamo.disable now
            import sympy.core
            assert sympy.core is sys.modules["sympy.core"]
            from torch.fx.experimental import symbolic_shapes
            assert symbolic_shapes.ShapeEnv is not None
        assert all(real(m) for m in ("torch._dynamo", "sympy"))
        print("ok")
    """)
    assert out == "ok"


def test_the_symbolic_shapes_helpers_answer_as_the_real_ones_on_concrete_values() -> None:
    out = _run("""
        import importlib, itertools, sys
        import torch
        from dpprof.emulator.standins import SymbolicShapesStandIn, load_real

        stand_in = SymbolicShapesStandIn("torch.fx.experimental.symbolic_shapes", load_real)
        values = [True, False, 0, 1, 7, -3]
        seqs = [[], [1], [1, 2], (1, 2), [1, [2, 3]], [1, (2, 3)], [2, 1], [1, 2, 3]]
        calls = []
        for name in ("expect_true", "guard_size_oblivious", "guard_or_false", "guard_or_true",
                     "statically_known_true"):
            calls += [(name, (v,)) for v in (True, False)]
        for name in ("guarding_hint_or_throw", "has_guarding_hint", "is_nested_int"):
            calls += [(name, (v,)) for v in values]
        for name in ("sym_and", "sym_or"):
            calls += [(name, c) for n in (1, 2, 3)
                      for c in itertools.product(values[:2], repeat=n)]
        calls += [("sym_eq", p) for p in itertools.product(values + seqs, repeat=2)]

        def outcome(module, name, args):
            try:
                v = getattr(module, name)(*args)
            except AssertionError as e:  # the real one refuses mixed shapes: so must we
                return ("raises", str(e))
            return (v, type(v))

        got = [outcome(stand_in, n, a) for n, a in calls]
        assert "sympy" not in sys.modules  # all answered without the real module
        real = importlib.import_module("torch.fx.experimental.symbolic_shapes")
        want = [outcome(real, n, a) for n, a in calls]
        assert got == want
        assert sum(g[0] == "raises" for g in got) > 0
        print(len(got))
    """)
    assert int(out) > 100
