"""``dpprof run`` on causal-LM scripts whose loss is an expression of DataParallel's
outputs (tests/scripts/dp_causal_lm*.py): the loss inside forward is offered, measured
(dp-loss-forward, cuda:0 below dp-loss-primary), and its diff, applied to the script and
run under ``dpprof run``, gives the peaks it promised. The scripts' folder and the working
folder stay byte-identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_script_rewrite import apply_diff
from test_seal_run import digest_tree
from typer.testing import CliRunner

from dpprof.answers.attribution import attribute
from dpprof.cli.app import app
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPTS = Path(__file__).parent / "scripts"

CASES = {
    "dp_causal_lm.py": (
        # the criterion, defined after the wrap, moves before it: ModelWithLoss finds the
        # loss modules its function calls when it is made
        "-model = nn.DataParallel(model).to(device)\n"
        "+criterion = nn.CrossEntropyLoss()\n"
        "+model = nn.DataParallel(dpprof.ModelWithLoss(model, lambda logits, y: criterion("
        "logits.view(-1, logits.size(-1)), y.view(-1)))).to(device)\n",
        "+    loss = dpprof.ModelWithLoss.combine(model(x, y))\n"),
    "dp_causal_lm_shifted.py": (
        "+model = nn.DataParallel(dpprof.ModelWithLoss(TinyLM(args.vocab, args.d_model)"
        ".to(device), lambda logits, ids: criterion(logits[:, :-1].transpose(1, 2).float(), "
        "ids[:, 1:])))\n",
        "+    loss = dpprof.ModelWithLoss.combine(model(ids, ids))\n"),
}


def _run(path: Path, out: Path) -> dict:  # type: ignore[type-arg]
    r = CliRunner().invoke(app, ["run", "--gpus", "4", "-q", "-o", str(out), "--", "python",
                                 str(path)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _cuda0(result: dict, name: str) -> int:  # type: ignore[type-arg]
    (s,) = [s for s in result["scenarios"] if s["name"] == name]
    assert s["status"] == "ok", s
    return int(s["devices"][0]["peak_allocated_bytes"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_causal_lm_loss_on_a_view_of_the_outputs_moves_inside_forward(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = digest_tree(SCRIPTS), digest_tree(work)
    result = _run(SCRIPTS / name, tmp_path / "r.json")
    assert (digest_tree(SCRIPTS), digest_tree(work)) == before
    assert not [n for n in result["notes"] if n.startswith("no loss-inside-forward")]
    primary, forward = _cuda0(result, "dp-loss-primary"), _cuda0(result, "dp-loss-forward")
    # the gathered logits and the loss's temporaries leave cuda:0
    assert forward < primary / 2, (primary, forward)
    fix = next(f for f in result["fixes"] if f["name"] == "loss-in-forward")
    assert fix["primary_peak_bytes"] == forward
    wrap, combine = CASES[name]
    assert wrap in fix["code"] and combine in fix["code"], fix["code"]

    # the diff applied to the user's file: it compiles, and run so, cuda:0 peaks as promised
    patched = apply_diff((SCRIPTS / name).read_text(), fix["code"])
    compile(patched, name, "exec")
    fixed = tmp_path / "fixed" / name
    fixed.parent.mkdir()
    fixed.write_text(patched)
    again = _run(fixed, tmp_path / "again.json")
    assert again["scenarios"][0]["name"] == "dp-loss-forward"
    assert _cuda0(again, "dp-loss-forward") == forward
    assert (max(d["peak_allocated_bytes"] for d in again["scenarios"][0]["devices"])
            == fix["max_peak_bytes"])
    shutil.rmtree(tmp_path / "fixed")


BIG_VOCAB = """
import torch, torch.nn as nn
V, D, B = 32000, 64, 256
model = nn.DataParallel(nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.GELU(),
                                      nn.Linear(D, V)).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = nn.CrossEntropyLoss()
for step in range(4):
    x = torch.randint(0, V, (B,), device="cuda")
    y = torch.randint(0, V, ({rows},), device="cuda")
    out = model(x)
    loss = crit({outputs}, y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize("outputs", ["out", "out.view(B, -1)[:, :].float()"])
def test_the_loss_over_a_large_vocabulary_is_labelled_loss_on_cuda0(
        outputs: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:0's excess under dp-loss-primary is mostly the loss over 32000 classes: its
    softmax and the gradient of the gathered logits, filed under 'loss' as compare files it,
    where they read as 'activations at cuda:0's peak moment' (80 %)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(BIG_VOCAB.format(rows="B", outputs=outputs))
    _, main = run_command(ScriptConfig(launch=parse_command(["python", "train.py"], 4),
                                       gpus=4))
    assert main.scenario.name == "dp-loss-primary"
    att = attribute(main.scenario)
    assert att is not None
    causes = {k: v for k, v in att.causes_bytes.items() if v > 0}
    assert max(causes, key=lambda k: causes[k]) == "loss", att.causes_bytes
    assert causes["loss"] > att.excess_bytes / 2
