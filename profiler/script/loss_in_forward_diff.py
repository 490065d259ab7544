"""The loss inside forward as a rewrite of the user's own lines (the ``loss-in-forward``
fix's diff, :mod:`dpprof.script.loss_in_forward_run`): ``nn.DataParallel(dpprof.ModelWithLoss(
<module>, <loss_fn>))`` at the wrap, ``dpprof.ModelWithLoss.combine(<model>(<inputs>,
<targets>))`` in place of the loss call (the model's separate call removed), ``import
dpprof``; where the script uses the outputs besides the loss, ``keep_outputs=True``."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dpprof.script.hoisting import available, hoist, moves
from dpprof.script.loss_expression import LossFunction, loss_function, output_refs
from dpprof.script.rewrite import (
    Rewrite,
    finish,
    read_source,
    site_of,
)
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    add_imports,
    bindings,
    bound_between,
    calls_at,
    data_parallel_call,
    dim_arg,
    dotted_name,
    loaded_names,
    module_arg,
    parenthesized,
    scope_nodes,
    start_of,
    until_scope,
)
from dpprof.script.wrap_elsewhere import (
    WrapElsewhere,
    called_model,
    set_inside,
    wrap_elsewhere,
)

LOSS_IN_FORWARD_TITLE = "the loss inside forward"

@dataclass
class _LossSite:
    loss: ast.Call  # criterion(outputs, targets)
    model: ast.Call  # model(inputs)
    outputs_stmt: ast.stmt | None  # ``outputs = model(inputs)``, where separate
    outputs_name: str  # "" where the model's call is inside the loss call
    # the loss reads a part of the outputs (``logits = outputs.logits``, ``out, aux =
    # model(x)``): its expression of the whole outputs (``"{}.logits"``), the statement
    # that binds it apart from the model's call, and the name the outputs had
    part: str = ""
    part_stmt: ast.stmt | None = None
    whole_name: str = ""


def _loss_site(src: ScriptSource, loss_line: int, call_line: int) -> _LossSite:
    """The loss call on ``loss_line`` whose first argument is the model's call on
    ``call_line``, or a name that line assigns from it."""
    for loss in calls_at(src, loss_line):
        if not loss.args or isinstance(loss.args[0], ast.Starred):
            continue
        first = loss.args[0]
        if _names_a_callee(first) and first.lineno <= call_line <= (first.end_lineno or 0):
            assert isinstance(first, ast.Call)
            return _LossSite(loss, first, None, "")
        if isinstance(first, ast.Name):
            scope = src.scope(loss)
            for node in scope_nodes(scope):
                if (isinstance(node, (ast.Assign, ast.AnnAssign))
                        and node.lineno <= call_line <= (node.end_lineno or 0)
                        and _names_a_callee(node.value)):
                    assert isinstance(node.value, ast.Call)
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


def _model_inputs(src: ScriptSource, model: ast.Call) -> str:
    """The model's call's inputs as ModelWithLoss takes them: the one argument, a tuple of
    several, or the keywords as a dict (``dict(input_ids=ids, attention_mask=mask)``; the
    dict itself for ``model(**batch)``), which it passes on as keywords."""
    if any(isinstance(a, ast.Starred) for a in model.args) or (model.args and model.keywords):
        raise NoRewrite(f"line {model.lineno}: the model's call unpacks its arguments (*) or "
                        "takes positional and keyword ones; ModelWithLoss takes (inputs, "
                        "targets), the inputs one tuple or one dict")
    if model.keywords:
        if len(model.keywords) == 1 and model.keywords[0].arg is None:
            return src.seg(model.keywords[0].value)  # model(**batch)
        return f"dict({', '.join(src.seg(k) for k in model.keywords)})"
    if not model.args:
        raise NoRewrite(f"line {model.lineno}: the model's call takes no inputs")
    inputs = ", ".join(src.seg(a) for a in model.args)
    # ModelWithLoss passes a tuple on as the model's arguments
    return f"({inputs})" if len(model.args) > 1 else inputs


def _plain_loss(src: ScriptSource, site: _LossSite, targets_name: str
                ) -> tuple[str, str, ast.expr] | None:
    """The loss call of ``site`` as :func:`_loss_fn_text` gives it, where the call is the
    loss applied to the outputs themselves and to ``targets_name`` (``criterion(out, y)``,
    ``F.nll_loss(out, y, reduction="sum")``): ModelWithLoss then takes the loss as it is
    named, not a function of an expression; else None."""
    loss = site.loss
    if site.part:  # the loss takes a part of the outputs: a function of them all
        return None
    first = loss.args[0] if loss.args else None
    outputs = first is site.model or (isinstance(first, ast.Name) and site.outputs_name != ""
                                      and first.id == site.outputs_name)
    given = (loss.args[1] if len(loss.args) > 1
             else next((kw.value for kw in loss.keywords if kw.arg == "target"), None))
    if not (outputs and isinstance(given, ast.Name) and given.id == targets_name):
        return None
    try:
        return _loss_fn_text(src, loss)
    except NoRewrite:
        return None


def _constant(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _constant(node.operand)
    return isinstance(node, ast.Constant)


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


def _expression_site(src: ScriptSource, dp: ast.Call | None, loss_line: int, call_line: int,
                     loss_callee: str, targets_name: str) -> tuple[_LossSite, LossFunction]:
    """The loss call ``loss_callee(...)`` on ``loss_line`` whose arguments read the outputs
    of the model's call on ``call_line`` (written inside it, or a name that line binds), and
    it as a function of the outputs and ``targets_name`` (``dp``: the wrap, where it is in
    this file: the name it binds is the model's)."""
    wrap = src.statement(dp) if dp is not None else None
    model_name = (dotted_name(wrap.targets[0]) if isinstance(wrap, ast.Assign)
                  and len(wrap.targets) == 1 else None)
    for loss in calls_at(src, loss_line):
        if dotted_name(loss.func) != loss_callee:
            continue
        if wrap is None:  # the wrap is in another file: the name it is called by here
            model_name = called_model(src, loss, call_line)
        inline = next((n for n in ast.walk(loss) if n is not loss and isinstance(n, ast.Call)
                       and model_name is not None and dotted_name(n.func) == model_name
                       and n.lineno <= call_line <= (n.end_lineno or 0)), None)
        site = (_LossSite(loss, inline, None, "") if inline is not None
                else _named_outputs(src, loss, call_line)
                or _part_outputs(src, loss, call_line, model_name))
        if site is None:
            continue
        return site, loss_function(src, loss, site.outputs_name, inline, targets_name,
                                   site.part, site.whole_name)
    raise NoRewrite(f"line {loss_line}: no call of {loss_callee or 'the loss'} whose "
                    f"arguments read the model's outputs from line {call_line}")


def _names_a_callee(node: ast.AST | None) -> bool:
    """Whether ``node`` is a call of a name or a dotted one (``model(x)``, ``self.net(x)``),
    as the model's is: not a method of an expression (``model(x)[0].float()``)."""
    return isinstance(node, ast.Call) and dotted_name(node.func) is not None


def _named_outputs(src: ScriptSource, loss: ast.Call, call_line: int) -> _LossSite | None:
    """The loss site where ``loss`` reads the name that ``name = model(...)`` on
    ``call_line`` binds."""
    for node in scope_nodes(src.scope(loss)):
        if (isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.lineno <= call_line <= (node.end_lineno or 0)
                and _names_a_callee(node.value)):
            assert isinstance(node.value, ast.Call)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            name = dotted_name(targets[0]) if len(targets) == 1 else None
            if name and isinstance(targets[0], ast.Name) and output_refs(loss, name, None):
                return _LossSite(loss, node.value, node, name)
    return None


def _part_outputs(src: ScriptSource, loss: ast.Call, call_line: int,
                  model_name: str | None) -> _LossSite | None:
    """The loss site where ``loss`` reads a part of the outputs of the model's call on
    ``call_line``: one name of ``a, b = model(x)``; the name a chain of attributes, indexes
    and method calls binds, on the call itself (``logits = model(x)["logits"].float()``) or
    on the name ``outputs = model(x)`` binds (``logits = outputs.logits[:, :-1]``); NoRewrite
    where the outputs or the part are read elsewhere too (the fix would need them kept
    beside the loss)."""
    scope = src.scope(loss)
    nodes = list(scope_nodes(scope))
    reads = [n for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    for node in nodes:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and node.lineno <= call_line <= (node.end_lineno or 0)):
            continue
        (target,) = node.targets
        if isinstance(target, ast.Name) and not _names_a_callee(node.value):
            # the chain on the model's call itself
            root = _chain_root(node.value, lambda n: isinstance(n, ast.Call)
                               and n.lineno <= call_line <= (n.end_lineno or 0)
                               and model_name is not None and dotted_name(n.func) == model_name)
            step = _chain_text(src, root, node.value) if isinstance(root, ast.Call) else ""
            if isinstance(root, ast.Call) and step and output_refs(loss, target.id, None):
                _read_only_in(src, loss, reads, [target.id], target.id)
                return _LossSite(loss, root, node, target.id, part="{}" + step)
            continue
        call = node.value
        if not (_names_a_callee(call) and isinstance(call, ast.Call)):
            continue
        if isinstance(target, (ast.Tuple, ast.List)) and all(
                isinstance(e, ast.Name) for e in target.elts):
            names = [e.id for e in target.elts if isinstance(e, ast.Name)]
            read = [i for i, name in enumerate(names) if output_refs(loss, name, None)]
            if len(read) != 1:
                continue
            (i,) = read
            _read_only_in(src, loss, reads, names, names[i])
            return _LossSite(loss, call, node, names[i], part=f"{{}}[{i}]")
        if not isinstance(target, ast.Name):
            continue
        whole = target.id
        for bind in nodes:
            if not (isinstance(bind, ast.Assign) and len(bind.targets) == 1
                    and isinstance(bind.targets[0], ast.Name)
                    and start_of(node) < start_of(bind) < start_of(src.statement(loss))):
                continue
            root = _chain_root(bind.value, _named(whole))
            step = _chain_text(src, root, bind.value) if root is not None else ""
            name = bind.targets[0].id
            if not (root is not None and step and output_refs(loss, name, None)):
                continue
            _read_only_in(src, loss, [r for r in reads if r is not root], [whole, name], name)
            return _LossSite(loss, call, node, name, part="{}" + step, part_stmt=bind,
                             whole_name=whole)
    return None


def _named(name: str) -> Callable[[ast.expr], bool]:
    """Whether a node is the name ``name``."""
    return lambda node: isinstance(node, ast.Name) and node.id == name


def _chain_root(node: ast.expr, is_root: Callable[[ast.expr], bool]) -> ast.expr | None:
    """The node ``is_root`` picks at the bottom of ``node``, a chain of attributes, indexes
    and method calls (``out[0][:, :-1].float()``); None where the chain breaks first."""
    while not is_root(node):
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func
        else:
            return None
    return node


def _chain_text(src: ScriptSource, root: ast.expr, value: ast.expr) -> str:
    """The chain's text after its root (``[0][:, :-1].float()``), or "" where it is not
    plainly written after it (a root in parentheses)."""
    text = src.text[src.span(root)[1]:src.span(value)[1]]
    return text if text[:1] in (".", "[") else ""


def _read_only_in(src: ScriptSource, loss: ast.Call, reads: list[ast.Name], names: list[str],
                  part: str) -> None:
    """NoRewrite where one of ``names`` (the outputs, their parts) is read anywhere but as
    ``part`` inside the loss call."""
    inside = {id(r) for r in output_refs(loss, part, None)}
    elsewhere = sorted({r.lineno for r in reads if r.id in names and id(r) not in inside})
    if elsewhere:
        raise NoRewrite(f"line {', '.join(map(str, elsewhere))} also read the model's outputs "
                        f"or a part of them besides the loss (line {loss.lineno}): with the "
                        "loss inside forward they are not returned; keep them with "
                        "ModelWithLoss(..., keep_outputs=True) by hand")


def _free_names_at_wrap(src: ScriptSource, fn: LossFunction, loss: ast.Call,
                        wrap: ast.stmt) -> None:
    """The loss function, made at the wrap, reads its names when it runs: each must be one
    the wrap's scope sees (its own, an enclosing function's, the module's, a builtin)."""
    scope = src.scope(wrap)
    for name in sorted(loaded_names(loss) - {fn.outputs_name, *fn.targets_names}):
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
                     loss_callee: str = "", targets_name: str = "",
                     elsewhere: WrapElsewhere | None = None) -> Rewrite:
    edits = Edits(src)
    notes: list[str] = []
    # the wrap, where it is in this file (else the training file sets ModelWithLoss inside
    # the DataParallel it holds: dpprof.script.wrap_elsewhere)
    dp: ast.Call | None = None
    wrap: ast.stmt | None = None
    condition: ast.stmt | None = None
    arg: ast.expr | None = None
    before: ast.stmt | None = None
    if elsewhere is None:
        dp = data_parallel_call(src, dp_line)
        wrap = src.statement(dp)
        # a wrap that runs under a condition (``if torch.cuda.device_count() > 1:``): where
        # the wrapped model is a name bound before it, ModelWithLoss wraps it there, before
        # the condition, so that the model's call with its targets works on every path (one
        # GPU, the CPU, a DDP branch), and the wrap stays as written
        condition = _condition_of(src, dp, wrap)
        arg = module_arg(dp)
        if condition is not None and isinstance(arg, ast.Name) and available(
                src, src.scope(wrap), arg.id, condition):
            before = condition
    anchor = before or wrap  # where the loss function must exist
    expression: LossFunction | None = None
    plain: tuple[str, str, ast.expr] | None = None  # the loss given as itself: criterion
    if targets_name:
        site, expression = _expression_site(src, dp, loss_line, call_line, loss_callee,
                                            targets_name)
        plain = _plain_loss(src, site, targets_name)
    if plain is not None:
        expression = None
        loss_fn, targets, callee = plain
    elif expression is not None:
        if anchor is not None:
            _free_names_at_wrap(src, expression, site.loss, anchor)
        loss_fn, targets, callee = expression.text, targets_name, site.loss.func
    else:
        site = _loss_site(src, loss_line, call_line)
        loss_fn, targets, callee = _loss_fn_text(src, site.loss)
    model = site.model
    inputs = _model_inputs(src, model)
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
        if site.part_stmt is not None:  # logits = outputs.logits: read inside forward now
            start, end = src.whole_lines(site.part_stmt)
            edits.replace(start, end, f"{src.indent(site.part_stmt.lineno)}pass{src.newline()}"
                          if len(src.block(site.part_stmt)) == 1 else "")
    if keep:
        assert isinstance(loss_stmt, ast.Assign)
        edits.node(loss_stmt, f"{site.outputs_name}, {src.seg(loss_stmt.targets[0])} = "
                   f"dpprof.ModelWithLoss.split({call})")
    else:
        edits.node(site.loss, f"dpprof.ModelWithLoss.combine({call})")
    keep_arg = ", keep_outputs=True" if keep else ""
    if elsewhere is not None:  # the training file sets it inside the DataParallel it holds
        # the names the loss function reads (its text: the model's call is its parameter)
        reads = (loaded_names(ast.parse(loss_fn, mode="eval"))
                 - {expression.outputs_name, *expression.targets_names}
                 if expression is not None else loaded_names(callee))
        notes += set_inside(src, edits, model, loss_fn, reads, keep_arg, elsewhere)
        return finish(src, edits, LOSS_IN_FORWARD_TITLE, notes)
    assert dp is not None and wrap is not None and arg is not None and anchor is not None
    # the loss function must exist where the model is wrapped
    wrap_scope = src.scope(wrap)
    key = dotted_name(callee)
    assert key is not None
    if wrap_scope is not scope:
        notes.append(f"the wrap (line {wrap.lineno}) and the loss (line {loss_stmt.lineno}) "
                     f"are in different functions: `{key}` at the wrap is taken to be the "
                     "loss the training step calls")
    if expression is None and not available(src, wrap_scope, key, anchor):
        notes.append(f"{moves(hoist(src, edits, wrap_scope, key, anchor))} before the wrap, "
                     "which now needs it")
    elif expression is not None and not available(src, wrap_scope, key, anchor):
        # ModelWithLoss finds the loss modules its function calls when it is made (to copy
        # their tensors, a weighted loss's weights, to every GPU): they must exist by then
        try:
            notes.append(f"{moves(hoist(src, edits, wrap_scope, key, anchor))} before the "
                         "wrap, where ModelWithLoss finds the loss modules its function calls, "
                         "to copy their tensors to every GPU")
        except NoRewrite as e:
            notes.append(f"{e}: ModelWithLoss finds the loss modules its function calls "
                         "when it is made, so a loss that holds tensors (class weights) "
                         "must be defined before the wrap")
    # DataParallel gathers the replicas' losses along its dim: ModelWithLoss shapes them so
    dim = dim_arg(dp)
    if dim is not None and not (isinstance(dim, ast.Constant) and dim.value == 0):
        keep_arg += f", dim={src.seg(dim)}"
    wrapped = f"dpprof.ModelWithLoss({src.seg(arg)}, {loss_fn}{keep_arg})"
    if before is not None:
        assert isinstance(arg, ast.Name)
        edits.insert_lines(before.lineno, [f"{src.indent(before.lineno)}{arg.id} = {wrapped}"])
        notes.append(f"the wrap (line {wrap.lineno}) is conditional: ModelWithLoss wraps "
                     f"`{arg.id}` before the condition (line {before.lineno}), so that the "
                     "model's call with the targets works where DataParallel does not wrap it "
                     "too (one GPU, the CPU)")
    else:
        edits.node(arg, wrapped)
    add_imports(src, edits, ["dpprof"], wrap_scope)
    callee_text = src.seg(model.func)
    others = sorted({n.lineno for n in ast.walk(src.tree) if isinstance(n, ast.Call)
                     and n is not model and src.seg(n.func) == callee_text})
    if others:
        notes.append(f"line {', '.join(map(str, others))} also call{'s' * (len(others) == 1)} "
                     f"{callee_text}(...): ModelWithLoss given the inputs alone returns the "
                     "model's outputs, gathered on cuda:0 as before; given the targets too, "
                     "the loss")
    if any(isinstance(n, ast.Attribute) and n.attr == "module" for n in ast.walk(src.tree)):
        notes.append("the wrapped module is now the ModelWithLoss, which stands in for the "
                     "model: .module's attributes, state_dict and load_state_dict are the "
                     "model's (checkpoints keep their keys); isinstance() and "
                     "named_parameters() see the wrapper (the model is .module.model)")
    if condition is not None and before is None:
        notes.append(f"the wrap (line {wrap.lineno}) is conditional: where it does not run, "
                     "the model's call with the targets needs dpprof.ModelWithLoss too")
    return finish(src, edits, LOSS_IN_FORWARD_TITLE, notes)


def _condition_of(src: ScriptSource, dp: ast.Call, wrap: ast.stmt) -> ast.stmt | None:
    """The statement that holds the condition the wrap runs under, in the wrap's function:
    the outermost ``if`` around it, or the wrap itself where it is a conditional expression
    (``nn.DataParallel(model) if n > 1 else model``); None where it always runs."""
    around = list(until_scope(src, dp))
    ifs = [a for a in around if isinstance(a, ast.If)]
    if ifs:
        return ifs[-1]
    return wrap if any(isinstance(a, ast.IfExp) for a in around) else None


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


def loss_in_forward_at(dp_site: str, call_site: str, loss_site: str, loss_callee: str = "",
                       targets_name: str = "") -> Rewrite:
    """:func:`loss_in_forward` from ``file:line`` sites: all in one file, or the wrap in
    another than the model's call and the loss (a model file's), which stays as written
    (:mod:`dpprof.script.wrap_elsewhere`)."""
    try:
        (path, dp_line), (p2, call_line), (p3, loss_line) = map(
            site_of, (dp_site, call_site, loss_site))
        if p2 != p3:
            raise NoRewrite("the model's call and the loss are in different files "
                            f"({Path(p2).name}, {Path(p3).name})")
        if path != p2:
            return _loss_in_forward(ScriptSource(read_source(p2), p2), 0, call_line, loss_line,
                                    loss_callee, targets_name, wrap_elsewhere(dp_site))
        return loss_in_forward(read_source(path), path, dp_line, call_line, loss_line, loss_callee,
                               targets_name)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


