"""The DDP alternative of a DataParallel script gives each rank its share of the batch
DataParallel scattered, however the script made it: a DataLoader's ``batch_size`` divided
(``test_run_scripts.py``), or, for batches made in the loop without one
(``torch.randint(0, V, (B, T))``), the rows each rank would make itself.

Checked against the DDP script a user would write: the same model with each rank making
``B // N`` rows, run under torchrun, peaks as the alternative's rank."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_script_rewrite import apply_diff

from dpprof.script.session import ScriptConfig, parse_command, run_command

# a token model: embedding, MLP, vocabulary head; the same whichever dimension is the batch
LM_MODEL = """
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.head = nn.Linear(D, V)
    def forward(self, ids):
        return self.head(self.mix(self.emb(ids)))
"""
LM = """
import torch, torch.nn as nn
V, D, T, B = 2000, 64, 32, 32""" + LM_MODEL + """{setup}
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
crit = nn.CrossEntropyLoss()
for step in range(6):
    ids = torch.randint(0, V, ({rows}, T + 1), device="cuda")
    x, y = ids[:, :-1], ids[:, 1:]
    out = model(x)
    loss = crit(out.reshape(-1, out.size(-1)), y.reshape(-1))
    opt.zero_grad(); loss.backward(); opt.step()
"""
DATA_PARALLEL = "model = nn.DataParallel(LM().cuda())"
DDP = """import torch.distributed as dist, os
dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
model = nn.parallel.DistributedDataParallel(LM().cuda(rank), device_ids=[rank])"""


def _run(tmp_path: Path, name: str, text: str, command: list[str]) -> object:
    (tmp_path / name).write_text(text)
    result, main = run_command(ScriptConfig(launch=parse_command(command, 4), gpus=4))
    assert main.exit_status == 0, main.script_traceback
    return result


def test_a_batch_made_without_a_dataloader_is_divided_among_the_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    dp = _run(tmp_path, "train.py", LM.format(setup=DATA_PARALLEL, rows="B"),
              ["python", "train.py"])
    ddp = dp.scenario("ddp")  # type: ignore[attr-defined]
    assert ddp is not None and ddp.status == "ok", dp.notes  # type: ignore[attr-defined]
    # each rank 8 rows: the global batch DataParallel's 32
    assert ddp.batch == 32 and all(d.batch_rows == 8 for d in ddp.devices)
    assert any("torch.randint at" in n and "train.py:16" in n and "8 rows of DataParallel's 32"
               in n for n in ddp.notes), ddp.notes
    # the loss takes out.reshape(...) and y.reshape(-1): moved inside forward as written,
    # each replica reshaping its own shards
    lif = dp.scenario("dp-loss-forward")  # type: ignore[attr-defined]
    assert lif is not None and lif.status == "ok", dp.notes  # type: ignore[attr-defined]
    primary = dp.scenario("dp-loss-primary")  # type: ignore[attr-defined]
    assert lif.devices[0].peak_allocated_bytes < primary.devices[0].peak_allocated_bytes
    # what a user's own DDP script makes of it: each rank B // 4 rows
    by_hand = _run(tmp_path, "ddp.py", LM.format(setup=DDP, rows="B // 4"),
                   ["torchrun", "--nproc-per-node", "4", "ddp.py"])
    (rank,) = by_hand.scenarios  # type: ignore[attr-defined]
    assert rank.name == "ddp" and rank.batch == 32
    assert all(d.batch_rows == 8 for d in rank.devices)
    assert ([d.peak_allocated_bytes for d in ddp.devices]
            == [d.peak_allocated_bytes for d in rank.devices])
    assert ddp.devices[0].breakdown_bytes == rank.devices[0].breakdown_bytes


def test_rows_sliced_from_a_tensor_in_memory_are_divided_as_they_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows sliced from a tensor made once (not a factory in the loop) and moved to the GPU
    each step: each rank moves its share (there was no DDP alternative), and the change
    names the line to divide by hand."""
    monkeypatch.chdir(tmp_path)
    text = LM.format(setup=DATA_PARALLEL, rows="B").replace(
        'ids = torch.randint(0, V, (B, T + 1), device="cuda")',
        "ids = data[step * B:(step + 1) * B].cuda()").replace(
        "for step in range(6):", "data = torch.randint(0, V, (6 * B, T + 1))\n"
        "for step in range(6):")
    result = _run(tmp_path, "train.py", text, ["python", "train.py"])
    ddp = result.scenario("ddp")  # type: ignore[attr-defined]
    assert ddp is not None and all(d.batch_rows == 8 for d in ddp.devices)
    fix = next(f for f in result.fixes if f.name == "ddp")  # type: ignore[attr-defined]
    assert "train.py:17 moves the batch's 32 rows to the GPU" in fix.code, fix.code


def test_the_ddp_fix_divides_the_hand_made_batch_and_runs_with_the_peaks_it_promised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DDP change printed for the script: its diff applied to the user's file gives a
    torchrun script whose every rank makes B // 4 rows, and run so, its ranks peak as the
    alternative promised."""
    monkeypatch.chdir(tmp_path)
    source = LM.format(setup=DATA_PARALLEL, rows="B")
    dp = _run(tmp_path, "train.py", source, ["python", "train.py"])
    fix = next(f for f in dp.fixes if f.name == "ddp")  # type: ignore[attr-defined]
    patched = apply_diff(source, fix.code)  # the notes after the diff are comments
    assert 'torch.randint(0, V, (B // 4, T + 1), device="cuda")' in patched
    assert "DistributedSampler" not in patched  # no DataLoader: nothing to note there
    ran = _run(tmp_path, "train.py", patched, ["torchrun", "--nproc-per-node", "4", "train.py"])
    (rank,) = ran.scenarios  # type: ignore[attr-defined]
    assert rank.name == "ddp" and rank.batch == 32
    assert all(d.batch_rows == 8 for d in rank.devices)
    assert fix.max_peak_bytes == max(d.peak_allocated_bytes for d in rank.devices)



# Inputs and targets made on one line, as the tutorials write them: each factory is cut
# (the diff cut the first twice and gave up: "the changes overlap"); a factory of another
# size on the line (the noise's 10) is left as it is
# a classifier on 128 features, as the tutorials' scripts make it
NET = """class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 1000))
    def forward(self, x):
        return self.f(x)
"""
ONE_LINE = """
import torch, torch.nn as nn
""" + NET + """device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.DataParallel(Net()).to(device)
opt = torch.optim.Adam(model.parameters())
crit = nn.CrossEntropyLoss()
for step in range(5):
    x, y, w = torch.randn(256, 128).to(device), torch.randint(0, 1000, (256,)).to(device), torch.rand(10)
    loss = crit(model(x), y) * w.mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_every_batch_factory_on_a_line_is_divided(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    dp = _run(tmp_path, "train.py", ONE_LINE, ["python", "train.py"])
    fix = next(f for f in dp.fixes if f.name == "ddp")  # type: ignore[attr-defined]
    assert fix.code.startswith("---"), fix.code
    patched = apply_diff(ONE_LINE, fix.code)
    assert ("torch.randn(256 // 4, 128).to(device), torch.randint(0, 1000, (256 // 4,))"
            ".to(device), torch.rand(10)") in patched
    ran = _run(tmp_path, "train.py", patched, ["torchrun", "--nproc-per-node", "4", "train.py"])
    (rank,) = ran.scenarios  # type: ignore[attr-defined]
    assert rank.name == "ddp" and all(d.batch_rows == 64 for d in rank.devices)
    assert fix.max_peak_bytes == max(d.peak_allocated_bytes for d in rank.devices)


def test_the_alternatives_use_the_gpus_data_parallel_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``nn.DataParallel(model, device_ids=[0, 1])`` on a machine of four GPUs: DDP runs a
    rank on each of those two (their batch 128 rows each), not four of 64 (which made DDP
    look lighter by using twice the GPUs), and its diff says two; applied and run so under
    torchrun, the ranks peak as promised."""
    monkeypatch.chdir(tmp_path)
    source = ONE_LINE.replace("nn.DataParallel(Net())", "nn.DataParallel(Net(), device_ids=[0, 1])")
    dp = _run(tmp_path, "train.py", source, ["python", "train.py"])
    ddp = dp.scenario("ddp")  # type: ignore[attr-defined]
    assert ddp is not None and ddp.batch == 256, dp.notes  # type: ignore[attr-defined]
    assert [d.batch_rows for d in ddp.devices] == [128, 128]
    assert any("one emulated rank of 2" in n for n in ddp.notes), ddp.notes
    fix = next(f for f in dp.fixes if f.name == "ddp")  # type: ignore[attr-defined]
    assert "# torchrun --nproc-per-node 2 train.py" in fix.code, fix.code
    patched = apply_diff(source, fix.code)
    assert "torch.randn(256 // 2, 128)" in patched
    ran = _run(tmp_path, "train.py", patched, ["torchrun", "--nproc-per-node", "2", "train.py"])
    (rank,) = ran.scenarios  # type: ignore[attr-defined]
    assert [d.peak_allocated_bytes for d in rank.devices] == [
        d.peak_allocated_bytes for d in ddp.devices]


# Batches made another way than a torch factory: numpy's arrays, torch.arange's labels, a
# legacy FloatTensor: each moved to the GPU in the loop
MOVED = """
import numpy as np
import torch, torch.nn as nn
B = 256
""" + NET + """{setup}
opt = torch.optim.Adam(model.parameters())
crit = nn.CrossEntropyLoss()
for step in range(5):
    x = torch.from_numpy(np.random.rand({rows}, 128)).float().cuda()
    y = (torch.arange({rows}) % 1000).to("cuda")
    w = torch.FloatTensor({rows}).fill_(1.0).cuda()
    loss = (nn.functional.cross_entropy(model(x), y, reduction="none") * w).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""
MOVED_DDP = """import torch.distributed as dist, os
dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
model = nn.parallel.DistributedDataParallel(Net().cuda(rank), device_ids=[rank])"""


def test_a_batch_made_without_a_torch_factory_is_divided_as_it_moves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the loop moves to a GPU with the batch's rows, made with numpy, torch.arange
    or a legacy constructor: each rank moves its share (there was no DDP alternative: "the
    script makes its batches neither with a DataLoader nor with a torch factory"), and it
    peaks as the DDP script whose ranks make B // 4 rows; the change says which lines to
    divide by hand."""
    monkeypatch.chdir(tmp_path)
    dp = _run(tmp_path, "train.py", MOVED.format(setup="model = nn.DataParallel(Net()).cuda()",
                                                  rows="B"), ["python", "train.py"])
    ddp = dp.scenario("ddp")  # type: ignore[attr-defined]
    assert ddp is not None and ddp.status == "ok", dp.notes  # type: ignore[attr-defined]
    assert ddp.batch == 256 and all(d.batch_rows == 64 for d in ddp.devices)
    by_hand = _run(tmp_path, "ddp.py", MOVED.format(setup=MOVED_DDP, rows="B // 4"),
                   ["torchrun", "--nproc-per-node", "4", "ddp.py"])
    (rank,) = by_hand.scenarios  # type: ignore[attr-defined]
    assert [d.peak_allocated_bytes for d in rank.devices] == [
        d.peak_allocated_bytes for d in ddp.devices]
    fix = next(f for f in dp.fixes if f.name == "ddp")  # type: ignore[attr-defined]
    # no DataLoader: the wrap's comment says what each rank makes, not how it loads
    assert "# DDP: each rank makes its share of every batch, 1/4 of its rows" in fix.code
    assert "DistributedSampler" not in fix.code
    for line in (15, 16, 17):
        assert (f"train.py:{line} moves the batch's 256 rows to the GPU" in fix.code
                and "make each rank's 64 (rows // 4) there by hand" in fix.code), fix.code

# A batch made row by row in a loop up to B, its lengths drawn with torch.randint of B
# (Hugging Face style: the labels go into the model, which returns its loss beside the
# logits): cutting the randint to a rank's share broke the script (IndexError at
# ``lengths[b]``), and the DDP alternative ran nothing, named "single"
ROW_BY_ROW = """
import torch, torch.nn as nn
V, D, T, B = 2000, 64, 32, 32
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)
    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1),
                                           ignore_index=-100)
        return loss, logits
{setup}
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
for step in range(6):
    lengths = torch.randint(4, T, ({rows},))
    ids = torch.zeros({rows}, T, dtype=torch.long)
    labels = torch.full(({rows}, T), -100)
    for b in range({rows}):
        ids[b, :lengths[b]] = torch.randint(0, V, (int(lengths[b]),))
        labels[b, :lengths[b] - 1] = ids[b, 1:lengths[b]]
    loss, logits = model(ids.cuda(), labels.cuda())
    opt.zero_grad(); loss.mean().backward(); opt.step()
"""


def test_a_batch_made_row_by_row_is_cut_at_the_models_call_where_cutting_it_breaks_the_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    dp = _run(tmp_path, "train.py", ROW_BY_ROW.format(setup=DATA_PARALLEL, rows="B"),
              ["python", "train.py"])
    ddp = dp.scenario("ddp")  # type: ignore[attr-defined]
    assert ddp is not None and ddp.status == "ok", dp.notes  # type: ignore[attr-defined]
    assert ddp.batch == 32 and all(d.batch_rows == 8 for d in ddp.devices)
    assert any(n.startswith("the DDP alternative cut the batches the script makes "
                            "(torch.randint at") and "IndexError" in n
               for n in dp.notes), dp.notes  # type: ignore[attr-defined]
    assert any("the model's inputs cut at its call to DataParallel's first chunk, 8 of its "
               "32 rows" in n for n in ddp.notes), ddp.notes
    # against the DDP script a user would write (each rank making B // 4 rows): higher by at
    # most the rest of the batch's inputs, which this rank's GPU still holds (ids and
    # labels, int64, 24 of the 32 rows: 12,288 B; 6,144 B of them live at the peak)
    by_hand = _run(tmp_path, "ddp.py", ROW_BY_ROW.format(setup=DDP, rows="B // 4"),
                   ["torchrun", "--nproc-per-node", "4", "ddp.py"])
    (rank,) = by_hand.scenarios  # type: ignore[attr-defined]
    assert all(d.batch_rows == 8 for d in rank.devices)
    rest = 2 * 24 * 32 * 8
    for alt, own in zip(ddp.devices, rank.devices, strict=True):
        assert own.peak_allocated_bytes < alt.peak_allocated_bytes
        assert alt.peak_allocated_bytes <= own.peak_allocated_bytes + rest


def test_where_neither_cut_runs_the_ddp_alternative_says_why_and_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the same batch, its loss computed outside the model on the whole batch's labels: cut
    # at the model's call, the outputs have a rank's rows and the labels all of them
    monkeypatch.chdir(tmp_path)
    text = ROW_BY_ROW.format(setup=DATA_PARALLEL, rows="B").replace(
        "    loss, logits = model(ids.cuda(), labels.cuda())\n",
        "    logits = model(ids.cuda(), labels.cuda())[1]\n"
        "    loss = nn.functional.cross_entropy(logits.reshape(-1, V), "
        "labels.cuda().reshape(-1), ignore_index=-100)\n")
    result = _run(tmp_path, "train.py", text, ["python", "train.py"])
    assert result.scenario("ddp") is None  # type: ignore[attr-defined]
    note = next(n for n in result.notes  # type: ignore[attr-defined]
                if n.startswith("no DDP alternative: the DDP alternative cut the batches"))
    assert "IndexError" in note and "with the model's inputs cut at its call instead it " \
        "failed too" in note and "make each rank's share of the batch in the script" in note


def test_a_batch_sized_tensor_made_once_before_the_loop_is_not_cut(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # dcgan's fixed noise, made once to draw samples from as training goes: no step's batch;
    # a DDP script keeps it whole on every rank
    monkeypatch.chdir(tmp_path)
    source = LM.format(setup=DATA_PARALLEL, rows="B").replace(
        "for step in range(6):",
        'fixed = torch.randint(0, V, (B, T), device="cuda")\nfor step in range(6):')
    dp = _run(tmp_path, "train.py", source, ["python", "train.py"])
    ddp = dp.scenario("ddp")  # type: ignore[attr-defined]
    assert ddp is not None and ddp.status == "ok"
    share = next(n for n in ddp.notes if n.startswith("each rank's share"))
    assert "train.py:17" in share and "train.py:15" not in share, share
    fix = next(f for f in dp.fixes if f.name == "ddp")  # type: ignore[attr-defined]
    patched = apply_diff(source, fix.code)
    assert 'fixed = torch.randint(0, V, (B, T), device="cuda")' in patched
    assert 'torch.randint(0, V, (B // 4, T + 1), device="cuda")' in patched


def test_a_script_written_again_between_runs_is_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # first a script whose line 15 makes a batch-sized tensor before its loop, then, at the
    # same path, one whose line 15 makes the batch inside its loop: that one is cut
    monkeypatch.chdir(tmp_path)
    before = LM.format(setup=DATA_PARALLEL, rows="B").replace(
        "for step in range(6):",
        'fixed = torch.randint(0, V, (B, T), device="cuda")\nfor step in range(6):')
    _run(tmp_path, "train.py", before, ["python", "train.py"])
    inside = LM.format(setup=DATA_PARALLEL, rows="B").replace(
        "opt = torch.optim.AdamW(model.parameters(), lr=3e-4)\ncrit = nn.CrossEntropyLoss()",
        "opt = torch.optim.AdamW(model.parameters(), lr=3e-4); crit = nn.CrossEntropyLoss()")
    assert inside.splitlines()[14].lstrip().startswith("ids = torch.randint")  # line 15
    dp = _run(tmp_path, "train.py", inside, ["python", "train.py"])
    ddp = dp.scenario("ddp")  # type: ignore[attr-defined]
    assert ddp is not None and ddp.status == "ok", dp.notes  # type: ignore[attr-defined]
    assert any("train.py:15) cut to 8 rows" in n for n in ddp.notes), ddp.notes


TARGETS = """
import torch, torch.nn as nn
B, D = 32, 64
model = nn.DataParallel(nn.Linear(D, D).cuda())
critic = nn.DataParallel(nn.Linear(D, 1).cuda())
opt = torch.optim.SGD([*model.parameters(), *critic.parameters()], lr=0.1)
mse, bce = nn.MSELoss(), nn.BCEWithLogitsLoss()
for step in range(6):
    x = torch.randn(B, D).cuda()
    out = model(x)
    real = torch.full((B, 1), 1.0, device="cuda")  # a GAN's labels
    loss = mse(out, torch.zeros(B, D).cuda()) + bce(critic(out), real)
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_targets_and_labels_made_in_the_loop_are_cut_with_the_inputs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's targets and labels made by torch.zeros and torch.full in the loop (a
    regression's target, a GAN's labels) are the batch's too: cut with its inputs, as a
    DDP script makes them. Only torch.randint/randn/rand were cut, and the loss of the cut
    outputs against the whole targets stopped both tries ("no DDP alternative")."""
    monkeypatch.chdir(tmp_path)
    result = _run(tmp_path, "train.py", TARGETS, ["python", "train.py"])
    ddp = result.scenario("ddp")  # type: ignore[attr-defined]
    assert ddp is not None and ddp.status == "ok", result.notes  # type: ignore[attr-defined]
    assert all(d.batch_rows == 8 for d in ddp.devices)
    (cut,) = [n for n in ddp.notes if n.startswith("each rank's share")]
    for made in ("torch.randn at", "torch.full at", "torch.zeros at"):
        assert made in cut, cut
    fix = next(f for f in result.fixes if f.name == "ddp")  # type: ignore[attr-defined]
    rewritten = apply_diff(TARGETS, fix.code)
    assert "torch.randn(B // 4, D)" in rewritten and "torch.full((B // 4, 1), 1.0" in rewritten
    assert "torch.zeros(B // 4, D)" in rewritten
