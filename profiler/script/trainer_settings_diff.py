"""A rung of the ladder for a script whose model Hugging Face's ``Trainer`` runs: the rung's
settings (:func:`dpprof.script.trainer_settings.settings_of`) as keywords of the script's
``TrainingArguments(...)``, the one given to the ``Trainer(...)`` whose ``.train()`` is the
script's line that led to the model's call. Where the arguments come from the command line
(``HfArgumentParser(...).parse_args_into_dataclasses()``, as transformers' examples do), the
reason says which flags to add instead."""

from __future__ import annotations

import ast
import json
from typing import Any

from dpprof.script.rewrite import Rewrite, finish, statement_on
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    given_keywords,
    last_name,
    value_bound_to,
)

__all__ = ["arguments_of_trainer", "trainer_settings"]


def arguments_of_trainer(src: ScriptSource, line: int, settings: dict[str, Any]) -> ast.Call:
    """The ``TrainingArguments(...)`` call (or a subclass's: ``Seq2SeqTrainingArguments``,
    TRL's ``SFTConfig``) that made the arguments of the trainer whose ``.train(...)`` is
    the statement on ``line``; else :class:`NoRewrite`, saying where the arguments come from
    (the command line: the flags that give them ``settings``)."""
    stmt = statement_on(src, line, "Trainer's train()")
    for train in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
        if not (isinstance(train.func, ast.Attribute) and train.func.attr == "train"):
            continue
        made_by = train.func.value  # `trainer.train()`, or `Trainer(...).train()`
        trainer = made_by if isinstance(made_by, ast.Call) else value_bound_to(src, stmt,
                                                                               made_by)
        if not (isinstance(trainer, ast.Call) and last_name(trainer.func).endswith("Trainer")):
            continue
        given = next((k.value for k in trainer.keywords if k.arg == "args"),
                     trainer.args[1] if len(trainer.args) > 1 else None)
        if given is None:
            raise NoRewrite(f"line {trainer.lineno}: the Trainer is given no `args=` (its "
                            f"own TrainingArguments): give it TrainingArguments("
                            f"{_keywords(settings)}, ...)")
        made = given if isinstance(given, ast.Call) else value_bound_to(
            src, src.statement(trainer), given)
        if isinstance(made, ast.Call) and last_name(made.func).endswith(
                ("Arguments", "Config")):
            return made
        if _parsed(src, src.statement(trainer), given):
            raise NoRewrite("the TrainingArguments are parsed from the command line: add "
                            f"{_flags(settings)} to the script's arguments")
        raise NoRewrite(f"line {trainer.lineno}: the Trainer's args "
                        f"(`{src.seg(given)}`) are not made by a TrainingArguments(...) "
                        f"call of the script's: give them {_keywords(settings)}")
    raise NoRewrite(f"line {line}: no `.train()` of a Trainer(...) the script makes")


def trainer_settings(src: ScriptSource, arguments: ast.Call, settings: dict[str, Any],
                     title: str) -> Rewrite:
    """The script with ``arguments`` (a ``TrainingArguments(...)`` call) given ``settings``
    (each keyword it has already replaced)."""
    edits = Edits(src)
    given_keywords(src, edits, arguments, {k: _text(v) for k, v in settings.items()})
    change = finish(src, edits, title, [])
    if change.new_source == src.text:
        raise NoRewrite(f"line {arguments.lineno}: the TrainingArguments already give "
                        f"{_keywords(settings)}")
    return change


def _text(value: Any) -> str:
    """``value`` as the script would write it (a dict's keys in double quotes)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_text(k)}: {_text(v)}" for k, v in value.items()) + "}"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _parsed(src: ScriptSource, stmt: ast.stmt, given: ast.expr) -> bool:
    """Whether ``given`` (a name) was unpacked from an argument parser's result
    (``model_args, data_args, training_args = parser.parse_args_into_dataclasses()``)."""
    name = given.id if isinstance(given, ast.Name) else None
    for node in ast.walk(src.scope(stmt)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and last_name(node.value.func).startswith("parse_") \
                and any(isinstance(t, ast.Name) and t.id == name
                        for target in node.targets for t in ast.walk(target)):
            return True
    return False


def _keywords(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_text(v)}" for k, v in settings.items())


def _flags(settings: dict[str, Any]) -> str:
    """``settings`` as transformers' argument parser reads them: a flag for True, JSON for
    a dict."""
    return " ".join(f"`--{k}`" if v is True else f"`--{k} '{json.dumps(v)}'`"
                    for k, v in settings.items())
