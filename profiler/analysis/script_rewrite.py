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
  made each rank's own device, and a ``DistributedSampler`` note at each ``DataLoader``.

Every edit is a splice at the positions of the tree's nodes (``lineno``/``col_offset``/
``end_lineno``/``end_col_offset``), so the rest of the file keeps its formatting; the new file
is compiled before its diff is given. Where the change cannot be made correctly, the result
has no diff and a reason, never code that does not compile.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOSS_IN_FORWARD_TITLE = "the loss inside forward"
DDP_TITLE = "DistributedDataParallel"
BUCKET_VIEW_TITLE = "DistributedDataParallel, gradient_as_bucket_view"

# calls that only move a module or tensor between devices: dropped where DDP places the module
_MOVES = ("cuda", "to")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
# expressions that need no parentheses before ``.attr`` or as a call's argument
_PRIMARIES = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.List,
              ast.Tuple, ast.Dict, ast.Set)


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


class NoRewrite(Exception):
    """The change cannot be made correctly; the message says why."""


# ---- positions and edits ---------------------------------------------------------------


class _Source:
    """The script's text, its tree with parent links, and node positions as text offsets."""

    def __init__(self, text: str, path: str) -> None:
        self.text = text
        self.path = path
        try:
            self.tree = ast.parse(text, filename=path)
        except SyntaxError as e:
            raise NoRewrite(f"{Path(path).name} does not parse: {e.msg} (line {e.lineno})"
                            ) from None
        # the tokenizer's line ends (str.splitlines also splits on \f, \v, \x1c...)
        self.lines = re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", text)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node

    def offset(self, lineno: int, col_bytes: int) -> int:
        """The text offset of a node position (columns are UTF-8 byte offsets)."""
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col_bytes].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        """The text offsets of a node that has a position (an expression or statement)."""
        line, col, end_line, end_col = (getattr(node, k) for k in (
            "lineno", "col_offset", "end_lineno", "end_col_offset"))
        return self.offset(line, col), self.offset(end_line, end_col)

    def seg(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_start(self, lineno: int) -> int:
        return self.starts[lineno - 1]

    def line_text(self, lineno: int) -> str:
        return self.lines[lineno - 1].rstrip("\r\n")

    def indent(self, lineno: int) -> str:
        line = self.line_text(lineno)
        return line[: len(line) - len(line.lstrip())]

    def newline(self) -> str:
        first = self.lines[0] if self.lines else "\n"
        return "\r\n" if first.endswith("\r\n") else ("\r" if first.endswith("\r") else "\n")

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parents:
            node = self.parents[node]
            yield node

    def statement(self, node: ast.AST) -> ast.stmt:
        if isinstance(node, ast.stmt):
            return node
        return next(a for a in self.ancestors(node) if isinstance(a, ast.stmt))

    def scope(self, node: ast.AST) -> ast.AST:
        return next(a for a in self.ancestors(node) if isinstance(a, _SCOPES))

    def block(self, stmt: ast.stmt) -> list[ast.stmt]:
        """The statement list that holds ``stmt`` (a body, an else, a finally...)."""
        parent = self.parents[stmt]
        for _, value in ast.iter_fields(parent):
            if isinstance(value, list) and any(v is stmt for v in value):
                return value
        raise NoRewrite(f"line {stmt.lineno}: no statement list holds it")  # pragma: no cover

    def whole_lines(self, stmt: ast.stmt) -> tuple[int, int]:
        """The text of the lines ``stmt`` occupies alone (with its line end), or NoRewrite."""
        assert stmt.end_lineno is not None
        start, end = self.span(stmt)
        before = self.text[self.line_start(stmt.lineno):start]
        line_end = self.starts[stmt.end_lineno]
        after = self.text[end:line_end]
        if before.strip() or (after.strip() and not after.strip().startswith("#")):
            raise NoRewrite(f"line {stmt.lineno} holds more than one statement")
        return self.line_start(stmt.lineno), line_end


class _Edits:
    """Replacements of text spans, applied together (they may not overlap)."""

    def __init__(self, src: _Source) -> None:
        self.src = src
        self.items: list[tuple[int, int, int, str]] = []

    def replace(self, start: int, end: int, text: str) -> None:
        self.items.append((start, end, len(self.items), text))

    def node(self, node: ast.AST, text: str) -> None:
        self.replace(*self.src.span(node), text)

    def insert_lines(self, lineno: int, lines: list[str]) -> None:
        """Whole lines before line ``lineno`` (one past the last line: at the end)."""
        nl = self.src.newline()
        at = self.src.starts[min(lineno - 1, len(self.src.lines))]
        text = "".join(line + nl for line in lines)
        if at == len(self.src.text) and self.src.text and not self.src.text.endswith(
                ("\n", "\r")):
            text = nl + text
        self.replace(at, at, text)

    def apply(self) -> str:
        out, pos = [], 0
        for start, end, _, text in sorted(self.items):
            if start < pos:
                raise NoRewrite("the changes overlap")  # pragma: no cover - a bug here
            out += [self.src.text[pos:start], text]
            pos = end
        return "".join([*out, self.src.text[pos:]])


# ---- names -----------------------------------------------------------------------------


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a name or a chain of attributes on a name; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _last_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _scope_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes that belong to ``scope`` itself: not those of nested functions, classes,
    lambdas or comprehensions (their own scopes), but their names and defaults."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack += [*node.decorator_list, *node.args.defaults,
                      *[d for d in node.args.kw_defaults if d is not None]]
            continue
        if isinstance(node, ast.Lambda):
            stack += [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]
            continue
        if isinstance(node, ast.ClassDef):
            stack += [*node.decorator_list, *node.bases, *node.keywords]
            continue
        if isinstance(node, _COMPREHENSIONS):
            stack.append(node.generators[0].iter)
            continue
        stack += list(ast.iter_child_nodes(node))


@dataclass(frozen=True)
class _Binding:
    name: str  # a name, or a dotted attribute (``self.criterion``)
    node: ast.AST  # where: the statement's node that binds it
    pos: tuple[int, int]  # (line, column) it takes effect from


def _bindings(src: _Source, scope: ast.AST) -> list[_Binding]:
    """Every name (and dotted attribute) ``scope`` binds, with where."""
    out: list[_Binding] = []
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                out.append(_Binding(arg.arg, scope, (0, 0)))
    for node in _scope_nodes(scope):
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            name = _dotted(node)
            if name:
                stmt = src.statement(node)
                assert stmt.end_lineno is not None and stmt.end_col_offset is not None
                out.append(_Binding(name, stmt, (stmt.end_lineno, stmt.end_col_offset)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                out.append(_Binding(name, node, (node.lineno, node.col_offset)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                               ast.ExceptHandler)) and node.name:
            out.append(_Binding(node.name, node, (node.lineno, node.col_offset)))
    return out


def _declared_global(scope: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Global) and name in n.names for n in _scope_nodes(scope))


def _loaded_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _pos(node: ast.AST) -> tuple[int, int]:
    """(line, column) where a node with a position starts."""
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)


def _bound_between(src: _Source, scope: ast.AST, names: set[str], after: tuple[int, int],
                   before: tuple[int, int]) -> list[str]:
    """Which of ``names`` ``scope`` binds between two positions."""
    return sorted({b.name for b in _bindings(src, scope)
                   if b.name in names and after <= _pos(b.node) < before})


# ---- finding the recorded sites ----------------------------------------------------------


def _calls_at(src: _Source, line: int) -> list[ast.Call]:
    """The calls whose text spans ``line``: those that start on it first, innermost first."""
    calls = [n for n in ast.walk(src.tree) if isinstance(n, ast.Call)
             and n.lineno <= line <= (n.end_lineno or n.lineno)]
    return sorted(calls, key=lambda c: (c.lineno != line, -c.lineno, -c.col_offset))


def _is_data_parallel(call: ast.Call) -> bool:
    name = _last_name(call.func)
    return name.endswith("DataParallel") and name != "DistributedDataParallel"


def _data_parallel_call(src: _Source, line: int) -> ast.Call:
    for call in _calls_at(src, line):
        if _is_data_parallel(call):
            return call
    raise NoRewrite(f"line {line}: no DataParallel(...) call to rewrite "
                    "(a subclass's own __init__, or a wrap dpprof cannot see in the text)")


def _module_arg(call: ast.Call) -> ast.expr:
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    for kw in call.keywords:
        if kw.arg == "module":
            return kw.value
    raise NoRewrite(f"line {call.lineno}: DataParallel's module is not given as an argument")


def _paren(src: _Source, node: ast.expr) -> str:
    text = src.seg(node)
    return text if isinstance(node, _PRIMARIES) else f"({text})"


@dataclass
class _LossSite:
    loss: ast.Call  # criterion(outputs, targets)
    model: ast.Call  # model(inputs)
    outputs_stmt: ast.stmt | None  # ``outputs = model(inputs)``, where separate
    outputs_name: str  # "" where the model's call is inside the loss call


def _loss_site(src: _Source, loss_line: int, call_line: int) -> _LossSite:
    """The loss call on ``loss_line`` whose first argument is the model's call on
    ``call_line``, or a name that line assigns from it."""
    for loss in _calls_at(src, loss_line):
        if not loss.args or isinstance(loss.args[0], ast.Starred):
            continue
        first = loss.args[0]
        if isinstance(first, ast.Call) and first.lineno <= call_line <= (first.end_lineno or 0):
            return _LossSite(loss, first, None, "")
        if isinstance(first, ast.Name):
            scope = src.scope(loss)
            for node in _scope_nodes(scope):
                if (isinstance(node, (ast.Assign, ast.AnnAssign))
                        and node.lineno <= call_line <= (node.end_lineno or 0)
                        and isinstance(node.value, ast.Call)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if len(targets) == 1 and _dotted(targets[0]) == first.id:
                        return _LossSite(loss, node.value, node, first.id)
    raise NoRewrite(f"line {loss_line}: no loss call whose first argument is the model's "
                    f"outputs from line {call_line} (as `outputs = model(x)` then "
                    "`criterion(outputs, y)`, or `criterion(model(x), y)`)")


# ---- the loss inside forward --------------------------------------------------------------


def _loss_fn_text(src: _Source, loss: ast.Call) -> tuple[str, str, ast.expr]:
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
    if _dotted(loss.func) is None:
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


def _available(src: _Source, scope: ast.AST, key: str, at: ast.stmt) -> bool:
    """Whether ``key`` (a name or dotted attribute) names something at statement ``at`` of
    ``scope`` (a local bound before it, a global, a builtin)."""
    binds = [b for b in _bindings(src, scope) if b.name == key]
    if binds:
        return any(b.pos <= _pos(at) for b in binds)
    root = key.split(".")[0]
    if root != key:
        return _available(src, scope, root, at)
    # a free name: an enclosing function's or the module's, bound by the time it runs (a
    # class body's names are not visible in its methods)
    outer = scope
    while not isinstance(outer, ast.Module):
        outer = src.scope(outer)
        if not isinstance(outer, ast.ClassDef) and any(
                b.name == key for b in _bindings(src, outer)):
            return True
    return hasattr(builtins, key)


def _hoist(src: _Source, edits: _Edits, scope: ast.AST, key: str, wrap: ast.stmt) -> int:
    """Move the one assignment of ``key`` that follows the wrap (in the same statement list
    as the wrap or a statement holding it) to just before that statement; its line."""
    binds = [b for b in _bindings(src, scope) if b.name == key]
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
    moved = _bound_between(src, scope, _loaded_names(assign.value), _pos(holder),
                           _pos(assign))
    if moved:
        raise NoRewrite(f"`{key}` (line {assign.lineno}) uses {', '.join(moved)}, set after "
                        f"the wrap (line {wrap.lineno}), so it cannot move before it")
    start, end = src.whole_lines(assign)
    text = src.text[start:end]
    edits.replace(start, end, "")
    at = src.line_start(holder.lineno)
    edits.replace(at, at, text)
    return assign.lineno


def _import_line(src: _Source) -> int:
    """The line before which the script's imports end (new imports go there)."""
    body = src.tree.body
    i = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        i = 1  # the docstring
    last = body[i - 1].end_lineno if i else 0
    while i < len(body) and isinstance(body[i], (ast.Import, ast.ImportFrom)):
        last = body[i].end_lineno
        i += 1
    assert last is not None
    return last + 1


def _module_binds(src: _Source, name: str) -> list[_Binding]:
    return [b for b in _bindings(src, src.tree) if b.name == name]


def _import_path(node: ast.AST, name: str) -> str | None:
    """What an import statement binds ``name`` to (``torch.distributed``), if it binds it."""
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname == name:
                return a.name
            if a.asname is None and a.name.split(".")[0] == name:
                return name
    if isinstance(node, ast.ImportFrom) and not node.level:
        for a in node.names:
            if (a.asname or a.name) == name:
                return f"{node.module}.{a.name}"
    return None


# what each name the rewrites use must be, and the line that imports it
_NEEDED = {
    "dpprof": (("dpprof",), "import dpprof"),
    "os": (("os",), "import os"),
    "torch": (("torch",), "import torch"),
    "dist": (("torch.distributed",), "import torch.distributed as dist"),
    "DDP": (("torch.nn.parallel.DistributedDataParallel",
             "torch.nn.parallel.distributed.DistributedDataParallel"),
            "from torch.nn.parallel import DistributedDataParallel as DDP"),
}


def _imports(src: _Source, edits: _Edits, names: list[str], scope: ast.AST) -> None:
    """Import each of ``names`` the script lacks; one it binds to something else (in the
    module, or in ``scope``, where the new lines use it) is a conflict."""
    lines = []
    for name in names:
        paths, line = _NEEDED[name]
        binds = _module_binds(src, name)
        if scope is not src.tree:
            binds += [b for b in _bindings(src, scope) if b.name == name]
        found = [_import_path(b.node, name) for b in binds]
        if any(p in paths for p in found) and all(p in paths for p in found):
            continue
        if binds:
            raise NoRewrite(f"the script already uses the name `{name}` for something else "
                            f"than `{line}`")
        lines.append(line)
    if lines:
        edits.insert_lines(_import_line(src), lines)


def _read(path: str) -> str:
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise NoRewrite(f"cannot read {path}: {e}") from None


def _finish(src: _Source, edits: _Edits, title: str, notes: list[str]) -> Rewrite:
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
                    loss_line: int) -> Rewrite:
    """The script with its loss computed inside forward on every replica (see the module).

    ``dp_line``: the ``DataParallel(...)`` wrap; ``call_line``: the call of the wrapped model
    whose outputs reach the loss; ``loss_line``: the loss call on them.
    """
    try:
        return _loss_in_forward(_Source(source, path), dp_line, call_line, loss_line)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def _loss_in_forward(src: _Source, dp_line: int, call_line: int, loss_line: int) -> Rewrite:
    edits = _Edits(src)
    notes: list[str] = []
    dp = _data_parallel_call(src, dp_line)
    wrap = src.statement(dp)
    site = _loss_site(src, loss_line, call_line)
    loss_fn, targets, callee = _loss_fn_text(src, site.loss)
    model = site.model
    if model.keywords or any(isinstance(a, ast.Starred) for a in model.args) or not model.args:
        raise NoRewrite(f"line {model.lineno}: the model's call takes keyword or unpacked "
                        "arguments, or none; ModelWithLoss takes (inputs, targets)")
    inputs = ", ".join(src.seg(a) for a in model.args)
    if len(model.args) > 1:
        inputs = f"({inputs})"  # ModelWithLoss passes a tuple on as the model's arguments
    call = f"{_paren(src, model.func)}({inputs}, {targets})"
    loss_stmt = src.statement(site.loss)
    scope = src.scope(loss_stmt)
    if site.outputs_stmt is not None:
        stmt = site.outputs_stmt
        assert stmt.end_lineno is not None and stmt.end_col_offset is not None
        if _pos(stmt) > _pos(loss_stmt):
            raise NoRewrite(f"the model's call (line {stmt.lineno}) comes after the loss "
                            f"(line {loss_stmt.lineno})")
        rebound = _bound_between(src, scope, _loaded_names(model),
                                 (stmt.end_lineno, stmt.end_col_offset), _pos(loss_stmt))
        if rebound:
            raise NoRewrite(f"{', '.join(rebound)} change between the model's call (line "
                            f"{stmt.lineno}) and the loss (line {loss_stmt.lineno})")
        uses = sorted({n.lineno for n in _scope_nodes(scope) if isinstance(n, ast.Name)
                       and n.id == site.outputs_name and isinstance(n.ctx, ast.Load)
                       and n is not site.loss.args[0]})
        start, end = src.whole_lines(stmt)
        indent = src.indent(stmt.lineno)
        lines = []
        if uses:
            where = ", ".join(str(u) for u in uses)
            lines.append(f"{indent}# {site.outputs_name} no longer reaches cuda:0 (line {where} "
                         "uses it): compute that inside forward")
        if len(src.block(stmt)) == 1:
            lines.append(f"{indent}pass")
        edits.replace(start, end, "".join(line + src.newline() for line in lines))
    edits.node(site.loss, f"dpprof.ModelWithLoss.combine({call})")
    # the loss function must exist where the model is wrapped
    wrap_scope = src.scope(wrap)
    key = _dotted(callee)
    assert key is not None
    if wrap_scope is not scope:
        notes.append(f"the wrap (line {wrap.lineno}) and the loss (line {loss_stmt.lineno}) "
                     f"are in different functions: `{key}` at the wrap is taken to be the "
                     "loss the training step calls")
    if not _available(src, wrap_scope, key, wrap):
        moved = _hoist(src, edits, wrap_scope, key, wrap)
        notes.append(f"`{key}` (line {moved}) moves before the wrap, which now needs it")
    edits.node(_module_arg(dp), f"dpprof.ModelWithLoss({src.seg(_module_arg(dp))}, {loss_fn})")
    _imports(src, edits, ["dpprof"], wrap_scope)
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
    if any(isinstance(a, (ast.If, ast.IfExp)) for a in [*_until_scope(src, dp)]):
        notes.append(f"the wrap (line {wrap.lineno}) is conditional: where it does not run, "
                     "the model's call with the targets needs dpprof.ModelWithLoss too")
    return _finish(src, edits, LOSS_IN_FORWARD_TITLE, notes)


def _until_scope(src: _Source, node: ast.AST) -> Iterator[ast.AST]:
    for a in src.ancestors(node):
        if isinstance(a, _SCOPES):
            return
        yield a


# ---- DistributedDataParallel ----------------------------------------------------------


def _device_like(src: _Source, node: ast.expr) -> bool:
    """An argument of ``.to(...)`` that names a device (not a dtype)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (str, int)) and not isinstance(node.value, bool)
    if isinstance(node, ast.Call):
        return _dotted(node.func) in ("torch.device", "device")
    text = src.seg(node).lower()
    return "dev" in text or "cuda" in text or "gpu" in text or "rank" in text


def _move(src: _Source, node: ast.AST) -> ast.expr | None:
    """``x`` of ``x.cuda(...)`` or ``x.to(<device>)``; None where ``node`` is not such a move."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MOVES):
        return None
    if node.func.attr == "to" and (node.keywords or len(node.args) != 1
                                   or not _device_like(src, node.args[0])):
        return None
    return node.func.value


def _free_name(src: _Source, *names: str) -> str:
    used = {n.id for n in ast.walk(src.tree) if isinstance(n, ast.Name)} | {
        a.arg for a in ast.walk(src.tree) if isinstance(a, ast.arg)}
    for name in names:
        if name not in used:
            return name
    raise NoRewrite(f"the script already uses the names {', '.join(names)}")


def _init_line(src: _Source, wrap: ast.stmt) -> tuple[int, str]:
    """Where the process group starts: the top of the wrap's function, of the script's
    ``if __name__ == "__main__":`` block, or of the script after its imports."""
    scope = src.scope(wrap)
    body: list[ast.stmt] | None = None
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = scope.body
    else:
        main = next((a for a in _until_scope(src, wrap) if isinstance(a, ast.If)
                     and "__name__" in ast.unparse(a.test)
                     and "__main__" in ast.unparse(a.test)), None)
        if main is not None:
            body = main.body
    if body is None:
        return _import_line(src), ""
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str) and len(body) > 1:
        first = body[1]
    if first.lineno == _pos(src.parents[first])[0]:  # ``def f(): x`` on one line
        raise NoRewrite(f"line {first.lineno}: the body shares its line with the def")
    return first.lineno, src.indent(first.lineno)


def ddp(source: str, path: str, dp_line: int, gpus: int, bucket_view: bool = False
        ) -> Rewrite:
    """The script as ``gpus`` DistributedDataParallel ranks (see the module)."""
    try:
        return _ddp(_Source(source, path), dp_line, gpus, bucket_view)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def _ddp(src: _Source, dp_line: int, gpus: int, bucket_view: bool) -> Rewrite:
    edits = _Edits(src)
    notes: list[str] = []
    dp = _data_parallel_call(src, dp_line)
    wrap = src.statement(dp)
    module = _module_arg(dp)
    inner = _move(src, module) or module
    rank = _free_name(src, "rank", "local_rank")
    args = [f"{_paren(src, inner)}.cuda({rank})", f"device_ids=[{rank}]"]
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
    _imports(src, edits, ["os", "torch", "dist", "DDP"], src.scope(wrap))
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
    share = (f"DDP: each rank loads its share: batch_size // {gpus}, "
             "sampler=DistributedSampler(dataset) (it shuffles: no shuffle=True)")
    loaders = sorted({src.statement(n).lineno for n in ast.walk(src.tree)
                      if isinstance(n, ast.Call) and _last_name(n.func) == "DataLoader"})
    for at in loaders or [wrap.lineno]:
        edits.insert_lines(at, [f"{src.indent(at)}# {share}"])
    if not loaders:
        notes.append("the script makes its batches without a DataLoader: give each rank its "
                     f"share (1/{gpus} of the batch) by hand")
    return _finish(src, edits, BUCKET_VIEW_TITLE if bucket_view else DDP_TITLE, notes)


# ---- from dpprof run's recorded sites ------------------------------------------------------


def _site(site: str) -> tuple[str, int]:
    path, _, num = site.rpartition(":")
    if not num.isdigit() or not path or path == "?":
        raise NoRewrite(f"dpprof did not see the script's line ({site!r})")
    return path, int(num)


def loss_in_forward_at(dp_site: str, call_site: str, loss_site: str) -> Rewrite:
    """:func:`loss_in_forward` from ``file:line`` sites (all in one file)."""
    try:
        (path, dp_line), (p2, call_line), (p3, loss_line) = map(
            _site, (dp_site, call_site, loss_site))
        if not path == p2 == p3:
            raise NoRewrite("the wrap, the model's call and the loss are in different files "
                            f"({Path(path).name}, {Path(p2).name}, {Path(p3).name})")
        return loss_in_forward(_read(path), path, dp_line, call_line, loss_line)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def ddp_at(dp_site: str, gpus: int, bucket_view: bool = False) -> Rewrite:
    """:func:`ddp` from the wrap's ``file:line``."""
    try:
        path, line = _site(dp_site)
        return ddp(_read(path), path, line, gpus, bucket_view)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def rewrite_text(rewrite: Rewrite) -> str:
    """A fix's code: the diff, then what to check by hand as comments; or, where there is no
    diff, the reason as a comment."""
    if not rewrite.ok:
        return f"# no rewrite of the script's lines: {rewrite.reason}" if rewrite.reason else ""
    return "\n".join([rewrite.diff, *(f"# also: {n}" for n in rewrite.notes)])
