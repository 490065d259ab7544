"""A ladder rung for a Hugging Face Trainer script as keywords of its ``TrainingArguments``
(dpprof.script.trainer_settings_diff): found from the script's ``trainer.train()`` line
however the arguments reach the Trainer, the keywords written in the call's own layout, and
a reason (the flags to add) where the arguments come from the command line."""

from __future__ import annotations

import ast

import pytest

from dpprof.script.source import NoRewrite, ScriptSource
from dpprof.script.trainer_settings_diff import arguments_of_trainer, trainer_settings

BF16 = {"bf16": True}
CHECKPOINT = {"activation_checkpointing": True,
              "activation_checkpointing_kwargs": {"use_reentrant": False}}

ONE_A_LINE = '''\
from transformers import Trainer, TrainingArguments

def main(model, data):
    training_args = TrainingArguments(
        output_dir="out",
        per_device_train_batch_size=8,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train()
'''


def _patched(text: str, settings: dict[str, object]) -> str:
    src = ScriptSource(text, "train.py")
    line = next(i for i, s in enumerate(text.splitlines(), 1) if ".train(" in s)
    change = trainer_settings(src, arguments_of_trainer(src, line, settings), settings,
                              "the rung")
    assert change.ok, change.reason
    ast.parse(change.new_source)
    return change.new_source


def test_keywords_go_on_lines_of_their_own_where_the_call_has_one_argument_a_line() -> None:
    patched = _patched(ONE_A_LINE, {**BF16, **CHECKPOINT})
    assert ('        per_device_train_batch_size=8,\n'
            '        bf16=True,\n'
            '        activation_checkpointing=True,\n'
            '        activation_checkpointing_kwargs={"use_reentrant": False},\n'
            '    )\n') in patched, patched


@pytest.mark.parametrize(("text", "expected"), [
    # inline arguments, given to Trainer by position, a keyword the call has replaced
    ('from transformers import Trainer, TrainingArguments\n'
     'args = TrainingArguments("out", bf16=False)\n'
     'Trainer(m, args).train()\n',
     'args = TrainingArguments("out", bf16=True)\n'),
    # made in the Trainer's call itself, the trainer kept under another name
    ('import transformers\n'
     't = transformers.Trainer(model=m, args=transformers.TrainingArguments(output_dir="o"))\n'
     'result = t.train(resume_from_checkpoint=None)\n',
     'args=transformers.TrainingArguments(output_dir="o", bf16=True))\n'),
    # a subclass of the arguments and of the Trainer (TRL's)
    ('from trl import SFTConfig, SFTTrainer\n'
     'cfg = SFTConfig(output_dir="o")\n'
     'trainer = SFTTrainer(model=m, args=cfg)\n'
     'trainer.train()\n',
     'cfg = SFTConfig(output_dir="o", bf16=True)\n'),
])
def test_the_arguments_are_found_however_they_reach_the_trainer(text: str,
                                                                 expected: str) -> None:
    assert expected in _patched(text, BF16)


def _reason(text: str, settings: dict[str, object]) -> str:
    src = ScriptSource(text, "train.py")
    line = next(i for i, s in enumerate(text.splitlines(), 1) if ".train(" in s)
    with pytest.raises(NoRewrite) as info:
        trainer_settings(src, arguments_of_trainer(src, line, settings), settings, "rung")
    return str(info.value)


def test_arguments_parsed_from_the_command_line_get_the_flags_to_add() -> None:
    """transformers' examples (run_glue.py, run_clm.py) parse them with HfArgumentParser."""
    text = ('from transformers import HfArgumentParser, Trainer, TrainingArguments\n'
            'parser = HfArgumentParser((ModelArguments, TrainingArguments))\n'
            'model_args, training_args = parser.parse_args_into_dataclasses()\n'
            'trainer = Trainer(model=m, args=training_args)\n'
            'train_result = trainer.train()\n')
    assert _reason(text, {**BF16, **CHECKPOINT}) == (
        "the TrainingArguments are parsed from the command line: add `--bf16` "
        "`--activation_checkpointing` `--activation_checkpointing_kwargs "
        "'{\"use_reentrant\": false}'` to the script's arguments")


@pytest.mark.parametrize(("text", "reason"), [
    ('trainer = Trainer(model=m)\ntrainer.train()\n',
     "line 1: the Trainer is given no `args=` (its own TrainingArguments): give it "
     "TrainingArguments(bf16=True, ...)"),
    ('trainer = Trainer(model=m, args=make_args())\ntrainer.train()\n',
     "line 1: the Trainer's args (`make_args()`) are not made by a TrainingArguments(...) "
     "call of the script's: give them bf16=True"),
    ('a = TrainingArguments("o", bf16=True)\ntrainer = Trainer(m, a)\ntrainer.train()\n',
     "line 1: the TrainingArguments already give bf16=True"),
    ('trainer = make_trainer()\ntrainer.train()\n',
     "line 2: no `.train()` of a Trainer(...) the script makes"),
])
def test_where_no_keyword_can_be_added_the_reason_says_what_to_do(text: str,
                                                                   reason: str) -> None:
    assert _reason(text, BF16) == reason
