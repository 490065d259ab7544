"""The cpu backend: DP on virtual devices over CPU tensors equals one device on the full
batch; the emulator's DP peaks over meta equal those over CPU tensors; the gloo launcher
reports every rank's failure and does not hang."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.backends.gloo import DistributedRunError, RankSpec, launch
from dpprof.scenarios.measured_loop import training_loop
from dpprof.scenarios.step import StepConfig, build_model, scenario_batch, step_stream
from dpprof.scenarios.workloads import load_workload

MODELS = Path(__file__).with_name("fidelity_models.py")
DP_WORKLOADS = ["mlp", f"{MODELS}:tied", f"{MODELS}:structured", f"{MODELS}:buffers"]
BATCH, GPUS = 8, 4  # equal shards of 2


def _reference(spec: str) -> dict[str, torch.Tensor]:
    """One device, the full batch, one step, seeded by the one seed rule."""
    wl = load_workload(spec)
    model = build_model(wl, 0)
    opt = wl.optimizer(list(model.parameters()))
    for g in opt.param_groups:
        g["foreach"] = True
    batch = scenario_batch(wl, 0, 0, BATCH, GPUS)  # step 0: DataParallel's whole batch
    model.train()
    with step_stream(0):
        training_loop(model, wl.loss, opt, [batch], lambda x, _: x, False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("scenario", ["dp-loss-primary", "dp-loss-forward"])
@pytest.mark.parametrize("spec", DP_WORKLOADS)
def test_one_dp_step_equals_one_device_on_the_full_batch(spec: str, scenario: str) -> None:
    trace: dict[str, Any] = {}
    r = run_scenario(scenario, load_workload(spec), EmulationConfig(
        gpus=GPUS, gpu_memory_bytes=2**40,
        compute=True,
        step=StepConfig(batch=BATCH, warmup=0),
    ), trace)
    assert r.status == "ok", r.message
    assert [d.batch_rows for d in r.devices] == [2] * GPUS
    ref = _reference(spec)
    got = dict(trace["model"].named_parameters())
    assert set(got) == set(ref)
    for name, p in ref.items():
        # float tolerance: the replicas sum gradients in another order, and Adam divides by
        # sqrt(v) on its first step, which magnifies that for tiny gradients
        torch.testing.assert_close(got[name].detach(), p, rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("scenario", ["dp-loss-primary", "dp-loss-forward"])
@pytest.mark.parametrize("spec", DP_WORKLOADS)
def test_dp_peaks_over_meta_equal_peaks_over_cpu(spec: str, scenario: str) -> None:
    peaks = []
    for compute in (False, True):
        r = run_scenario(scenario, load_workload(spec), EmulationConfig(
            gpus=GPUS, gpu_memory_bytes=2**40,
            compute=compute,
            step=StepConfig(batch=BATCH),
        ))
        assert r.status == "ok", r.message
        peaks.append([d.peak_requested_bytes for d in r.devices])
    meta, cpu = peaks
    if spec == "mlp":
        # F.mse_loss: the CPU kernel keeps an input-sized buffer behind its 4-byte loss
        # (where the loss is computed: all of cuda:0's batch, or each replica's shard)
        for m, c in zip(meta, cpu, strict=True):
            assert 0 <= c - m <= BATCH * 1024 * 4
    else:
        assert meta == cpu


def test_a_failing_rank_is_reported_with_its_traceback_and_nothing_hangs() -> None:
    spec = RankSpec(workload="no_such_module_xyz:workload", join_timeout_s=120,
                    grace_s=5)
    with pytest.raises(DistributedRunError) as info:
        launch(spec, 2)
    assert set(info.value.failures) == {0, 1}
    assert all("Traceback" in tb and "no_such_module_xyz" in tb
               for tb in info.value.failures.values())


@pytest.mark.slow
@pytest.mark.torchrun
def test_torchrun_ranks_gather_their_results_on_rank_0(tmp_path: Path) -> None:
    import subprocess
    import sys

    from dpprof.backends.gloo import free_port

    script = tmp_path / "ranks.py"
    script.write_text(
        # each line in one write: the ranks run unbuffered into one pipe, and print's
        # pieces (words, separators, newline) of two ranks interleave
        "import os, sys\n"
        "from dpprof.backends.gloo import RankSpec, torchrun_main\n"
        "from dpprof.scenarios.step import StepConfig\n"
        "res = torchrun_main(RankSpec(workload='mlp', step=StepConfig(batch=4)))\n"
        "if res is not None:\n"
        "    got = [(r.rank, r.world_size, r.step_peak_requested_bytes > 0) for r in res]\n"
        "    sys.stdout.write(f'GATHERED {got}\\n')\n"
        "names = [open(f'/proc/self/task/{t}/comm').read().strip()"
        " for t in os.listdir('/proc/self/task')]\n"
        "sys.stdout.write(f\"GLOO THREADS LEFT {sum('gloo' in n for n in names)}\\n\")\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(script)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "GATHERED [(0, 2, True), (1, 2, True)]" in r.stdout
    # the group is freed when the rank leaves it: no gloo thread is left to outlive the
    # interpreter and abort the rank at exit (the SIGABRT after results, see ranks._init)
    assert re.findall(r"GLOO THREADS LEFT (\d+)", r.stdout) == ["0", "0"], r.stdout
