"""The step time predicted without a GPU (dpprof.emulator.step_time): checked on what an H200
measured (tests/data/h200_measured.json) for workloads the model's constants were not fitted
to, and on what the scenarios must show (DataParallel's cuda:0 the busiest GPU, DDP's
all-reduce overlapped with the backward)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.backends.emulated_time import single_step_log
from dpprof.emulator.catalog import GPUS
from dpprof.emulator.op_log import ALL_REDUCE, CONV, MATMUL, NO_KERNEL, TRANSFER
from dpprof.emulator.step_time import H200_FIT, predict_step, rates_for
from dpprof.result import RunResult, ScenarioResult
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload, load_workload

TESTS = Path(__file__).resolve().parent
H200 = TESTS / "data" / "h200_measured.json"
# the workloads scripts/fit_step_time.py holds out of the fit
HELD_OUT = ("attention", "classifier", "zoo:timm_vit")


def _workload(spec: str) -> Workload:
    if spec.startswith("zoo:"):
        sys.path.insert(0, str(TESTS))
        from torchvision_shim import import_torchvision

        import_torchvision()  # its C ops do not load over the CPU torch
        pytest.importorskip("timm")

        return load_workload(f"{TESTS / 'zoo.py'}:{spec[4:]}")
    return load_workload(spec)


def _h200_runs(workloads: tuple[str, ...]) -> list[dict[str, Any]]:
    runs = json.loads(H200.read_text())["parts"]["kernels"]["result"]["runs"]
    return [r for r in runs if r["workload"] in workloads and "error" not in r]


@pytest.mark.slow
def test_h200_held_out_steps_within_15_percent() -> None:
    """The step of workloads held out of the fit, predicted on the H200's datasheet peaks,
    against the step the H200 measured (CUDA events, median of 10): mean |error| 7.5 %
    when written, each within 15 %."""
    rates = rates_for(GPUS["h200"])
    errors = []
    for r in _h200_runs(HELD_OUT):
        log = single_step_log(_workload(r["workload"]), r["batch"], r["amp"])
        predicted = predict_step(log.records, rates, H200_FIT, [0]).step_time_s
        errors.append((r["workload"], r["batch"], r["amp"],
                       predicted / (r["step_ms_median"] / 1e3) - 1))
    assert len(errors) == 8
    assert sum(abs(e[-1]) for e in errors) / len(errors) <= 0.10, errors
    assert all(abs(e[-1]) <= 0.15 for e in errors), errors


def test_op_log_counts_torchs_flops_and_the_bytes_moved() -> None:
    """mlp's forward matmuls carry the FLOPs torch's FlopCounterMode counts for them, and
    every op is filed: kernels, views without one."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    wl = load_workload("mlp")
    log = single_step_log(wl, 64)
    forward = [o for o in log.records if o.phase == "forward" and o.kind == MATMUL]
    model = wl.model()
    x, _ = wl.batch(64, torch.device("cpu"))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x)
    assert sum(o.flops for o in forward) == counter.get_total_flops() > 0
    assert any(o.kind == NO_KERNEL for o in log.records)
    assert all(o.bytes > 0 for o in log.records if o.kind == MATMUL)
    # the batch moved to the GPU: host to device
    assert any(o.kind == TRANSFER and o.source == -1 for o in log.records)


def test_convolutions_are_their_own_kind() -> None:
    log = single_step_log(load_workload("convnet"), 32)
    assert {o.name for o in log.records if o.kind == CONV} >= {"convolution",
                                                                "convolution_backward"}


def test_op_log_records_the_matmuls_shapes_torch_runs() -> None:
    """Each matmul's (M, N, K) in the op log is the product torch itself runs for the same
    step on the CPU (its mm/addmm calls, seen by a dispatch mode), batch rows included."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[int, int, int]] = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func._overloadpacket.__name__ in ("mm", "addmm"):
                a, b = args[-2], args[-1]
                seen.append((a.shape[0], b.shape[1], a.shape[1]))
            return func(*args, **(kwargs or {}))

    wl = load_workload("mlp")
    model = wl.model()
    x, y = wl.batch(32, torch.device("cpu"))
    with Shapes():
        wl.loss(model(x), y).backward()
    log = single_step_log(wl, 32)
    logged = [o.gemm for o in log.records if o.kind == MATMUL]
    assert sorted(logged) == sorted(seen)
    assert (32, 8192, 2048) in logged  # the first Linear's forward: the batch's 32 rows
    assert any(g[2] == 32 for g in logged)  # a weight's gradient sums over the 32 rows


def test_a_convolution_is_logged_as_the_gemm_it_lowers_to() -> None:
    """convnet's second convolution (32 -> 64 channels, 3 x 3, 26 x 26 -> 24 x 24) at batch
    8: M = 8 x 24 x 24 output pixels, N = 64 output channels, K = 32 x 3 x 3; its backward
    the same product."""
    log = single_step_log(load_workload("convnet"), 8)
    convs = {(o.name, o.gemm) for o in log.records if o.kind == CONV}
    assert ("convolution", (8 * 24 * 24, 64, 32 * 9)) in convs
    assert ("convolution_backward", (8 * 24 * 24, 64, 32 * 9)) in convs
    assert ("convolution", (8 * 26 * 26, 32, 1 * 9)) in convs  # the first, one channel in


def _cpu_check() -> Any:
    import importlib.util

    path = TESTS.parent / "benchmarks" / "step_time_cpu.py"
    spec = importlib.util.spec_from_file_location("step_time_cpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_checks_matmul_shapes_are_solved_from_its_micro_benchmarks() -> None:
    """The CPU check's peak and shape terms come from the matmuls it measured
    (benchmarks/step_time_cpu.json): they explain those measured times better than the peak
    alone (the square matmul's rate, by FLOPs), and a short side costs rate."""
    import dataclasses

    from dpprof.emulator.step_time import matmul_shape_efficiency

    bench = _cpu_check()
    recorded = json.loads((TESTS.parent / "benchmarks" / "step_time_cpu.json").read_text())
    shapes = recorded["peaks"]["matmul_shapes_mnk_s"]
    rates, k = bench.cpu_model(recorded["peaks"], recorded["gloo_bus_bytes_per_s"])
    peak = rates.matmul_peak("float32")
    flat = dataclasses.replace(k, matmul_outer_dim_rows=0.0, matmul_inner_dim_rows=0.0)

    def error(constants: Any) -> float:  # mean |error| over the measured shapes
        return sum(abs(2 * m * n * kk / (peak * matmul_shape_efficiency((m, n, kk), constants))
                       / seconds - 1) for m, n, kk, seconds in shapes) / len(shapes)

    assert len(shapes) >= 4
    assert k.matmul_outer_dim_rows > 0 and k.matmul_inner_dim_rows > 0
    assert error(k) < error(flat) / 2, (error(k), error(flat))
    assert matmul_shape_efficiency((32, 8192, 2048), k) < matmul_shape_efficiency(
        (1024, 1024, 1024), k)


@pytest.mark.slow
def test_the_cpu_check_recorded_steps_within_15_percent() -> None:
    """The CPU check (benchmarks/step_time_cpu.py) as recorded: its micro-benchmarks' model
    predicts each workload's measured ``single`` step within 25 %, within 15 % on the mean;
    without the matmuls' shape terms it misses that (by FLOPs alone)."""
    import dataclasses

    bench = _cpu_check()
    recorded = json.loads((TESTS.parent / "benchmarks" / "step_time_cpu.json").read_text())
    rates, k = bench.cpu_model(recorded["peaks"], recorded["gloo_bus_bytes_per_s"])
    flat = dataclasses.replace(k, matmul_outer_dim_rows=0.0, matmul_inner_dim_rows=0.0)
    rows = [r for r in recorded["rows"] if r["scenario"] == "single"]
    assert len(rows) == 5
    errors, flat_errors = [], []
    for r in rows:
        measured = r["measured_best_s"]
        for constants, out in ((k, errors), (flat, flat_errors)):
            predicted = bench.predicted(r["workload"], r["batch"], "single", 1, rates,
                                        constants)
            out.append(predicted / measured - 1)
    assert sum(abs(e) for e in errors) / len(errors) <= 0.15, errors
    assert all(abs(e) <= 0.25 for e in errors), errors
    assert sum(abs(e) for e in flat_errors) / len(flat_errors) > 0.15, flat_errors


def _scenarios(workload: str, batch: int, names: tuple[str, ...],
               gpus: int = 4) -> dict[str, ScenarioResult]:
    wl = load_workload(workload)
    cfg = EmulationConfig(gpus=gpus, gpu_memory_bytes=140 << 30, step=StepConfig(batch=batch),
                          gpu="h200")
    return {n: run_scenario(n, wl, cfg) for n in names}


def test_dataparallel_cuda0_is_the_busiest_gpu_and_waits_least() -> None:
    runs = _scenarios("lm", 32, ("single", "dp-loss-primary", "ddp"))
    dp = runs["dp-loss-primary"]
    busy = {d.index: d.predicted_busy_s for d in dp.devices}
    assert set(busy) == {0, 1, 2, 3}
    zero = busy[0]["compute"] + busy[0]["communication"] - busy[0]["overlap"]
    for i in (1, 2, 3):
        assert zero > busy[i]["compute"] + busy[i]["communication"] - busy[i]["overlap"]
        assert busy[i]["waiting"] > busy[0]["waiting"]
    for d in dp.devices:  # busy (its streams' union) and waiting add up to the step
        assert busy_and_waiting_s(d.predicted_busy_s) == pytest.approx(dp.predicted_step_time_s)
    # every GPU computes a quarter of the batch as single does, but DataParallel adds
    # the gather, the loss on cuda:0 and the reductions: slower than single, and DDP faster
    single, ddp = runs["single"], runs["ddp"]
    assert single.predicted_step_time_s is not None and dp.predicted_step_time_s is not None
    assert ddp.predicted_step_time_s is not None
    assert dp.predicted_step_time_s > ddp.predicted_step_time_s > single.predicted_step_time_s
    assert dp.predicted_samples_per_s is not None
    assert dp.predicted_samples_per_s == pytest.approx(32 / dp.predicted_step_time_s)


def test_ddp_all_reduce_overlaps_the_backward() -> None:
    """DDP's bucket all-reduces are logged as the buckets fill, and run beside the
    backward: they add less than half their own time to the step (run after the backward,
    they would add all of it)."""
    wl = load_workload("lm")
    cfg = EmulationConfig(gpus=4, gpu_memory_bytes=140 << 30, step=StepConfig(batch=128),
                          gpu="h200", interconnect="pcie")
    trace: dict[str, Any] = {}
    r = run_scenario("ddp", wl, cfg, trace=trace)
    records = trace["rt"].op_log.records
    reduces = [o for o in records if o.kind == ALL_REDUCE]
    params = sum(p.numel() * p.element_size() for p in trace["params"])
    assert len(reduces) > 1 and sum(o.bytes for o in reduces) == params
    rates = rates_for(GPUS["h200"], "pcie")
    pred = predict_step(records, rates, H200_FIT, [0])
    alone = predict_step([o for o in records if o.kind != ALL_REDUCE], rates, H200_FIT, [0])
    comm = pred.devices[0].communication_s
    assert comm > 0.001
    assert alone.step_time_s <= pred.step_time_s < alone.step_time_s + comm / 2
    assert r.predicted_step_time_s == pytest.approx(pred.step_time_s)


def test_pcie_is_slower_than_nvlink_for_dataparallel() -> None:
    wl = load_workload("lm")
    times = {}
    for link in ("nvlink", "pcie"):
        cfg = EmulationConfig(gpus=4, gpu_memory_bytes=140 << 30,
                              step=StepConfig(batch=32), gpu="h200", interconnect=link)
        times[link] = run_scenario("dp-loss-primary", wl, cfg).predicted_step_time_s
    assert times["pcie"] > times["nvlink"]


def test_the_predicted_fields_survive_json() -> None:
    runs = _scenarios("mlp", 64, ("dp-loss-primary",))
    from dpprof.result import new_result

    run = new_result("emulated", "mlp", batch=64, gpus=4, gpu_memory_bytes=80 << 30, config={})
    run = dataclasses.replace(run, scenarios=tuple(runs.values()))
    back = RunResult.from_dict(json.loads(run.to_json()))
    s = back.scenarios[0]
    assert s.predicted_step_time_s == runs["dp-loss-primary"].predicted_step_time_s
    assert s.devices[0].predicted_busy_s == runs["dp-loss-primary"].devices[0].predicted_busy_s


@pytest.fixture(scope="module")
def compared() -> RunResult:
    """``dpprof compare``'s pipeline on mlp, emulated on 4 H200s, the fixes included."""
    from dpprof.pipeline import CompareConfig, run_compare

    return run_compare(CompareConfig(workload="mlp", step=StepConfig(batch=256),
                                     backend="emulated", gpu="h200"))


def test_the_speed_up_is_beside_the_verdict_in_every_format(compared: RunResult) -> None:
    from dpprof.reports import html, markdown, terminal

    one = compared.scenario("single")
    ddp = compared.scenario("ddp")
    assert one is not None and ddp is not None
    assert one.predicted_samples_per_s and ddp.predicted_samples_per_s
    ratio = ddp.predicted_samples_per_s / one.predicted_samples_per_s
    sentence = f"DDP {ratio:.1f}x one GPU"
    text = terminal.TerminalRenderer().render_view(terminal.build_view(compared))
    assert "Predicted speed on 4 GPUs (h200)" in text and sentence in text
    assert "predicted without a GPU" in text  # the table says what it is
    md = markdown.render(compared)
    assert "### Step time, predicted" in md and sentence in md
    page = html.render(compared)
    assert "Step time, predicted" in page and sentence in page
    assert "waiting" in page  # the busy/waiting bars' legend


def test_the_answer_costs_each_change_its_predicted_step_time(compared: RunResult) -> None:
    from dpprof.answers.answer import answer_of

    answer = answer_of(compared)
    base = compared.scenario(answer.baseline or "")
    by_fix = {f.fix: f for f in answer.fixes}
    ddp = compared.scenario("ddp")
    assert base is not None and ddp is not None
    assert base.predicted_step_time_s is not None and ddp.predicted_step_time_s is not None
    assert by_fix["ddp"].step_time_cost_s == pytest.approx(
        ddp.predicted_step_time_s - base.predicted_step_time_s)
    assert "predicted" in by_fix["ddp"].cost


SCRIPTS = TESTS / "scripts"


def test_dpprof_run_predicts_each_runs_step(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``dpprof run`` on an unmodified DataParallel script: the run as written and each
    alternative carry the predicted step, samples per second and each GPU's split in the
    JSON; cuda:0 is the busiest GPU as written; the terminal shows the predicted table."""
    from typer.testing import CliRunner

    from dpprof.cli.app import app

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["run", "--gpu", "h200", "-o", "r.json", "--", "python",
                                   str(SCRIPTS / "dp_loss_outside.py"), "--batch-size", "256"])
    assert res.exit_code == 0, res.output
    run = RunResult.from_dict(json.loads((tmp_path / "r.json").read_text()))
    names = [s.name for s in run.scenarios]
    assert names == ["dp-loss-primary", "dp-loss-forward", "ddp"]
    for s in run.scenarios:
        assert s.predicted_step_time_s and s.predicted_step_time_s > 0, s.name
        assert s.predicted_samples_per_s == pytest.approx(256 / s.predicted_step_time_s)
        for d in s.devices:
            assert set(d.predicted_busy_s) == {"compute", "communication", "overlap",
                                               "waiting"}
            assert busy_and_waiting_s(d.predicted_busy_s) == pytest.approx(
                s.predicted_step_time_s)
    dp = run.scenarios[0]
    busy = [busy_and_waiting_s(d.predicted_busy_s) - d.predicted_busy_s["waiting"]
            for d in dp.devices]
    assert len(busy) == 4 and all(busy[0] > b for b in busy[1:]), busy
    assert all(d.predicted_busy_s["communication"] > 0 for d in dp.devices)  # the NCCL calls
    assert "step time (* predicted without a GPU)" in res.output
    ms = f"{dp.predicted_step_time_s * 1e3:.1f} ms"
    assert any(line.split()[:1] == ["dp-loss-primary"] and ms in line
               for line in res.output.splitlines()), res.output


def test_dpprof_run_predicts_the_measured_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The steps after the warm-up, averaged: 3 and 5 steps predict the same step; with
    one step (no warm-up) the step also holds the model's setup (its copy to the GPU, the
    optimizer's first state), so it is longer."""
    from dpprof.script.session import ScriptConfig, parse_command, run_command

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cmd = ["python", str(SCRIPTS / "dp_loss_outside.py"), "--batch-size", "128"]
    step = {}
    for steps in (1, 3, 5):
        result, _ = run_command(ScriptConfig(launch=parse_command(cmd, 4), gpus=4,
                                             steps=steps), alternatives=False)
        s = result.scenarios[0]
        assert s.name == "dp-loss-primary" and s.predicted_step_time_s is not None
        step[steps] = s.predicted_step_time_s
    assert step[5] == pytest.approx(step[3], rel=1e-6)
    assert step[1] > step[3] * 1.05, step


def test_dpprof_runs_ladder_rungs_are_costed_by_their_predicted_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rung of ``dpprof run``'s ladder (a fix, not a scenario) carries its run's predicted
    step, and the answer costs it by what it adds to the script's step, not the policy's
    words alone."""
    from dpprof.answers.answer import answer_of
    from dpprof.emulator.catalog import lookup_gpu
    from dpprof.script.session import ScriptConfig, parse_command, run_command

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cmd = ["python", str(SCRIPTS / "single_gpu.py")]
    result, _ = run_command(ScriptConfig(launch=parse_command(cmd, 4), gpus=4, ladder=True,
                                         gpu=lookup_gpu("h200")))
    base = result.scenarios[0]
    rungs = [f for f in result.fixes if f.name.startswith("ladder-")]
    assert base.name == "single" and base.predicted_step_time_s and rungs
    assert all(f.predicted_step_time_s and f.predicted_step_time_s > 0 for f in rungs)
    by_fix = {f.fix: f for f in answer_of(result).fixes}
    for f in rungs:
        assert f.predicted_step_time_s is not None
        added = f.predicted_step_time_s - base.predicted_step_time_s
        assert by_fix[f.name].step_time_cost_s == pytest.approx(added)
        assert f"predicted {added * 1e3:+.1f} ms a step" in by_fix[f.name].cost


@functools.cache
def _fsdp2_rank(d_model: int, reshard: bool) -> tuple[ScenarioResult, list[Any], int]:
    """One rank of 4 of lm (``d_model`` wide) under FSDP2, as the ladder's rung runs it:
    its result, its op log, the model's parameter bytes, each parameter padded to a
    multiple of 4 rows as FSDP2 shards it."""
    from dpprof.emulator.fsdp import emulated_ranks
    from dpprof.measure.rung_models import fully_sharded
    from dpprof.scenarios.workloads import LMConfig, lm

    base = lm(LMConfig(vocab=2048, seq=64, d_model=d_model, layers=2, heads=4))
    params = sum(-(-p.shape[0] // 4) * 4 * (p.numel() // p.shape[0]) * p.element_size()
                 for p in base.model().parameters())
    cfg = EmulationConfig(gpus=4, gpu_memory_bytes=140 << 30, step=StepConfig(batch=32),
                          gpu="h200", collectives=True)
    trace: dict[str, Any] = {}
    with emulated_ranks(4):
        s = run_scenario("single", fully_sharded(base, reshard), cfg, trace=trace)
    assert s.status == "ok", s.message
    return s, trace["rt"].op_log.records, params


def test_fsdp2_collectives_are_costed_on_the_interconnect() -> None:
    """FSDP2's all-gathers and reduce-scatters (no-ops on the fake process group) are
    logged with their unsharded buffers: ZeRO-2 gathers the parameters once (forward),
    ZeRO-3 twice (forward and backward), both reduce-scatter the gradients once; the
    predicted communication grows with the parameters, and ZeRO-3's is more."""
    comm: dict[tuple[int, bool], float] = {}
    for d_model in (128, 256):
        for reshard in (False, True):
            s, records, params = _fsdp2_rank(d_model, reshard)
            gathered = sum(o.bytes for o in records if o.kind == "all_gather")
            scattered = sum(o.bytes for o in records if o.kind == "reduce_scatter")
            assert gathered == (2 if reshard else 1) * params
            assert scattered == params
            assert all(o.world == 4 for o in records if o.kind in ("all_gather",
                                                                  "reduce_scatter"))
            comm[d_model, reshard] = s.devices[0].predicted_busy_s["communication"]
    assert comm[128, False] > 0
    for reshard in (False, True):
        assert comm[256, reshard] > comm[128, reshard]
    for d_model in (128, 256):
        assert comm[d_model, True] > comm[d_model, False]


def test_fsdp2_all_gathers_overlap_the_compute() -> None:
    """An all-gather runs on its own stream as soon as it is issued (the next block's
    prefetched while this one computes): ZeRO-3's step is shorter than its compute and
    its collectives one after the other."""
    _, records, _ = _fsdp2_rank(256, True)
    rates = rates_for(GPUS["h200"], "pcie")
    pred = predict_step(records, rates, H200_FIT, [0])
    without = predict_step([o for o in records if o.kind not in (
        "all_gather", "reduce_scatter", "gather_wait")], rates, H200_FIT, [0])
    comm = pred.devices[0].communication_s
    assert comm > 0
    assert without.step_time_s < pred.step_time_s < without.step_time_s + comm
    # The GPU is busy while either stream runs: never longer than the step. On a T4 over
    # PCIe the step is the GPU's (not the host's), and its kernels and collectives added
    # up (107 % of the step before) count twice the time the two streams ran at once.
    t4 = predict_step(records, rates_for(GPUS["t4"], "pcie"), H200_FIT, [0])
    d = t4.devices[0]
    assert d.compute_s + d.communication_s > t4.step_time_s
    assert 0 < d.overlap_s <= min(d.compute_s, d.communication_s)
    assert d.busy_s <= t4.step_time_s
    assert d.busy_s + d.waiting_s == pytest.approx(t4.step_time_s)


def busy_and_waiting_s(split: dict[str, float]) -> float:
    """A GPU's predicted busy time (its streams' union) and waiting time, together."""
    return split["compute"] + split["communication"] - split["overlap"] + split["waiting"]


def test_variants_of_a_scenario_are_costed_by_their_predicted_step(
        compared: RunResult) -> None:
    """The fixes measured as further steps of dp-loss-primary's loop (the output device,
    the balanced split) carry their step's predicted time, the one each variant emulated
    on its own predicts, and the answer costs them by it."""
    import dataclasses

    from dpprof.answers.answer import answer_of

    fixes = {f.name: f for f in compared.fixes}
    base = compared.scenario("dp-loss-primary")
    assert base is not None and base.predicted_step_time_s is not None
    by_fix = {f.fix: f for f in answer_of(compared).fixes}
    cfg = EmulationConfig(gpus=4, gpu_memory_bytes=140 << 30, step=StepConfig(batch=256),
                          gpu="h200")
    for name, variant in (("output-device", {"dp_output_device": 3}),
                          ("balanced-split", {"dp_chunk_sizes": tuple(
                              fixes["balanced-split"].chunk_sizes)})):
        fix = fixes[name]
        alone = run_scenario("dp-loss-primary", load_workload("mlp"),
                             dataclasses.replace(cfg, **variant))  # type: ignore[arg-type]
        assert fix.predicted_step_time_s is not None, name
        assert fix.predicted_step_time_s == pytest.approx(alone.predicted_step_time_s)
        assert by_fix[name].step_time_cost_s == pytest.approx(
            fix.predicted_step_time_s - base.predicted_step_time_s)
        assert "predicted" in by_fix[name].cost


SCRIPTS = TESTS / "scripts"
# a GPT of 2 blocks of 1024 wide over a 32k vocabulary (about 80M parameters): its DDP
# all-reduce takes longer than its backward over PCIe, not over NVLink
_WIDE_LM = ["--n-embd", "1024", "--n-layer", "2", "--vocab-size", "32768"]


def _run_json(tmp_path: Path, *options: str) -> dict[str, Any]:
    from typer.testing import CliRunner

    from dpprof.cli.app import app

    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
    # in a folder of its own: the seal's check walks the working folder, where other tests
    # running beside this one write (hypothesis's .hypothesis/)
    with contextlib.chdir(tmp_path):
        r = CliRunner().invoke(app, ["run", "-q", "--steps", "2", *options, "-o", str(out),
                                     "--", "python", str(SCRIPTS / "dp_causal_lm.py"),
                                     *_WIDE_LM])
    assert r.exit_code == 0, r.output
    return dict(json.loads(out.read_text()))


def _measured(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each scenario's figures but the predicted ones (and the notes, which carry the
    run's wall time)."""
    return [{**{k: v for k, v in s.items() if not k.startswith("predicted") and k != "notes"},
             "devices": [{k: v for k, v in d.items() if k != "predicted_busy_s"}
                         for d in s["devices"]]} for s in run["scenarios"]]


@pytest.mark.slow
def test_run_interconnect_changes_the_ddp_alternatives_predicted_step(tmp_path: Path) -> None:
    """``dpprof run --interconnect`` reaches the emulation of every run of the script: over
    PCIe the DDP alternative's bucket all-reduces outlast the backward and its predicted
    step grows; nothing measured changes (memory, each device's figures) but what NCCL
    holds beside the context on a DDP rank's GPU and on DataParallel's (fewer channels over
    PCIe, no NVLS); one GPU holds no communicator."""
    runs = {link: _run_json(tmp_path, "--gpu", "h100-80gb", "--interconnect", link)
            for link in ("nvlink", "pcie")}
    ddp = {link: next(s for s in run["scenarios"] if s["name"] == "ddp")
           for link, run in runs.items()}
    assert ddp["pcie"]["predicted_step_time_s"] > 1.5 * ddp["nvlink"]["predicted_step_time_s"]
    measured = {link: _measured(run) for link, run in runs.items()}
    context = {link: [[(d.pop("context_bytes"), d.pop("context_breakdown_bytes"))[0]
                       for d in s["devices"]] for s in m] for link, m in measured.items()}
    assert measured["nvlink"] == measured["pcie"]
    names = [s["name"] for s in runs["nvlink"]["scenarios"]]
    for name, nvlink, pcie in zip(names, context["nvlink"], context["pcie"], strict=True):
        if name == "single":
            assert nvlink == pcie, name
        else:
            assert all(p < n for p, n in zip(pcie, nvlink, strict=True) if n), name
    assert runs["pcie"]["config"]["interconnect"] == "pcie"


def test_run_interconnect_is_compares_option() -> None:
    """The same option, in the same help panel, refused the same way (exit 2, one line)."""
    import typer
    from typer.testing import CliRunner

    from dpprof.cli.app import app

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    options = {c: next(p for p in commands[c].params if p.name == "interconnect")
               for c in ("compare", "run")}
    assert options["run"].help == options["compare"].help
    assert options["run"].rich_help_panel == options["compare"].rich_help_panel == "GPUs"
    r = CliRunner().invoke(app, ["run", "--gpu", "rtx-4090", "--interconnect", "nvlink", "--",
                                 "python", str(SCRIPTS / "dp_loss_outside.py")])
    assert r.exit_code == 2, r.output
    assert "--interconnect nvlink: the NVIDIA GeForce RTX 4090 has no NVLink" in r.output
    assert "Traceback" not in r.output


class _ConvsAndRepeats(torch.nn.Module):
    """Two convolutions of one input and weight shape but other strides, and one linear
    layer run twice on the same shapes: calls the op log's FLOP cache must tell apart, and
    calls it may share."""

    def __init__(self) -> None:
        super().__init__()
        self.fine = torch.nn.Conv2d(3, 8, 3, stride=1, padding=1)
        self.coarse = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.fine(x).mean((2, 3))
        b = self.coarse(x).mean((2, 3))
        return self.head(self.head(a)) + b


def test_the_op_logs_flops_are_torchs_call_by_call() -> None:
    """The op log computes an op's FLOPs once per distinct call (its shapes and arguments)
    and reuses them: the forward's convolutions and matmuls add up to what torch's own
    FlopCounterMode counts running the same forward."""
    from torch.utils.flop_counter import FlopCounterMode

    import dpprof

    wl = dpprof.Workload(
        model=_ConvsAndRepeats,
        batch=lambda rows, device: (torch.randn(rows, 3, 16, 16, device=device),
                                    torch.randn(rows, 8, device=device)),
        loss=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    log = single_step_log(wl, 4)
    logged: dict[str, int] = {}
    for o in log.records:
        if o.phase == "forward" and o.kind in (CONV, MATMUL):
            logged[o.name] = logged.get(o.name, 0) + o.flops
    counter = FlopCounterMode(display=False)
    with counter:
        _ConvsAndRepeats()(torch.randn(4, 3, 16, 16))
    counted = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    assert logged == counted and len(counted) == 2  # convolution, addmm


def test_a_result_saved_before_the_overlap_was_predicted_is_never_busier_than_its_step(
        ) -> None:
    """A result saved without the overlap of its streams (compute 0.41 s and collectives
    0.06 s in a 0.41 s step: Lightning's tensor-parallel example, saved as it was) is shown
    busy 100 %, not 113 %."""
    from dpprof.reports import markdown, terminal
    from dpprof.result import new_result

    (s,) = _scenarios("mlp", 64, ("ddp",), gpus=2).values()
    step = 0.4137
    devices = tuple(dataclasses.replace(d, predicted_busy_s={
        "compute": 0.4125, "communication": 0.0562, "waiting": 0.0}) for d in s.devices)
    s = dataclasses.replace(s, predicted_step_time_s=step, devices=devices)
    run = dataclasses.replace(new_result("emulated", "mlp", batch=64, gpus=2,
                                         gpu_memory_bytes=80 << 30, config={}),
                              scenarios=(s,))
    saved = RunResult.from_dict(json.loads(run.to_json()))
    text = terminal.TerminalRenderer().render_view(terminal.build_view(saved))
    row = next(line for line in text.splitlines() if line.split()[:1] == ["ddp"]
               and "ms" in line)
    assert "100%" in row and "113%" not in row, row
    assert "113" not in markdown.render(saved)
