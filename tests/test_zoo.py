"""Real models from the libraries people train with (``tests/zoo.py``: transformers,
torchvision, timm, built from tiny configs), checked as the built-ins are.

* every model runs all four scenarios under emulation (meta tensors, the default);
* ``single`` against ``torch.profiler`` on the same loop over real CPU tensors (profiling
  from before the model is built): the bytes live when the measured iteration begins are
  equal to the byte, and so is the iteration's peak, except for the CPU-only kernel scratch
  named in ``dpprof.backends.memtrace.CPU_ONLY_ALLOCATIONS`` (oneDNN convolution and batch
  norm scratch), by which the profiler's peak may exceed the emulator's and no more;
* over meta tensors (what users get) the same peak, except where the emulator runs the GPU's
  kernels on purpose (GPT-2's dropout: the fused kernel's 1-byte mask; cuDNN's convolution
  workspace, checked by taking it out).

The profiler's records are not also matched one by one here as they are for the built-ins:
in these larger graphs the autograd engine accumulates some gradients in another order under
a dispatch mode, so an in-order alignment reports frees as unmatched though the peaks agree.

``benchmarks/zoo.py`` prints and records the same per model, with times.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.backends.gloo import RankSpec, run_rank
from dpprof.backends.memtrace import SCALAR_BYTES, Alloc, align, peak_of
from dpprof.emulator import kernels
from dpprof.fixes.kinds.balanced_split import BalancedSplits
from dpprof.measure.fix_savings import alongside
from dpprof.scenarios.names import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY
from dpprof.scenarios.registry import SCENARIOS
from dpprof.scenarios.step import DdpOptions, StepConfig
from dpprof.scenarios.workloads import load_workload

sys.path.insert(0, str(Path(__file__).parent))
from test_fidelity import emulated_step
from test_mirrored_replicas import assert_same, run_both

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "torchvision", "timm")),
    reason="the zoo needs the zoo extra: pip install -e '.[zoo]'")

ZOO = Path(__file__).with_name("zoo.py")
# timm computes its drop-path rates as linspace(0, rate, depth) and reads them in __init__
# (.item() in ViT, .tolist() in ConvNeXt): over meta the emulator answers such reads with the
# real numbers (dpprof.emulator.cuda_devices.NUMERIC_FACTORIES), so every zoo model runs.
RUNS_ON_META = ["gpt2", "llama", "bert", "resnet18", "vit", "timm_convnext", "timm_vit"]
GPU_DROPOUT = {"gpt2"}  # meta runs the GPU's fused dropout (bool mask): lower than the CPU's
ROWS = 2


@pytest.mark.parametrize("name", RUNS_ON_META)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_zoo_model_runs_every_scenario(name: str, scenario: str) -> None:
    r = run_scenario(scenario, load_workload(f"{ZOO}:{name}"),
                     EmulationConfig(
                         gpus=2, gpu_memory_bytes=2**40, step=StepConfig(batch=2 * ROWS),
                     ))
    assert r.status == "ok", r.message
    assert r.devices[0].peak_allocated_bytes > 0



@pytest.mark.parametrize("name", RUNS_ON_META)
@pytest.mark.parametrize("scenario", [DP_LOSS_PRIMARY, DP_LOSS_FORWARD])
def test_every_zoo_model_is_mirrored_byte_for_byte(name: str, scenario: str) -> None:
    """At 4 GPUs cuda:1 runs and cuda:2..3 mirror it (no model falls back to running every
    replica), every device's events as when every replica runs."""
    wl = load_workload(f"{ZOO}:{name}")
    plain, mirrored = run_both(wl, 4 * ROWS, 4, scenario)
    assert mirrored[1]["rt"].mirrors.mirrored_replicas == 2 * 2  # two steps, two mirrors
    assert_same(plain, mirrored)
    assert plain[0].notes == mirrored[0].notes


@pytest.mark.parametrize("name", RUNS_ON_META)
def test_every_zoo_model_mirrors_onto_the_output_device_byte_for_byte(name: str) -> None:
    """DataParallel(output_device=3): cuda:3 mirrors cuda:1 as well (its share of the
    gradient a view, its gathered outputs and loss its own), every device's events as
    when every replica runs."""
    wl = load_workload(f"{ZOO}:{name}")
    plain, mirrored = run_both(wl, 4 * ROWS, 4, dp_output_device=3)
    assert mirrored[1]["rt"].mirrors.mirrored_replicas == 2 * 2
    assert_same(plain, mirrored)


@pytest.mark.parametrize("name", RUNS_ON_META)
def test_every_zoo_model_measures_the_fixes_in_its_own_loop_byte_for_byte(name: str) -> None:
    """dp-loss-primary's further steps (the balanced split's search, then output_device)
    and gradient_as_bucket_view beside ddp: what emulating each on its own gives, or left
    to that (a one-row split a BatchNorm cannot take)."""
    wl = load_workload(f"{ZOO}:{name}")
    base = EmulationConfig(gpus=4, gpu_memory_bytes=2**40, step=StepConfig(batch=8 * ROWS))
    seen = alongside(8 * ROWS, 4)
    assert run_scenario(DP_LOSS_PRIMARY, wl, base, alongside=seen) == run_scenario(
        DP_LOSS_PRIMARY, wl, base)
    run_scenario(DDP, wl, base, alongside=seen)
    alone = {
        "output_device": run_scenario(DP_LOSS_PRIMARY, wl, dataclasses.replace(
            base, dp_output_device=3, peaks_only=True)),
        "bucket_view": run_scenario(DDP, wl, base.with_step(
            ddp=DdpOptions(gradient_as_bucket_view=True))),
    }
    followed = {"output_device": seen.output_device_result,
                "bucket_view": seen.bucket_view_result}
    splits = seen.splits
    assert isinstance(splits, BalancedSplits)
    if name == "resnet18":  # a one-row split BatchNorm cannot take stops the loop there:
        # the split and output_device are left to be emulated alone
        assert not splits.finished and followed.pop("output_device") is None
    for what, s in followed.items():
        assert s is not None, what
        assert [d.peak_allocated_bytes for d in s.devices] == [
            d.peak_allocated_bytes for d in alone[what].devices], what
    if splits.finished and splits.result is not None:
        chunks, s = splits.result
        split_alone = run_scenario(DP_LOSS_PRIMARY, wl, dataclasses.replace(
            base, dp_chunk_sizes=tuple(chunks), peaks_only=True))
        assert [d.peak_allocated_bytes for d in s.devices] == [
            d.peak_allocated_bytes for d in split_alone.devices]


def cpu_only_peak(records: list[Alloc], emulated: list[int]) -> int:
    """The most CPU-only kernel scratch live at once: the records the alignment with the
    emulator's events leaves unmatched and memtrace.cpu_only_reason explains (oneDNN
    convolution and batch-norm scratch...), their frees paired by address."""
    kept = {id(e) for e in align(emulated, records).kept}
    live = peak = 0
    for e in records:
        if id(e) not in kept:
            live += e.size
            peak = max(peak, live)
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS_ON_META)
def test_single_matches_the_profiler(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = f"{ZOO}:{name}"
    measured = run_rank(RankSpec(workload=spec, step=StepConfig(batch=ROWS * 2), wrap="none"),
                        0, 2)
    records = [Alloc(0, s, op, p) for s, op, p in measured.step_events if abs(s) > SCALAR_BYTES]
    start, cpu = emulated_step(spec, "single", ROWS, True)
    assert measured.start_large_requested_bytes == start
    profiler_peak = start + peak_of(records)
    emulated_peak = start + max(0, *_running(cpu))
    scratch = cpu_only_peak(records, cpu)
    assert emulated_peak <= profiler_peak <= emulated_peak + scratch, (
        name, profiler_peak, emulated_peak, scratch)
    if scratch == 0:
        assert profiler_peak == emulated_peak
    meta_start, meta = emulated_step(spec, "single", ROWS, False)
    assert meta_start == start
    with_workspace_peak = meta_start + max(0, *_running(meta))
    # Over meta a convolution also takes cuDNN's workspace (a GPU's, which the CPU's
    # kernels do not have): without it, the same peak as over CPU tensors.
    monkeypatch.setattr(kernels, "conv_workspace_bytes", lambda *args: 0)
    meta_start, meta = emulated_step(spec, "single", ROWS, False)
    meta_peak = meta_start + max(0, *_running(meta))
    assert with_workspace_peak >= meta_peak
    if name in GPU_DROPOUT:
        assert meta_peak < emulated_peak
    else:
        assert meta_peak == emulated_peak


def _running(deltas: list[int]) -> list[int]:
    out, live = [], 0
    for d in deltas:
        live += d
        out.append(live)
    return out
