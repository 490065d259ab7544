"""A registry of per-op rules for a dispatch mode, as torch's ``FakeTensorMode`` keeps its
op implementations (``torch/_subclasses/fake_tensor.py``: ``register_op_impl`` files a
rule under an ``OpOverload``, or under a check that ops are asked in order, with a default
for every other op).

A rule is registered with :meth:`OpRules.register` for an ``OpOverload`` (that overload),
an ``OpOverloadPacket`` (each of its overloads) or a predicate over ops (asked in the order
registered, after the ops named). :meth:`OpRules.rule_for` answers an op's rule once and
keeps the answer by the op's identity (an ``OpOverload``'s ``__hash__`` is Python: a call
per look-up, on every op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from torch._ops import OpOverload, OpOverloadPacket

from dpprof.emulator.identity import op_key

__all__ = ["OpRules", "Rule"]

M = TypeVar("M")
# rule(mode, func, types, args, kwargs) -> the op's result, as __torch_dispatch__ returns it
Rule = Callable[[M, Any, Any, Any, Any], Any]


class OpRules(Generic[M]):
    """Per-op rules of a dispatch mode of type ``M``, with a ``default`` for the rest."""

    def __init__(self, default: Rule[M]) -> None:
        self.default = default
        self._by_op: dict[OpOverload, Rule[M]] = {}
        self._by_packet: dict[OpOverloadPacket, Rule[M]] = {}
        self._checks: list[tuple[Callable[[Any], bool], Rule[M]]] = []
        # op_key(op) -> (op, its rule): the op is kept to check the key
        self._found: dict[int, tuple[Any, Rule[M]]] = {}

    def register(self, *targets: OpOverload | OpOverloadPacket | Callable[[Any], bool]
                 ) -> Callable[[Rule[M]], Rule[M]]:
        """A decorator filing its rule under each of ``targets``: ops, op packets, or
        predicates over ops."""
        def file(rule: Rule[M]) -> Rule[M]:
            for target in targets:
                if isinstance(target, OpOverload):
                    self._by_op[target] = rule
                elif isinstance(target, OpOverloadPacket):
                    self._by_packet[target] = rule
                else:
                    self._checks.append((target, rule))
            self._found.clear()
            return rule
        return file

    def rule_for(self, func: Any) -> Rule[M]:
        """``func``'s rule: the one filed under it, else under its packet, else the first
        whose predicate holds for it, else the default."""
        found = self._found.get(op_key(func))
        if found is not None and found[0] is func:
            return found[1]
        rule = self._by_op.get(func)
        if rule is None:
            rule = self._by_packet.get(getattr(func, "_overloadpacket", None))  # type: ignore[arg-type]
        if rule is None:
            rule = next((r for check, r in self._checks if check(func)), self.default)
        self._found[op_key(func)] = (func, rule)
        return rule

    def forget(self) -> None:
        """Drop the answers kept (a predicate's answer may change: tests)."""
        self._found.clear()
