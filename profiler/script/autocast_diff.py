"""Mixed precision as a rewrite of the user's own lines (the ladder's autocast rungs): the
statements from the model's call through the loss under ``with torch.autocast("cuda",
dtype=...)`` in their block, and for float16 torch's AMP recipe's ``GradScaler``: made before
the training loop, scaling the loss's backward, making the optimizer's step
(``scaler.step(optimizer)``, ``scaler.update()``)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from dpprof.script.rewrite import (
    LOOPS,
    Rewrite,
    finish,
    free_name,
    indent_unit,
    read_source,
    site_of,
    statement_on,
)
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    add_imports,
    dotted_name,
    last_name,
    loaded_names,
    start_of,
    until_scope,
)

AUTOCAST_BF16_TITLE = "mixed precision (bf16 autocast)"
AUTOCAST_FP16_TITLE = "mixed precision (fp16 autocast and GradScaler)"
AUTOCAST_TITLES = {"bfloat16": AUTOCAST_BF16_TITLE, "float16": AUTOCAST_FP16_TITLE}

_CLIPS = ("clip_grad_norm_", "clip_grad_value_")


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
    loops = [a for a in until_scope(src, first) if isinstance(a, LOOPS)]
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
    scaler = free_name(src, "scaler", "grad_scaler", "amp_scaler")
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
    first = statement_on(src, call_line, "model's call")
    last = statement_on(src, loss_line, "loss")
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
    indent, unit = src.indent(first.lineno), indent_unit(src, first)
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
    return finish(src, edits, AUTOCAST_TITLES[dtype], [])


def autocast_at(call_site: str, loss_site: str, dtype: str) -> Rewrite:
    """:func:`autocast` from the model's call's and the loss's ``file:line``."""
    try:
        (path, call_line), (p2, loss_line) = map(site_of, (call_site, loss_site))
        if path != p2:
            raise NoRewrite("the model's call and the loss are in different files "
                            f"({Path(path).name}, {Path(p2).name})")
        return autocast(read_source(path), path, call_line, loss_line, dtype)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def autocast_until_at(call_site: str, backward_site: str, dtype: str) -> Rewrite:
    """:func:`autocast` over what ``dpprof run``'s mixed-precision rung ran under autocast:
    the statements from the model's call up to the one that calls ``backward()``, in the
    same block (its statement before holds the loss)."""
    try:
        (path, call_line), (p2, back_line) = map(site_of, (call_site, backward_site))
        if path != p2:
            raise NoRewrite("the model's call and backward() are in different files "
                            f"({Path(path).name}, {Path(p2).name})")
        return autocast_until(ScriptSource(read_source(path), path), call_line, back_line, dtype)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def autocast_until(src: ScriptSource, call_line: int, back_line: int, dtype: str) -> Rewrite:
    try:
        first = statement_on(src, call_line, "model's call")
        back = statement_on(src, back_line, "backward")
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


