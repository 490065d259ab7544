"""Activation checkpointing as a rewrite of the user's own lines (the ladder's checkpointing
rungs): the model's repeated blocks under non-reentrant ``torch.utils.checkpoint``, right
after the statement that makes the model."""

from __future__ import annotations

import ast

from dpprof.script.rewrite import (
    LOOPS,
    Rewrite,
    finish,
    free_name,
    indent_unit,
    statement_on,
)
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    add_imports,
    bindings,
    calls_at,
    dotted_name,
    import_line,
    last_name,
    start_of,
    until_scope,
)

_WRAPPERS = ("DataParallel", "DistributedDataParallel", "DDP")
_MODULE = "torch.utils.checkpoint"  # imported by its path where the script binds `checkpoint`


class _Unbound(NoRewrite):
    """A name called on the model's line that nothing binds before its loop (not the model:
    another call on that line)."""


def _model_binding(src: ScriptSource, forward: ast.stmt, name: str) -> ast.stmt:
    """The statement that last binds ``name`` (the model the forward calls) before the loop
    that holds the forward, in the forward's function or the module; a function's parameter
    is followed to the one call of that function (:func:`_passed_in`)."""
    forward, name = _passed_in(src, forward, name)
    node, _ = _last_binding(src, forward, name)
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node, ast.stmt):
        raise NoRewrite(f"`{name}`, the model called on line {forward.lineno}, is not made "
                        "by an assignment dpprof can follow (an argument, a loop variable)")
    if any(isinstance(a, LOOPS) for a in until_scope(src, node)):
        raise NoRewrite(f"line {node.lineno}: the model is made inside a loop, so its blocks "
                        "would be checkpointed again on every pass")
    return node


def _last_binding(src: ScriptSource, forward: ast.stmt, name: str
                  ) -> tuple[ast.AST, ast.AST]:
    """The node that last binds ``name`` before the loop that holds ``forward`` (the
    function itself where ``name`` is its parameter), and the scope it binds it in."""
    loops = [a for a in until_scope(src, forward) if isinstance(a, LOOPS)]
    before = start_of(loops[-1] if loops else forward)
    scope = src.scope(forward)
    while True:
        binds = [b for b in bindings(src, scope) if b.name == name and b.pos <= before]
        if binds:
            return max(binds, key=lambda b: b.pos).node, scope
        if isinstance(scope, ast.Module):
            raise _Unbound(f"`{name}`, the model called on line {forward.lineno}, is not "
                           "assigned before its loop")
        scope = src.scope(scope)


def _passed_in(src: ScriptSource, forward: ast.stmt, name: str) -> tuple[ast.stmt, str]:
    """Where the model is made from, for a model that a function is given (``def
    train(loader, model, ...)``, as the ImageNet example and timm's and torchvision's
    scripts train): the statement of the function's one call in the script and the name it
    passes, followed on through the callers; else ``forward`` and ``name``."""
    seen: set[ast.AST] = set()
    while True:
        function, scope = _last_binding(src, forward, name)
        if function is not scope or not isinstance(function, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef)):
            return forward, name  # not a parameter
        if function in seen:
            raise NoRewrite(f"`{function.name}` passes the model to itself")
        seen.add(function)
        forward, name = _argument_of(src, function, name)


def _argument_of(src: ScriptSource, function: ast.FunctionDef | ast.AsyncFunctionDef,
                 parameter: str) -> tuple[ast.stmt, str]:
    """The statement of ``function``'s one call in the script and the name that call
    passes as ``parameter``."""
    calls = [n for n in ast.walk(src.tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == function.name]
    if len(calls) != 1 or not isinstance(src.scope(function), ast.Module):
        raise NoRewrite(f"`{parameter}`, the model `{function.name}` calls, is its argument, "
                        f"and `{function.name}` is called {len(calls)} times in the script: "
                        "which model to checkpoint is not one line")
    call = calls[0]
    positional = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
    given: ast.expr | None = next((k.value for k in call.keywords if k.arg == parameter), None)
    at = positional.index(parameter) if parameter in positional else len(call.args)
    if given is None and at < len(call.args) and not any(
            isinstance(a, ast.Starred) for a in call.args[:at + 1]):
        given = call.args[at]
    if not isinstance(given, ast.Name):
        raise NoRewrite(f"line {call.lineno}: the model `{function.name}` is given is not a "
                        "name dpprof can follow to where it is made")
    return src.statement(call), given.id


def _model_name(src: ScriptSource, forward_line: int) -> tuple[ast.stmt, str]:
    """The statement that uses the model, in the scope that makes it (the model's call on
    ``forward_line``, or the call that passes the model to the function holding it), and
    the model's name there."""
    stmt = statement_on(src, forward_line, "model's call")
    why = ""  # why a call that names something bound is not the model's dpprof can follow
    for call in calls_at(src, forward_line):
        name = dotted_name(call.func)
        if name is None or call.lineno != forward_line:
            continue
        try:
            _model_binding(src, stmt, name)
        except _Unbound:
            continue
        except NoRewrite as e:
            why = why or f": {e}"
            continue
        return _passed_in(src, stmt, name)
    raise NoRewrite(f"line {forward_line}: no call of a model assigned before its loop{why}")


def checkpointing(source: str, path: str, forward_line: int, words: dict[str, object]
                  ) -> Rewrite:
    """The script with its model's repeated blocks (``words``:
    :func:`dpprof.measure.ladder_code.blocks_words`) run under non-reentrant
    ``torch.utils.checkpoint``, as dpprof's rung ran them: the lines that wrap each block's
    forward, right after the statement that makes the model called on ``forward_line``
    (its ``.module``'s blocks where that statement wraps it in DataParallel or DDP)."""
    try:
        return _checkpointing(ScriptSource(source, path), forward_line, words)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def _checkpointing(src: ScriptSource, forward_line: int, words: dict[str, object]) -> Rewrite:
    names = words.get("names")
    if not isinstance(names, list) or not names:
        raise NoRewrite("the model has no repeated blocks to checkpoint")
    forward, model = _model_name(src, forward_line)
    made = _model_binding(src, forward, model)
    src.whole_lines(made)
    wrapped = any(isinstance(n, ast.Call) and last_name(n.func) in _WRAPPERS
                  for n in ast.walk(made))
    root = f"{model}.module" if wrapped else model
    at: ast.stmt = made  # the lines go after it, or after the branches that hold it
    around = set(until_scope(src, forward))
    branches = [a for a in until_scope(src, made)
                if isinstance(a, (ast.If, ast.Try, ast.Match)) and a not in around]
    if branches:
        # the last binding is in a branch the run may not have taken (nanoGPT's
        # `if ddp: model = DDP(model)`): after the outermost, the model is whichever was made
        at = branches[-1]
        assert isinstance(at, ast.stmt)
        root = f'getattr({model}, "module", {model})'
    helper = free_name(src, "checkpointed", "checkpoint_block")
    block = free_name(src, "block", "repeated_block")
    indent, unit = src.indent(at.lineno), indent_unit(src, made)
    kind, count = words.get("kind", ""), len(names)
    if words.get("whole"):
        head = [f"{indent}for {block} in {root}.{words['blocks']}:  # the {count} repeated "
                f"{kind} blocks"]
    else:
        listed = ", ".join(repr(n) for n in names)
        head = [f"{indent}for {block} in map({root}.get_submodule, ({listed},)):  # the "
                f"{count} repeated {kind} blocks"]
    assert made.end_lineno is not None
    assert at.end_lineno is not None
    where = at.end_lineno + 1
    edits = Edits(src)
    function = "checkpoint"
    try:
        add_imports(src, edits, ["checkpoint"], src.scope(made))
    except NoRewrite:  # the script's own `checkpoint` (a dict it saves): torch's by its path
        edits = Edits(src)
        add_imports(src, edits, ["torch"], src.scope(made))
        if not any(isinstance(n, ast.Import) and any(a.name == _MODULE and a.asname is None
                                                     for a in n.names)
                   for n in ast.walk(src.tree)):
            edits.insert_lines(import_line(src), [f"import {_MODULE}"])
        function = f"{_MODULE}.checkpoint"
    edits.insert_lines(where, [
        "", f"{indent}def {helper}(block):  # its activations are recomputed in backward",
        f"{indent}{unit}forward = block.forward",
        f"{indent}{unit}block.forward = lambda *a, **k: {function}(forward, *a, "
        "use_reentrant=False, **k)",
        "", *head, f"{indent}{unit}{helper}({block})",
        *([""] if where <= len(src.lines) and src.line_text(where).strip() else [])])
    return finish(src, edits, "activation checkpointing", [])


