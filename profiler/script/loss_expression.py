"""The loss a script computes on DataParallel's outputs, as a function of them and the batch.

A loop computes its loss on the gathered outputs, often through an expression:
``criterion(logits.view(-1, logits.size(-1)), y.view(-1))``,
``criterion(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:])``. Moved inside forward,
each replica applies the same expression to its own shard of the outputs and of the batch
tensor the targets are taken from, so the loss call becomes the function::

    lambda logits, y: criterion(logits.view(-1, logits.size(-1)), y.view(-1))

(its source text, the loss call as written), which ``dpprof.ModelWithLoss`` takes as its
loss function and DataParallel scatters ``y`` for. The same text is what ``dpprof run``
computes per replica in its loss-inside-forward run and what the diff it prints writes, so
the two cannot differ.

:func:`loss_function` makes that text from the script's tree; which name is the batch's
tensor (``y``, not the vocabulary size ``V``) is read from the running script's values
(:func:`batch_tensor_names`).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from dpprof.emulator.call_sites import frame_locals
from dpprof.scenarios.losses import LOSS_FORMS, is_loss
from dpprof.script.source import NoRewrite, ScriptSource, dotted_name, running_source

_OUTPUTS = "outputs"  # the parameter's name where the model's call is inside the loss call


@dataclass(frozen=True)
class LossFunction:
    """A loss call on DataParallel's outputs, as a function of (outputs, targets)."""

    text: str  # ``lambda logits, y: criterion(...)``
    outputs_name: str  # the function's first parameter
    # the others: the batch tensors DataParallel scatters as the targets, in the order the
    # loss call reads them (``y``; a CTC loss's ``text, preds_size, length``)
    targets_names: tuple[str, ...]

    @property
    def targets_name(self) -> str:
        """The targets' parameters as the function and the model's call list them."""
        return ", ".join(self.targets_names)


def output_refs(loss: ast.Call, outputs_name: str, model_call: ast.Call | None
                ) -> list[ast.expr]:
    """The places in the loss call that read the outputs: the name they were bound to, or
    the model's own call written inside the loss call."""
    refs: list[ast.expr] = []
    for node in ast.walk(loss):
        if isinstance(node, ast.Name) and node.id == outputs_name and isinstance(
                node.ctx, ast.Load) and outputs_name:
            refs.append(node)
        elif model_call is not None and node is model_call:
            refs.append(model_call)
    return refs


def loaded_outside(loss: ast.Call, skip: list[ast.expr]) -> list[ast.Name]:
    """The names the loss call's arguments read, outside ``skip`` (the outputs' places)."""
    out: list[ast.Name] = []
    stack: list[ast.AST] = [*loss.args, *(kw.value for kw in loss.keywords)]
    while stack:
        node = stack.pop()
        if any(node is s for s in skip):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def loss_function(src: ScriptSource, loss: ast.Call, outputs_name: str,
                  model_call: ast.Call | None, targets_name: str, part: str = "",
                  whole_name: str = "") -> LossFunction:
    """The loss call ``loss`` as ``lambda <outputs>, <targets>: <the call as written>``
    (the model's call inside it, where it is there, replaced by the outputs' parameter);
    or NoRewrite where the call cannot move into forward as written. ``targets_name``: one
    name, or several as a parameter list (``text, preds_size, length``). ``part``: the loss
    reads ``outputs_name``, a part of the outputs (``logits = outputs.logits``), whose
    expression of the whole outputs this formats (``"{}.logits"``); the function is then of
    the whole outputs, its parameter ``whole_name``, each read of the part that expression."""
    if dotted_name(loss.func) is None:
        raise NoRewrite(f"line {loss.lineno}: the loss function is an expression "
                        f"({src.seg(loss.func)}), not a name")
    refs = output_refs(loss, outputs_name, model_call)
    if not refs:
        raise NoRewrite(f"line {loss.lineno}: the loss call does not read the outputs")
    if not targets_name:
        raise NoRewrite(f"line {loss.lineno}: the loss takes no tensor of the batch as its "
                        "targets")
    targets_names = tuple(n.strip() for n in targets_name.split(","))
    names = {n.id for n in ast.walk(loss) if isinstance(n, ast.Name)}
    param = outputs_name or next(p for p in (_OUTPUTS, f"{_OUTPUTS}_", f"{_OUTPUTS}__")
                                 if p not in names)
    if param in targets_names:
        raise NoRewrite(f"line {loss.lineno}: the outputs and the targets have one name "
                        f"({param})")
    if part:
        param = whole_name if whole_name and whole_name not in names else next(
            p for p in (_OUTPUTS, f"{_OUTPUTS}_", f"{_OUTPUTS}__") if p not in names)
    start, end = src.span(loss)
    text = src.text[start:end]
    for ref in sorted(refs, key=lambda r: src.span(r)[0], reverse=True):
        if isinstance(ref, ast.Call) or part:  # the model's call inside the loss, or a part
            a, b = src.span(ref)
            text = text[:a - start] + (part.format(param) if part else param) + text[b - start:]
    # a call over several lines stays inside its own parentheses: one expression
    return LossFunction(text=f"lambda {param}, {', '.join(targets_names)}: {text}",
                        outputs_name=param, targets_names=targets_names)


# ---- in the running script -------------------------------------------------------------

def _statement_at(src: ScriptSource, line: int) -> ast.stmt | None:
    """The innermost statement whose lines hold ``line``."""
    best: ast.stmt | None = None
    for node in ast.walk(src.tree):
        if (isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or 0)
                and (best is None or (node.lineno, -(node.end_lineno or 0))
                     > (best.lineno, -(best.end_lineno or 0)))):
            best = node
    return best


_MISSING = object()


def _value(names: dict[str, Any], node: ast.AST, opaque: Callable[[Any], bool]) -> Any:
    """The value of a name or dotted attribute in ``names`` (a frame's globals and locals:
    :func:`_names_of`; ``_MISSING`` where it is not
    one, or not bound, or an attribute of a value that is ``opaque``: the outputs, whose
    attributes are what is being looked for)."""
    key = dotted_name(node)
    if key is None:
        return _MISSING
    root, *attrs = key.split(".")
    value = names.get(root, _MISSING)
    for attr in attrs:
        if value is _MISSING or opaque(value):
            return _MISSING
        value = getattr(value, attr, _MISSING)
    return value


@dataclass(frozen=True)
class FoundLoss:
    """A loss call on the outputs, in the running script."""

    function: LossFunction
    call: ast.Call
    site: str  # "file:line" of the loss call
    # the batch tensors the targets are taken from (the whole batch's), the function's order
    targets: tuple[torch.Tensor, ...]
    env: dict[str, Any]  # the values of the names the function reads, from the frame
    # where it reads a number equal to the whole batch's rows, what to say if it fails so
    whole_rows: str = ""


def _names_of(frame: FrameType) -> dict[str, Any]:
    """The names ``frame`` sees, its locals over its globals (read as
    :func:`dpprof.emulator.call_sites.frame_locals` reads them: keeping none)."""
    return {**frame.f_globals, **frame_locals(frame)}


def find_in_frame(frame: FrameType, is_outputs: Callable[[Any], bool], model: nn.Module,
                  rows: int, dim: int) -> FoundLoss | str:
    """The first of :func:`losses_in_frame`, or why there is none."""
    found = losses_in_frame(frame, is_outputs, model, rows, dim)
    return found if isinstance(found, str) else found[0]


def losses_in_frame(frame: FrameType, is_outputs: Callable[[Any], bool], model: nn.Module,
                    rows: int, dim: int) -> list[FoundLoss] | str:
    """The loss calls of the statement ``frame`` is running whose arguments read the
    outputs (a name whose value ``is_outputs``, or ``model``'s call), in the order Python
    evaluates them (left to right: ``crit(out[0], y) + 0.4 * crit(out[1], y)``), each as a
    :class:`LossFunction` whose targets are the one tensor of the batch (``rows`` along
    ``dim``) it reads; or, where there is none, why (one sentence)."""
    path, line = frame.f_code.co_filename, frame.f_lineno
    where = f"{Path(path).name}:{line}"
    names = _names_of(frame)
    src = running_source(path)
    stmt = _statement_at(src, line) if src is not None else None
    if src is None or stmt is None:
        return f"the outputs are used at {where}, whose source dpprof cannot read"
    refs: list[ast.expr] = []
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if is_outputs(_value(names, node, is_outputs)):
                refs.append(node)
        elif isinstance(node, ast.Call) and _value(names, node.func, is_outputs) is model:
            refs.append(node)
    if not refs:
        return f"the outputs are used at {where} through an expression dpprof cannot follow"
    losses: list[ast.Call] = []
    for ref in refs:
        loss = next((a for a in src.ancestors(ref) if isinstance(a, ast.Call)
                     and ref is not a.func and is_loss(_value(names, a.func, is_outputs),
                                                       len(a.args) + len(a.keywords))), None)
        if loss is None:
            text = src.line_text(line).strip()
            return (f"the outputs are used at {where} outside the arguments of a loss "
                    f"(`{text}`; {LOSS_FORMS})")
        if not any(loss is seen for seen in losses):
            losses.append(loss)
    model_calls = [r for r in refs if isinstance(r, ast.Call)]
    if len(losses) > 1 and model_calls:  # each loss its own forward: not the same outputs
        return (f"{where} computes {len(losses)} losses, each on a call of the model, and "
                "dpprof moves the losses of one forward inside it")
    found: list[FoundLoss] = []
    for loss in sorted(losses, key=lambda c: (c.lineno, c.col_offset)):
        one = _found_loss(path, line, names, src, loss, refs, is_outputs, rows, dim)
        if isinstance(one, str):
            return one
        found.append(one)
    return found


# A step from the outputs to a part of them: ("attr", name), ("item", key) or ("call", args,
# kwargs) (a method's call: the step before it took the method)
Step = tuple[Any, ...]


@dataclass(frozen=True)
class Binding:
    """What the statement now running binds of the outputs: ``names`` names to their first
    ``names`` items (``a, b = model(x)``), or one name to the end of ``steps``
    (``logits = outputs.logits[:, :-1].float()``)."""

    names: int = 0
    steps: tuple[Step, ...] = ()
    where: frozenset[tuple[str, int]] = frozenset()  # (file, line) of the statement's lines


def parts_bound(frame: FrameType, is_outputs: Callable[[Any], bool], model: nn.Module
                ) -> Binding | None:
    """What the statement ``frame`` is running binds of the outputs (a name whose value
    ``is_outputs``, or ``model``'s call), where it binds them and nothing else: k names
    unpacked (``a, b = model(x)``, ``a, b = outputs``; none starred), or one name to a chain
    of attributes, indexes and method calls on them whose keys and arguments are plain
    values (``logits = outputs.logits``, ``out = model(x)[0]``, ``logits =
    out[:, :-1].float()``); None for any other statement."""
    path, line = frame.f_code.co_filename, frame.f_lineno
    src = running_source(path)
    stmt = _statement_at(src, line) if src is not None else None
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    names = _names_of(frame)

    def outputs(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return is_outputs(_value(names, node, is_outputs))
        return isinstance(node, ast.Call) and _value(names, node.func, is_outputs) is model

    (target,), value = stmt.targets, stmt.value
    if isinstance(target, ast.Name):
        steps = _chain(value, outputs, names)
        where = frozenset((path, n) for n in range(stmt.lineno, (stmt.end_lineno or 0) + 1))
        return Binding(steps=tuple(steps), where=where) if steps else None
    if (isinstance(target, (ast.Tuple, ast.List)) and target.elts
            and all(isinstance(e, ast.Name) for e in target.elts) and outputs(value)):
        return Binding(names=len(target.elts))
    return None


def _chain(node: ast.expr, outputs: Callable[[ast.expr], bool],
           names: dict[str, Any]) -> list[Step] | None:
    """The steps from the outputs to ``node``, a chain of attributes, indexes and method
    calls rooted at them; None where ``node`` is no such chain or a key or an argument is
    not a plain value (a tensor, or anything computed by a call)."""
    steps: list[Step] = []
    if any(outputs(n) for n in ast.walk(node) if isinstance(n, ast.expr)
           and n is not _root(node)):
        return None  # ``y.to(out.device)``: the outputs read in a key or an argument
    while not outputs(node):
        if isinstance(node, ast.Attribute):
            steps.append(("attr", node.attr))
            node = node.value
        elif isinstance(node, ast.Subscript):
            key = _plain(node.slice, names, index=True)
            if key is _MISSING:
                return None
            steps.append(("item", key))
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            args = [_plain(a, names) for a in node.args]
            kwargs = {k.arg: _plain(k.value, names) for k in node.keywords}
            if _MISSING in args or _MISSING in kwargs.values() or None in kwargs:
                return None
            steps.append(("call", tuple(args), kwargs))
            node = node.func
        else:
            return None
    return steps[::-1] or None


def _root(node: ast.expr) -> ast.expr:
    """The expression a chain of attributes, indexes and method calls starts from."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        else:
            return node


_PLAIN = (int, float, bool, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device)


class _Key:
    """``_Key()[k]`` is ``k``: a subscript's key (slices and all) evaluated as Python does."""

    def __getitem__(self, key: Any) -> Any:
        return key


def _plain(node: ast.expr, names: dict[str, Any], index: bool = False) -> Any:
    """The value of ``node``, an index (``index``) or a method's argument, where it is plain
    (numbers, slices, dtypes and tuples of them, read without calling anything); else
    ``_MISSING``."""
    if any(isinstance(n, (ast.Call, ast.Starred, ast.Lambda, ast.NamedExpr, ast.Await,
                          ast.Yield, ast.YieldFrom, ast.ListComp, ast.GeneratorExp,
                          ast.DictComp, ast.SetComp)) for n in ast.walk(node)):
        return _MISSING
    if index:  # a slice is an expression only inside a subscript
        node = ast.Subscript(value=ast.Name(id="_dpprof_key", ctx=ast.Load()), slice=node,
                             ctx=ast.Load())
    expression = ast.fix_missing_locations(ast.Expression(body=node))
    try:
        value = eval(compile(expression, "<index>", "eval"),
                     {**names, "_dpprof_key": _Key()})
    except Exception:
        return _MISSING

    def plain(v: Any) -> bool:
        return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(plain(x) for x in v))

    return value if plain(value) else _MISSING


def _found_loss(path: str, line: int, names: dict[str, Any], src: ScriptSource,
                loss: ast.Call, refs: list[ast.expr], is_outputs: Callable[[Any], bool],
                rows: int, dim: int) -> FoundLoss | str:
    """The loss call ``loss`` on ``line`` of ``path`` (of the outputs' places ``refs``; the
    frame's ``names``) as a :class:`FoundLoss`, or why not."""
    where = f"{Path(path).name}:{line}"
    model_call = next((r for r in refs if isinstance(r, ast.Call)), None)
    outputs_name = next((r.id for r in refs if isinstance(r, ast.Name)), "")
    callee_root = (dotted_name(loss.func) or "").split(".")[0]
    batch: dict[str, torch.Tensor] = {}
    for name in sorted(loaded_outside(loss, refs), key=lambda n: (n.lineno, n.col_offset)):
        value = _value(names, name, is_outputs)
        if not isinstance(value, torch.Tensor) and hasattr(type(value), "__torch_function__"):
            # outputs not computed yet, another part of them (``crit(out, y, out_sizes)``)
            return (f"the loss at {where} reads {name.id}, another part of the outputs, "
                    "besides its first; dpprof moves a loss on one part of them")
        if (name.id != callee_root and isinstance(value, torch.Tensor)
                and value.dim() > dim and value.shape[dim] == rows):
            batch[name.id] = value
    if not batch:
        others = sorted({n.id for n in loaded_outside(loss, refs)} - {callee_root})
        return (f"the loss at {where} reads no tensor of the batch's {rows} rows besides "
                f"the outputs ({', '.join(others) or 'nothing else'}), so there are no "
                "targets to scatter with the inputs")
    try:
        function = loss_function(src, loss, outputs_name, model_call, ", ".join(batch))
    except NoRewrite as e:
        return str(e)
    # the names the call reads, and no more: a copy of the whole frame would keep its other
    # tensors (the last step's loss, its batch) alive as long as the function
    read = {n.id for n in ast.walk(loss) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)} - {function.outputs_name, *batch}
    env = {name: names[name] for name in read | {"__builtins__"} if name in names}
    # B of ``out.view(B * T, V)``, read from the batch or the outputs' shape, is the whole
    # batch's rows where a replica has its share; or a size that equals it (V == B)
    whole = sorted(name for name in read if type(env.get(name)) is int and env[name] == rows)
    return FoundLoss(function=function, call=loss, site=f"{path}:{line}",
                     targets=tuple(batch.values()), env=env,
                     whole_rows=(f"the loss at {where} reads {' and '.join(whole)} ({rows}, the "
                                 "whole batch's rows), which inside forward is each replica's "
                                 "share: size the loss's views from the outputs (-1, or the "
                                 "outputs' own size)") if whole else "")


def compiled(found: FoundLoss) -> Callable[..., Any]:
    """The loss function, made in the script's names (those of the loss call's frame): of
    the outputs and each of ``found.targets``."""
    path = found.site.rpartition(":")[0]
    # at the loss call's line: an error inside a replica's loss points there
    tree = ast.increment_lineno(ast.parse(found.function.text, mode="eval"),
                                found.call.lineno - 1)
    fn = eval(compile(tree, path, "eval"), dict(found.env))
    return fn  # type: ignore[no-any-return]
