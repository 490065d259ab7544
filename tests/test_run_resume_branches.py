"""The DDP fix of a script laid out as VainF's DeepLabV3Plus-Pytorch: DataParallel written in
both branches of ``if args.ckpt ...: load; wrap; else: wrap``, ``model.to(device)`` after each
wrap, an evaluation loader of batch size 1. Found there: the diff changed the branch the run
took and left the other DataParallel; it divided the evaluation's batch size 1 by 2 (0, which
DataLoader refuses, where the DDP alternative had rounded it up to 1); and applied, the
script stopped at its ``model.to(device)`` after DDP, which on a GPU does nothing ("Couldn't
swap Conv2d.weight": the emulator swapped parameters DDP's reducer holds). Now both wraps
become DDP, the batch size is rounded up as the alternative ran it, and the fixed script
runs on both branches, each rank peaking as promised, to the byte."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from script_runs import peaks, run_report

SCRIPT = Path(__file__).parent / "scripts" / "dp_resume_branches.py"




def test_both_wraps_become_ddp_and_the_fixed_script_runs_as_promised_on_both_branches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    shutil.copy(SCRIPT, tmp_path)
    monkeypatch.chdir(tmp_path)
    result = run_report(["python", SCRIPT.name], tmp_path / "dp.json", ("--gpus", "2"))
    fix = {f["name"]: f for f in result["fixes"]}["ddp"]
    diff = fix["code"]
    assert diff.count("+        model = DDP(model.cuda(rank), device_ids=[rank])") == 2, diff
    assert "-        model = nn.DataParallel(model)" in diff
    assert "batch_size=(args.val_batch_size + 1) // 2" in diff
    assert "batch_size=args.batch_size // 2" in diff
    assert "wraps model in DataParallel too, on a path this run did not take" in diff
    subprocess.run(["patch", "-p0", "-s"], input=diff, text=True, check=True, cwd=tmp_path)
    ran = run_report(["torchrun", "--nproc-per-node", "2", SCRIPT.name], tmp_path / "ddp.json")
    (ddp,) = ran["scenarios"]
    assert ddp["status"] == "ok", ddp
    assert [d["batch_rows"] for d in ddp["devices"]] == [4, 4]
    assert [p[0] for p in peaks(ddp)] == [fix["max_peak_bytes"]] * 2
    alternative = {s["name"]: s for s in result["scenarios"]}["ddp"]
    assert peaks(ddp) == peaks(alternative)
    # the other branch: the checkpoint loaded, then its DDP
    import tests.scripts.dp_resume_branches as written

    torch.save({"model": written.Net().state_dict()}, tmp_path / "ck.pt")
    resumed = run_report(["torchrun", "--nproc-per-node", "2", SCRIPT.name, "--ckpt", "ck.pt"],
                   tmp_path / "resumed.json")
    (again,) = resumed["scenarios"]
    assert again["status"] == "ok" and [p[0] for p in peaks(again)] == [
        fix["max_peak_bytes"]] * 2
