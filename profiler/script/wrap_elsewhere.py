"""The loss inside forward where another file wraps the model in DataParallel (a model
file's ``build_model()`` returns ``nn.DataParallel(net)``; the training script calls it and
computes the loss): only the training file changes. ModelWithLoss goes inside the
DataParallel the script holds, as its module, once the script has both the model and the
loss: ``model.module = dpprof.ModelWithLoss(model.module, <loss>)``. DataParallel replicates
its module at every forward, so the replicas compute the loss from then on; the model file
stays as written (other scripts may import it)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from dpprof.script.hoisting import after_definition
from dpprof.script.rewrite import read_source, site_of
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    add_imports,
    bindings,
    data_parallel_call,
    dim_arg,
    start_of,
)

__all__ = ["WrapElsewhere", "called_model", "model_bound", "set_inside", "wrap_elsewhere"]


@dataclass(frozen=True)
class WrapElsewhere:
    """The ``DataParallel(...)`` call in another file than the model's call and the loss."""

    site: str  # its "file:line"
    dim: bool  # it gives DataParallel a dim other than 0 (the losses are shaped along it)

    @property
    def words(self) -> str:
        path, line = site_of(self.site)
        return f"{Path(path).name}:{line}"


def wrap_elsewhere(dp_site: str) -> WrapElsewhere:
    """The wrap at ``dp_site`` ("file:line"), as read from its file."""
    path, line = site_of(dp_site)
    dp = data_parallel_call(ScriptSource(read_source(path), path), line)
    dim = dim_arg(dp)
    return WrapElsewhere(dp_site, dim is not None and not (
        isinstance(dim, ast.Constant) and dim.value == 0))


def called_model(src: ScriptSource, loss: ast.Call, call_line: int) -> str | None:
    """The name the model is called by inside ``loss`` on ``call_line``
    (``criterion(model(x).view(-1, V), y)``: ``model``), where the wrap's own file cannot
    say: the one plain name called there that an assignment binds (not a builtin, ``int``,
    nor a function of the script's); None where there is not exactly one."""
    scope = src.scope(loss)
    assigned = {b.name for s in (scope, src.tree) for b in bindings(src, s)
                if isinstance(b.node, (ast.Assign, ast.AnnAssign))}
    names = {n.func.id for n in ast.walk(loss) if isinstance(n, ast.Call) and n is not loss
             and isinstance(n.func, ast.Name) and n.func.id in assigned
             and n.lineno <= call_line <= (n.end_lineno or n.lineno)}
    return names.pop() if len(names) == 1 else None


def model_bound(src: ScriptSource, model: ast.Call) -> ast.stmt:
    """The assignment that last binds the name the training step calls the model by
    (``model = build_model()``) before the call, in the call's function or, where that
    does not bind it, the module's; NoRewrite where the model is called otherwise or comes
    in as a function's argument (its maker is elsewhere: the change is by hand)."""
    if not isinstance(model.func, ast.Name):
        raise NoRewrite(f"line {model.lineno}: the model is called as {src.seg(model.func)}, "
                        "not by a name the script binds: set its DataParallel's module to "
                        "dpprof.ModelWithLoss(<module>, <loss>) by hand")
    name = model.func.id
    scope: ast.AST = src.scope(model)
    binds = [b for b in bindings(src, scope) if b.name == name]
    if binds:
        binds = [b for b in binds if start_of(b.node) < start_of(src.statement(model))]
    elif not isinstance(scope, ast.Module):
        binds = [b for b in bindings(src, src.tree) if b.name == name]
    if not binds:
        raise NoRewrite(f"line {model.lineno}: `{name}` is not bound before the model's call")
    node = max(binds, key=lambda b: start_of(b.node)).node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        where = getattr(node, "name", "a lambda")
        raise NoRewrite(f"`{name}` comes into {where}() as an argument (line {node.lineno}): "
                        f"where the caller makes the model, set `{name}.module = dpprof."
                        f"ModelWithLoss({name}.module, <loss>)` by hand")
    if not isinstance(node, (ast.Assign, ast.AnnAssign)):
        raise NoRewrite(f"line {start_of(node)[0]}: `{name}` is bound by a "
                        f"{type(node).__name__} "
                        "statement, not an assignment: set its DataParallel's module to "
                        "dpprof.ModelWithLoss(<module>, <loss>) by hand")
    return node


def set_inside(src: ScriptSource, edits: Edits, model: ast.Call, loss_fn: str,
               reads: set[str], keep_arg: str, wrap: WrapElsewhere) -> list[str]:
    """The line that sets ModelWithLoss (of ``loss_fn``, whose text reads the script's
    names ``reads``) as the DataParallel's module after the model's binding and theirs (see
    the module); its notes."""
    bound = model_bound(src, model)
    name = src.seg(model.func)
    scope = src.scope(bound)
    at: ast.stmt = bound
    for read in sorted(reads - {name}):
        at = after_definition(src, scope, read, at)
    dim = f", dim={name}.dim" if wrap.dim else ""
    edits.insert_lines((at.end_lineno or at.lineno) + 1, [
        f"{src.indent(at.lineno)}{name}.module = dpprof.ModelWithLoss({name}.module, "
        f"{loss_fn}{keep_arg}{dim})"])
    add_imports(src, edits, ["dpprof"], scope)
    return [f"{wrap.words} wraps the model in DataParallel: ModelWithLoss goes inside it, as "
            f"its module, where this file has the model and the loss (after line "
            f"{at.end_lineno or at.lineno}); {Path(site_of(wrap.site)[0]).name} stays as "
            "written"]
