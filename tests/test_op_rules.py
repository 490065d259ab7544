"""The per-op rule registry (:class:`dpprof.emulator.op_rules.OpRules`), as torch's
``FakeTensorMode`` files its op implementations: an overload's own rule first, then its
packet's, then the first predicate that holds, then the default; and the virtual CUDA's
rules filed so (:data:`dpprof.emulator.cuda_devices.RULES`)."""

from __future__ import annotations

from typing import Any

import torch

from dpprof.emulator import cuda_devices
from dpprof.emulator.op_rules import OpRules

aten = torch.ops.aten


def _named(name: str) -> Any:
    def rule(mode: object, func: object, types: object, args: object, kwargs: object) -> str:
        return name
    return rule


def test_an_overload_beats_its_packet_and_a_packet_beats_a_predicate() -> None:
    rules: OpRules[object] = OpRules(_named("default"))
    rules.register(aten.add)(_named("add, any overload"))
    rules.register(aten.add.Tensor)(_named("add.Tensor"))
    rules.register(lambda func: func.__name__.startswith("add"))(_named("starts with add"))
    rules.register(lambda func: "mul" in func.__name__)(_named("mul, first"))
    rules.register(lambda func: "mul" in func.__name__)(_named("mul, second"))

    def answer(func: Any) -> str:
        return rules.rule_for(func)(None, func, (), (), {})  # type: ignore[no-any-return]

    assert answer(aten.add.Tensor) == "add.Tensor"
    assert answer(aten.add.Scalar) == "add, any overload"
    assert answer(aten.addmm.default) == "starts with add"
    assert answer(aten.mul.Tensor) == "mul, first"  # predicates in the order registered
    assert answer(aten.sub.Tensor) == "default"
    # a rule registered later applies to ops already asked about
    rules.register(aten.sub.Tensor)(_named("sub"))
    assert answer(aten.sub.Tensor) == "sub"


def test_the_virtual_cudas_ops_with_rules_of_their_own() -> None:
    rules = cuda_devices.RULES
    default = cuda_devices.CudaDevices.dispatch_counted
    own = {aten.convolution.default, aten._local_scalar_dense.default, aten.item.default,
           aten.is_nonzero.default, aten.index.Tensor, aten.copy_.default,
           aten.nonzero.default, aten.arange.start, aten._foreach_add_.List,
           torch.ops.profiler._record_function_enter_new.default}
    for op in own:
        assert rules.rule_for(op) is not default, op
    for op in (aten.add.Tensor, aten.mm.default, aten.empty.memory_format, aten.index_put_.default):
        assert rules.rule_for(op) is default, op
