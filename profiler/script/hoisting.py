"""Where a rewrite needs a name bound earlier than the script binds it: whether a name is
bound at a statement, moving its one assignment up (and those it reads first), and the
statement after which a name that is bound later is available."""

from __future__ import annotations

import ast
import builtins

from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    bindings,
    bound_between,
    loaded_names,
    start_of,
)

__all__ = ["after_definition", "available", "hoist", "moves"]


def available(src: ScriptSource, scope: ast.AST, key: str, at: ast.stmt) -> bool:
    """Whether ``key`` (a name or dotted attribute) names something at statement ``at`` of
    ``scope`` (a local bound before it, a global, a builtin)."""
    binds = [b for b in bindings(src, scope) if b.name == key]
    if binds:
        return any(b.pos <= start_of(at) for b in binds)
    root = key.split(".")[0]
    if root != key:
        return available(src, scope, root, at)
    # a free name: an enclosing function's or the module's, bound by the time it runs (a
    # class body's names are not visible in its methods)
    outer = scope
    while not isinstance(outer, ast.Module):
        outer = src.scope(outer)
        if not isinstance(outer, ast.ClassDef) and any(
                b.name == key for b in bindings(src, outer)):
            return True
    return hasattr(builtins, key)


def hoist(src: ScriptSource, edits: Edits, scope: ast.AST, key: str, wrap: ast.stmt) -> str:
    """Move the one assignment of ``key`` that follows the wrap (in the same statement list
    as the wrap or a statement holding it) to just before that statement, and first those of
    the names it reads that are set between (``weights`` of ``criterion =
    CrossEntropyLoss(weight=weights)``), each as it; all are checked before any moves. The
    words for the note: each name moved and its line."""
    order = _to_hoist(src, scope, key, wrap, ())
    for assign, holder in order:
        start, end = src.whole_lines(assign)
        text = src.text[start:end]
        edits.replace(start, end, "")
        at = src.line_start(holder.lineno)
        edits.replace(at, at, text)  # after those inserted here before: their order kept
    return " and ".join(f"`{src.seg(a.targets[0])}` (line {a.lineno})" for a, _ in order)


def moves(moved: str) -> str:
    """``hoist``'s words with their verb: "`w` (line 9) and `c` (line 10) move"."""
    return f"{moved} move{'s' * (' and ' not in moved)}"


def _to_hoist(src: ScriptSource, scope: ast.AST, key: str, wrap: ast.stmt,
              seen: tuple[str, ...]) -> list[tuple[ast.Assign, ast.stmt]]:
    """The assignments :func:`hoist` moves for ``key``, those it reads first, each with the
    statement it moves before; NoRewrite where one cannot move."""
    every = bindings(src, scope)
    binds = [b for b in every if b.name == key]
    if key in seen or len(binds) != 1 or not isinstance(binds[0].node, ast.Assign):
        raise NoRewrite(f"`{key}` is not defined where the model is wrapped (line "
                        f"{wrap.lineno}), and no single assignment of it can move there")
    assign = binds[0].node
    assert isinstance(assign, ast.Assign)
    block = src.block(assign)
    holder = next((s for s in [wrap, *src.ancestors(wrap)]
                   if isinstance(s, ast.stmt) and any(s is b for b in block)), None)
    if holder is None:
        raise NoRewrite(f"`{key}` (line {assign.lineno}) is defined in another block than "
                        f"the wrap (line {wrap.lineno}): move it before the wrap by hand")
    out: list[tuple[ast.Assign, ast.stmt]] = []
    needs = bound_between(src, scope, loaded_names(assign.value), start_of(holder),
                          start_of(assign))
    for name in sorted(needs, key=lambda n: min(start_of(b.node) for b in every
                                                 if b.name == n)):
        try:
            first = _to_hoist(src, scope, name, wrap, (*seen, key))
        except NoRewrite:
            raise NoRewrite(f"`{key}` (line {assign.lineno}) uses {name}, set after the wrap "
                            f"(line {wrap.lineno}), which cannot move before it") from None
        out += [item for item in first if not any(item[0] is a for a, _ in out)]
    return [*out, (assign, holder)]


def after_definition(src: ScriptSource, scope: ast.AST, key: str, at: ast.stmt) -> ast.stmt:
    """The statement after which a line that reads ``key`` can go, no earlier than after
    ``at``: ``at`` where ``key`` is bound by then and not again (or free: the module's, a
    builtin), else its one assignment after ``at`` in the same block (``criterion = ...`` a
    line below ``model = build_model()``); NoRewrite where there is none such."""
    root = key.split(".")[0]
    later = [b.node for b in bindings(src, scope)
             if b.name == root and start_of(b.node) > start_of(at)]
    if not later:
        if available(src, scope, key, at):
            return at
        raise NoRewrite(f"`{key}` is not defined by line {at.lineno} or after it")
    block = src.block(at)
    if len(later) > 1 or not any(later[0] is s for s in block):
        raise NoRewrite(f"`{key}` is bound after line {at.lineno} in another block or more "
                        "than once: no one place follows both")
    assert isinstance(later[0], ast.stmt)
    return later[0]
