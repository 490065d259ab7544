"""Every patch dpprof makes to torch and the standard library is undone, also when the
script under ``dpprof run`` raises half-way through a step."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from dpprof.emulator.patcher import MISSING, Patcher, own_attribute
from dpprof.script.session import ScriptConfig, parse_command, run_command


def test_a_patcher_restores_in_reverse_and_deletes_what_was_not_there() -> None:
    class Base:
        def f(self) -> str:
            return "base"

    class Child(Base):
        pass

    ns = type("NS", (), {})()
    ns.x = 1
    with Patcher() as p:
        p.patch(Child, "f", lambda self: "patched")
        p.patch(ns, "x", 2)
        p.patch(ns, "x", 3)
        p.patch(ns, "y", 4)
        assert Child().f() == "patched" and ns.x == 3 and ns.y == 4
    assert Child().f() == "base" and "f" not in Child.__dict__  # the base's shows again
    assert ns.x == 1 and own_attribute(ns, "y") is MISSING


RAISES_MID_STEP = """
    import torch
    model = torch.nn.DataParallel(torch.nn.Linear(8, 4).cuda())
    criterion = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,))),
        batch_size=16)
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x.cuda())
            loss = criterion(out, y.cuda())
        loss.backward()
        torch.save(model.state_dict(), "ckpt.pt")
        if step == 2:
            raise RuntimeError("the script's own failure, mid-step")
        opt.step(); opt.zero_grad()
"""


@pytest.mark.parametrize("compute", [False, True], ids=["meta", "compute"])
def test_every_patched_owner_is_restored_after_a_run_that_raises(
        compute: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(RAISES_MID_STEP))
    before: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    original_patch = Patcher.patch

    def recording_patch(self: Patcher, owner: Any, name: str, value: Any) -> None:
        before.setdefault((id(owner), name), (owner, name, own_attribute(owner, name)))
        original_patch(self, owner, name, value)

    monkeypatch.setattr(Patcher, "patch", recording_patch)
    _, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 4),
                                            steps=5, compute=compute))
    assert main.exit_status == 1 and "mid-step" in (main.script_traceback or "")
    owners = {type(o).__name__ if not isinstance(o, type) else o.__name__
              for o, _, _ in before.values()}
    # the emulation's own patches (torch.cuda, Tensor), the script's effects, the autocast names
    assert {"Tensor", "module"} <= owners and len(before) > 60
    changed = [f"{getattr(o, '__name__', type(o).__name__)}.{n}"
               for o, n, v in before.values() if own_attribute(o, n) is not v]
    assert changed == []
    assert torch.cuda.is_available() is False
    assert torch.save.__module__ == "torch.serialization"
