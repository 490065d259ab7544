"""The one seed rule (dpprof.scenarios.step): every backend's own code path builds the same
initial weights and feeds the same step-k batch for the same --seed, a fresh batch every
step, and none of them disturbs the caller's global RNG.

The workload (tests/seed_workload.py) writes down, from inside its forward, a hash of the
inputs each call got and of the weights at the first call, in whatever process runs it."""

from __future__ import annotations

import json
from pathlib import Path

import fake_cuda
import pytest
import torch
from fake_cuda import CpuOps

from dpprof.backends.cuda import run_local_scenario
from dpprof.backends.cuda_ddp import DdpJob, spawn_ddp
from dpprof.backends.cuda_measure import CudaRunConfig
from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.backends.gloo import RankSpec, launch
from dpprof.measure.equivalence import check
from dpprof.scenarios.step import StepConfig, build_model, scenario_batch, step_batch
from dpprof.scenarios.workloads import load_workload

SPEC = f"{Path(__file__).with_name('seed_workload.py')}:workload"
BATCH, GPUS, SEED = 8, 2, 7  # 4 rows per rank
Record = dict[int | None, list[dict[str, object]]]  # rank -> forward calls, in order


def _recorded(path: Path) -> Record:
    calls: Record = {}
    for f in sorted(path.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            calls.setdefault(rec["rank"], []).append(rec)
    return calls


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Run a backend with the workload recording into a fresh folder; its calls by rank."""
    count = iter(range(1000))

    def run(fn) -> Record:  # type: ignore[no-untyped-def]
        out = tmp_path / str(next(count))
        out.mkdir()
        monkeypatch.setenv("DPPROF_SEED_RECORD", str(out))
        fn()
        return _recorded(out)

    return run


def _emulated(scenario: str, seed: int = SEED) -> None:
    r = run_scenario(scenario, load_workload(SPEC), EmulationConfig(
        gpus=GPUS, gpu_memory_bytes=2**40,
        compute=True,
        step=StepConfig(batch=BATCH, seed=seed, warmup=1),
    ))
    assert r.status == "ok", r.message


def _cuda_cfg(seed: int = SEED) -> CudaRunConfig:
    return CudaRunConfig(devices=[0, 1], step=StepConfig(batch=BATCH, seed=seed, warmup=1, steps=1))


def test_every_backend_builds_the_same_weights_and_feeds_the_same_step_batches(
        record, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake_cuda.install(monkeypatch, gpus=GPUS)  # the cuda backend's code on CPU tensors
    emulated = record(lambda: _emulated("single"))[None]
    cuda_single = record(lambda: run_local_scenario(
        "single", load_workload(SPEC), _cuda_cfg(), ops=CpuOps([0, 1])))[None]
    gloo = record(lambda: launch(RankSpec(workload=SPEC, step=StepConfig(
        batch=BATCH, seed=SEED, warmup=1)), GPUS))
    cuda_ddp = record(lambda: spawn_ddp(DdpJob(workload=SPEC, cfg=_cuda_cfg(),
                                               backend="gloo", device="cpu"), GPUS))
    equiv = record(lambda: check(load_workload(SPEC), BATCH, GPUS, SEED,
                                 scenarios=("ddp",)))[None]

    # single (one GPU's share) is rank 0's rows: the same weights and step-k inputs in the
    # emulator over CPU tensors, the cuda backend's code, and rank 0 of both DDP paths
    rank0 = [[c["inputs"] for c in calls] for calls in
             (emulated, cuda_single, gloo[0], cuda_ddp[0])]
    assert all(len(r) == 2 for r in rank0)  # one warm-up step, one measured
    assert rank0[0] == rank0[1] == rank0[2] == rank0[3]
    assert rank0[0][0] != rank0[0][1]  # a fresh batch every step, as a loader gives
    weights = {calls[0]["params"] for calls in (emulated, cuda_single, gloo[0], gloo[1],
                                                cuda_ddp[0], cuda_ddp[1], equiv)}
    assert len(weights) == 1
    # every rank takes its own rows of the same global batch
    assert [c["inputs"] for c in gloo[1]] == [c["inputs"] for c in cuda_ddp[1]]
    assert gloo[1][0]["inputs"] != gloo[0][0]["inputs"]
    # equivalence's reference (one device, the full batch) gets step 0's global batch,
    # its DDP ranks the ranks' rows of it
    full = step_batch(load_workload(SPEC), SEED, 0, BATCH)[0]
    ranks = [scenario_batch(load_workload(SPEC), SEED, 0, BATCH, GPUS, r)[0]
             for r in range(GPUS)]
    torch.testing.assert_close(torch.cat(ranks), full, rtol=0, atol=0)
    assert equiv[0]["rows"] == BATCH


def test_the_seed_changes_weights_and_batches(record) -> None:  # type: ignore[no-untyped-def]
    a = record(lambda: _emulated("single", seed=1))[None]
    b = record(lambda: _emulated("single", seed=2))[None]
    assert a[0]["params"] != b[0]["params"]
    assert [c["inputs"] for c in a] != [c["inputs"] for c in b]


def test_dropout_draws_the_same_stream_in_the_emulator_and_the_cuda_code() -> None:
    """single over CPU tensors: same weights, batches and dropout masks, so the same loss
    after a warm-up step (the optimizers differ only in foreach, not in the math)."""
    wl = load_workload(SPEC)
    emulated = run_scenario("single", wl, EmulationConfig(
        gpus=GPUS, gpu_memory_bytes=2**40, compute=True,
        step=StepConfig(batch=BATCH, seed=SEED, warmup=1),
    ))
    cuda = run_local_scenario("single", wl, _cuda_cfg(), ops=CpuOps([0, 1]))
    assert emulated.loss is not None and cuda.loss is not None
    assert emulated.loss == pytest.approx(cuda.loss, rel=1e-5)


def test_building_running_and_checking_leave_the_callers_rng_alone() -> None:
    wl = load_workload(SPEC)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    build_model(wl, SEED)
    scenario_batch(wl, SEED, 3, BATCH, GPUS, 1)
    _emulated("single")
    _emulated("dp-loss-primary")
    run_local_scenario("dp-loss-forward", wl, _cuda_cfg(), ops=CpuOps([0, 1]))
    check(wl, BATCH, GPUS, SEED)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_model_is_what_manual_seed_then_model_builds() -> None:
    wl = load_workload(SPEC)
    torch.manual_seed(SEED)
    mine = wl.model()
    for a, b in zip(build_model(wl, SEED).parameters(), mine.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_largest_seed_is_valid_for_every_stream() -> None:
    from dpprof.cli.options import MAX_SEED

    wl = load_workload(SPEC)
    top = scenario_batch(wl, MAX_SEED, 1000, BATCH, GPUS, 1)[0]
    assert not torch.equal(top, scenario_batch(wl, 0, 1000, BATCH, GPUS, 1)[0])
    assert build_model(wl, MAX_SEED) is not None


def test_the_cuda_loop_holds_one_host_batch_at_a_time() -> None:
    """The cuda backend makes each step's batch before the step's clock starts and lets
    the previous one go: a run of many steps holds one host batch, not one per step."""
    import weakref

    from dpprof.backends.cuda_measure import StepBatches

    wl = load_workload(SPEC)
    made: list[weakref.ref[torch.Tensor]] = []

    def make(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = scenario_batch(wl, SEED, k, BATCH, GPUS)
        made.append(weakref.ref(b[0]))
        return b

    batches = StepBatches(make, 5)
    seen = []
    for k in range(len(batches)):
        batches.prepare(k)
        seen.append(batches[k][0].sum().item())
        assert sum(r() is not None for r in made) == 1
    assert len(made) == 5 and len(set(seen)) == 5  # made once each, all different
