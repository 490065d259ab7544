"""An alternative's run prints nothing, also through a stream a library took in the first
run: an installed package the script imports stays imported for the next runs, and a
logging handler it made at its import writes to the ``sys.stdout`` of that first run.

Found on ultralytics' YOLOv5 ``train.py``: its logger is ``ultralytics.utils.LOGGER``, an
installed package's, and the script's output was shown three times (the run as written,
then the DDP alternative's two tries) above a note saying an alternative's output is not
shown."""

from __future__ import annotations

import contextlib
import io
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from script_runs import run_printing

from dpprof.result import ScenarioResult
from dpprof.script.notes import alternative_notes
from dpprof.script.runner import ScriptRun
from dpprof.script.session import ScriptConfig, parse_command, run_command

LIBRARY = """
    import logging
    import sys

    LOGGER = logging.getLogger("dpprof_test_installed_logger")
    LOGGER.setLevel(logging.INFO)
    LOGGER.addHandler(logging.StreamHandler(sys.stdout))  # the stream of its import
    LOGGER.propagate = False
"""

SCRIPT = """
    import torch
    from torch import nn

    from dpprof_test_installed_logger import LOGGER

    model = nn.DataParallel(nn.Linear(8, 2).cuda())
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(16, 8)
        y = torch.randint(0, 2, (16,))
        loss = criterion(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        LOGGER.info("logged step %d", step)
        print("printed step", step)
"""


def test_an_alternatives_output_is_not_shown_through_a_stream_a_library_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"  # outside the script's folder: an installed package's
    site.mkdir()
    (site / "dpprof_test_installed_logger.py").write_text(textwrap.dedent(LIBRARY))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "dpprof_test_installed_logger", raising=False)
    code = tmp_path / "code"
    code.mkdir()
    script = code / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result, shown = run_printing(script, gpus=2)
    sys.modules.pop("dpprof_test_installed_logger", None)
    names = [s.name for s in result.scenarios]
    assert len(names) > 1, names  # alternatives ran
    assert all(s.status == "ok" for s in result.scenarios), [s.message for s in
                                                             result.scenarios]
    for step in range(2):  # the third step's optimizer.step() ends each run
        assert shown.count(f"printed step {step}\n") == 1, shown
        assert shown.count(f"logged step {step}\n") == 1, shown


FAILING = """
    import sys

    import torch
    from torch import nn

    model = nn.DataParallel(nn.Linear(8, 2).cuda())
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    for step, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=16)):
        loss = criterion(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # a progress bar as tqdm and rich draw it: colours, "erase line", carriage returns
        sys.stderr.write(f"\\r\\x1b[K  train: \\x1b[34m━━━━\\x1b[0m {step + 1}/3 loss 0.69")
        sys.stderr.flush()
        if x.shape[0] != 16:  # the DDP alternative's share of the batch (its DataLoader's)
            sys.stderr.write("\\n")
            raise RuntimeError("this script runs batches of 16 only")
"""


def test_an_alternatives_last_output_is_noted_as_a_terminal_shows_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FAILING))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2),
                                             steps=3))
    ddp = next(s for s in result.scenarios if s.name == "ddp")
    assert ddp.status == "error", ddp.message
    last = [n for n in ddp.notes if n.startswith("its last output: ")]
    assert last == ["its last output: train: ━━━━ 1/3 loss 0.69"], ddp.notes
    # what it held up to its failure is no measurement of DDP: no fix, nothing recommended
    fixes = [f.name for f in result.fixes]
    assert fixes and not any("ddp" in name.lower() for name in fixes), fixes


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(st.text(alphabet="ab ", min_size=0, max_size=150)
                      | st.text(alphabet="ab", min_size=390, max_size=500),
                      min_size=1, max_size=12))
def test_an_alternatives_last_output_begins_where_a_line_does(lines: list[str]) -> None:
    # the note keeps the end of what the run printed: from a line's start, never mid-word
    # (pytorch-YOLOv4's DDP run showed "cesses in total. Our suggested max number ...")
    printed = "\n".join(lines)
    run = ScriptRun(scenario=ScenarioResult(name="ddp"), ended="script raised",
                    output_tail=printed)
    notes = [n for n in alternative_notes(run) if n.startswith("its last output: ")]
    shown = printed.strip()
    if not shown:
        assert notes == []
        return
    (note,) = notes
    last = note.removeprefix("its last output: ")
    assert shown.endswith(last) and len(last) <= 400
    start = len(shown) - len(last)
    # a last line longer than the note: its end (no line starts within it)
    assert start == 0 or shown[start - 1] == "\n" or "\n" not in shown[-400:]
    if len(shown) <= 400:
        assert last == shown


# open-reid's Logger, copied into torchreid and many ReID repositories: sys.stdout wrapped,
# and closed when the wrapper is collected
CLOSING_LOGGER = """
import sys
import torch
from torch import nn


class Logger:
    def __init__(self):
        self.console = sys.stdout

    def write(self, msg):
        self.console.write(msg)

    def flush(self):
        self.console.flush()

    def __del__(self):
        self.console.close()


sys.stdout = Logger()
model = nn.DataParallel(nn.Linear(8, 2).cuda())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = nn.functional.cross_entropy(model(torch.randn(16, 8).cuda()),
                                       torch.randint(0, 2, (16,)).cuda())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print("printed step", step)
"""


def test_a_script_that_closes_its_standard_output_leaves_the_report_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import json

    from typer.testing import CliRunner

    from dpprof.cli.app import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(CLOSING_LOGGER)
    gc.collect()
    r = CliRunner().invoke(app, ["run", "--gpus", "2", "-o", "r.json", "--", "python",
                                 "train.py"])
    gc.collect()  # the script's Logger, collected: it closes what it wrapped
    assert r.exit_code == 0, r.output
    assert "printed step 0" in r.output and "recommended" in r.output.lower()
    assert {s["name"] for s in json.loads((tmp_path / "r.json").read_text())["scenarios"]} \
        >= {"dp-loss-primary", "ddp"}
