"""A script's syntax tree, as the rewrites (:mod:`dpprof.script.rewrite`) edit it: the text
with node positions as offsets, splices at those positions, the names each scope binds and
where, the calls ``dpprof run`` recorded (the ``nn.DataParallel`` wrap), and the imports a
rewrite adds. Where an edit cannot be made correctly, :class:`NoRewrite` says why."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
# expressions that need no parentheses before ``.attr`` or as a call's argument
_PRIMARIES = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.List,
              ast.Tuple, ast.Dict, ast.Set)


class NoRewrite(Exception):
    """The change cannot be made correctly; the message says why."""


# ---- positions and edits ---------------------------------------------------------------


class ScriptSource:
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


class Edits:
    """Replacements of text spans, applied together (they may not overlap)."""

    def __init__(self, src: ScriptSource) -> None:
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


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` of a name or a chain of attributes on a name; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def last_name(node: ast.AST) -> str:
    """The last part of a name or attribute (``nn.DataParallel``: ``DataParallel``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def scope_nodes(scope: ast.AST) -> Iterator[ast.AST]:
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


def bindings(src: ScriptSource, scope: ast.AST) -> list[_Binding]:
    """Every name (and dotted attribute) ``scope`` binds, with where."""
    out: list[_Binding] = []
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                out.append(_Binding(arg.arg, scope, (0, 0)))
    for node in scope_nodes(scope):
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            name = dotted_name(node)
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
    return any(isinstance(n, ast.Global) and name in n.names for n in scope_nodes(scope))


def value_bound_to(src: ScriptSource, stmt: ast.stmt, node: ast.AST) -> ast.expr | None:
    """The value last assigned to the name (or dotted attribute) ``node`` in ``stmt``'s scope
    before ``stmt`` (``x = <value>``, ``x: T = <value>``); None where ``node`` is no name,
    or it was last bound otherwise (a parameter, a loop, a tuple unpacked)."""
    name = dotted_name(node)
    if name is None:
        return None
    binds = [b for b in bindings(src, src.scope(stmt))
             if b.name == name and b.pos <= start_of(stmt)]
    if not binds:
        return None
    made = max(binds, key=lambda b: b.pos).node
    if isinstance(made, ast.Assign) and len(made.targets) == 1 \
            and dotted_name(made.targets[0]) == name:
        return made.value
    if isinstance(made, ast.AnnAssign) and dotted_name(made.target) == name:
        return made.value
    return None


def given_keywords(src: ScriptSource, edits: Edits, call: ast.Call, given: dict[str, str]
                   ) -> None:
    """``call`` given each keyword of ``given`` (name -> its value's text): one the call has
    already replaced, the others added after its last argument (each on a line of its own
    where the call puts its arguments so)."""
    added = []
    for name, value in given.items():
        have = next((k for k in call.keywords if k.arg == name), None)
        if have is not None:
            edits.node(have, f"{name}={value}")
        else:
            added.append(f"{name}={value}")
    if not added:
        return
    given_now: list[ast.expr | ast.keyword] = [*call.args, *call.keywords]
    last = max(given_now, key=lambda n: src.span(n)[1], default=None)
    if last is None:
        end = src.span(call)[1]
        edits.replace(end - 1, end - 1, ", ".join(added))
        return
    start, at = src.span(last)
    # one argument a line, the call closed on a line of its own
    own_line = (last.lineno != call.lineno and call.end_lineno != last.end_lineno
                and not src.text[src.line_start(last.lineno):start].strip())
    sep = f",{src.newline()}{src.indent(last.lineno)}" if own_line else ", "
    edits.replace(at, at, "".join(f"{sep}{a}" for a in added))


def loaded_names(node: ast.AST) -> set[str]:
    """Every plain name ``node`` mentions."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def start_of(node: ast.AST) -> tuple[int, int]:
    """(line, column) where a node with a position starts."""
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)


def bound_between(src: ScriptSource, scope: ast.AST, names: set[str], after: tuple[int, int],
                   before: tuple[int, int]) -> list[str]:
    """Which of ``names`` ``scope`` binds between two positions."""
    return sorted({b.name for b in bindings(src, scope)
                   if b.name in names and after <= start_of(b.node) < before})


# ---- finding the recorded sites ----------------------------------------------------------


def calls_at(src: ScriptSource, line: int) -> list[ast.Call]:
    """The calls whose text spans ``line``: those that start on it first, innermost first."""
    calls = [n for n in ast.walk(src.tree) if isinstance(n, ast.Call)
             and n.lineno <= line <= (n.end_lineno or n.lineno)]
    return sorted(calls, key=lambda c: (c.lineno != line, -c.lineno, -c.col_offset))


def is_data_parallel(call: ast.Call) -> bool:
    """Whether ``call`` makes an ``nn.DataParallel`` (any spelling of torch's name)."""
    return last_name(call.func) == "DataParallel"


_RUNNING: dict[str, ScriptSource] = {}


def running_source(path: str) -> ScriptSource | None:
    """The source of ``path`` as the running script has it (Python's line cache), parsed
    once while it stays the same; None where it does not parse."""
    import linecache

    text = "".join(linecache.getlines(path))
    held = _RUNNING.get(path)
    if held is not None and held.text == text:
        return held
    try:
        src = ScriptSource(text, path)
    except NoRewrite:
        return None
    _RUNNING[path] = src
    return src


def data_parallel_call(src: ScriptSource, line: int) -> ast.Call:
    """The ``nn.DataParallel(...)`` call on ``line``."""
    for call in calls_at(src, line):
        if is_data_parallel(call):
            return call
    if any(last_name(call.func) == "data_parallel" for call in calls_at(src, line)):
        raise NoRewrite(f"line {line}: nn.parallel.data_parallel(...) runs on every call, so "
                        "there is no wrap to replace: for DDP wrap each model once where it "
                        "is built, DDP(model.cuda(rank), device_ids=[rank]), and call its "
                        "module directly in forward")
    made = [c for c in calls_at(src, line) if c.lineno == line and last_name(c.func)]
    if made:  # a subclass of the script's (BalancedDataParallel(8, model)), or its factory
        # the first call on the line, the innermost of those starting there: ``Wrap(m)``
        # of ``Wrap(m).cuda()``
        name = last_name(min(made, key=lambda c: (c.col_offset, c.end_col_offset or 0)).func)
        raise NoRewrite(f"line {line}: {name}(...) makes the DataParallel, a class or function "
                        "of the script's: replace it with DDP(<the module>.cuda(rank), "
                        "device_ids=[rank]) by hand")
    raise NoRewrite(f"line {line}: no DataParallel(...) call to rewrite "
                    "(a wrap dpprof cannot see in the text)")


def module_arg(call: ast.Call) -> ast.expr:
    """The module a ``DataParallel(...)`` call wraps."""
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    for kw in call.keywords:
        if kw.arg == "module":
            return kw.value
    raise NoRewrite(f"line {call.lineno}: DataParallel's module is not given as an argument")


def dim_arg(call: ast.Call) -> ast.expr | None:
    """The ``dim`` a ``DataParallel(...)`` call splits the batch along, as written (its
    keyword, or torch's fourth positional argument); None where left to its default, 0."""
    for kw in call.keywords:
        if kw.arg == "dim":
            return kw.value
    if last_name(call.func) == "DataParallel" and len(call.args) > 3 and not any(
            isinstance(a, ast.Starred) for a in call.args[:4]):
        return call.args[3]
    return None


def parenthesized(src: ScriptSource, node: ast.expr) -> str:
    """``node``'s text, in parentheses where ``.attr`` or a call could not follow it bare."""
    text = src.seg(node)
    return text if isinstance(node, _PRIMARIES) else f"({text})"


def until_scope(src: ScriptSource, node: ast.AST) -> Iterator[ast.AST]:
    """``node``'s ancestors up to (not including) its function, class or module."""
    for a in src.ancestors(node):
        if isinstance(a, _SCOPES):
            return
        yield a


# ---- imports -----------------------------------------------------------------------------


def import_line(src: ScriptSource) -> int:
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


def _module_binds(src: ScriptSource, name: str) -> list[_Binding]:
    return [b for b in bindings(src, src.tree) if b.name == name]


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
    "DistributedSampler": (("torch.utils.data.distributed.DistributedSampler",
                            "torch.utils.data.DistributedSampler"),
                           "from torch.utils.data.distributed import DistributedSampler"),
    "checkpoint": (("torch.utils.checkpoint.checkpoint",),
                   "from torch.utils.checkpoint import checkpoint"),
}


def add_imports(src: ScriptSource, edits: Edits, names: list[str], scope: ast.AST) -> None:
    """Import each of ``names`` the script lacks; one it binds to something else (in the
    module, or in ``scope``, where the new lines use it) is a conflict."""
    lines = []
    for name in names:
        paths, line = _NEEDED[name]
        binds = _module_binds(src, name)
        if scope is not src.tree:
            binds += [b for b in bindings(src, scope) if b.name == name]
        found = [_import_path(b.node, name) for b in binds]
        if any(p in paths for p in found) and all(p in paths for p in found):
            continue
        if binds:
            raise NoRewrite(f"the script already uses the name `{name}` for something else "
                            f"than `{line}`")
        lines.append(line)
    if lines:
        edits.insert_lines(import_line(src), lines)
