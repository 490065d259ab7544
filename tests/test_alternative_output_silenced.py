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
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2),
                                             steps=3))
    sys.modules.pop("dpprof_test_installed_logger", None)
    names = [s.name for s in result.scenarios]
    assert len(names) > 1, names  # alternatives ran
    assert all(s.status == "ok" for s in result.scenarios), [s.message for s in
                                                             result.scenarios]
    shown = out.getvalue()
    for step in range(2):  # the third step's optimizer.step() ends each run
        assert shown.count(f"printed step {step}\n") == 1, shown
        assert shown.count(f"logged step {step}\n") == 1, shown

