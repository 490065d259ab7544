"""The cuda backend's code without a GPU: OOM parsing and handling, the NVML view (FakeNvml,
matched by UUID), device choice, DDP outcome merging, and DataParallel's loss combine."""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import os
import weakref
from pathlib import Path
from typing import Any

import fake_cuda
import pytest
import torch
import torch.distributed as dist
from fake_cuda import CpuOps
from fake_nvml import FakeDevice, FakeNvml
from torch import nn

import dpprof
from dpprof.backends.cuda import run_local_scenario
from dpprof.backends.cuda_ddp import ddp_scenario, measure_ddp_rank, torchrun_info
from dpprof.backends.cuda_measure import CudaRunConfig, Measured
from dpprof.backends.cuda_oom import find_oom, is_oom
from dpprof.backends.cuda_run import select_devices
from dpprof.errors import UsageError
from dpprof.pipeline import CompareConfig, resolve_backend, run_compare
from dpprof.result import DeviceResult, RunResult
from dpprof.scenarios.step import DdpOptions, StepConfig

DATA = Path(__file__).parent / "data"
GiB = 2**30
UA = "GPU-11111111-2222-3333-4444-555555555555"
UB = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def _tiny(oom_rows: int | None = None, model_cb=None) -> dpprof.Workload:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)
            if model_cb:
                model_cb(self)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if oom_rows is not None and x.shape[0] > oom_rows and self.training:
                raise torch.cuda.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
                    "capacity of 23.65 GiB of which 3.06 MiB is free.")
            return self.lin(x)

    return dpprof.Workload(
        name="tiny", model=Tiny,
        batch=lambda rows, device: (torch.randn(rows, 8), torch.randint(0, 4, (rows,))),
        loss=nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )


def _cfg(devices: tuple[int, ...] = (0, 1), batch: int = 8,
         ddp: DdpOptions | None = None) -> CudaRunConfig:
    return CudaRunConfig(devices=list(devices), nvml_interval_s=0.001, step=StepConfig(
        batch=batch, warmup=1, steps=2, ddp=ddp or DdpOptions()))


# ---- OOM ----------------------------------------------------------------------------------


def test_find_oom_reads_the_device_and_size_of_the_current_and_old_formats() -> None:
    new = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 3 has a total capacity of "
           "79.15 GiB of which 1.02 GiB is free.")
    found = find_oom("Caught OutOfMemoryError in replica 3 on device 3.\nOriginal Traceback"
                     " (most recent call last):\n  ...\ntorch.OutOfMemoryError: " + new)
    assert found is not None and (found.cuda_index, found.requested_bytes) == (3, int(2.5 * GiB))
    old = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 10.76 GiB total capacity; "
           "9.70 GiB already allocated; 3.81 MiB free; 10.76 GiB reserved in total by PyTorch)")
    found = find_oom(old)
    assert found is not None and (found.cuda_index, found.requested_bytes) == (1, 20 * 2**20)
    assert find_oom("something else") is None


def test_is_oom() -> None:
    assert is_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("CUDA out of memory"))


class _WatchRelease(CpuOps):
    """CpuOps that records, when memory is released, whether the model is already gone."""

    def __init__(self, devices: list[int], ref: list[weakref.ref]) -> None:
        super().__init__(devices)
        self.ref = ref
        self.model_dead_at_release: list[bool] = []

    def release(self) -> None:
        super().release()
        self.model_dead_at_release.append(bool(self.ref) and self.ref[0]() is None)


def test_oom_is_a_result_and_the_tensors_are_gone_before_release() -> None:
    refs: list[weakref.ref] = []
    wl = _tiny(oom_rows=4, model_cb=lambda m: refs.append(weakref.ref(m)))
    ops = _WatchRelease([0, 1], refs)
    r = run_local_scenario("dp-loss-primary", wl, _cfg(), ops=ops)
    assert r.status == "oom"
    assert r.oom_bytes == 20 * 2**20 and r.oom_device == 0 and r.oom_phase == "forward"
    assert "out of memory on cuda:0 asking for 20.0 MiB during forward" in r.message
    assert ops.model_dead_at_release == [True]  # frames dropped, then gc + empty_cache
    # the next scenario runs: single's 4 rows fit
    s = run_local_scenario("single", wl, _cfg(), ops=CpuOps([0, 1]))
    assert s.status == "ok" and len(s.step_times_s) == 2 and s.loss is not None


def test_an_error_keeps_its_traceback() -> None:
    wl = _tiny()
    wl.loss = lambda out, tgt: (_ for _ in ()).throw(KeyError("no such label"))
    r = run_local_scenario("single", wl, _cfg(), ops=CpuOps([0, 1]))
    assert r.status == "error" and "KeyError" in r.message
    assert r.traceback and "Traceback" in r.traceback


def test_compare_runs_the_remaining_scenarios_after_an_oom(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda.install(monkeypatch, gpus=2, children=False)
    cfg = CompareConfig(
        workload="tiny", gpus=2, scenarios=("dp-loss-primary", "dp-loss-forward", "single"),
        step=StepConfig(batch=8, warmup=1, steps=2),
    )
    run = run_compare(cfg, workload=_tiny(oom_rows=4))  # auto: the host's 2 GPUs
    assert run is not None and run.backend == "cuda"
    assert [s.status for s in run.scenarios] == ["oom", "oom", "ok"]
    assert run.scenarios[2].step_time_s is not None
    # single trains its ceil(8 / 2) = 4 rows a step, not the comparison's batch of 8
    assert run.scenarios[2].devices[0].batch_rows == 4
    assert run.scenarios[2].throughput_samples_per_s == pytest.approx(
        4 / run.scenarios[2].step_time_s)
    assert "nvml" in run.environment and "gpus" in run.environment  # the dpprof env block
    assert RunResult.from_dict(run.to_dict()).scenarios[0].oom_phase == "forward"


def test_each_measured_step_has_its_prediction_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On real GPUs each scenario's measured step carries the step the model predicts for
    it: the same scenario emulated for the GPU measured (here --gpu), exactly what the
    emulated backend predicts; the reports show the two side by side."""
    from dpprof.reports import markdown, terminal
    from dpprof.reports.sentences import step_time

    fake_cuda.install(monkeypatch, gpus=2, children=False)
    names = ("dp-loss-primary", "dp-loss-forward", "single")

    def compared(backend: str) -> RunResult:
        run = run_compare(CompareConfig(
            workload="tiny", gpus=2, scenarios=names, backend=backend, gpu="h100-80gb",
            step=StepConfig(batch=8, warmup=1, steps=2)), workload=_tiny())
        assert run is not None and run.backend == backend
        return run

    measured, emulated = compared("cuda"), compared("emulated")
    for m, e in zip(measured.scenarios, emulated.scenarios, strict=True):
        assert m.status == "ok" and m.step_time_s is not None
        assert m.predicted_step_time_s is not None
        assert m.predicted_step_time_s == pytest.approx(e.predicted_step_time_s, rel=1e-12)
        used = [d for d in m.devices if d.used]
        assert used and all(set(d.predicted_busy_s) == {"compute", "communication",
                                                        "overlap", "waiting"} for d in used)
    text = terminal.TerminalRenderer().render_view(terminal.build_view(measured))
    table = text[text.index("step time (* predicted without a GPU)"):]
    assert "measured" in table.splitlines()[2]  # the header: predicted, then measured
    md = markdown.render(measured)
    section = md[md.index("### Step time, predicted"):].splitlines()
    single = measured.scenario("single")
    assert single is not None and single.step_time_s is not None
    row = next(line for line in section if line.startswith("| single |"))
    cells = [c.strip() for c in row.split("|")]
    # its predicted step, then (after samples/s and the speed-up) its measured one
    assert cells[2] == step_time(single.predicted_step_time_s)
    assert cells[5] == step_time(single.step_time_s) != "-"


def test_a_gpu_outside_the_catalog_gets_no_prediction_and_a_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda.install(monkeypatch, gpus=2, children=False)  # its GPUs have no name
    run = run_compare(CompareConfig(workload="tiny", gpus=2, scenarios=("single",),
                                    step=StepConfig(batch=8, warmup=1, steps=2)),
                      workload=_tiny())
    assert run is not None and run.scenarios[0].step_time_s is not None
    assert run.scenarios[0].predicted_step_time_s is None
    assert any("not in dpprof's catalog" in n for n in run.notes)


# ---- DataParallel's loss in forward ----------------------------------------------------------


def test_model_with_loss_outputs_combine_to_the_full_batch_loss_over_uneven_shards() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    mwl = dpprof.ModelWithLoss(model, nn.functional.cross_entropy)
    x, y = torch.randn(10, 8), torch.randint(0, 4, (10,))
    # DataParallel scatters with chunk (10 over 4: 3, 3, 3, 1) and Gather concatenates each
    # output along dim 0 (torch/nn/parallel/_functions.py Gather -> comm.gather)
    outs = [mwl(xs, ys) for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True)]
    gathered = tuple(torch.cat([o[k] for o in outs]) for k in range(2))
    assert gathered[0].shape == (4,) and gathered[1].tolist() == [3.0, 3.0, 3.0, 1.0]
    full = nn.functional.cross_entropy(model(x), y)
    assert dpprof.ModelWithLoss.combine(gathered).item() == pytest.approx(full.item(), rel=1e-6)
    # and through the real nn.DataParallel (on CPU it calls the module directly)
    dp = nn.DataParallel(mwl)
    assert dpprof.ModelWithLoss.combine(dp(x, y)).item() == pytest.approx(full.item(), rel=1e-6)


# ---- NVML, matched by UUID -------------------------------------------------------------------


def test_nvml_view_is_matched_by_uuid_not_position() -> None:
    # NVML lists B first; the CUDA runtime says cuda:0 is A and cuda:1 is B
    nvml = FakeNvml([
        FakeDevice(uuid=UB, used=7 * GiB, util=[90]),
        FakeDevice(uuid=UA, used=lambda n: 1 * GiB if n <= 1 else 5 * GiB, util=[40, 60]),
        # (reading 0 is taken by the UUID matching: device_info reads memory)
    ])
    r = run_local_scenario("single", _tiny(), _cfg(), ops=CpuOps([0, 1]), nvml=nvml,
                           cuda_uuids=[UA, UB])
    assert r.status == "ok", r.message
    d = r.devices[0]
    assert d.uuid == UA and d.nvml_index == 1
    assert d.nvml_peak_used_bytes == 5 * GiB and d.nvml_baseline_used_bytes == 1 * GiB
    assert d.gpu_utilization_max_percent == 60 and d.gpu_utilization_mean_percent >= 40
    assert len(d.timeline) >= 2 and {p.phase for p in d.timeline} & {"inputs", "forward",
                                                                    "zero_grad", ""}
    assert d.nvml_unexplained_bytes is None  # no allocator numbers on CPU: not invented
    assert nvml.calls("memory", 0) > 0  # B sampled too: a stray context would show there
    assert r.stray_contexts == ()


def test_a_context_outside_the_chosen_gpus_is_flagged() -> None:
    me = os.getpid()
    nvml = FakeNvml([FakeDevice(uuid=UA, processes=[(me, 500 * 2**20)]),
                     FakeDevice(uuid=UB, processes=[(me, 900 * 2**20)])])
    # --devices 1: only cuda:1 (B) is the run's; this process also sits on cuda:0 (A)
    r = run_local_scenario("single", _tiny(), _cfg(devices=(1,)), ops=CpuOps([1]), nvml=nvml,
                           cuda_uuids=[UA, UB])
    assert r.stray_contexts == (
        {"rank": None, "pid": me, "cuda_index": 0, "used_bytes": 500 * 2**20},)
    assert r.devices[0].uuid == UB and r.devices[0].process_used_bytes == {str(me): 900 * 2**20}


def test_nvml_unavailable_degrades_to_a_reason() -> None:
    nvml = FakeNvml.unavailable("NVML Shared Library Not Found")
    r = run_local_scenario("single", _tiny(), _cfg(), ops=CpuOps([0]), nvml=nvml,
                           cuda_uuids=[UA])
    assert r.status == "ok"
    assert r.devices[0].nvml_peak_used_bytes is None
    assert r.devices[0].nvml_reason == "NVML not available: NVML Shared Library Not Found"


@pytest.fixture
def one_rank_group(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=dt.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_ddp_rank_flags_its_context_on_another_gpu(one_rank_group: None) -> None:
    me = os.getpid()
    nvml = FakeNvml([
        FakeDevice(uuid=UA, used=2 * GiB, processes=[(me, 1 * GiB), (4242, 3 * GiB)]),
        FakeDevice(uuid=UB, used=1 * GiB, processes=[(me, 300 * 2**20)]),  # forgot set_device
    ])
    out = measure_ddp_rank(_tiny(), _cfg(devices=(0,)), rank=0, world=1, local_device=0,
                           ops=CpuOps([0]), nvml=nvml, cuda_uuids=[UA, UB])
    assert out.status == "ok", out.message
    assert out.stray_contexts == [
        {"rank": 0, "pid": me, "cuda_index": 1, "used_bytes": 300 * 2**20}]
    assert "set_device" in out.notes[0]
    assert out.devices[0].process_used_bytes == {str(me): 1 * GiB}


def test_ddp_rank_takes_the_reducer_options(one_rank_group: None) -> None:
    # a parameter forward never uses: DDP's defaults fail on the next step's forward,
    # find_unused_parameters=True (DdpOptions, shared with the cpu backend) runs it
    wl = _tiny(model_cb=lambda m: setattr(m, "unused", nn.Linear(8, 4)))
    nvml = FakeNvml([FakeDevice(uuid=UA, used=1 * GiB)])
    kw: dict[str, Any] = dict(rank=0, world=1, local_device=0, ops=CpuOps([0]), nvml=nvml,
                              cuda_uuids=[UA])
    bad = measure_ddp_rank(wl, _cfg(devices=(0,)), **kw)
    assert bad.status == "error" and "reduction" in bad.message
    good = measure_ddp_rank(
        wl, _cfg(devices=(0,), ddp=DdpOptions(find_unused_parameters=True)), **kw)
    assert good.status == "ok", good.message


# ---- choosing devices, backends, torchrun ---------------------------------------------------


def test_select_devices() -> None:
    assert select_devices(None, None, 4) == [0, 1, 2, 3]
    assert select_devices(2, None, 4) == [0, 1]
    assert select_devices(None, (2, 3), 4) == [2, 3]
    for gpus, devices in ((5, None), (None, (1, 4)), (None, (1, 1)), (3, (0, 1))):
        with pytest.raises(UsageError):
            select_devices(gpus, devices, 4)


def test_backend_cuda_without_a_gpu_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    host = fake_cuda.install(monkeypatch, gpus=0, children=False)
    with pytest.raises(UsageError, match="no CUDA GPU visible"):
        resolve_backend("cuda")
    assert resolve_backend("auto") == "emulated"
    host.gpus = 1  # DataParallel needs two
    assert (resolve_backend("auto"), resolve_backend("cuda")) == ("emulated", "cuda")
    host.gpus = 2
    assert resolve_backend("auto") == "cuda"


def test_torchrun_info() -> None:
    assert torchrun_info({}) is None
    info = torchrun_info({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "GROUP_RANK": "1"})
    assert info is not None and (info.rank, info.world_size, info.local_rank, info.node_rank) == (
        9, 16, 1, 1)


def test_ddp_scenario_reports_the_first_failure_and_the_slowest_rank() -> None:
    cfg = _cfg(batch=9)
    ok = [Measured(rank=r, devices=[DeviceResult(index=r, rank=r)], step_times_s=[1.0 + r, 2.0],
                   loss=1.0) for r in range(2)]
    s = ddp_scenario(ok, cfg, 2)
    assert s.status == "ok" and s.step_time_s == 2.0 and s.step_times_s == (2.0, 2.0)
    assert any("ceil(9 / 2) = 5" in n for n in s.notes)
    failed = [
        Measured(rank=0, status="error", message="Connection closed by peer"),
        Measured(rank=1, status="oom", message="out of memory", oom_device=1, oom_bytes=5,
                 first_failure=True, traceback="Traceback ..."),
    ]
    s = ddp_scenario(failed, cfg, 2)
    assert s.status == "oom" and s.oom_device == 1 and s.message.startswith("rank 1")
    assert s.traceback == "Traceback ..." and "rank 0: Connection closed" in s.notes[0]
    gc.collect()


# ---- the command line ------------------------------------------------------------------------


def test_cli_backend_cuda_without_gpus_is_one_line_and_exit_2() -> None:
    from typer.testing import CliRunner

    from dpprof.cli.app import app

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = CliRunner().invoke(app, ["compare", "--backend", "cuda", "-b", "8"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU visible" in lines[0] and "Traceback" not in r.output


def test_cli_bad_devices_and_steps_are_usage_errors() -> None:
    from typer.testing import CliRunner

    from dpprof.cli.app import app

    for args in (["--devices", "a,b"], ["--steps", "0"], ["--nvml-interval", "0"]):
        r = CliRunner().invoke(app, ["compare", "-w", "mlp", "-b", "8", *args])
        assert r.exit_code == 2, (args, r.output)


def test_cli_env_table_and_markdown() -> None:
    from typer.testing import CliRunner

    from dpprof.cli.app import app

    r = CliRunner().invoke(app, ["env"])
    assert r.exit_code == 0, r.output
    assert "PyTorch" in r.stdout and "NVML" in r.stdout and "CUDA_VISIBLE_DEVICES" in r.stdout
    r = CliRunner().invoke(app, ["env", "--markdown"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("### Environment") and "- **PyTorch**:" in r.stdout


def test_the_cli_ddp_options_reach_the_cuda_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """--bucket-cap-mb, --find-unused-parameters, ... --dtype and --amp travel to every rank."""
    from dpprof import pipeline
    from dpprof.backends import cuda_run
    from dpprof.pipeline import CompareConfig, run_compare
    from dpprof.scenarios.step import DdpOptions

    seen: list[CompareConfig] = []

    def fake_compare(run, cfg, wl, visible, progress):  # type: ignore[no-untyped-def]
        seen.append(cfg)
        return run

    monkeypatch.setattr(pipeline, "cuda_compare", fake_compare)
    fake_cuda.install(monkeypatch, gpus=2, children=False)
    ddp = DdpOptions(bucket_cap_mb=5, gradient_as_bucket_view=True,
                     find_unused_parameters=True, broadcast_buffers=False)
    run_compare(CompareConfig(
        workload="mlp", gpus=2, backend="cuda", fixes=False, scenarios=("ddp",),
        step=StepConfig(batch=4, ddp=ddp, dtype="bfloat16", amp="float16"),
    ))
    (cfg,) = seen
    ccfg = cuda_run.run_config(cfg, [0, 1])
    job = cuda_run.ddp_job(ccfg, cfg)
    # the step's options as they are, with the cuda backend's warm-up and steps filled in
    assert job.cfg.step == dataclasses.replace(cfg.step, warmup=3, steps=10)
    assert job.cfg.step.ddp == ddp and job.cfg.step.dtype == "bfloat16"
    assert job.cfg.step.amp == "float16"
