"""The fixes of ``dpprof run`` as rewrites of the user's own lines, made on the syntax tree.

``dpprof run`` records where the script wraps its model in ``nn.DataParallel``, where it
calls that model, and where it computes the loss on the outputs (``file:line`` each). From
those lines and the script's source this module makes the change that fixes cuda:0's
imbalance, as a unified diff of the whole file (``difflib.unified_diff``, the file's name
in the header):

* :func:`loss_in_forward`: ``nn.DataParallel(dpprof.ModelWithLoss(<module>, <loss_fn>))``
  at the wrap, ``dpprof.ModelWithLoss.combine(<model>(<inputs>, <targets>))`` in place of the
  loss call (the model's separate call removed), ``import dpprof``;
* :func:`ddp`: ``DDP(<module>.cuda(rank), device_ids=[rank])`` at the wrap (with
  ``gradient_as_bucket_view=True`` for ``bucket_view``), the process group and the rank's
  device at the start of the wrap's function (or of the script), the imports, ``"cuda:0"``
  made each rank's own device, and each rank's share of every ``DataLoader``
  (``batch_size // N``, a ``DistributedSampler``) and of the batches made by hand;
* :func:`autocast`: the statements from the model's call through the loss under
  ``with torch.autocast("cuda", dtype=...)`` in their block, and for float16 torch's AMP
  recipe's ``GradScaler``: made before the training loop, scaling the loss's backward, making
  the optimizer's step (``scaler.step(optimizer)``, ``scaler.update()``);
* :func:`checkpointing`: the model's repeated blocks under non-reentrant
  ``torch.utils.checkpoint``, right after the statement that makes the model;
* :func:`rung_changes`: a ladder rung's edits made one after the other (and DDP's, where the
  rung ran on a DataParallel script's DDP alternative), one diff against the user's file.

Every edit is a splice at the positions of the tree's nodes (``lineno``/``col_offset``/
``end_lineno``/``end_col_offset``), so the rest of the file keeps its formatting; the new file
is compiled before its diff is given. Where the change cannot be made correctly, the result
has no diff and a reason, never code that does not compile. The tree, its positions, names,
splices and imports are :mod:`dpprof.script.source`.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from dpprof.script.loss_expression import LossFunction, loss_function, output_refs
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    add_imports,
    bindings,
    bound_between,
    calls_at,
    data_parallel_call,
    dotted_name,
    import_line,
    last_name,
    loaded_names,
    module_arg,
    parenthesized,
    scope_nodes,
    start_of,
    until_scope,
)

LOSS_IN_FORWARD_TITLE = "the loss inside forward"
DDP_TITLE = "DistributedDataParallel"
BUCKET_VIEW_TITLE = "DistributedDataParallel, gradient_as_bucket_view"
AUTOCAST_BF16_TITLE = "mixed precision (bf16 autocast)"
AUTOCAST_FP16_TITLE = "mixed precision (fp16 autocast and GradScaler)"
AUTOCAST_TITLES = {"bfloat16": AUTOCAST_BF16_TITLE, "float16": AUTOCAST_FP16_TITLE}

# calls that only move a module or tensor between devices: dropped where DDP places the module
_MOVES = ("cuda", "to")


@dataclass(frozen=True)
class Rewrite:
    """A change to one file: its diff and the whole new text, or why there is none."""

    diff: str = ""
    new_source: str = ""
    reason: str = ""  # why there is no diff ("" where there is one)
    notes: tuple[str, ...] = ()  # what the user should still check by hand

    @property
    def ok(self) -> bool:
        return bool(self.diff)


# ---- the loss inside forward --------------------------------------------------------------


@dataclass
class _LossSite:
    loss: ast.Call  # criterion(outputs, targets)
    model: ast.Call  # model(inputs)
    outputs_stmt: ast.stmt | None  # ``outputs = model(inputs)``, where separate
    outputs_name: str  # "" where the model's call is inside the loss call


def _loss_site(src: ScriptSource, loss_line: int, call_line: int) -> _LossSite:
    """The loss call on ``loss_line`` whose first argument is the model's call on
    ``call_line``, or a name that line assigns from it."""
    for loss in calls_at(src, loss_line):
        if not loss.args or isinstance(loss.args[0], ast.Starred):
            continue
        first = loss.args[0]
        if isinstance(first, ast.Call) and first.lineno <= call_line <= (first.end_lineno or 0):
            return _LossSite(loss, first, None, "")
        if isinstance(first, ast.Name):
            scope = src.scope(loss)
            for node in scope_nodes(scope):
                if (isinstance(node, (ast.Assign, ast.AnnAssign))
                        and node.lineno <= call_line <= (node.end_lineno or 0)
                        and isinstance(node.value, ast.Call)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if len(targets) == 1 and dotted_name(targets[0]) == first.id:
                        return _LossSite(loss, node.value, node, first.id)
    raise NoRewrite(f"line {loss_line}: no loss call whose first argument is the model's "
                    f"outputs from line {call_line} (as `outputs = model(x)` then "
                    "`criterion(outputs, y)`, or `criterion(model(x), y)`)")


def _loss_fn_text(src: ScriptSource, loss: ast.Call) -> tuple[str, str, ast.expr]:
    """(the loss function as ModelWithLoss takes it, the targets' text, the loss callee)."""
    if any(isinstance(a, ast.Starred) for a in loss.args) or any(
            kw.arg is None for kw in loss.keywords):
        raise NoRewrite(f"line {loss.lineno}: the loss call unpacks its arguments (* or **)")
    keywords = list(loss.keywords)
    if len(loss.args) >= 2:
        targets = loss.args[1]
    else:
        target_kw = next((kw for kw in keywords if kw.arg == "target"), None)
        if target_kw is None:
            raise NoRewrite(f"line {loss.lineno}: the loss call has no targets "
                            "(ModelWithLoss calls loss_fn(outputs, targets))")
        targets = target_kw.value
        keywords.remove(target_kw)
    if len(loss.args) > 2:
        raise NoRewrite(f"line {loss.lineno}: the loss takes more than (outputs, targets) "
                        "positionally")
    if dotted_name(loss.func) is None:
        raise NoRewrite(f"line {loss.lineno}: the loss function is an expression "
                        f"({src.seg(loss.func)}), not a name")
    fn = src.seg(loss.func)
    if not keywords:
        return fn, src.seg(targets), loss.func
    if not all(_constant(kw.value) for kw in keywords):
        raise NoRewrite(f"line {loss.lineno}: the loss call's keyword arguments are not "
                        "constants, so it cannot move into forward as written")
    extra = ", ".join(src.seg(kw) for kw in keywords)
    return (f"lambda outputs, targets: {fn}(outputs, targets, {extra})", src.seg(targets),
            loss.func)


def _constant(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _constant(node.operand)
    return isinstance(node, ast.Constant)


def _available(src: ScriptSource, scope: ast.AST, key: str, at: ast.stmt) -> bool:
    """Whether ``key`` (a name or dotted attribute) names something at statement ``at`` of
    ``scope`` (a local bound before it, a global, a builtin)."""
    binds = [b for b in bindings(src, scope) if b.name == key]
    if binds:
        return any(b.pos <= start_of(at) for b in binds)
    root = key.split(".")[0]
    if root != key:
        return _available(src, scope, root, at)
    # a free name: an enclosing function's or the module's, bound by the time it runs (a
    # class body's names are not visible in its methods)
    outer = scope
    while not isinstance(outer, ast.Module):
        outer = src.scope(outer)
        if not isinstance(outer, ast.ClassDef) and any(
                b.name == key for b in bindings(src, outer)):
            return True
    return hasattr(builtins, key)


def _hoist(src: ScriptSource, edits: Edits, scope: ast.AST, key: str, wrap: ast.stmt) -> int:
    """Move the one assignment of ``key`` that follows the wrap (in the same statement list
    as the wrap or a statement holding it) to just before that statement; its line."""
    binds = [b for b in bindings(src, scope) if b.name == key]
    if len(binds) != 1 or not isinstance(binds[0].node, ast.Assign):
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
    moved = bound_between(src, scope, loaded_names(assign.value), start_of(holder),
                           start_of(assign))
    if moved:
        raise NoRewrite(f"`{key}` (line {assign.lineno}) uses {', '.join(moved)}, set after "
                        f"the wrap (line {wrap.lineno}), so it cannot move before it")
    start, end = src.whole_lines(assign)
    text = src.text[start:end]
    edits.replace(start, end, "")
    at = src.line_start(holder.lineno)
    edits.replace(at, at, text)
    return assign.lineno


def _read(path: str) -> str:
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise NoRewrite(f"cannot read {path}: {e}") from None


def _finish(src: ScriptSource, edits: Edits, title: str, notes: list[str]) -> Rewrite:
    new = edits.apply()
    try:
        compile(new, src.path, "exec", dont_inherit=True)
    except SyntaxError as e:  # pragma: no cover - a bug here: say so rather than show it
        raise NoRewrite(f"the rewritten script does not compile ({e.msg}, line {e.lineno})"
                        ) from None
    name = Path(src.path).name
    diff = difflib.unified_diff(src.text.splitlines(), new.splitlines(),
                                f"{name} (as written)", f"{name} ({title})", lineterm="")
    return Rewrite(diff="\n".join(diff), new_source=new, notes=tuple(notes))


def loss_in_forward(source: str, path: str, dp_line: int, call_line: int,
                    loss_line: int, loss_callee: str = "", targets_name: str = "") -> Rewrite:
    """The script with its loss computed inside forward on every replica (see the module).

    ``dp_line``: the ``DataParallel(...)`` wrap; ``call_line``: the call of the wrapped model
    whose outputs reach the loss; ``loss_line``: the loss call on them. Where the loss takes
    an expression of the outputs (``criterion(out.view(-1, V), y.view(-1))``):
    ``loss_callee`` names the loss (``criterion``) and ``targets_name`` the batch tensor its
    targets come from (``y``), as the run saw them; the loss call moves into forward as a
    function of the two (:mod:`dpprof.script.loss_expression`).
    """
    try:
        return _loss_in_forward(ScriptSource(source, path), dp_line, call_line, loss_line,
                                loss_callee, targets_name)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def _expression_site(src: ScriptSource, dp: ast.Call, loss_line: int, call_line: int,
                     loss_callee: str, targets_name: str) -> tuple[_LossSite, LossFunction]:
    """The loss call ``loss_callee(...)`` on ``loss_line`` whose arguments read the outputs
    of the model's call on ``call_line`` (written inside it, or a name that line binds), and
    it as a function of the outputs and ``targets_name``."""
    wrap = src.statement(dp)
    model_name = (dotted_name(wrap.targets[0]) if isinstance(wrap, ast.Assign)
                  and len(wrap.targets) == 1 else None)
    for loss in calls_at(src, loss_line):
        if dotted_name(loss.func) != loss_callee:
            continue
        inline = next((n for n in ast.walk(loss) if n is not loss and isinstance(n, ast.Call)
                       and model_name is not None and dotted_name(n.func) == model_name
                       and n.lineno <= call_line <= (n.end_lineno or 0)), None)
        site = (_LossSite(loss, inline, None, "") if inline is not None
                else _named_outputs(src, loss, call_line))
        if site is None:
            continue
        return site, loss_function(src, loss, site.outputs_name, inline, targets_name)
    raise NoRewrite(f"line {loss_line}: no call of {loss_callee or 'the loss'} whose "
                    f"arguments read the model's outputs from line {call_line}")


def _named_outputs(src: ScriptSource, loss: ast.Call, call_line: int) -> _LossSite | None:
    """The loss site where ``loss`` reads the name that ``name = model(...)`` on
    ``call_line`` binds."""
    for node in scope_nodes(src.scope(loss)):
        if (isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.lineno <= call_line <= (node.end_lineno or 0)
                and isinstance(node.value, ast.Call)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            name = dotted_name(targets[0]) if len(targets) == 1 else None
            if name and isinstance(targets[0], ast.Name) and output_refs(loss, name, None):
                return _LossSite(loss, node.value, node, name)
    return None


def _free_names_at_wrap(src: ScriptSource, fn: LossFunction, loss: ast.Call,
                        wrap: ast.stmt) -> None:
    """The loss function, made at the wrap, reads its names when it runs: each must be one
    the wrap's scope sees (its own, an enclosing function's, the module's, a builtin)."""
    scope = src.scope(wrap)
    for name in sorted(loaded_names(loss) - {fn.outputs_name, fn.targets_name}):
        seen = scope
        while True:
            if not isinstance(seen, ast.ClassDef) and any(
                    b.name == name for b in bindings(src, seen)):
                break
            if isinstance(seen, ast.Module):
                if not hasattr(builtins, name):
                    raise NoRewrite(f"`{name}`, which the loss (line {loss.lineno}) reads, is "
                                    f"not visible where the model is wrapped (line "
                                    f"{wrap.lineno})")
                break
            seen = src.scope(seen)


def _loss_in_forward(src: ScriptSource, dp_line: int, call_line: int, loss_line: int,
                     loss_callee: str = "", targets_name: str = "") -> Rewrite:
    edits = Edits(src)
    notes: list[str] = []
    dp = data_parallel_call(src, dp_line)
    wrap = src.statement(dp)
    expression: LossFunction | None = None
    if targets_name:
        site, expression = _expression_site(src, dp, loss_line, call_line, loss_callee,
                                            targets_name)
        _free_names_at_wrap(src, expression, site.loss, wrap)
        loss_fn, targets, callee = expression.text, targets_name, site.loss.func
    else:
        site = _loss_site(src, loss_line, call_line)
        loss_fn, targets, callee = _loss_fn_text(src, site.loss)
    model = site.model
    if model.keywords or any(isinstance(a, ast.Starred) for a in model.args) or not model.args:
        raise NoRewrite(f"line {model.lineno}: the model's call takes keyword or unpacked "
                        "arguments, or none; ModelWithLoss takes (inputs, targets)")
    inputs = ", ".join(src.seg(a) for a in model.args)
    if len(model.args) > 1:
        inputs = f"({inputs})"  # ModelWithLoss passes a tuple on as the model's arguments
    call = f"{parenthesized(src, model.func)}({inputs}, {targets})"
    loss_stmt = src.statement(site.loss)
    scope = src.scope(loss_stmt)
    keep = False  # the outputs used besides the loss: ModelWithLoss(keep_outputs=True)
    if site.outputs_stmt is not None:
        stmt = site.outputs_stmt
        assert stmt.end_lineno is not None and stmt.end_col_offset is not None
        if start_of(stmt) > start_of(loss_stmt):
            raise NoRewrite(f"the model's call (line {stmt.lineno}) comes after the loss "
                            f"(line {loss_stmt.lineno})")
        rebound = bound_between(src, scope, loaded_names(model),
                                 (stmt.end_lineno, stmt.end_col_offset), start_of(loss_stmt))
        if rebound:
            raise NoRewrite(f"{', '.join(rebound)} change between the model's call (line "
                            f"{stmt.lineno}) and the loss (line {loss_stmt.lineno})")
        in_loss = (output_refs(site.loss, site.outputs_name, None) if expression is not None
                   else [site.loss.args[0]])
        uses = sorted({n.lineno for n in scope_nodes(scope) if isinstance(n, ast.Name)
                       and n.id == site.outputs_name and isinstance(n.ctx, ast.Load)
                       and not any(n is r for r in in_loss)})
        start, end = src.whole_lines(stmt)
        indent = src.indent(stmt.lineno)
        lines = []
        if uses:
            keep = _keep_outputs(src, site, loss_stmt, uses)
            where = ", ".join(str(u) for u in uses)
            notes.append(f"line {where} also use{'s' * (len(uses) == 1)} {site.outputs_name}: "
                         "ModelWithLoss(..., keep_outputs=True) gathers the outputs on cuda:0 "
                         "beside the loss, as before; the loss and its temporaries stay on "
                         "the replicas")
        if len(src.block(stmt)) == 1:
            lines.append(f"{indent}pass")
        edits.replace(start, end, "".join(line + src.newline() for line in lines))
    if keep:
        assert isinstance(loss_stmt, ast.Assign)
        edits.node(loss_stmt, f"{site.outputs_name}, {src.seg(loss_stmt.targets[0])} = "
                   f"dpprof.ModelWithLoss.split({call})")
    else:
        edits.node(site.loss, f"dpprof.ModelWithLoss.combine({call})")
    # the loss function must exist where the model is wrapped
    wrap_scope = src.scope(wrap)
    key = dotted_name(callee)
    assert key is not None
    if wrap_scope is not scope:
        notes.append(f"the wrap (line {wrap.lineno}) and the loss (line {loss_stmt.lineno}) "
                     f"are in different functions: `{key}` at the wrap is taken to be the "
                     "loss the training step calls")
    if expression is None and not _available(src, wrap_scope, key, wrap):
        moved = _hoist(src, edits, wrap_scope, key, wrap)
        notes.append(f"`{key}` (line {moved}) moves before the wrap, which now needs it")
    keep_arg = ", keep_outputs=True" if keep else ""
    edits.node(module_arg(dp),
               f"dpprof.ModelWithLoss({src.seg(module_arg(dp))}, {loss_fn}{keep_arg})")
    add_imports(src, edits, ["dpprof"], wrap_scope)
    callee_text = src.seg(model.func)
    others = sorted({n.lineno for n in ast.walk(src.tree) if isinstance(n, ast.Call)
                     and n is not model and src.seg(n.func) == callee_text})
    if others:
        notes.append(f"line {', '.join(map(str, others))} also call{'s' * (len(others) == 1)} "
                     f"{callee_text}(...): with ModelWithLoss it takes (inputs, targets) and "
                     "returns the loss; for the outputs call its .module.model")
    if any(isinstance(n, ast.Attribute) and n.attr == "module" for n in ast.walk(src.tree)):
        notes.append("the wrapped module is now the ModelWithLoss: the model is .module.model "
                     "(its state_dict keys gain `model.`)")
    if any(isinstance(a, (ast.If, ast.IfExp)) for a in [*until_scope(src, dp)]):
        notes.append(f"the wrap (line {wrap.lineno}) is conditional: where it does not run, "
                     "the model's call with the targets needs dpprof.ModelWithLoss too")
    return _finish(src, edits, LOSS_IN_FORWARD_TITLE, notes)


def _keep_outputs(src: ScriptSource, site: _LossSite, loss_stmt: ast.stmt,
                  uses: list[int]) -> bool:
    """Whether the outputs, used besides the loss, can be kept: the loss statement binds the
    loss call alone to one name (``loss = criterion(outputs, y)``, which becomes
    ``outputs, loss = ModelWithLoss.split(model(x, y))``) and nothing between the model's call
    and it reads the outputs; else a reason."""
    assert site.outputs_stmt is not None and site.outputs_stmt.end_lineno is not None
    between = [u for u in uses if site.outputs_stmt.end_lineno < u < loss_stmt.lineno]
    if between:
        raise NoRewrite(f"line {', '.join(map(str, between))} use{'s' * (len(between) == 1)} "
                        f"{site.outputs_name} between the model's call (line "
                        f"{site.outputs_stmt.lineno}) and the loss (line {loss_stmt.lineno}): "
                        "with the loss inside forward the outputs come with the loss")
    if not (isinstance(loss_stmt, ast.Assign) and loss_stmt.value is site.loss
            and len(loss_stmt.targets) == 1 and isinstance(loss_stmt.targets[0], ast.Name)):
        raise NoRewrite(f"line {loss_stmt.lineno}: the loss call is part of a larger "
                        f"statement, and line {', '.join(map(str, uses))} also use "
                        f"{site.outputs_name}: write `loss = {src.seg(site.loss.func)}(...)` "
                        "on a line of its own")
    return True


# ---- DistributedDataParallel ----------------------------------------------------------


def _device_like(src: ScriptSource, node: ast.expr) -> bool:
    """An argument of ``.to(...)`` that names a device (not a dtype)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (str, int)) and not isinstance(node.value, bool)
    if isinstance(node, ast.Call):
        return dotted_name(node.func) in ("torch.device", "device")
    text = src.seg(node).lower()
    return "dev" in text or "cuda" in text or "gpu" in text or "rank" in text


def _move(src: ScriptSource, node: ast.AST) -> ast.expr | None:
    """``x`` of ``x.cuda(...)`` or ``x.to(<device>)``; None where ``node`` is not such a move."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MOVES):
        return None
    if node.func.attr == "to" and (node.keywords or len(node.args) != 1
                                   or not _device_like(src, node.args[0])):
        return None
    return node.func.value


def _free_name(src: ScriptSource, *names: str) -> str:
    used = {n.id for n in ast.walk(src.tree) if isinstance(n, ast.Name)} | {
        a.arg for a in ast.walk(src.tree) if isinstance(a, ast.arg)}
    for name in names:
        if name not in used:
            return name
    raise NoRewrite(f"the script already uses the names {', '.join(names)}")


def _init_line(src: ScriptSource, wrap: ast.stmt) -> tuple[int, str]:
    """Where the process group starts: the top of the wrap's function, of the script's
    ``if __name__ == "__main__":`` block, or of the script after its imports."""
    scope = src.scope(wrap)
    body: list[ast.stmt] | None = None
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = scope.body
    else:
        main = next((a for a in until_scope(src, wrap) if isinstance(a, ast.If)
                     and "__name__" in ast.unparse(a.test)
                     and "__main__" in ast.unparse(a.test)), None)
        if main is not None:
            body = main.body
    if body is None:
        return import_line(src), ""
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str) and len(body) > 1:
        first = body[1]
    if first.lineno == start_of(src.parents[first])[0]:  # ``def f(): x`` on one line
        raise NoRewrite(f"line {first.lineno}: the body shares its line with the def")
    return first.lineno, src.indent(first.lineno)


def ddp(source: str, path: str, dp_line: int, gpus: int, bucket_view: bool = False,
        batch_lines: tuple[int, ...] = (), rows: int = 0) -> Rewrite:
    """The script as ``gpus`` DistributedDataParallel ranks (see the module).
    ``batch_lines``: the lines where the script makes its batches by hand (a random factory
    of the scattered rows, which the DDP alternative cut to each rank's share)."""
    try:
        return _ddp(ScriptSource(source, path), dp_line, gpus, bucket_view, batch_lines,
                    rows)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


_BATCH_FACTORIES = ("randint", "randn", "rand")


def _batch_rows_node(call: ast.Call) -> ast.expr | None:
    """The first dimension of a random factory's size (``torch.randint(0, V, (B, T))``:
    ``B``; ``torch.randn(B, D)``: ``B``), as the DDP alternative read it."""
    size = next((k.value for k in call.keywords if k.arg == "size"), None)
    if size is None:
        if last_name(call.func) == "randint":
            size = next((a for a in call.args if isinstance(a, (ast.Tuple, ast.List))), None)
        elif call.args:
            size = call.args[0]
    if isinstance(size, (ast.Tuple, ast.List)):
        return size.elts[0] if size.elts else None
    return size


def _share(src: ScriptSource, rows: ast.expr, gpus: int, scattered: int) -> str:
    """Each rank's share of the rows ``rows`` reads: ``rows // gpus``, rounded up where the
    run saw DataParallel scatter ``scattered`` rows that ``gpus`` does not divide (its first
    chunk, the heaviest, is what the DDP alternative measured)."""
    text = src.seg(rows)
    simple = isinstance(rows, (ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Call))
    if scattered % gpus:
        return f"({text} + {gpus - 1}) // {gpus}"
    return f"{text if simple else f'({text})'} // {gpus}"


def _divide_batches(src: ScriptSource, edits: Edits, lines: tuple[int, ...], gpus: int,
                    scattered: int) -> list[int]:
    """Each rank makes its share of a hand-made batch: ``B`` -> ``B // gpus`` in the
    factories on ``lines``; the lines edited."""
    done = []
    for line in lines:
        call = next((c for c in calls_at(src, line)
                     if last_name(c.func) in _BATCH_FACTORIES), None)
        rows = _batch_rows_node(call) if call is not None else None
        if rows is None or isinstance(rows, ast.Starred):
            continue
        edits.node(rows, _share(src, rows, gpus, scattered))
        done.append(line)
    return done


def _ddp(src: ScriptSource, dp_line: int, gpus: int, bucket_view: bool,
         batch_lines: tuple[int, ...] = (), scattered: int = 0) -> Rewrite:
    edits = Edits(src)
    notes: list[str] = []
    dp = data_parallel_call(src, dp_line)
    wrap = src.statement(dp)
    module = module_arg(dp)
    inner = _move(src, module) or module
    rank = _free_name(src, "rank", "local_rank")
    args = [f"{parenthesized(src, inner)}.cuda({rank})", f"device_ids=[{rank}]"]
    if len(dp.args) > 3:
        args.append(f"dim={src.seg(dp.args[3])}")
    args += [src.seg(kw) for kw in dp.keywords if kw.arg == "dim"]
    if any(kw.arg is None for kw in dp.keywords):
        raise NoRewrite(f"line {dp.lineno}: DataParallel's arguments are unpacked (**)")
    if bucket_view:
        args.append("gradient_as_bucket_view=True")
    # DataParallel(model).cuda(): DDP's module is on its device already
    outer: ast.AST = dp
    parent = src.parents.get(dp)
    if isinstance(parent, ast.Attribute) and _move(src, src.parents.get(parent, dp)) is dp:
        outer = src.parents[parent]
    edits.node(outer, f"DDP({', '.join(args)})")
    share = (f"DDP: each rank loads its share: batch_size // {gpus}, "
             "sampler=DistributedSampler(dataset) (it shuffles: no shuffle=True)")
    loaders = sorted((n for n in ast.walk(src.tree)
                      if isinstance(n, ast.Call) and last_name(n.func) == "DataLoader"),
                     key=start_of)
    shared = False
    for loader in loaders:
        why = _share_loader(src, edits, loader, gpus, scattered)
        shared = shared or not why
        if why:
            at = src.statement(loader).lineno
            edits.insert_lines(at, [f"{src.indent(at)}# {share}"])
            notes.append(f"line {loader.lineno}: give each rank its share of the DataLoader by "
                         f"hand ({why})")
    add_imports(src, edits, ["os", "torch", "dist", "DDP",
                             *(["DistributedSampler"] if shared else [])], src.scope(wrap))
    line, indent = _init_line(src, wrap)
    name = Path(src.path).name
    edits.insert_lines(line, [
        f"{indent}# torchrun --nproc-per-node {gpus} {name}",
        f'{indent}dist.init_process_group("nccl")',
        f'{indent}{rank} = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device({rank})'])
    # "cuda:0" is every rank's own device once set_device has run
    replaced = src.span(outer)
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Constant) and node.value == "cuda:0" and not isinstance(
                src.parents.get(node), ast.JoinedStr) and not (
                replaced[0] <= src.span(node)[0] < replaced[1]):
            text = src.seg(node)
            edits.node(node, text.replace("cuda:0", "cuda"))
    divided = _divide_batches(src, edits, batch_lines, gpus, scattered)
    if not loaders and not divided:
        edits.insert_lines(wrap.lineno, [f"{src.indent(wrap.lineno)}# {share}"])
        notes.append("the script makes its batches without a DataLoader: give each rank its "
                     f"share (1/{gpus} of the batch) by hand")
    return _finish(src, edits, BUCKET_VIEW_TITLE if bucket_view else DDP_TITLE, notes)


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_LOADER_ARGS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler")


def _share_loader(src: ScriptSource, edits: Edits, loader: ast.Call, gpus: int,
                  scattered: int) -> str:
    """Each rank loads its share of ``loader``'s batches, as the DDP alternative divided
    them: ``batch_size`` // ``gpus`` and a ``DistributedSampler`` of its dataset (shuffling
    as the loader did, which then no longer shuffles itself). "" where done, else why not."""
    if any(isinstance(a, ast.Starred) for a in loader.args) or any(
            kw.arg is None for kw in loader.keywords):
        return "its arguments are unpacked"
    given = {name: arg for name, arg in zip(_LOADER_ARGS, loader.args, strict=False)}
    if len(loader.args) > 2:
        return "its shuffle or sampler is given by position"
    given |= {kw.arg: kw.value for kw in loader.keywords if kw.arg in _LOADER_ARGS}
    if "sampler" in given or "batch_sampler" in given:
        return "it has a sampler of its own"
    dataset, rows = given.get("dataset"), given.get("batch_size")
    if dataset is None or rows is None:
        return "no dataset or no batch_size given"
    named = src.seg(dataset)
    if not isinstance(dataset, (ast.Name, ast.Attribute)):
        # the sampler needs the dataset too: made once, named, before the loader's statement
        stmt = src.statement(loader)
        if any(isinstance(a, (ast.Lambda, *_COMPREHENSIONS)) for a in src.ancestors(loader)
               if start_of(a) >= start_of(stmt) and a is not stmt):
            return "it is made inside a lambda or comprehension"
        try:
            src.whole_lines(stmt)
        except NoRewrite:
            return f"line {stmt.lineno} holds more than one statement"
        named = _free_name(src, "dataset", "train_dataset", "loader_dataset")
        edits.insert_lines(stmt.lineno, [f"{src.indent(stmt.lineno)}{named} = "
                                         f"{src.seg(dataset)}"])
        edits.node(dataset, named)
    edits.node(rows, _share(src, rows, gpus, scattered))
    shuffle = next((kw for kw in loader.keywords if kw.arg == "shuffle"), None)
    order = src.seg(shuffle.value) if shuffle is not None else "False"
    sampler = f"sampler=DistributedSampler({named}, shuffle={order})"
    if shuffle is not None:
        edits.node(shuffle, sampler)
    else:
        last = max([*loader.args, *(kw.value for kw in loader.keywords)], key=start_of)
        end = src.span(last)[1]
        edits.replace(end, end, f", {sampler}")
    return ""


# ---- mixed precision ---------------------------------------------------------------------

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_CLIPS = ("clip_grad_norm_", "clip_grad_value_")


def _statement_on(src: ScriptSource, line: int, what: str) -> ast.stmt:
    """The simple statement that holds ``line`` (the one of its first call, where the line
    holds several)."""
    calls = calls_at(src, line)
    if calls:
        stmt = src.statement(calls[0])
    else:
        spanning = [s for s in ast.walk(src.tree) if isinstance(s, ast.stmt)
                    and not isinstance(s, ast.Module) and s.lineno <= line <= (s.end_lineno or 0)]
        if not spanning:
            raise NoRewrite(f"line {line}: no statement there holds the {what}")
        stmt = max(spanning, key=lambda s: len(list(src.ancestors(s))))
    if hasattr(stmt, "body"):
        keyword = src.seg(stmt).split(None, 1)[0].rstrip(":")
        raise NoRewrite(f"line {line}: the {what} is in the header of a `{keyword}` statement; "
                        "only whole statements of one block can go under autocast")
    return stmt


def _names_autocast(src: ScriptSource, expr: ast.AST, seen: tuple[str, ...] = ()) -> bool:
    """Whether ``expr`` is (or names something assigned) an autocast context."""
    if any(last_name(n) == "autocast" for n in ast.walk(expr)):
        return True
    key = dotted_name(expr)
    if key is None or key in seen:
        return False
    for node in ast.walk(src.tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(dotted_name(t) == key for t in targets) and _names_autocast(
                    src, node.value, (*seen, key)):
                return True
    return False


def _under_autocast(src: ScriptSource, stmt: ast.stmt) -> None:
    """NoRewrite where a ``with`` around ``stmt`` (or a decorator of its function) is
    autocast already: a second one would override the script's own choice of dtype."""
    for a in until_scope(src, stmt):
        if isinstance(a, (ast.With, ast.AsyncWith)):
            for item in a.items:
                if _names_autocast(src, item.context_expr):
                    raise NoRewrite("the script already runs its forward under autocast "
                                    f"(`{src.seg(item.context_expr)}`, line {a.lineno})")
    scope = src.scope(stmt)
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for deco in scope.decorator_list:
            if _names_autocast(src, deco):
                raise NoRewrite("the script already runs its forward under autocast "
                                f"(`@{src.seg(deco)}`, line {deco.lineno})")


def _indent_unit(src: ScriptSource, stmt: ast.stmt) -> str:
    """One level of the script's indentation: the one ``stmt``'s block adds to its header,
    else the first nested block's, else four spaces."""
    def added(body: ast.stmt) -> str:
        header = src.parents.get(body)
        line = getattr(header, "lineno", 0)
        if not line or line == body.lineno:
            return ""
        inner, outer = src.indent(body.lineno), src.indent(line)
        return inner[len(outer):] if inner.startswith(outer) else ""
    unit = added(stmt)
    if unit:
        return unit
    for node in ast.walk(src.tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and not isinstance(node, ast.Module):
            unit = added(body[0])
            if unit:
                return unit
    return "    "


def _string_lines(src: ScriptSource) -> set[int]:
    """The lines that start inside a string (their leading spaces are the string's)."""
    inside: set[int] = set()
    fstring_start = getattr(tokenize, "FSTRING_START", None)  # Python 3.12's f-strings
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    opened: list[int] = []
    for tok in tokenize.generate_tokens(io.StringIO(src.text).readline):
        if tok.type == fstring_start:
            opened.append(tok.start[0])
        elif tok.type == fstring_end and opened:
            inside.update(range(opened.pop() + 1, tok.end[0] + 1))
        elif tok.type == tokenize.STRING:
            inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    return inside


def _own_lines(src: ScriptSource, first: ast.stmt, last: ast.stmt) -> None:
    """NoRewrite where the lines from ``first`` through ``last`` hold other statements."""
    assert last.end_lineno is not None
    before = src.text[src.line_start(first.lineno):src.span(first)[0]]
    after = src.text[src.span(last)[1]:src.starts[last.end_lineno]].strip()
    if before.strip() or (after and not after.startswith("#")):
        line = first.lineno if before.strip() else last.end_lineno
        raise NoRewrite(f"line {line} holds another statement beside the forward or the loss: "
                        "put them on lines of their own")


def _assigned_names(stmt: ast.stmt) -> set[str]:
    """The plain names an assignment statement binds (``logits, loss = ...``: both)."""
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
        targets = [stmt.target]
    else:
        return set()
    return {n.id for t in targets for n in ast.walk(t)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _optimizer_names(src: ScriptSource) -> set[str]:
    """The names (and dotted attributes) the script binds to a ``torch.optim`` constructor."""
    # torch.optim.SGD, optim.AdamW, or AdamW imported from torch.optim; not its
    # lr_scheduler's classes (a scheduler steps too)
    from_optim = {a.asname or a.name for n in ast.walk(src.tree)
                  if isinstance(n, ast.ImportFrom) and n.module == "torch.optim"
                  for a in n.names}
    out = set()
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = dotted_name(node.value.func) or ""
            if re.search(r"(?:^|\.)optim\.[A-Z]\w*$", func) or func in from_optim:
                out |= {d for t in node.targets if (d := dotted_name(t))}
    return out


def _calls_after(src: ScriptSource, region: ast.AST, after: tuple[int, int]) -> list[ast.Call]:
    """The calls in ``region`` that start after ``after``, in the text's order."""
    return sorted((n for n in ast.walk(region) if isinstance(n, ast.Call)
                   and start_of(n) >= after), key=start_of)


def _grad_scaler(src: ScriptSource, edits: Edits, first: ast.stmt, last: ast.stmt) -> None:
    """torch's AMP recipe around the forward ``first``..``last``: a GradScaler before the
    training loop, the loss's backward scaled, the optimizer's step made by the scaler."""
    made = next((n for n in ast.walk(src.tree) if isinstance(n, ast.Call)
                 and last_name(n.func) == "GradScaler"), None)
    if made is not None:
        raise NoRewrite(f"the script already makes a GradScaler (line {made.lineno}): put its "
                        "forward under autocast by hand")
    loops = [a for a in until_scope(src, first) if isinstance(a, _LOOPS)]
    if not loops:
        raise NoRewrite(f"the forward (line {first.lineno}) is in no loop of its function: "
                        "make the GradScaler before the training loop, and scale the backward "
                        "and step through it by hand")
    names = _assigned_names(last)
    if not names:
        raise NoRewrite(f"the loss (line {last.lineno}) is not assigned to a name, so its "
                        "backward cannot be found for the GradScaler")
    assert last.end_lineno is not None and last.end_col_offset is not None
    backward = next((c for c in _calls_after(src, loops[0], (last.end_lineno,
                                                             last.end_col_offset))
                     if isinstance(c.func, ast.Attribute) and c.func.attr == "backward"
                     and loaded_names(c.func.value) & names), None)
    if backward is None:
        raise NoRewrite(f"no `{sorted(names)[-1]}.backward()` after the loss (line "
                        f"{last.lineno}) in its loop, for the GradScaler to scale")
    known = _optimizer_names(src)
    assert isinstance(backward.func, ast.Attribute)
    steps = [(c, receiver) for c in _calls_after(src, loops[-1], start_of(backward))
             if isinstance(c.func, ast.Attribute) and c.func.attr == "step"
             and not c.args and not c.keywords and (receiver := dotted_name(c.func.value))]
    # a scheduler steps too: an optimizer is one the script makes from torch.optim, or
    # (where it makes none it can see) one named so
    optimizers = [(c, r) for c, r in steps
                  if (r in known if known else "opt" in r.rsplit(".", 1)[-1].lower())]
    if not optimizers:
        raise NoRewrite(f"no optimizer step (`optimizer.step()`) after the backward (line "
                        f"{backward.lineno}) in the loop, for the GradScaler to make")
    step, opt = optimizers[0]
    # every optimizer's step must go through the scaler, and each backward be scaled
    others = sorted({c.lineno for c, r in optimizers if r != opt})
    if others:
        raise NoRewrite(f"the loop steps more than one optimizer (lines {step.lineno}, "
                        f"{', '.join(map(str, others))}): scale each backward and step each "
                        "through one GradScaler by hand")
    # one scaler across the loops that reuse one optimizer (epochs around batches), a new
    # one where a loop makes a new optimizer
    outer = loops[0]
    for loop in loops[1:]:
        if any(isinstance(n, ast.Assign) and opt in {dotted_name(t) for t in n.targets}
               for n in ast.walk(loop)):
            break
        outer = loop
    step_stmt = src.statement(step)
    try:
        if not (isinstance(step_stmt, ast.Expr) and step_stmt.value is step):
            raise NoRewrite
        src.whole_lines(step_stmt)
    except NoRewrite:
        raise NoRewrite(f"line {step.lineno}: the optimizer's step is not a statement of its "
                        "own line, so `scaler.update()` cannot follow it") from None
    assert step_stmt.end_lineno is not None
    scaler = _free_name(src, "scaler", "grad_scaler", "amp_scaler")
    clips = [c for c in _calls_after(src, loops[-1], start_of(backward))
             if last_name(c.func) in _CLIPS and start_of(c) < start_of(step)]
    for clip in clips:
        clip_stmt = src.statement(clip)
        if src.block(clip_stmt) is not src.block(step_stmt):
            raise NoRewrite(f"line {clip.lineno} clips the gradients in another block than the "
                            f"step: call {scaler}.unscale_({opt}) before it by hand")
        src.whole_lines(clip_stmt)
        edits.insert_lines(clip_stmt.lineno, [
            f"{src.indent(clip_stmt.lineno)}{scaler}.unscale_({opt})  # clip the true gradients"])
    edits.insert_lines(outer.lineno, [f'{src.indent(outer.lineno)}{scaler} = '
                                      'torch.amp.GradScaler("cuda")'])
    edits.node(backward.func, f"{scaler}.scale({src.seg(backward.func.value)}).backward")
    edits.node(step, f"{scaler}.step({opt})")
    edits.insert_lines(step_stmt.end_lineno + 1,
                       [f"{src.indent(step_stmt.lineno)}{scaler}.update()"])


def autocast(source: str, path: str, call_line: int, loss_line: int, dtype: str) -> Rewrite:
    """The script with its forward and loss under ``torch.autocast`` (see the module).

    ``call_line``: the model's call; ``loss_line``: the loss on its outputs (the same line
    where one statement does both); ``dtype``: "bfloat16", or "float16" (with a GradScaler).
    """
    try:
        return _autocast(ScriptSource(source, path), call_line, loss_line, dtype)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def _autocast(src: ScriptSource, call_line: int, loss_line: int, dtype: str) -> Rewrite:
    if dtype not in AUTOCAST_TITLES:
        raise NoRewrite(f"dtype {dtype!r}: autocast's rewrite takes \"bfloat16\" or "
                        "\"float16\"")
    edits = Edits(src)
    first = _statement_on(src, call_line, "model's call")
    last = _statement_on(src, loss_line, "loss")
    _under_autocast(src, first)
    block = src.block(first)
    if src.block(last) is not block:
        raise NoRewrite(f"the model's call (line {first.lineno}) and the loss (line "
                        f"{last.lineno}) are in different blocks, so one `with torch.autocast"
                        "(...)` cannot hold both: put each under one by hand")
    i, j = block.index(first), block.index(last)
    if j < i:
        raise NoRewrite(f"the loss (line {last.lineno}) comes before the model's call (line "
                        f"{first.lineno})")
    held = block[i:j + 1]
    backward = next((n for s in held for n in ast.walk(s) if isinstance(n, ast.Call)
                     and last_name(n.func) == "backward"), None)
    if backward is not None:
        raise NoRewrite(f"line {backward.lineno}: the backward is among the statements from the "
                        "model's call through the loss; it runs outside autocast: assign the "
                        "loss to a name and call its backward on the next line")
    _own_lines(src, first, last)
    assert last.end_lineno is not None
    indent, unit = src.indent(first.lineno), _indent_unit(src, first)
    edits.insert_lines(first.lineno, [
        f'{indent}with torch.autocast("cuda", dtype=torch.{dtype}):'])
    strings = _string_lines(src)
    for line in range(first.lineno, last.end_lineno + 1):
        if src.line_text(line).strip() and line not in strings:
            at = src.line_start(line)
            edits.replace(at, at, unit)
    if dtype == "float16":
        _grad_scaler(src, edits, first, last)
    add_imports(src, edits, ["torch"], src.scope(first))
    return _finish(src, edits, AUTOCAST_TITLES[dtype], [])


# ---- activation checkpointing -------------------------------------------------------------

_WRAPPERS = ("DataParallel", "DistributedDataParallel", "DDP")


def _model_binding(src: ScriptSource, forward: ast.stmt, name: str) -> ast.stmt:
    """The statement that last binds ``name`` (the model the forward calls) before the loop
    that holds the forward, in the forward's function or the module."""
    loops = [a for a in until_scope(src, forward) if isinstance(a, _LOOPS)]
    before = start_of(loops[-1] if loops else forward)
    scope = src.scope(forward)
    while True:
        binds = [b for b in bindings(src, scope) if b.name == name and b.pos <= before]
        if binds:
            break
        if isinstance(scope, ast.Module):
            raise NoRewrite(f"`{name}`, the model called on line {forward.lineno}, is not "
                            "assigned before its loop")
        scope = src.scope(scope)
    node = max(binds, key=lambda b: b.pos).node
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node, ast.stmt):
        raise NoRewrite(f"`{name}`, the model called on line {forward.lineno}, is not made "
                        "by an assignment dpprof can follow (an argument, a loop variable)")
    if any(isinstance(a, _LOOPS) for a in until_scope(src, node)):
        raise NoRewrite(f"line {node.lineno}: the model is made inside a loop, so its blocks "
                        "would be checkpointed again on every pass")
    return node


def _model_name(src: ScriptSource, forward_line: int) -> tuple[ast.stmt, str]:
    """The statement of the model's call on ``forward_line`` and the model's name."""
    stmt = _statement_on(src, forward_line, "model's call")
    for call in calls_at(src, forward_line):
        name = dotted_name(call.func)
        if name is None or call.lineno != forward_line:
            continue
        try:
            _model_binding(src, stmt, name)
        except NoRewrite:
            continue
        return stmt, name
    raise NoRewrite(f"line {forward_line}: no call of a model assigned before its loop")


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
    helper = _free_name(src, "checkpointed", "checkpoint_block")
    block = _free_name(src, "block", "repeated_block")
    indent, unit = src.indent(made.lineno), _indent_unit(src, made)
    kind, count = words.get("kind", ""), len(names)
    if words.get("whole"):
        head = [f"{indent}for {block} in {root}.{words['blocks']}:  # the {count} repeated "
                f"{kind} blocks"]
    else:
        listed = ", ".join(repr(n) for n in names)
        head = [f"{indent}for {block} in map({root}.get_submodule, ({listed},)):  # the "
                f"{count} repeated {kind} blocks"]
    assert made.end_lineno is not None
    edits = Edits(src)
    edits.insert_lines(made.end_lineno + 1, [
        f"{indent}def {helper}(block):  # its activations are recomputed in backward",
        f"{indent}{unit}forward = block.forward",
        f"{indent}{unit}block.forward = lambda *a, **k: checkpoint(forward, *a, "
        "use_reentrant=False, **k)",
        "", *head, f"{indent}{unit}{helper}({block})"])
    add_imports(src, edits, ["checkpoint"], src.scope(made))
    return _finish(src, edits, "activation checkpointing", [])


# ---- a rung: its changes made one after the other ------------------------------------------


def _line_map(old: str, new: str) -> dict[int, int]:
    """Where each line of ``old`` that ``new`` keeps as it was is in ``new`` (1-based)."""
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(),
                                      autojunk=False)
    out: dict[int, int] = {}
    for tag, i1, i2, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            out.update({i1 + k + 1: j1 + k + 1 for k in range(i2 - i1)})
    return out


@dataclass(frozen=True)
class RungSites:
    """What ``dpprof run`` saw of the script its rung changed: the model's first call and the
    first ``backward()``; for a DataParallel script whose rung ran on its DDP alternative,
    the wrap (and the batches it makes by hand)."""

    path: str
    forward_line: int
    backward_line: int
    dp_line: int = 0  # 0: the rung ran on the script as written
    batch_lines: tuple[int, ...] = ()
    rows: int = 0  # the batch DataParallel scattered


def rung_changes(sites: RungSites, gpus: int, title: str, dtype: str | None,
                 blocks: dict[str, object] | None) -> Rewrite:
    """A ladder rung as one diff of the user's file: its blocks checkpointed (``blocks``,
    where it checkpoints), its forward to ``backward()`` under autocast (``dtype``, where it
    has one), and, where it ran on a DataParallel script's DDP alternative, the DDP change
    too, so that the script patched with it is the one the rung measured."""
    try:
        original = _read(sites.path)
        text, notes = original, list[str]()
        lines = {k: k for k in (sites.forward_line, sites.backward_line, sites.dp_line,
                                *sites.batch_lines) if k}

        def then(change: Rewrite, what: str) -> None:
            nonlocal text, lines
            if not change.ok:
                raise NoRewrite(f"{what}: {change.reason}")
            moved = _line_map(text, change.new_source)
            lines = {k: moved[v] for k, v in lines.items() if v in moved}
            text = change.new_source
            notes.extend(change.notes)

        def at(line: int) -> int:
            if line not in lines:
                raise NoRewrite(f"line {line} was changed by the rung's other edits")
            return lines[line]

        if blocks:
            then(checkpointing(text, sites.path, at(sites.forward_line), blocks),
                 "activation checkpointing")
        if dtype is not None:
            then(_autocast_until(ScriptSource(text, sites.path), at(sites.forward_line),
                                 at(sites.backward_line), dtype), "autocast")
        if sites.dp_line:
            then(ddp(text, sites.path, at(sites.dp_line), gpus,
                     batch_lines=tuple(lines[b] for b in sites.batch_lines if b in lines),
                     rows=sites.rows),
                 "DDP")
        name = Path(sites.path).name
        diff = difflib.unified_diff(original.splitlines(), text.splitlines(),
                                    f"{name} (as written)", f"{name} ({title[:1].lower()}"
                                    f"{title[1:]})", lineterm="")
        return Rewrite(diff="\n".join(diff), new_source=text, notes=tuple(notes))
    except NoRewrite as e:
        return Rewrite(reason=str(e))


# ---- from dpprof run's recorded sites ------------------------------------------------------


def _site(site: str) -> tuple[str, int]:
    path, _, num = site.rpartition(":")
    if not num.isdigit() or not path or path == "?":
        raise NoRewrite(f"dpprof did not see the script's line ({site!r})")
    return path, int(num)


def loss_in_forward_at(dp_site: str, call_site: str, loss_site: str, loss_callee: str = "",
                       targets_name: str = "") -> Rewrite:
    """:func:`loss_in_forward` from ``file:line`` sites (all in one file)."""
    try:
        (path, dp_line), (p2, call_line), (p3, loss_line) = map(
            _site, (dp_site, call_site, loss_site))
        if not path == p2 == p3:
            raise NoRewrite("the wrap, the model's call and the loss are in different files "
                            f"({Path(path).name}, {Path(p2).name}, {Path(p3).name})")
        return loss_in_forward(_read(path), path, dp_line, call_line, loss_line, loss_callee,
                               targets_name)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def ddp_at(dp_site: str, gpus: int, bucket_view: bool = False,
           batch_sites: tuple[str, ...] = (), rows: int = 0) -> Rewrite:
    """:func:`ddp` from the wrap's ``file:line`` (and those of hand-made batches; ``rows``:
    the batch DataParallel scattered)."""
    try:
        path, line = _site(dp_site)
        batch_lines = tuple(n for p, n in map(_site, batch_sites) if p == path)
        return ddp(_read(path), path, line, gpus, bucket_view, batch_lines, rows)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def autocast_at(call_site: str, loss_site: str, dtype: str) -> Rewrite:
    """:func:`autocast` from the model's call's and the loss's ``file:line``."""
    try:
        (path, call_line), (p2, loss_line) = map(_site, (call_site, loss_site))
        if path != p2:
            raise NoRewrite("the model's call and the loss are in different files "
                            f"({Path(path).name}, {Path(p2).name})")
        return autocast(_read(path), path, call_line, loss_line, dtype)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def autocast_until_at(call_site: str, backward_site: str, dtype: str) -> Rewrite:
    """:func:`autocast` over what ``dpprof run``'s mixed-precision rung ran under autocast:
    the statements from the model's call up to the one that calls ``backward()``, in the
    same block (its statement before holds the loss)."""
    try:
        (path, call_line), (p2, back_line) = map(_site, (call_site, backward_site))
        if path != p2:
            raise NoRewrite("the model's call and backward() are in different files "
                            f"({Path(path).name}, {Path(p2).name})")
        return _autocast_until(ScriptSource(_read(path), path), call_line, back_line, dtype)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def _autocast_until(src: ScriptSource, call_line: int, back_line: int, dtype: str) -> Rewrite:
    try:
        first = _statement_on(src, call_line, "model's call")
        back = _statement_on(src, back_line, "backward")
        block = src.block(first)
        if src.block(back) is not block:
            raise NoRewrite(f"the model's call (line {first.lineno}) and backward() (line "
                            f"{back.lineno}) are in different blocks: put the forward and "
                            "the loss under `with torch.autocast(...)` by hand")
        i, j = block.index(first), block.index(back)
        last = block[j - 1] if j > i else None
        if last is None or last.end_lineno is None:
            raise NoRewrite(f"line {back.lineno}: backward() is called in the statement of "
                            "the model's call: assign the loss to a name and call its "
                            "backward on the next line")
        return _autocast(src, first.lineno, last.end_lineno, dtype)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def rewrite_text(rewrite: Rewrite) -> str:
    """A fix's code: the diff, then what to check by hand as comments; or, where there is no
    diff, the reason as a comment."""
    if not rewrite.ok:
        return f"# no rewrite of the script's lines: {rewrite.reason}" if rewrite.reason else ""
    return "\n".join([rewrite.diff, *(f"# also: {n}" for n in rewrite.notes)])
