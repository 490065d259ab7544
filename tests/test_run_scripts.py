"""``dpprof run``: real scripts in the styles people write, run unchanged (tests/scripts/).

Every byte count is derived from the shapes in the script (4 bytes per float32, 8 per
int64, each storage rounded up to 512 B as the CUDA caching allocator rounds it); the
one-device script is also checked against torch.profiler's records of the same script on
real CPU tensors.
"""

from __future__ import annotations

import importlib.util
import json
import runpy
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dpprof.backends.memtrace import peak_of, record
from dpprof.cli.app import app
from dpprof.result import DeviceResult, RunResult
from dpprof.script.runner import run_script
from dpprof.script.session import ScriptConfig, parse_command, run_command

SCRIPTS = Path(__file__).parent / "scripts"
runner = CliRunner()


def r512(n: int) -> int:
    return -(-n // 512) * 512


def params_bytes(*shapes: tuple[int, ...]) -> int:
    """Each float32 parameter in its own block, as ``.to("cuda")`` allocates them."""
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        total += r512(4 * n)
    return total


def numel(*shapes: tuple[int, ...]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def run(cmd: list[str], gpus: int = 4, steps: int = 3, alternatives: bool = True) -> RunResult:
    result, _ = run_command(ScriptConfig(launch=parse_command(cmd, gpus), gpus=gpus,
                                         steps=steps), alternatives)
    return result


def devs(result: RunResult, name: str) -> list[DeviceResult]:
    s = result.scenario(name)
    assert s is not None, [x.name for x in result.scenarios]
    assert s.status == "ok", s.message
    return s.devices


MLP = [(256, 32), (256,), (1000, 256), (1000,)]  # dp_loss_outside.py's Net


def test_data_parallel_loss_outside_forward_and_its_alternatives() -> None:
    result = run(["python", str(SCRIPTS / "dp_loss_outside.py"), "--batch-size", "64"])
    assert [s.name for s in result.scenarios] == ["dp-loss-primary", "dp-loss-forward", "ddp"]
    assert result.batch == 64 and result.gpus == 4
    dp = devs(result, "dp-loss-primary")
    assert all(dp[0].peak_allocated_bytes > d.peak_allocated_bytes for d in dp[1:])
    cuda0 = dp[0].breakdown_bytes
    assert cuda0["parameters"] == params_bytes(*MLP)
    assert cuda0["optimizer_state"] == params_bytes(*MLP)  # SGD momentum, on cuda:0 only
    assert cuda0["outputs"] == 64 * 1000 * 4  # the gathered logits, kept by the loop
    for d in dp[1:]:
        # a replica's parameters: one flat broadcast buffer (< 10 MiB), no optimizer state
        assert d.breakdown_bytes["parameters"] == r512(4 * numel(*MLP))
        assert "optimizer_state" not in d.breakdown_bytes
    # The loss inside forward: the loop's accuracy (line 48) reads the outputs, so the fix
    # keeps them (ModelWithLoss(keep_outputs=True)) and so does its run: cuda:0 still holds
    # the gathered logits, and the loss's own temporaries were not at its peak
    fwd = devs(result, "dp-loss-forward")
    assert fwd[0].breakdown_bytes["outputs"] == 64 * 1000 * 4
    assert dp[0].peak_allocated_bytes == fwd[0].peak_allocated_bytes
    # what computing the accuracy inside forward too would save: the gathered logits
    assert "would save 250 KiB more on cuda:0" in next(
        f.detail for f in result.fixes if f.name == "loss-in-forward")
    # DDP in place: every rank holds the model, its gradients and its momentum; 16 rows
    ddp = devs(result, "ddp")
    assert result.scenario("ddp").batch == 64  # type: ignore[union-attr] (4 ranks of 16)
    assert len({d.peak_allocated_bytes for d in ddp}) == 1 and len(ddp) == 4
    assert ddp[0].breakdown_bytes["parameters"] == params_bytes(*MLP)
    assert ddp[0].breakdown_bytes["optimizer_state"] == params_bytes(*MLP)
    assert ddp[0].breakdown_bytes["communication"] >= 4 * numel(*MLP)  # the buckets
    # what each alternative saves, with the change as a diff of the script's own lines
    fixes = {f.name: f for f in result.fixes}
    assert fixes["loss-in-forward"].saves_bytes == 0  # the outputs kept: see above
    code = fixes["loss-in-forward"].code
    assert code.startswith("--- dp_loss_outside.py (as written)\n"
                           "+++ dp_loss_outside.py (the loss inside forward)\n")
    # the wrap is conditional: ModelWithLoss wraps the model before the condition, and the
    # loss, defined after the wrap, moves before that
    assert "-    model = nn.DataParallel(model)\n" not in code
    assert (" model = Net()\n+criterion = nn.CrossEntropyLoss()\n+model = dpprof.ModelWithLoss("
            "model, criterion, keep_outputs=True)\n if torch.cuda") in code
    # the loop's accuracy reads the outputs (line 48): they are kept beside the loss
    assert ("-        outputs = model(inputs)\n-        loss = criterion(outputs, labels)\n"
            "+        outputs, loss = dpprof.ModelWithLoss.split(model(inputs, labels))") in code
    assert ("-    model = nn.DataParallel(model)\n"
            "+    model = DDP(model.cuda(rank), device_ids=[rank])\n") in fixes["ddp"].code
    assert fixes["ddp"].saves_bytes == (dp[0].peak_allocated_bytes
                                        - ddp[0].peak_allocated_bytes)
    notes = " ".join(result.scenario("dp-loss-primary").notes)  # type: ignore[union-attr]
    assert "stopped after 3 optimizer step(s)" in notes and "item x" in notes
    assert "dp_loss_outside.py:47" in notes  # loss.item(): the user's own line


def test_dataloader_workers_and_pinned_memory_change_nothing_on_the_gpus(
        tmp_path: Path) -> None:
    """The loader's real work (worker processes, pinned host memory) is the script's."""
    text = (SCRIPTS / "dp_loss_outside.py").read_text()
    plain = "DataLoader(data, batch_size=args.batch_size, shuffle=True)"
    assert plain in text
    script = tmp_path / "dp_workers.py"
    script.write_text(text.replace(plain, plain[:-1] + ", num_workers=2, pin_memory=True)"))
    with_workers = run(["python", str(script)], alternatives=False)
    without = run(["python", str(SCRIPTS / "dp_loss_outside.py")], alternatives=False)
    assert ([d.peak_allocated_bytes for d in devs(with_workers, "dp-loss-primary")]
            == [d.peak_allocated_bytes for d in devs(without, "dp-loss-primary")])


def test_batches_passed_as_keyword_arguments_are_counted_as_scattered() -> None:
    """A Trainer-style ``model(**inputs)``: the rows each GPU got are those DataParallel's
    scatter split (62 rows in chunks of ceil(62 / 4): 16, 16, 16, 14), and the DDP
    alternative's rank its share."""
    result = run(["python", str(SCRIPTS / "hf_trainer_kwargs.py")])
    assert result.batch == 62
    dp = result.scenario("dp-loss-forward")  # the model returns its loss beside its logits
    assert dp is not None and dp.status == "ok" and dp.batch == 62
    assert [d.batch_rows for d in dp.devices] == [16, 16, 16, 14]
    ddp = result.scenario("ddp")
    assert ddp is not None and ddp.status == "ok", ddp and ddp.message
    # its batch is the global one, as compare's: 16 rows on each of the 4 ranks
    assert ddp.batch == 64 and all(d.batch_rows == 16 for d in ddp.devices)


def test_data_parallel_loss_inside_forward_is_recognised() -> None:
    result = run(["python", str(SCRIPTS / "dp_loss_inside.py")])
    # the loss inside forward already: DDP is the fix left, and is measured
    assert [s.name for s in result.scenarios] == ["dp-loss-forward", "ddp"]
    d = devs(result, "dp-loss-forward")
    assert d[0].breakdown_bytes["parameters"] == params_bytes(*MLP)
    assert d[0].breakdown_bytes["optimizer_state"] == 2 * params_bytes(*MLP)  # Adam
    assert "outputs" not in d[0].breakdown_bytes
    assert all("optimizer_state" not in x.breakdown_bytes for x in d[1:])


def test_model_parallel_shows_each_gpus_share() -> None:
    result = run(["python", str(SCRIPTS / "model_parallel.py")])
    (s,) = result.scenarios
    assert s.name == "model-parallel" and s.status == "ok"
    d0, d1, d2, d3 = s.devices
    net1, net2 = [(2000, 1000), (2000,)], [(500, 2000), (500,)]
    assert d0.breakdown_bytes["parameters"] == params_bytes(*net1)
    assert d1.breakdown_bytes["parameters"] == params_bytes(*net2)
    assert d0.breakdown_bytes["inputs"] == 128 * 1000 * 4  # x.to("cuda:0")
    assert d1.breakdown_bytes["inputs"] == 128 * 500 * 4  # labels.to("cuda:1")
    # at cuda:0's peak (backward) net1's gradients exist; cuda:1 holds x.to("cuda:1")
    assert d0.breakdown_bytes["gradients"] == params_bytes(*net1)
    assert d1.breakdown_bytes["activations"] >= 128 * 2000 * 4
    assert not d2.used and not d3.used and d2.peak_allocated_bytes == 0
    assert result.comparison.verdict.startswith("The script places its work on cuda:0 (")


def test_one_gpu_script_matches_torch_profiler_on_cpu() -> None:
    """The same script on real CPU tensors (no GPU: it trains on "cpu"), recorded by
    torch.profiler from before the model is built: its peak of live bytes equals the
    emulated cuda:0 peak, to the byte."""
    path = str(SCRIPTS / "single_gpu.py")
    _, events = record(lambda: runpy.run_path(path, run_name="__main__"))
    result = run(["python", path], steps=4)
    (s,) = result.scenarios
    assert s.name == "single" and s.batch == 96
    assert s.devices[0].peak_requested_bytes == peak_of(events)
    assert s.devices[0].peak_allocated_bytes == peak_of(events, rounded=True)


def test_accelerator_script_matches_torch_profiler_on_cpu() -> None:
    """torch.accelerator code runs on the CPU where no accelerator is: the same script under
    torch.profiler. Adam's step counters are the difference: torch keeps ``state["step"]``
    on the host for GPU parameters (not capturable, not fused), so the GPU does not hold
    them; on the CPU they are four 4-byte tensors of the same allocator."""
    path = str(SCRIPTS / "accelerator.py")
    _, events = record(lambda: runpy.run_path(path, run_name="__main__"))
    result = run(["python", path], steps=4)
    (s,) = result.scenarios
    host_step_counters = 4 * 4  # one float32 0-dim tensor per parameter
    assert s.devices[0].peak_requested_bytes == peak_of(events) - host_step_counters


def test_ddp_under_torchrun() -> None:
    result = run(["torchrun", "--nproc-per-node", "4", str(SCRIPTS / "ddp_torchrun.py")])
    (s,) = result.scenarios
    assert s.name == "ddp" and s.status == "ok" and s.batch == 128  # 4 ranks of 32
    assert [d.rank for d in s.devices] == [0, 1, 2, 3]
    shapes = [(512, 64), (512,), (100, 512), (100,)]
    for d in s.devices:
        assert d.breakdown_bytes["parameters"] == params_bytes(*shapes)
        assert d.breakdown_bytes["optimizer_state"] == 2 * params_bytes(*shapes)  # AdamW
        assert d.breakdown_bytes["communication"] >= 4 * numel(*shapes)
        assert d.peak_allocated_bytes == s.devices[0].peak_allocated_bytes


def test_collectives_on_the_fake_process_group(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "coll.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl')\n"
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
        "t = torch.ones(1000, device='cuda')\n"
        "dist.all_reduce(t)\n"
        "outs = [torch.empty(1000, device='cuda') for _ in range(dist.get_world_size())]\n"
        "dist.all_gather(outs, t)\n"
        "dist.broadcast(t, 0)\n"
        "dist.barrier()\n"
        "print('allocated', torch.cuda.memory_allocated(), len(outs))\n")
    result = run(["torchrun", "--nproc-per-node", "3", str(script)])
    assert result.scenarios[0].status == "ok"
    # t and the three gathered tensors: 4 x 1000 floats, each in its own block
    assert "allocated 16384 3" in capsys.readouterr().out


FSDP2_SHAPES = [(512, 256), (256, 512)] + 4 * [(256,), (256,), (256, 256)]  # Net's


def sharded_bytes(shapes: list[tuple[int, ...]], ranks: int) -> int:
    """Each parameter's shard (dim 0 split over the ranks, padded), a block of its own."""
    return sum(r512(4 * numel((-(-s[0] // ranks), *s[1:]))) for s in shapes)


def test_fsdp2_built_on_meta_and_initialised_after_fully_shard() -> None:
    """pytorch/examples' FSDP2 recipe: the model built on meta, fully_shard per block and at
    the root, to_empty on the GPU, reset_parameters (DTensor's random init on a CUDA mesh),
    Adam over the sharded parameters: each rank holds 1/4 of every parameter."""
    result = run(["torchrun", "--nproc-per-node", "4", str(SCRIPTS / "fsdp2_meta_init.py")])
    (s,) = result.scenarios
    assert s.name == "fsdp2" and s.status == "ok", s.message
    assert [d.rank for d in s.devices] == [0, 1, 2, 3]
    d = s.devices[0]
    sharded = sharded_bytes(FSDP2_SHAPES, 4)
    assert d.breakdown_bytes["optimizer_state"] == 2 * sharded  # Adam's two moments
    # at its peak (backward) the root's parameters and one block's are all-gathered
    root = params_bytes((512, 256), (256, 512))
    block = params_bytes((256,), (256,), (256, 256))
    assert d.breakdown_bytes["parameters"] == sharded + root + block
    assert 0 < d.breakdown_bytes["gradients"] <= sharded
    assert d.breakdown_bytes["communication"] > 0  # all-gather and reduce-scatter buffers
    assert all(x.peak_allocated_bytes == d.peak_allocated_bytes for x in s.devices)


def test_fsdp2_verdict_names_fsdp2(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["run", "--ranks", "none", "-o", str(out), "--", "torchrun",
                              "--nproc-per-node", "4", str(SCRIPTS / "fsdp2_meta_init.py")])
    assert res.exit_code == 0, res.output
    assert "FSDP2 balances all 4 GPUs at" in " ".join(res.output.split())


def test_the_batch_reported_is_a_measured_steps(tmp_path: Path) -> None:
    # the model-parallel tutorial trains a toy on 20 rows once, then ResNet-50 on 120
    script = tmp_path / "two_models.py"
    script.write_text(
        "import torch\n"
        "for model, rows in ((torch.nn.Linear(10, 5), 20), (torch.nn.Linear(10, 5), 120)):\n"
        "    model = model.cuda()\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    for _ in range(1 if rows == 20 else 3):\n"
        "        model(torch.randn(rows, 10, device='cuda')).sum().backward()\n"
        "        opt.step()\n")
    assert run(["python", str(script)], steps=3).batch == 120
    assert run(["python", str(script)], steps=1).batch == 20


TENSOR_PARALLEL = """
import os, torch, torch.nn as nn, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# no init_process_group: the mesh initialises the default group itself
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, 4, 16).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, 64))

model = parallelize_module(Attention().cuda(), mesh, {
    # the heads sharded, kept as DTensors into the attention (the FSDP + TP example's plan)
    "wq": ColwiseParallel(use_local_output=False), "wk": ColwiseParallel(use_local_output=False),
    "wv": ColwiseParallel(use_local_output=False), "wo": RowwiseParallel()})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    model(torch.randn(2, 8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
print("trained")
"""


def test_tensor_parallel_attention_over_a_mesh_made_without_a_process_group(
        tmp_path: Path) -> None:
    # without the fake group behind init_device_mesh a real rendezvous waits for the other
    # ranks forever: a subprocess, so that the test fails instead of hanging
    import subprocess
    import sys

    script = tmp_path / "tp.py"
    script.write_text(TENSOR_PARALLEL)
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "dpprof.cli.entry", "run", "--steps", "5", "--ranks", "none",
         "-o", str(out), "--", "torchrun", "--nproc-per-node", "4", str(script)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trained" in proc.stdout
    (s,) = json.loads(out.read_text())["scenarios"]
    assert s["name"] == "tensor-parallel" and s["status"] == "ok"
    assert [d["rank"] for d in s["devices"]] == [0, 1, 2, 3]
    # the four ranks of the mesh compute on one batch of 2 rows (it was said 8, and the
    # samples a second four times too many)
    assert s["batch"] == 2
    # each rank holds a quarter of each projection's weight, and AdamW's two moments of it
    d = s["devices"][0]["breakdown_bytes"]
    assert d["optimizer_state"] == 2 * 4 * r512(4 * 16 * 64)


def test_attention_takes_the_kernel_the_gpu_picks(tmp_path: Path) -> None:
    # float32, head dim 16, no mask: an A100 runs memory-efficient attention, which saves
    # the output and a log-sum-exp per row; over meta tensors torch would take the math
    # path and keep the 8 x 4 x 256 x 256 weights (8 MiB) for backward
    script = tmp_path / "attention.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "proj = torch.nn.Linear(64, 3 * 64).cuda()\n"
        "opt = torch.optim.SGD(proj.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    x = torch.randn(8, 256, 64, device='cuda')\n"
        "    q, k, v = (t.view(8, 256, 4, 16).transpose(1, 2) for t in proj(x).chunk(3, -1))\n"
        "    F.scaled_dot_product_attention(q, k, v).sum().backward()\n"
        "    opt.step()\n")
    (s,) = run(["python", str(script)]).scenarios
    weights_bytes = 8 * 4 * 256 * 256 * 4
    assert s.devices[0].peak_allocated_bytes < weights_bytes


def test_ddp_under_mp_spawn() -> None:
    result = run(["python", str(SCRIPTS / "ddp_spawn.py")], gpus=2)
    (s,) = result.scenarios
    assert s.name == "ddp" and len(s.devices) == 2  # nprocs = torch.cuda.device_count()
    shapes = [(512, 64), (512,), (100, 512), (100,)]
    assert s.devices[1].breakdown_bytes["parameters"] == params_bytes(*shapes)
    assert s.devices[1].breakdown_bytes["optimizer_state"] == 2 * params_bytes(*shapes)


def test_ddp_tutorial_with_the_rank_as_the_device() -> None:
    """The DDP tutorial's demo_basic under mp.spawn: .to(rank), device=rank, .cuda(rank),
    torch.device(rank)."""
    result = run(["python", str(SCRIPTS / "ddp_tutorial.py")], gpus=2)
    (s,) = result.scenarios
    assert s.name == "ddp" and s.status == "ok", s.message
    # the global batch: 200 rows on each of the 2 ranks
    assert s.batch == 2 * 200 and [d.rank for d in s.devices] == [0, 1]
    assert all(d.batch_rows == 200 for d in s.devices)
    shapes = [(1000, 10), (1000,), (5, 1000), (5,)]
    d = s.devices[0].breakdown_bytes
    assert d["parameters"] == params_bytes(*shapes)
    assert d["inputs"] == r512(200 * 5 * 4)  # the labels, moved with .cuda(rank)


def test_script_that_sets_cuda_visible_devices_itself() -> None:
    result = run(["python", str(SCRIPTS / "sets_visible_devices.py")], gpus=4,
                 alternatives=False)
    assert result.gpus == 2  # CUDA_VISIBLE_DEVICES=1,2 of 4
    d = devs(result, "dp-loss-primary")
    assert len(d) == 2
    assert d[0].breakdown_bytes["parameters"] == params_bytes(*MLP)
    assert d[1].breakdown_bytes["parameters"] == r512(4 * numel(*MLP))


def test_every_alternative_keeps_to_the_gpus_the_script_made_visible() -> None:
    """CUDA_VISIBLE_DEVICES="2,3" set by the script: 2 of the 4 GPUs, for the script as
    written and for each alternative (DDP: one rank per visible GPU, the loader's batch
    halved)."""
    result = run(["python", str(SCRIPTS / "visible_devices_loader.py")], gpus=4)
    assert result.gpus == 2
    names = [s.name for s in result.scenarios]
    assert names == ["dp-loss-primary", "dp-loss-forward", "ddp"]
    for s in result.scenarios:
        assert s.status == "ok" and len(s.devices) == 2, (s.name, s.message)
    assert [d.batch_rows for d in devs(result, "dp-loss-primary")] == [32, 32]
    ddp = result.scenario("ddp")
    # the global batch: the loader's 64 halved on each of the 2 ranks
    assert ddp is not None and ddp.batch == 64 and "one emulated rank of 2" in ddp.notes[0]
    assert all(d.batch_rows == 32 for d in ddp.devices)


def test_a_ddp_script_under_cuda_visible_devices_counts_those_gpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    result = run(["python", str(SCRIPTS / "ddp_spawn.py")], gpus=4)
    (s,) = result.scenarios
    assert s.name == "ddp" and len(s.devices) == 2 and result.gpus == 2


def test_script_using_torch_accelerator() -> None:
    result = run(["python", str(SCRIPTS / "accelerator.py")])
    (s,) = result.scenarios
    assert s.name == "single" and s.status == "ok"
    shapes = [(1024, 128), (1024,), (10, 1024), (10,)]
    assert s.devices[0].breakdown_bytes["parameters"] == params_bytes(*shapes)
    assert s.devices[0].breakdown_bytes["optimizer_state"] == 2 * params_bytes(*shapes)


def test_keras3_model_on_the_torch_backend() -> None:
    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras is not installed (pip install -e '.[test]')")
    result = run(["python", str(SCRIPTS / "keras_torch.py")])
    (s,) = result.scenarios
    assert s.name == "single" and s.status == "ok" and s.batch == 128
    # Dense(64 -> 512) and Dense(512 -> 10): the Keras variables followed the model to cuda:0
    shapes = [(64, 512), (512,), (512, 10), (10,)]
    d = s.devices[0].breakdown_bytes
    assert d["parameters"] == params_bytes(*shapes)
    assert d["optimizer_state"] == 2 * params_bytes(*shapes)  # torch.optim.Adam
    assert not any(x.used for x in s.devices[1:])


def test_keras3_guide_ddp_mnist_with_uint8_labels() -> None:
    """The Keras 3 multi-GPU guide: MNIST's uint8 labels go to CrossEntropyLoss as they are
    (CUDA's nll_loss takes uint8 targets); DDP under start_processes, the model moved with
    .to(rank)."""
    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras is not installed (pip install -e '.[test]')")
    result = run(["python", str(SCRIPTS / "keras_mnist_ddp.py")], gpus=2)
    (s,) = result.scenarios
    assert s.name == "ddp" and s.status == "ok", s.message
    assert s.batch == 2 * 64 and [d.rank for d in s.devices] == [0, 1]  # 2 ranks of 64
    # the batch on the rank's GPU: 64 float32 28x28x1 images and 64 uint8 labels
    assert s.devices[0].breakdown_bytes["inputs"] == r512(64 * 28 * 28 * 4) + r512(64)
    assert "stopped after 3 optimizer step(s)" in " ".join(s.notes)


def test_autocast_and_grad_scaler_take_every_step() -> None:
    main = run_script(ScriptConfig(launch=parse_command(
        ["python", str(SCRIPTS / "amp_autocast.py")], 4), steps=3))
    # GradScaler's found_inf is a meta tensor: no inf, every optimizer step is taken
    assert main.steps_done == 3 and main.ended == "steps"
    assert main.autocast_regions >= 2
    d = main.scenario.devices[0].breakdown_bytes
    # float32 master weights: Linear(256, 2048) and Linear(2048, 256)
    assert d["parameters"] == params_bytes((2048, 256), (2048,), (256, 2048), (256,))


def test_checkpoint_recompute_reenters_the_scripts_bf16_region() -> None:
    """Non-reentrant checkpoint records ``torch.is_autocast_enabled("cuda")`` and its dtype
    in forward and enters them again for the recompute in backward, outside the script's
    region (torch/utils/checkpoint.py, ``_get_autocast_kwargs``). Reading False, the
    recompute ran in float32 and checkpoint raised: its saved tensors were bfloat16."""
    main = run_script(ScriptConfig(launch=parse_command(
        ["python", str(SCRIPTS / "amp_checkpoint_rotary.py")], 1), steps=3))
    assert main.scenario.status == "ok", main.scenario.message
    assert main.steps_done == 3 and main.ended == "steps"
    # the script's own regions, one a step: checkpoint's re-entries are torch's
    assert main.autocast_regions == 3
    d = main.scenario.devices[0].breakdown_bytes
    # four Linear(256, 1024) and four Linear(1024, 256): float32 master weights, and the
    # rotary embedding's inv_freq buffer (128 floats)
    shapes = [(1024, 256), (1024,), (256, 1024), (256,)] * 4
    assert d["parameters"] == params_bytes(*shapes, (128,))


DP_BF16_SCRIPT = """
import torch
import torch.nn as nn

model = nn.DataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(3):
    x = torch.randn(32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
    print(out.dtype)
    loss = out.float().pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize(("gpus", "replica_dtype"), [(1, "torch.bfloat16"), (2, "torch.float16")])
def test_data_parallel_script_under_bf16_says_its_replicas_compute_in_float16(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], gpus: int, replica_dtype: str) -> None:
    """A DataParallel script inside ``torch.autocast("cuda", dtype=torch.bfloat16)``: over
    two GPUs or more torch's parallel_apply runs each replica in a thread of its own that
    enters autocast without the caller's dtype (the thread's default: float16 on CUDA), so
    the gathered outputs are float16 and the run's notes say why and what keeps bf16; over
    one GPU the replica runs in the caller's thread, in bfloat16, and nothing is said."""
    script = tmp_path / "dp_bf16.py"
    script.write_text(DP_BF16_SCRIPT)
    main = run_script(ScriptConfig(launch=parse_command(["python", str(script)], gpus),
                                   gpus=gpus, steps=3))
    assert main.scenario.status == "ok", main.scenario.message
    assert set(capfd.readouterr().out.split()) == {replica_dtype}
    assert (main.replicas_float16 is not None) == (gpus > 1)
    result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], gpus),
                                         gpus=gpus, steps=3), False)
    notes = result.scenarios[0].notes
    said = [n for n in notes if "replicas compute in float16, not bfloat16" in n]
    assert len(said) == (gpus > 1), notes


def test_resnet18_in_data_parallel_loads_cuda0() -> None:
    from torchvision_shim import import_torchvision

    try:
        import_torchvision()
    except Exception as e:  # pragma: no cover - no torchvision installed
        pytest.skip(f"torchvision unavailable: {e}")
    result = run(["python", str(SCRIPTS / "resnet_dp.py"), "-b", "32", "--image-size", "32"])
    dp = devs(result, "dp-loss-primary")
    assert all(dp[0].peak_allocated_bytes > d.peak_allocated_bytes for d in dp[1:])
    att = result.attribution["dp-loss-primary"]
    assert att.excess_bytes > 0
    named = {k for k, v in att.causes_bytes.items() if v > 0}
    assert {"reduced gradients", "optimizer state and step temporaries"} <= {
        c for c in named} or any("gradients" in c for c in named)
    assert dp[0].breakdown_bytes["outputs"] == 32 * 1000 * 4


def test_stops_after_steps_and_measures_after_the_warm_up() -> None:
    one = run_script(ScriptConfig(launch=parse_command(
        ["python", str(SCRIPTS / "single_gpu.py")], 4), steps=1))
    assert one.steps_done == 1 and one.ended == "steps"
    three = run_script(ScriptConfig(launch=parse_command(
        ["python", str(SCRIPTS / "single_gpu.py")], 4), steps=3))
    assert three.steps_done == 3
    # step 1 has no momentum buffers before its update: the warm-up peak is lower
    assert (one.scenario.devices[0].peak_allocated_bytes
            <= three.scenario.devices[0].peak_allocated_bytes)


# ---- the command line ------------------------------------------------------------------


def test_cli_run_writes_reports(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    md = tmp_path / "run.md"
    r = runner.invoke(app, ["run", "-g", "2", "-o", str(out), "-o", str(md), "--",
                            "python", str(SCRIPTS / "dp_loss_outside.py"), "--batch-size", "32"])
    assert r.exit_code == 0, r.output
    assert "running dp_loss_outside.py --batch-size 32 on 2 virtual" in r.stderr
    assert "dp-loss-primary" in r.stdout and "cuda:1" in r.stdout
    data = json.loads(out.read_text())
    assert data["gpus"] == 2 and data["batch"] == 32 and data["config"]["command"] == "run"
    assert "dp-loss-primary" in md.read_text()


def test_cli_script_error_is_the_scripts(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import torch\nx = torch.zeros(3, device='cuda')\n"
                      "def f():\n    return 1 / 0\nf()\n")
    r = runner.invoke(app, ["run", "-q", "-o", str(tmp_path / "r.json"), "--", "python",
                            str(script)])
    assert r.exit_code == 1
    assert "Traceback" in r.stderr and "boom.py\", line 4" in r.stderr
    assert "ZeroDivisionError" in r.stderr and "dpprof/" not in r.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["scenarios"][0]["status"] == "error"


def test_a_script_that_fails_before_its_first_gpu_tensor_is_its_own_error(
        tmp_path: Path) -> None:
    """No allocation was seen on any GPU: the result is the script's error, not dpprof's."""
    script = tmp_path / "early.py"
    script.write_text("import torch\nraise ValueError('bad config')\n")
    r = runner.invoke(app, ["run", "-q", "-o", str(tmp_path / "r.json"), "--", "python",
                            str(script)])
    assert r.exit_code == 1, r.stderr
    assert "ValueError: bad config" in r.stderr and "internal error" not in r.stderr


def test_cli_no_optimizer_step_is_said(tmp_path: Path) -> None:
    script = tmp_path / "infer.py"
    script.write_text("import torch\nm = torch.nn.Linear(8, 8).cuda()\n"
                      "y = m(torch.randn(4, 8).cuda())\n")
    r = runner.invoke(app, ["run", "-o", str(tmp_path / "r.json"), "--", "python",
                            str(script)])
    assert r.exit_code == 0, r.output
    assert "never called optimizer.step()" in " ".join(r.stdout.split())
    assert "saw 1 forward pass(es) and 0 backward pass(es)" in " ".join(r.stdout.split())


def test_cli_data_dependent_shape_names_compute(tmp_path: Path) -> None:
    """A mask of values the emulation does not have selects nothing (a stand-in): the run
    goes on, and the report names the line and --compute, which has the real values."""
    script = tmp_path / "mask.py"
    script.write_text("import torch\nx = torch.randn(8, device='cuda')\ny = x[x > 0]\n")
    r = runner.invoke(app, ["run", "-o", str(tmp_path / "r.json"), "--", "python",
                            str(script)])
    assert r.exit_code == 0, r.output
    notes = " ".join(json.loads((tmp_path / "r.json").read_text())["scenarios"][0]["notes"])
    assert "mask.py:3 (shape) x1" in notes and "--compute runs the same emulation" in notes
    r = runner.invoke(app, ["run", "-q", "--compute", "-o", str(tmp_path / "r.json"), "--",
                            "python", str(script)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--", "python", "does_not_exist.py"], "does_not_exist.py: no such file"),
    (["run"], "give the command after --"),
    (["run", "--", "ls", "-l"], "give a Python command"),
    (["run", "--steps", "0", "--", "python", "x.py"], "--steps must be at least 1"),
    (["run", "--gpus", "2", "--", "torchrun", "--nproc_per_node=4", "x.py"],
     "torchrun starts 4 processes on the node, which has 2 GPU(s) (--gpus): ranks 2 to 3 "
     "would find no GPU of their own; pass --gpus 4, or --nproc-per-node 2"),
])
def test_cli_bad_input_is_one_line(args: list[str], message: str) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.stderr
    assert "dpprof: running" not in r.stderr  # the error alone, no announcement before it


def test_parse_command_forms() -> None:
    assert parse_command(["python", "-u", "train.py", "--lr", "1"], 4).argv == ["--lr", "1"]
    m = parse_command(["python", "-m", "pkg.train", "--x"], 4)
    assert m.is_module and m.target == "pkg.train" and m.argv == ["--x"]
    t = parse_command(["torchrun", "--nproc_per_node=2", "--nnodes", "1", "t.py", "-b", "8"],
                      4)
    assert t.target == "t.py" and t.argv == ["-b", "8"] and t.nproc == 2
    assert t.env["WORLD_SIZE"] == "2" and t.env["LOCAL_RANK"] == "0"
    launch = parse_command(["python", "-m", "torch.distributed.launch", "--nproc-per-node",
                            "4", "t.py"], 4)
    assert launch.argv[0] == "--local-rank=0" and launch.nproc == 4
    assert parse_command(["train.py"], 4).target == "train.py"


def test_virtual_cuda_is_gone_after_a_run() -> None:
    run(["python", str(SCRIPTS / "single_gpu.py")], steps=1)
    assert not torch.zeros(1).is_cuda and torch.zeros(1).device.type == "cpu"
    assert torch.nn.DataParallel.__module__ == "torch.nn.parallel.data_parallel"


def test_a_script_accumulating_under_no_sync(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """DDP's no_sync() in a script (gradient accumulation): the flag a script may read is
    cleared inside and restored after, and the step runs."""
    script = tmp_path / "accumulate.py"
    script.write_text(
        "import os, torch, torch.distributed as dist, torch.nn as nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('nccl')\n"
        "rank = int(os.environ['LOCAL_RANK']); torch.cuda.set_device(rank)\n"
        "model = DDP(nn.Linear(64, 64).cuda(rank), device_ids=[rank])\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(2):\n"
        "    opt.zero_grad()\n"
        "    with model.no_sync():\n"
        "        inside = model.require_backward_grad_sync\n"
        "        (model(torch.randn(8, 64, device='cuda')).sum() / 2).backward()\n"
        "    (model(torch.randn(8, 64, device='cuda')).sum() / 2).backward()\n"
        "    opt.step()\n"
        "print('sync', inside, model.require_backward_grad_sync)\n")
    result = run(["torchrun", "--nproc-per-node", "2", str(script)])
    assert result.scenarios[0].status == "ok", result.scenarios[0].message
    assert "sync False True" in capsys.readouterr().out


GAN_G = [(128, 16), (128,), (64, 128), (64,)]  # gan_data_parallel.py's networks
GAN_D = [(256, 64), (256,), (1, 256), (1,)]


def test_data_parallel_called_in_forward_becomes_one_ddp_per_network() -> None:
    """dcgan's ``nn.parallel.data_parallel(self.main, ...)`` in forward: the DDP alternative
    wraps each network once (one reducer, one bucket each at this size), though the
    discriminator runs three times a step."""
    result = run(["python", str(SCRIPTS / "gan_data_parallel.py")])
    assert [s.name for s in result.scenarios] == ["dp-loss-primary", "ddp"]
    dp = devs(result, "dp-loss-primary")
    assert dp[0].breakdown_bytes["parameters"] == params_bytes(*GAN_G, *GAN_D)
    assert dp[0].breakdown_bytes["optimizer_state"] == 2 * params_bytes(*GAN_G, *GAN_D)
    ddp = devs(result, "ddp")
    assert result.scenario("ddp").batch == 4 * 8  # type: ignore[union-attr] (4 ranks of 8)
    # one bucket per network, rebuilt after the first iteration; over NCCL the first
    # iteration's live on in their all-reduce's works at the peak (a transient)
    buckets = r512(4 * numel(*GAN_G)) + r512(4 * numel(*GAN_D))
    assert ddp[0].breakdown_bytes["communication"] == 2 * buckets
    assert ddp[0].transient_bytes == {"ddp_unreaped_buckets": buckets}
    fixes = {f.name: f for f in result.fixes}
    assert fixes["ddp"].saves_bytes == dp[0].peak_allocated_bytes - ddp[0].peak_allocated_bytes
    # at this size the first buckets, counted at the peak (the worst case), outweigh what
    # DDP saves; once the watchdog has reaped them (the steady state) DDP peaks lower
    steady = ddp[0].steady_peak_allocated_bytes
    assert steady == ddp[0].peak_allocated_bytes - buckets < dp[0].peak_allocated_bytes
    assert "nn.parallel.data_parallel(...) runs on every call" in fixes["ddp"].code


def test_cli_torchrun_gets_one_gpu_per_process(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 8`` without --gpus: the node's 8 GPUs, rank 0 of 8 on its
    own (it was refused against the default 4, or ran on 4). With --gpus below it: refused
    in one line, status 2."""
    out = tmp_path / "r.json"
    script = str(SCRIPTS / "ddp_torchrun.py")
    r = runner.invoke(app, ["run", "-q", "-o", str(out), "--", "torchrun",
                            "--nproc-per-node", "8", script])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["gpus"] == 8
    assert [d["rank"] for d in data["scenarios"][0]["devices"]] == list(range(8))
    r = runner.invoke(app, ["run", "--gpus", "2", "--", "torchrun", "--nproc-per-node", "4",
                            script])
    assert r.exit_code == 2
    assert "starts 4 processes on the node, which has 2 GPU(s) (--gpus)" in r.stderr


def test_the_batch_is_the_models_rows_not_the_flattened_losss(tmp_path: Path) -> None:
    """A language model's loss module on its logits flattened to batch x seq rows (8 x 16)
    is not a forward pass of the model: the batch is the model's 8 rows, and the passes
    counted are the model's."""
    script = tmp_path / "lm.py"
    script.write_text(
        "import torch\nimport torch.nn as nn\n"
        "model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 50)).cuda()\n"
        "criterion = nn.CrossEntropyLoss()\n"
        "for _ in range(2):\n"
        "    x = torch.randint(0, 50, (8, 16), device='cuda')\n"
        "    logits = model(x)\n"
        "    criterion(logits.view(-1, 50), x.view(-1)).backward()\n")
    result, main = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 4),
                                            gpus=4, steps=3), False)
    assert result.batch == 8 and result.scenarios[0].batch == 8
    assert (main.forwards, main.backwards) == (2, 2)


BUILT_THREE_WAYS = """
import sys
import torch
import torch.nn as nn

how = sys.argv[1]
torch.cuda.set_device(0)  # as a launcher's rank sets its GPU first
def net():
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))
if how == "on the gpu":
    model = net().cuda()
elif how == "on meta, then to_empty":  # torchtitan's and Lightning's empty_init
    with torch.device("meta"):
        model = net()
    assert all(p.is_meta and p.device.type == "meta" for p in model.parameters())
    assert torch.cuda.memory_allocated() == 0
    model.to_empty(device="cuda")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
else:  # the default device
    torch.set_default_device("cuda")
    model = net()
opt = torch.optim.Adam(model.parameters())
for _ in range(3):
    model(torch.randn(64, 512, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_model_built_on_meta_or_on_the_default_device_is_the_model_built_on_the_gpu(
        tmp_path: Path) -> None:
    """On a GPU the three ways of building a model hold the same bytes: built on meta it
    holds none until ``to_empty``, and under ``set_default_device("cuda")`` it is built
    there. Before, torch's ``DeviceContext`` gave no device to the emulation's wrapped
    constructors (the meta model was built on the host; the default device's on the host,
    so nothing was measured), and a meta tensor made after ``set_device`` was counted on
    that GPU."""
    script = tmp_path / "built.py"
    script.write_text(BUILT_THREE_WAYS)
    peaks = {}
    for how in ("on the gpu", "on meta, then to_empty", "the default device"):
        (s,) = run(["python", str(script), how], gpus=1, alternatives=False).scenarios
        assert s.status == "ok", (how, s.message)
        peaks[how] = (s.devices[0].peak_allocated_bytes, s.devices[0].breakdown_bytes)
    assert len(set(map(str, peaks.values()))) == 1, peaks
    assert peaks["on the gpu"][1]["parameters"] == r512(4 * 512 * 1024) + r512(4 * 1024) \
        + r512(4 * 1024 * 10) + r512(4 * 10)


def test_a_script_s_default_device_and_dtype_do_not_outlive_its_run(tmp_path: Path) -> None:
    """A script that sets torch's default device and dtype leaves them set in dpprof's
    process: the next run (an alternative, another rank) and dpprof's own tensors start from
    torch's defaults again, as a new process does (before, every later factory in the
    process went to "cuda" and failed outside the emulation)."""
    import torch

    script = tmp_path / "defaults.py"
    script.write_text("import torch\n"
                      "torch.set_default_device('cuda')\n"
                      "torch.set_default_dtype(torch.float64)\n"
                      "model = torch.nn.Linear(8, 8)\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "for _ in range(3):\n"
                      "    model(torch.randn(4, 8)).sum().backward()\n"
                      "    opt.step()\n")
    (s,) = run(["python", str(script)], gpus=1, alternatives=False).scenarios
    assert s.status == "ok", s.message
    assert s.devices[0].breakdown_bytes["parameters"] == r512(8 * 8 * 8) + r512(8 * 8)
    assert torch.get_default_device() == torch.device("cpu")
    assert torch.get_default_dtype() == torch.float32
    assert torch.empty(1).device.type == "cpu"
