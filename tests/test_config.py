"""Each option declared once and passed down as it is: the step's options live in
:class:`dpprof.scenarios.step.StepConfig` only; CompareConfig holds it, every backend's
config embeds it unchanged, and the command line's defaults are the dataclasses'."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dpprof.backends.cuda_ddp import DdpJob
from dpprof.backends.cuda_measure import CudaRunConfig
from dpprof.backends.cuda_run import ddp_job, run_config
from dpprof.backends.emulated import EmulationConfig
from dpprof.backends.gloo import RankSpec
from dpprof.cli import compare as compare_command
from dpprof.cli import maxbatch as maxbatch_command
from dpprof.cli.app import app
from dpprof.measure.maxbatch_search import MaxBatch
from dpprof.pipeline import DEFAULT_EMULATED_GPUS, CompareConfig, emulation_config
from dpprof.scenarios.step import DdpOptions, StepConfig

runner = CliRunner()
STEP_FIELDS = {f.name for f in dataclasses.fields(StepConfig)}


@pytest.mark.parametrize("config", [CompareConfig, EmulationConfig, CudaRunConfig, RankSpec,
                                    DdpJob])
def test_no_config_redeclares_a_step_option(config: type) -> None:
    own = {f.name for f in dataclasses.fields(config)}
    assert not own & STEP_FIELDS | {"warmup_steps", "rows"} & own, own & STEP_FIELDS


def test_every_backend_gets_the_step_as_it_is() -> None:
    step = StepConfig(batch=24, seed=5, warmup=2, steps=4, dtype="bfloat16", amp="float16",
                      ddp=DdpOptions(bucket_cap_mb=3.0, broadcast_buffers=False))
    cfg = CompareConfig(workload="mlp", step=step, gpus=3)
    for backend in ("emulated", "cpu", "cuda"):
        assert emulation_config(cfg, backend, 3).step == step
    ccfg = run_config(cfg, [0, 1, 2])
    assert ccfg.step == step and ddp_job(ccfg, cfg).cfg.step == step
    # unset warm-up and steps: each backend's own default, filled in once
    default = CompareConfig(workload="mlp")
    assert emulation_config(default, "emulated", 2).step.warmup == 1
    assert emulation_config(default, "cuda", 2).step.warmup == 3  # the predictions for a GPU run
    assert run_config(default, [0]).warmup_steps == 3 and run_config(default, [0]).steps == 10


def test_the_step_travels_to_the_ranks_pickled() -> None:
    step = StepConfig(batch=6, seed=9, warmup=0, amp="bfloat16",
                      ddp=DdpOptions(find_unused_parameters=True))
    for body in (RankSpec(workload="mlp", step=step),
                 DdpJob(workload="mlp", cfg=CudaRunConfig(devices=[0], step=step),
                        backend="gloo", device="cpu")):
        back = pickle.loads(pickle.dumps(body))
        assert (back.step if isinstance(back, RankSpec) else back.cfg.step) == step


def test_compare_without_options_builds_the_default_config(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every default of ``dpprof compare`` is CompareConfig's (and StepConfig's): a default
    written into the command line that drifts from the dataclass fails here."""
    seen: list[CompareConfig] = []

    def fake_run_compare(cfg: CompareConfig, **_: Any) -> None:
        seen.append(cfg)
        return None  # as a torchrun rank other than 0: nothing to write

    monkeypatch.setattr(compare_command, "run_compare", fake_run_compare)
    r = runner.invoke(app, ["compare", "-q", "-o", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    assert seen == [CompareConfig()]


def test_maxbatch_without_options_uses_the_default_step(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def fake(wl: Any, names: Any, gpus: int, memory: int, **kw: Any) -> Any:
        seen.append(dict(kw, gpus=gpus, workload=wl.name, scenarios=names))
        return MaxBatch(capacity_bytes=memory)

    monkeypatch.setattr(maxbatch_command, "run_maxbatch", fake)
    r = runner.invoke(app, ["maxbatch", "-q"])
    assert r.exit_code == 0, r.output
    (kw,) = seen
    default = CompareConfig()
    assert kw["step"] == StepConfig() and kw["gpus"] == DEFAULT_EMULATED_GPUS
    assert kw["workload"] == default.workload and kw["scenarios"] == default.scenarios
    assert kw["multiple_of"] == default.multiple_of
