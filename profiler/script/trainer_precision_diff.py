"""Mixed precision for a script whose model Lightning's ``Trainer`` runs: the ladder's
autocast rungs as Lightning's own precision setting, ``Trainer(..., precision="bf16-mixed")``
(``"16-mixed"`` for float16), given to the script's ``Trainer(...)`` call. The model's call and
``backward()`` are both in Lightning's loop, under the script's ``trainer.fit(...)``, so
there are no lines of the script's to put under ``torch.autocast``; Lightning's precision
plugin runs each ``training_step`` (forward and loss) under ``torch.autocast("cuda",
dtype)``, as the rung did (and for float16 scales the loss with a ``GradScaler``)."""

from __future__ import annotations

import ast

from dpprof.script.rewrite import Rewrite, finish, statement_on
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    bindings,
    dotted_name,
    last_name,
    start_of,
)

PRECISIONS = {"bfloat16": "bf16-mixed", "float16": "16-mixed"}  # Lightning's names


def fit_of_trainer(src: ScriptSource, line: int) -> ast.Call | None:
    """The ``Trainer(...)`` call that made the trainer whose ``.fit(...)`` is the statement
    on ``line``, or None where that statement calls no ``fit`` of a trainer made so."""
    try:
        stmt = statement_on(src, line, "model's call")
    except NoRewrite:
        return None
    for fit in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
        if not (isinstance(fit.func, ast.Attribute) and fit.func.attr == "fit"):
            continue
        name = dotted_name(fit.func.value)
        binds = [b for b in bindings(src, src.scope(stmt))
                 if b.name == name and b.pos <= start_of(stmt)]
        if not binds:
            continue
        made = max(binds, key=lambda b: b.pos).node
        value = made.value if isinstance(made, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call) and last_name(value.func) == "Trainer":
            return value
    return None


def trainer_precision(src: ScriptSource, trainer: ast.Call, dtype: str, title: str
                      ) -> Rewrite:
    """The script with ``trainer`` (a ``Trainer(...)`` call) given Lightning's mixed
    precision of ``dtype`` (its own ``precision=`` replaced)."""
    if dtype not in PRECISIONS:
        raise NoRewrite(f"dtype {dtype!r}: Lightning's precision takes \"bfloat16\" or "
                        "\"float16\"")
    precision = f'precision="{PRECISIONS[dtype]}"'
    edits = Edits(src)
    given = next((k for k in trainer.keywords if k.arg == "precision"), None)
    if given is not None:
        edits.node(given, precision)
    else:
        last = max((*trainer.args, *trainer.keywords), key=lambda n: src.span(n)[1],
                   default=None)
        if last is None:
            end = src.span(trainer)[1]
            edits.replace(end - 1, end - 1, precision)
        else:
            at = src.span(last)[1]
            edits.replace(at, at, f", {precision}")
    return finish(src, edits, title, [])
