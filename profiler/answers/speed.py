"""How much faster than one GPU each scenario trains: the speed-up over ``single`` (one GPU
with one GPU's share of the batch), predicted (every backend's emulated step time,
:mod:`dpprof.emulator.step_time`) and, on real GPUs, measured. Pure functions of a result.

A scenario's speed-up is its samples per second over one GPU's: the N GPUs of ``ddp``
compute N shares in the time one GPU computes one, at best N times one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpprof.result import RunResult, ScenarioResult
from dpprof.scenarios.names import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY, SINGLE

__all__ = ["SpeedUp", "speed_sentence", "speed_ups"]

_WORDS = {DP_LOSS_PRIMARY: "DataParallel", DP_LOSS_FORWARD: "DataParallel with the loss in "
          "forward", DDP: "DDP"}


@dataclass(frozen=True)
class SpeedUp:
    scenario: str
    predicted: float | None  # over single's predicted samples per second
    measured: float | None  # over single's measured (real GPUs)


def _rows(s: ScenarioResult) -> int:
    return sum(d.batch_rows for d in s.devices if d.used) or s.batch


def _measured_rate(s: ScenarioResult) -> float | None:
    if s.status != "ok" or not s.step_time_s:
        return None
    return _rows(s) / s.step_time_s


def speed_ups(run: RunResult) -> list[SpeedUp]:
    """Each scenario's speed-up over one GPU (``single`` must be in the result)."""
    one = run.scenario(SINGLE)
    if one is None or one.status != "ok":
        return []
    one_predicted = one.predicted_samples_per_s
    one_measured = _measured_rate(one)
    out = []
    for s in run.scenarios:
        if s.name == SINGLE or s.status != "ok":
            continue
        predicted = (s.predicted_samples_per_s / one_predicted
                     if s.predicted_samples_per_s and one_predicted else None)
        rate = _measured_rate(s)
        measured = rate / one_measured if rate and one_measured else None
        if predicted is not None or measured is not None:
            out.append(SpeedUp(s.name, predicted, measured))
    return out


def speed_sentence(run: RunResult) -> str:
    """One sentence: "Predicted on 4 GPUs: DataParallel 2.2x one GPU, DDP 3.8x." (measured
    beside it on real GPUs); "" when nothing was timed."""
    ups = [u for u in speed_ups(run) if u.scenario in _WORDS]
    if not ups:
        return ""
    gpus = max((sum(1 for d in s.devices if d.used) for s in run.scenarios), default=run.gpus)

    def one(u: SpeedUp) -> str:
        parts = []
        if u.predicted is not None:
            parts.append(f"{u.predicted:.1f}x one GPU")
        if u.measured is not None:
            parts.append(f"measured {u.measured:.1f}x")
        return f"{_WORDS[u.scenario]} {', '.join(parts)}"

    where = f" ({run.config['gpu']})" if run.config.get("gpu") else ""
    kind = "Predicted" if any(u.predicted is not None for u in ups) else "Measured"
    return f"{kind} speed on {gpus} GPUs{where}: " + "; ".join(one(u) for u in ups) + "."
