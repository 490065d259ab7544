"""Every run of the script draws the same batches: paired runs compare one data.

A script that draws its batches' sizes or contents without seeding (a sequence length from
``random.randint``, a batch size from ``np.random.choice``, a shuffle) drew others in each
run: the alternatives' savings mixed the fix with the data, and the same ``dpprof run``
measured 248 MB on cuda:0 once and 536 MB the next time. Now every run (as written, each
alternative, each ``dpprof run``) starts from the same seeds, torch's, Python's and NumPy's,
and dpprof's own random states are as they were after it."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPT = """
import random

import numpy as np
import torch
from torch import nn

model = nn.DataParallel(nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000)).cuda())
opt = torch.optim.Adam(model.parameters())
order = list(range(10))
for step in range(4):
    T = random.randint(16, 256)
    B = int(np.random.choice([8, 16, 32]))
    random.shuffle(order)
    x = torch.randint(0, 1000, (B, T))
    with open("draws.txt", "a") as f:
        f.write(f"{T} {B} {order} {x.sum().item()}\\n")
    loss = nn.functional.cross_entropy(model(x.cuda()).view(-1, 1000), x.cuda().view(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _draws(kept: Path, script: Path) -> dict[str, str]:
    """Each run's draws (its name -> what the script wrote), from the kept overlays."""
    return {run.name: (run / str(script.parent).lstrip("/") / "draws.txt").read_text()
            for run in sorted(kept.iterdir()) if run.is_dir()}


def _sizes(draws: str) -> list[str]:
    """The sizes and the order each step drew (each line less its batch's sum)."""
    return [line.rsplit(" ", 1)[0] for line in draws.splitlines()]


def test_every_run_draws_the_same_batches(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "work" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    monkeypatch.chdir(script.parent)
    before = random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()
    seen = []
    for attempt in ("first", "second"):
        kept = tmp_path / attempt
        result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 2),
                                             steps=3, keep_writes=str(kept)))
        assert [s.status for s in result.scenarios] == ["ok"] * len(result.scenarios)
        draws = _draws(kept, script)
        assert {"as-written", "loss-in-forward", "ddp"} <= set(draws), draws
        # one data for every run: the same sizes and order drawn; the same batch where the
        # run takes the whole of it (a DDP rank makes its share, so draws less from torch)
        assert len({tuple(_sizes(d)) for d in draws.values()}) == 1, draws
        assert draws["as-written"] == draws["loss-in-forward"]
        seen.append((draws["as-written"],
                     [(s.name, [d.peak_allocated_bytes for d in s.devices])
                      for s in result.scenarios]))
    assert seen[0] == seen[1]  # and for every dpprof run
    # dpprof's own random states as they were
    after = random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()
    assert after[0] == before[0] and after[1] == before[1] and torch.equal(after[2], before[2])
