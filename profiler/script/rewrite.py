"""The fixes of ``dpprof run`` as rewrites of the user's own lines, made on the syntax tree:
what every rewrite shares (its result, :class:`Rewrite`; the file read and the new text
compiled and diffed, :func:`finish`; a recorded ``file:line`` read, :func:`site_of`; a free
name, a statement on a line, the script's indentation; the fix's code, :func:`rewrite_text`).

``dpprof run`` records where the script wraps its model in ``nn.DataParallel``, where it
calls that model, and where it computes the loss on the outputs (``file:line`` each). From
those lines and the script's source each change is made as a unified diff of the whole file
(``difflib.unified_diff``, the file's name in the header), one module each:
:mod:`~dpprof.script.loss_in_forward_diff`, :mod:`~dpprof.script.ddp_diff` (beside their
fixes' strategies, :mod:`~dpprof.script.loss_in_forward_run`, :mod:`~dpprof.script.ddp_run`),
:mod:`~dpprof.script.autocast_diff`, :mod:`~dpprof.script.checkpointing_diff` and
:mod:`~dpprof.script.rung_diff` (a ladder rung's edits made one after the other).

Every edit is a splice at the positions of the tree's nodes (``lineno``/``col_offset``/
``end_lineno``/``end_col_offset``), so the rest of the file keeps its formatting; the new file
is compiled before its diff is given. Where the change cannot be made correctly, the result
has no diff and a reason, never code that does not compile. The tree, its positions, names,
splices and imports are :mod:`dpprof.script.source`.
"""

from __future__ import annotations

import ast
import difflib
import tokenize
from dataclasses import dataclass
from pathlib import Path

from dpprof.script.source import Edits, NoRewrite, ScriptSource, calls_at


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


def read_source(path: str) -> str:
    """The script's text (its encoding as Python reads it), or :class:`NoRewrite`."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise NoRewrite(f"cannot read {path}: {e}") from None


def finish(src: ScriptSource, edits: Edits, title: str, notes: list[str],
           label: str = "") -> Rewrite:
    """``edits`` made to ``src``: the new text compiled, its diff titled ``title``, the file
    named ``label`` (its name where not given)."""
    new = edits.apply()
    try:
        compile(new, src.path, "exec", dont_inherit=True)
    except SyntaxError as e:  # pragma: no cover - a bug here: say so rather than show it
        raise NoRewrite(f"the rewritten script does not compile ({e.msg}, line {e.lineno})"
                        ) from None
    name = label or Path(src.path).name
    diff = difflib.unified_diff(src.text.splitlines(), new.splitlines(),
                                f"{name} (as written)", f"{name} ({title})", lineterm="")
    return Rewrite(diff="\n".join(diff), new_source=new, notes=tuple(notes))


def site_of(site: str) -> tuple[str, int]:
    """A recorded ``file:line`` as (path, line), or :class:`NoRewrite`."""
    path, _, num = site.rpartition(":")
    if not num.isdigit() or not path or path == "?":
        raise NoRewrite(f"dpprof did not see the script's line ({site!r})")
    return path, int(num)


LOOPS = (ast.For, ast.AsyncFor, ast.While)  # the statements a training loop is made of


def free_name(src: ScriptSource, *names: str) -> str:
    """The first of ``names`` the script does not use, or :class:`NoRewrite`."""
    used = {n.id for n in ast.walk(src.tree) if isinstance(n, ast.Name)} | {
        a.arg for a in ast.walk(src.tree) if isinstance(a, ast.arg)}
    for name in names:
        if name not in used:
            return name
    raise NoRewrite(f"the script already uses the names {', '.join(names)}")


def statement_on(src: ScriptSource, line: int, what: str) -> ast.stmt:
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


def indent_unit(src: ScriptSource, stmt: ast.stmt) -> str:
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


def rewrite_text(rewrite: Rewrite) -> str:
    """A fix's code: the diff, then what to check by hand as comments; or, where there is no
    diff, the reason as a comment."""
    if not rewrite.ok:
        return f"# no rewrite of the script's lines: {rewrite.reason}" if rewrite.reason else ""
    return "\n".join([rewrite.diff, *(f"# also: {n}" for n in rewrite.notes)])
