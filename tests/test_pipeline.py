"""One pipeline for every backend (issue 10): spec -> backend -> comparison -> answers -> reports.

Each test here is the regression test of one defect of issue 10 and failed before its fix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import fake_cuda
import pytest
from fake_cuda import CpuOps
from typer.testing import CliRunner

from dpprof.answers.attribution import cause_label
from dpprof.backends.cuda_host import DeviceOps
from dpprof.cli.app import app
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.reports import html, markdown, terminal
from dpprof.result import STATUS_ERROR, RunResult
from dpprof.scenarios.names import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY, SINGLE
from dpprof.scenarios.step import StepConfig

MiB = 2**20
DP_AND_SINGLE = (DP_LOSS_PRIMARY, DP_LOSS_FORWARD, SINGLE)


class FakeCudaAllocator(CpuOps):
    """The cuda backend's device layer on CPU tensors, with scripted allocator peaks: the
    CUDA caching allocator's statistics are what a machine without GPUs cannot give.

    Device 0 (DataParallel's output device) reports ``primary_bytes`` as its peak in every
    phase, every other device ``other_bytes``; reserved is 2 MiB above allocated.
    """

    def __init__(self, devices: Sequence[int], primary_bytes: int, other_bytes: int) -> None:
        super().__init__(devices)
        self.primary_bytes = primary_bytes
        self.other_bytes = other_bytes

    def max_allocated(self, logical: int) -> int | None:
        return self.other_bytes if logical else self.primary_bytes

    def max_reserved(self, logical: int) -> int | None:
        return (self.max_allocated(logical) or 0) + 2 * MiB


@pytest.fixture
def fake_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    def make(devices: Sequence[int]) -> DeviceOps:
        return FakeCudaAllocator(devices, primary_bytes=300 * MiB, other_bytes=100 * MiB)

    fake_cuda.install(monkeypatch, gpus=3, ops=make, children=False)


def test_real_gpus_get_attribution_fixes_and_ci_checks(fake_allocator: None) -> None:
    """Defect 1: the cuda backend's result goes through the same answers as every other."""
    cfg = CompareConfig(
        workload="mlp", gpus=3, scenarios=DP_AND_SINGLE, backend="cuda",
        fail_on_imbalance=1.5, step=StepConfig(batch=6, warmup=0, steps=1),
    )
    run = run_compare(cfg)
    assert run is not None
    primary = run.scenario(DP_LOSS_PRIMARY)
    assert primary is not None and primary.devices[0].peak_allocated_bytes == 300 * MiB
    att = run.attribution[DP_LOSS_PRIMARY]
    assert att.excess_bytes == 200 * MiB == run.comparison.scenarios[
        DP_LOSS_PRIMARY].primary_excess_bytes
    assert sum(att.causes_bytes.values()) == att.excess_bytes
    assert att.answer
    # the fixes, as code, with what the emulator predicts they save on this workload
    assert {f.name for f in run.fixes} >= {"loss-in-forward", "ddp"}
    assert all(f.code and f.saves_bytes is not None for f in run.fixes)
    # max/mean = 300 / ((300 + 100 + 100) / 3) = 1.8 > 1.5
    assert [r.split(":")[0] for r in run.fail_reasons] == [DP_LOSS_PRIMARY, DP_LOSS_FORWARD]


def test_cli_fails_a_ci_job_on_real_gpus(fake_allocator: None, tmp_path: Path) -> None:
    """Defect 1: --fail-on-imbalance exits 3 on the cuda backend (it exited 0)."""
    out = tmp_path / "run.json"
    res = CliRunner().invoke(app, [
        "compare", "--workload", "mlp", "--batch", "6", "--gpus", "3",
        "--warmup", "0", "--steps", "1", "--scenarios", ",".join(DP_AND_SINGLE),
        "--fail-on-imbalance", "1.5", "--no-fixes", "-q", "-o", str(out),
    ])
    assert res.exit_code == 3, res.output
    assert "exceeds --fail-on-imbalance 1.5" in res.output
    saved = json.loads(out.read_text())
    assert saved["attribution"][DP_LOSS_PRIMARY]["excess_bytes"] == 200 * MiB


def test_cpu_backend_ranks_run_the_same_warmup_and_autocast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect 2: --warmup and --amp reach the gloo ddp ranks as the emulated scenarios get
    them (the ranks ran 1 warm-up step without autocast)."""
    from dpprof.backends import cpu

    specs = []
    real_launch = cpu.launch

    def launch(spec, world_size):  # type: ignore[no-untyped-def]
        specs.append(spec)
        return real_launch(spec, world_size)

    monkeypatch.setattr(cpu, "launch", launch)
    losses = {}
    for amp in (None, "bfloat16"):
        run = run_compare(CompareConfig(
            workload="mlp", gpus=2, backend="cpu", scenarios=(DDP,), fixes=False,
            step=StepConfig(batch=4, warmup=0, amp=amp),
        ))
        assert run is not None
        (ddp,) = run.scenarios
        assert ddp.status == "ok", ddp.message
        losses[amp] = ddp.loss
    assert [s.step.warmup for s in specs] == [0, 0]
    assert [s.step.amp for s in specs] == [None, "bfloat16"]
    # autocast really ran: bfloat16 matmuls give another loss than float32
    assert losses[None] != losses["bfloat16"]


def _formats(run: RunResult) -> dict[str, str]:
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(terminal.render(run))
    return {"terminal": console.export_text(), "markdown": markdown.render(run),
            "html": html.render(run)}


def test_every_format_names_the_same_causes() -> None:
    """Defect 3: one attribution and one set of labels (markdown and HTML said "loss and its
    gradient" where the terminal said "loss, its temporaries and its gradient")."""
    run = run_compare(CompareConfig(workload="mlp", fixes=False, step=StepConfig(batch=8)))
    assert run is not None
    att = run.attribution[DP_LOSS_PRIMARY]
    labels = [cause_label(k) for k, v in att.causes_bytes.items() if v]
    assert "loss, its temporaries and its gradient" in labels
    for fmt, text in _formats(run).items():
        text = text.replace("&#x27;", "'").replace("&#39;", "'")
        for label in labels:
            assert label in text, (fmt, label)
        assert "loss and its gradient" not in text, fmt


def test_one_model_of_reserved_memory_and_context() -> None:
    """Defect 4: meta and --compute count the same reserved memory + context (512 MiB
    against 468 MiB: the second model ignored the compute capability and cuDNN)."""
    totals = {}
    for compute in (False, True):
        run = run_compare(CompareConfig(
            workload="mlp", count_reserved=True, compute=compute,
            compute_capability=(9, 0), scenarios=(DP_LOSS_PRIMARY, SINGLE),
            fixes=False, step=StepConfig(batch=8),
        ))
        assert run is not None
        totals[compute] = [(d.peak_reserved_bytes, d.context_bytes, d.total_peak_bytes)
                           for s in run.scenarios for d in s.devices if d.used]
    assert totals[False] == totals[True]
    hopper = run_compare(CompareConfig(
        workload="mlp", count_reserved=True, compute=True,
        compute_capability=(9, 0), scenarios=(SINGLE,), fixes=False,
        step=StepConfig(batch=8),
    ))
    ampere = run_compare(CompareConfig(
        workload="mlp", count_reserved=True, compute=True,
        compute_capability=(8, 0), scenarios=(SINGLE,), fixes=False,
        step=StepConfig(batch=8),
    ))
    assert hopper is not None and ampere is not None
    # Hopper's cuBLAS workspaces are larger (32 MiB against 4 MiB + cuBLASLt's)
    assert (hopper.scenarios[0].devices[0].total_peak_bytes
            > ampere.scenarios[0].devices[0].total_peak_bytes)


def test_a_fix_that_saves_nothing_is_not_recommended() -> None:
    """Defect 5: convnet's loss is tiny: computing it inside forward saves (next to) nothing
    and DDP is heavier than DataParallel; neither may be recommended, in any format."""
    run = run_compare(CompareConfig(workload="convnet", step=StepConfig(batch=64)))
    assert run is not None
    by_name = {f.name: f for f in run.fixes}
    heaviest = max(d.peak_allocated_bytes for d in run.scenarios[0].devices if d.used)
    assert 0 <= (by_name["loss-in-forward"].heaviest_saves_bytes or 0) < 0.01 * heaviest
    assert (by_name["ddp"].heaviest_saves_bytes or 0) < 0
    page = html.render(run)
    assert "Recommended: Compute the loss inside forward" not in page
    assert "Recommended: DistributedDataParallel" not in page
    assert "Saves -" not in page
    md = markdown.render(run)
    # Markdown's recommendation is its bold title under "What to change" (every change
    # measured is listed under its bold name too, in the collapsed "Each change, measured")
    assert "**Recommended: Compute the loss inside forward" not in md
    assert "**Recommended: DistributedDataParallel" not in md
    assert "it makes the heaviest GPU worse" in md  # DDP's paragraph
    # cuda:0's excess (9.31 MiB) is under 1 % of the 79.2 GiB GPU: the policy asks for
    # nothing, and says why (a smaller share of the batch on cuda:0 was recommended)
    assert "Recommended: nothing to change" in page
    assert "**Recommended: nothing to change**" in md
    assert "above it by less than the policy's 1% of the GPU" in md


def test_a_run_that_measured_nothing_is_not_called_fine() -> None:
    """Defect 5: every scenario errored: no "Nothing to change"."""
    from torch import nn

    import dpprof

    def broken(x):  # type: ignore[no-untyped-def]
        raise ValueError("shape mismatch in the user's loss")

    wl = dpprof.Workload(
        name="broken", model=lambda: nn.Linear(4, 2),
        batch=lambda rows, device: (__import__("torch").randn(rows, 4),
                                     __import__("torch").randn(rows, 2)),
        loss=lambda out, tgt: broken(out),
    )
    run = run_compare(CompareConfig(workload="broken", fixes=True, step=StepConfig(batch=8)), workload=wl)
    assert run is not None and {s.status for s in run.scenarios} == {STATUS_ERROR}
    for fmt, text in _formats(run).items():
        assert "Nothing to change" not in text and "Nothing: cuda:0" not in text, fmt


def test_amp_reaches_the_cuda_backends_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """One config: --amp reached the emulated and cpu scenarios but not the cuda backend's."""
    fake_cuda.install(monkeypatch, gpus=2, children=False)
    losses = {}
    for amp in (None, "bfloat16"):
        run = run_compare(CompareConfig(
            workload="mlp", gpus=2, scenarios=(DP_LOSS_PRIMARY, SINGLE),
            backend="cuda", fixes=False,
            step=StepConfig(batch=4, warmup=0, steps=1, amp=amp),
        ))
        assert run is not None and {s.status for s in run.scenarios} == {"ok"}
        losses[amp] = [s.loss for s in run.scenarios]
    assert all(a != b for a, b in zip(losses[None], losses["bfloat16"], strict=True))
