"""Fit the step-time model's constants (dpprof.emulator.step_time.TimeConstants) to what an
NVIDIA H200 measured (tests/data/h200_measured.json, part "kernels": each workload's
``single`` step time, CUDA events, median of 10, and its kernels' device time), and state the
errors on the runs fitted and on the runs held out.

    python scripts/fit_step_time.py            # fit, print the constants and both errors
    python scripts/fit_step_time.py --check    # the errors of the constants in step_time.py

Fitted: mlp, lm, convnet, zoo:gpt2 (fp32 and bf16 autocast, each batch). Held out:
attention, classifier, zoo:timm_vit. The fit minimises the mean squared log error of the
device time (the kernels' constants), then of the step time (the host's constants, the
kernels' kept), by coordinate search; it never sees the held-out runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "tests" / "data" / "h200_measured.json"
FITTED = ("mlp", "lm", "convnet", "zoo:gpt2")
HELD_OUT = ("attention", "classifier", "zoo:timm_vit")


def measured_runs() -> list[dict[str, Any]]:
    """The H200's runs: workload, batch, amp, step_s, device_s (kernels, without the
    profiler's annotation of the optimizer step, which is no kernel)."""
    runs = json.loads(DATA.read_text())["parts"]["kernels"]["result"]["runs"]
    out = []
    for r in runs:
        if "error" in r:
            continue
        ranges = sum(k["total_us"] for k in r["kernels"] if k["kernel"].startswith("Optimizer."))
        groups: dict[str, float] = {}
        for op in r["ops"]:
            g = group(op["op"].removeprefix("aten::"))
            groups[g] = groups.get(g, 0.0) + op["self_device_us"] / 1e6
        out.append({"workload": r["workload"], "batch": r["batch"], "amp": r["amp"],
                    "step_s": r["step_ms_median"] / 1e3,
                    "device_s": (r["kernel_total_us"] - ranges) / 1e6, "groups_s": groups})
    return out


def group(op: str) -> str:
    """The kind of an aten op, as the fit compares them (the profiler names the CUDA
    kernels' ops: cudnn_convolution for convolution, cudnn_batch_norm for batch_norm)."""
    if "conv" in op:
        return "conv"
    if "batch_norm" in op:
        return "batch_norm"
    if op in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear") or "attention" in op:
        return "matmul"
    return "other"


def load(spec: str) -> Any:
    from dpprof.scenarios.workloads import load_workload

    if spec.startswith("zoo:"):
        sys.path.insert(0, str(HERE.parent / "tests"))
        from torchvision_shim import import_torchvision

        import_torchvision()  # its C ops do not load over the CPU torch

        return load_workload(f"{HERE.parent / 'tests' / 'zoo.py'}:{spec[4:]}")
    return load_workload(spec)


def logs(runs: list[dict[str, Any]]) -> list[Any]:
    from dpprof.backends.emulated_time import single_step_log

    return [single_step_log(load(r["workload"]), r["batch"], r["amp"]).records for r in runs]


def errors(runs: list[dict[str, Any]], records: list[Any], k: Any) -> list[tuple[float, float]]:
    """(step, device) relative errors of each run, predicted over measured minus one."""
    from dpprof.emulator.catalog import GPUS
    from dpprof.emulator.step_time import predict_step, rates_for

    rates = rates_for(GPUS["h200"])
    out = []
    for r, recs in zip(runs, records, strict=True):
        p = predict_step(recs, rates, k, [0])
        out.append((p.step_time_s / r["step_s"] - 1, p.devices[0].compute_s / r["device_s"] - 1))
    return out


def group_errors(runs: list[dict[str, Any]], records: list[Any], k: Any) -> list[float]:
    """Each run's kinds of op (convolutions, batch norms, matmuls, the rest): predicted
    device time over measured minus one, where both have some."""
    from dpprof.emulator.catalog import GPUS
    from dpprof.emulator.step_time import kernel_time_s, rates_for

    rates = rates_for(GPUS["h200"])
    out = []
    for r, recs in zip(runs, records, strict=True):
        predicted: dict[str, float] = {}
        for op in recs:
            g = group(op.name)
            predicted[g] = predicted.get(g, 0.0) + kernel_time_s(op, rates, k)
        out += [predicted[g] / m - 1 for g, m in r["groups_s"].items()
                if m > 0 and predicted.get(g, 0.0) > 0]
    return out


DEVICE = ("matmul_efficiency", "matmul_half_flops", "memory_efficiency", "conv_efficiency",
          "norm_passes", "kernel_gap_s")
HOST = ("host_op_s", "host_view_s", "step_overhead_s")


def loss(runs: list[dict[str, Any]], records: list[Any], k: Any, which: int) -> float:
    """Mean squared log error: of the step times (``which`` 0), or of each run's kinds of
    op's device time (1)."""
    errs = ([e[0] for e in errors(runs, records, k)] if which == 0
            else group_errors(runs, records, k))
    return sum(math.log1p(e) ** 2 for e in errs) / len(errs)


def search(runs: list[dict[str, Any]], records: list[Any], k: Any, names: tuple[str, ...],
           which: int) -> Any:
    """Coordinate search over ``names``, each multiplied by a few factors in turn, keeping
    what lowers :func:`loss` ``which``."""
    best = loss(runs, records, k, which)
    for _ in range(8):
        improved = False
        for name in names:
            for factor in (0.5, 0.8, 0.9, 1.1, 1.25, 2.0):
                value = getattr(k, name) * factor
                if ("efficiency" in name and value > 1) or (name == "norm_passes" and value < 1):
                    continue
                trial = dataclasses.replace(k, **{name: value})
                e = loss(runs, records, trial, which)
                if e < best - 1e-9:
                    best, k, improved = e, trial, True
        if not improved:
            break
    return k


def fit(runs: list[dict[str, Any]], records: list[Any], start: Any) -> Any:
    """The device's constants to the kernels' time first, then the host's to the step's
    (the device's kept): neither error can make up for the other."""
    k = search(runs, records, start, DEVICE, 1)
    return search(runs, records, k, HOST, 0)


def summary(label: str, runs: list[dict[str, Any]], errs: list[tuple[float, float]]) -> None:
    for r, (a, b) in zip(runs, errs, strict=True):
        print(f"  {label} {r['workload']:>14} b{r['batch']:<4} {r['amp'] or 'fp32':>8}: "
              f"step {r['step_s'] * 1e3:8.3f} ms, error {a:+.1%}; device "
              f"{r['device_s'] * 1e3:8.3f} ms, error {b:+.1%}")
    step = sum(abs(a) for a, _ in errs) / len(errs)
    dev = sum(abs(b) for _, b in errs) / len(errs)
    print(f"{label}: mean |error| step {step:.1%}, device {dev:.1%} over {len(errs)} runs")


def main() -> None:
    from dpprof.emulator.step_time import H200_FIT, TimeConstants

    # where the search starts: round guesses (3/4 of the peaks, a 2 us launch, 20 us of host
    # per op), not the constants it fitted before
    start = TimeConstants(matmul_efficiency=0.75, matmul_half_flops=2e8,
                          memory_efficiency=0.7, conv_efficiency=0.3, norm_passes=2.0,
                          kernel_gap_s=2e-6, host_op_s=20e-6, host_view_s=3e-6,
                          step_overhead_s=100e-6)

    runs = measured_runs()
    fitted = [r for r in runs if r["workload"] in FITTED]
    held = [r for r in runs if r["workload"] in HELD_OUT]
    rec_fit, rec_held = logs(fitted), logs(held)
    k = fit(fitted, rec_fit, start) if "--check" not in sys.argv else H200_FIT
    print(k)
    summary("fitted", fitted, errors(fitted, rec_fit, k))
    summary("held out", held, errors(held, rec_held, k))


if __name__ == "__main__":
    main()
