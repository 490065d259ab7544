"""A smaller share of the batch on cuda:0: a ``BalancedDataParallel``-style scatter, its
rows per GPU solved from the even split's peaks (each device's peak taken as affine in its
rows), measured as further steps of ``dp-loss-primary``'s loop and refined once by a
secant where that still promises a saving."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpprof.fixes.fix_kind import FURTHER_STEP, MIN_SAVING, FixKind, Trial, measured_ok, peaks
from dpprof.fixes.policy import Cost
from dpprof.result import DeviceResult, Fix, ScenarioResult
from dpprof.scenarios.names import DP_LOSS_PRIMARY
from dpprof.scenarios.shards import shard_sizes

if TYPE_CHECKING:
    from dpprof.backends.emulated import Alongside, EmulationConfig

Emulate = Callable[[str, "EmulationConfig"], ScenarioResult]

CODE_BALANCED = """\
+from torch.nn.parallel._functions import Scatter
+
+class BalancedDataParallel(nn.DataParallel):
+    \"\"\"DataParallel with rows per GPU in proportion to `shares` (cuda:0 first).\"\"\"
+    def __init__(self, module, shares, **kwargs):
+        super().__init__(module, **kwargs)
+        self.shares = shares
+    def scatter(self, inputs, kwargs, device_ids):
+        rows = next(t for t in inputs if torch.is_tensor(t)).size(self.dim)
+        sizes = [rows * s // sum(self.shares) for s in self.shares]
+        sizes[-1] += rows - sum(sizes)
+        def split(x):
+            if torch.is_tensor(x):
+                return Scatter.apply(device_ids, sizes, self.dim, x)
+            return [x] * len(device_ids)
+        inputs = list(zip(*map(split, inputs)))
+        return inputs, [kwargs] * len(inputs)
+
-model = nn.DataParallel(model.cuda())
+# rows per GPU at batch {batch}; another batch (a micro-batch) is split in proportion
+model = BalancedDataParallel(model.cuda(), shares={shares})"""


# The categories at a device's peak that grow with its own rows: on cuda:0 (the output
# device) only its replica's activations, its inputs, outputs and loss being the whole
# batch's (moved there, gathered there); on the others everything but the model's state.
OWN_ROWS_ON_PRIMARY = ("activations",)
OWN_ROWS_ELSEWHERE = ("inputs", "activations", "outputs", "loss")


@dataclasses.dataclass(frozen=True)
class Split:
    """Rows per device and the heaviest peak the affine model predicts for them."""

    chunks: list[int]
    predicted_peak_bytes: float


def solve_split(batch: int, gpus: int, rows0: float, peak0: float, slope0: float,
                rowsk: float, peakk: float, slopek: float) -> Split | None:
    """Rows per device that equalise cuda:0 and the others, each device's peak taken as
    affine in its own rows: cuda:0's through (``rows0``, ``peak0``) with slope ``slope0``
    (bytes per row), a typical other device's through (``rowsk``, ``peakk``) with
    ``slopek``. cuda:0 gets ``r0`` rows, the others share the rest as ``tensor.chunk``
    would; ``r0`` solves ``P0(r0) = Pk((batch - r0) / (gpus - 1))``. None when the slopes
    give no solution."""
    if gpus < 2:
        return None
    a0 = peak0 - slope0 * rows0
    ak = peakk - slopek * rowsk
    denom = slope0 + slopek / (gpus - 1)
    if denom <= 0:
        return None
    exact = (ak + slopek * batch / (gpus - 1) - a0) / denom
    best: Split | None = None
    for r0 in {math.floor(exact), math.ceil(exact)}:
        r0 = int(min(max(r0, 1), batch - (gpus - 1)))
        rest = shard_sizes(batch - r0, gpus - 1)
        if len(rest) < gpus - 1:
            continue
        predicted = max(a0 + slope0 * r0, ak + slopek * rest[0])
        if best is None or predicted < best.predicted_peak_bytes:
            best = Split([r0, *rest], predicted)
    return best


def secant_split(
    batch: int, gpus: int, rows0_a: float, peak0_a: float, rows0_b: float, peak0_b: float,
    rowsk_a: float, peakk_a: float, rowsk_b: float, peakk_b: float,
) -> Split | None:
    """:func:`solve_split` with the slopes of two measured splits ``a`` and ``b`` (``k``
    is a typical other device); None when they give no usable slope."""
    if rows0_a == rows0_b or rowsk_a == rowsk_b:
        return None
    return solve_split(batch, gpus, rows0_a, peak0_a,
                       (peak0_a - peak0_b) / (rows0_a - rows0_b),
                       rowsk_a, peakk_a, (peakk_a - peakk_b) / (rowsk_a - rowsk_b))


def per_row_bytes(d: DeviceResult, categories: tuple[str, ...]) -> float:
    """Bytes per row of ``d``'s own shard in ``categories`` at its peak."""
    return sum(d.breakdown_bytes.get(c, 0) for c in categories) / max(d.batch_rows, 1)


class BalancedSplits:
    """The balanced split's search, as :class:`~dpprof.backends.emulated_alongside.FurtherSplits`:
    fed ``dp-loss-primary``'s figures, then each split's, it names the next split to
    measure; :attr:`result` is the answer once :attr:`finished`.

    The first split comes from the even split alone: each device's slope (bytes per row)
    is what grows with its own rows at its peak (:data:`OWN_ROWS_ON_PRIMARY`,
    :data:`OWN_ROWS_ELSEWHERE`). Where the secant through the even split and that one
    still promises :data:`MIN_SAVING` of the heaviest peak, its split is measured too,
    and the lighter of the two is the answer. A split with one row on cuda:0 that fails
    (``BatchNorm`` needs two values per channel in training) is measured again with two.
    """

    max_steps = 2  # further steps of the scenario's loop (a failed split stops the loop)

    def __init__(self, batch: int, gpus: int) -> None:
        self.batch, self.gpus = batch, gpus
        self.even = shard_sizes(batch, gpus)
        self.finished = False
        self.result: tuple[list[int], ScenarioResult] | None = None
        self._primary: ScenarioResult | None = None
        self._tried: list[tuple[list[int], ScenarioResult]] = []
        self._next: list[int] | None = None
        self.min_rows = 1  # cuda:0's fewest rows: 2 once a one-row split has failed

    def __call__(self, last: ScenarioResult) -> tuple[int, ...] | None:
        if self._primary is None:
            self._primary = last
            self._next = self._first(last)
        else:
            assert self._next is not None
            if measured_ok(last):
                self._next = self._after(self._next, last)
            elif self._next[0] == 1 and self.even[0] > 2 and self.min_rows == 1:
                self.min_rows = 2
                self._next = [2, *shard_sizes(self.batch - 2, self.gpus - 1)]
            else:
                self._next = None
        if self._next is None:
            self.finished = True
            return None
        return tuple(self._next)

    def _first(self, primary: ScenarioResult) -> list[int] | None:
        even, k = self.even, 1  # k: a typical other device (the last may have fewer rows)
        used = [d for d in primary.devices if d.used]
        every_gpu_used = len(even) == len(used) == self.gpus
        if not measured_ok(primary) or self.gpus < 2 or not every_gpu_used or even[0] < 2:
            return None
        d0, dk = used[0], used[k]
        first = solve_split(self.batch, self.gpus, even[0], d0.peak_allocated_bytes,
                            per_row_bytes(d0, OWN_ROWS_ON_PRIMARY), even[k],
                            dk.peak_allocated_bytes, per_row_bytes(dk, OWN_ROWS_ELSEWHERE))
        return None if first is None or first.chunks == even else first.chunks

    def _after(self, chunks: list[int], s: ScenarioResult) -> list[int] | None:
        self._tried.append((chunks, s))
        self.result = min(self._tried, key=lambda t: peaks(t[1])[1])  # the first on ties
        if len(self._tried) > 1:
            return None
        assert self._primary is not None
        even, k = self.even, 1
        used = [d for d in self._primary.devices if d.used]
        used_a = [d for d in s.devices if d.used]
        heaviest = peaks(s)[1]
        second = secant_split(self.batch, self.gpus, even[0], used[0].peak_allocated_bytes,
                              chunks[0], used_a[0].peak_allocated_bytes, even[k],
                              used[k].peak_allocated_bytes, chunks[k],
                              used_a[k].peak_allocated_bytes)
        if (second is None or second.chunks in (chunks, even) or second.chunks[0] < self.min_rows
                or heaviest - second.predicted_peak_bytes < MIN_SAVING * heaviest):
            return None
        return second.chunks


def balanced_split(primary: ScenarioResult, batch: int, gpus: int, base: EmulationConfig,
                   em: Emulate) -> tuple[list[int], ScenarioResult] | None:
    """Chunk sizes that balance ``dp-loss-primary``, and the emulation that measured them
    (:class:`BalancedSplits`, each split emulated on its own)."""
    plan = BalancedSplits(batch, gpus)
    chunks = plan(primary)
    while chunks is not None:
        chunks = plan(em(DP_LOSS_PRIMARY, dataclasses.replace(base, dp_chunk_sizes=chunks)))
    return plan.result


@dataclass(frozen=True)
class BalancedSplit(FixKind):
    def ask(self, alongside: Alongside, batch: int, gpus: int) -> None:
        alongside.splits = BalancedSplits(batch, gpus)
        alongside.further_steps_in = DP_LOSS_PRIMARY

    def alone(self, trial: Trial, fix: Fix) -> tuple[str, EmulationConfig] | None:
        if not fix.chunk_sizes:
            return None
        return DP_LOSS_PRIMARY, trial.variant(dp_chunk_sizes=tuple(fix.chunk_sizes))

    def measure(self, trial: Trial) -> Fix | None:
        batch, gpus = trial.batch, trial.gpus
        splits = trial.measured.splits
        bal = (splits.result if isinstance(splits, BalancedSplits) and splits.finished
               else balanced_split(trial.primary, batch, gpus, trial.base,
                                   lambda name, cfg: trial.emulate(name, cfg)))
        if bal is None:
            return None
        chunks, s = bal
        return trial.fix(
            self, s,
            f"rows per GPU {chunks} instead of {shard_sizes(batch, gpus)}; a "
            "BalancedDataParallel-style scatter override (Scatter.apply with chunk_sizes)",
            CODE_BALANCED.format(shares=chunks, batch=batch), chunks)


FIX = BalancedSplit(
    name="balanced-split", title="A smaller share of the batch on cuda:0",
    applies_to=(DP_LOSS_PRIMARY,), measured=FURTHER_STEP, measured_in=DP_LOSS_PRIMARY,
    cost=Cost(5, "a scatter override (a class of about twenty lines), its rows tuned to this "
              "batch", "the other GPUs wait for the most loaded one"),
)
