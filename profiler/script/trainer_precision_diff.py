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
    given_keywords,
    last_name,
    value_bound_to,
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
        value = value_bound_to(src, stmt, fit.func.value)
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
    edits = Edits(src)
    given_keywords(src, edits, trainer, {"precision": f'"{PRECISIONS[dtype]}"'})
    return finish(src, edits, title, [])
