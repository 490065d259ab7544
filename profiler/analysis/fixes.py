"""What each fix buys on the user's workload, and the code for it.

Every fix is measured, not estimated: the step with the change
(``DataParallel(output_device=...)``, ``DDP(gradient_as_bucket_view=True)``, an uneven
scatter) is emulated and cuda:0's peak is compared with ``dp-loss-primary``'s. A
comparison's own scenarios measure them as they run (:func:`alongside`: further steps of
``dp-loss-primary``'s loop, a ledger beside ``ddp``); what they could not is emulated here
on its own. The balanced split (:class:`BalancedSplits`) is solved from the even split's
peaks and what grows with each device's rows there (each device's peak taken as affine in
its rows), measured, and refined once by a secant where that still promises a saving.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from dpprof.analysis.answers import MIN_SAVING
from dpprof.backends.emulated import Alongside, EmulationConfig, run_scenario
from dpprof.result import STATUS_OK, STATUS_OOM, DeviceResult, Fix, RunResult, ScenarioResult
from dpprof.scenarios.base import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY
from dpprof.scenarios.workloads import Workload, shard_sizes
from dpprof.units import fmt_bytes

Emulate = Callable[[str, EmulationConfig], ScenarioResult]

TYPICAL_LOOP = """\
model = nn.DataParallel(model.cuda())
for inputs, targets in loader:
    loss = loss_fn(model(inputs.cuda()), targets.cuda())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()"""

CODE_LOSS_IN_FORWARD = """\
-model = nn.DataParallel(model.cuda())
+model = nn.DataParallel(dpprof.ModelWithLoss(model, loss_fn).cuda())
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    loss = dpprof.ModelWithLoss.combine(model(inputs.cuda(), targets.cuda()))"""

CODE_DDP = """\
+# torchrun --nproc-per-node {gpus} train.py
+dist.init_process_group("nccl")
+rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
-model = nn.DataParallel(model.cuda())
+model = DDP(model.cuda(rank), device_ids=[rank])
+loader = DataLoader(dataset, batch_size={per_rank},
+                    sampler=DistributedSampler(dataset))  # per-rank batch
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))"""

CODE_BUCKET_VIEW = """\
-model = DDP(model.cuda(rank), device_ids=[rank])
+model = DDP(model.cuda(rank), device_ids=[rank], gradient_as_bucket_view=True)"""

CODE_OUTPUT_DEVICE = """\
-model = nn.DataParallel(model.cuda())
+model = nn.DataParallel(model.cuda(), output_device={dev})
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    loss = loss_fn(model(inputs.cuda()), targets.cuda({dev}))"""

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


def _ok(s: ScenarioResult | None) -> bool:
    return s is not None and s.status in (STATUS_OK, STATUS_OOM) and bool(s.devices)


def _peaks(s: ScenarioResult) -> tuple[int, int]:
    used = [d for d in s.devices if d.used]
    return used[0].peak_allocated_bytes, max(d.peak_allocated_bytes for d in used)


def _fix(name: str, title: str, s: ScenarioResult | None, baseline: ScenarioResult,
         detail: str, code: str, chunks: list[int] | None = None) -> Fix | None:
    """``s`` (the scenario with the fix) against ``baseline`` (dp-loss-primary)."""
    if not _ok(s):
        return None
    assert s is not None
    p0, pmax = _peaks(baseline)
    q0, qmax = _peaks(s)
    return Fix(name=name, title=title, primary_peak_bytes=q0, max_peak_bytes=qmax,
               saves_bytes=p0 - q0, heaviest_saves_bytes=pmax - qmax, detail=detail,
               code=code, chunk_sizes=list(chunks or []))


def _loss_in_forward(fwd: ScenarioResult | None, primary: ScenarioResult) -> Fix | None:
    return _fix("loss-in-forward", "Compute the loss inside forward", fwd, primary,
                "DataParallel(ModelWithLoss(model, loss_fn)): cuda:0 gathers one number per "
                "GPU instead of the batch's outputs", CODE_LOSS_IN_FORWARD)


def _ddp(ddp: ScenarioResult | None, primary: ScenarioResult, gpus: int,
         batch: int) -> Fix | None:
    return _fix("ddp", "DistributedDataParallel", ddp, primary,
                "every GPU holds its own parameters, gradients and optimizer state and its "
                "shard", CODE_DDP.format(gpus=gpus, per_rank=shard_sizes(batch, gpus)[0]))


def from_scenarios(run: RunResult) -> list[Fix]:
    """The fixes the run's own scenarios measure, without emulating anything: for results
    saved without fixes (``--no-fixes``, older files)."""
    primary = run.scenario(DP_LOSS_PRIMARY)
    if not _ok(primary) or run.gpus < 2:
        return []
    assert primary is not None
    found = [_loss_in_forward(run.scenario(DP_LOSS_FORWARD), primary),
             _ddp(run.scenario(DDP), primary, run.gpus, run.batch)]
    return [f for f in found if f is not None]


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


def output_device(batch: int, gpus: int) -> int | None:
    """The output device the fix moves the outputs to: the last GPU used."""
    used = len(shard_sizes(batch, gpus))
    return used - 1 if used >= 2 else None


def alongside(batch: int, gpus: int) -> Alongside:
    """What a comparison's own scenarios measure for the fixes as they run: the balanced
    split's search and then ``output_device`` in ``dp-loss-primary``'s loop,
    ``gradient_as_bucket_view`` beside ``ddp``."""
    return Alongside(splits=BalancedSplits(batch, gpus), bucket_view=True,
                     output_device=output_device(batch, gpus))


def evaluate(run: RunResult, wl: Workload, base: EmulationConfig,
             measured: Alongside | None = None) -> list[Fix]:
    """Emulate each fix on the run's workload and batch; what it saves on cuda:0.

    The run's own scenarios are the baseline where the emulator made them (the same
    emulation as the variants); for a measured run (cpu, cuda) every figure is the
    emulator's prediction for ``base``, so that measured and emulated bytes never mix.
    ``measured``: what the run's own scenarios measured alongside (:func:`alongside`);
    what they did not is emulated here.
    """

    def em(name: str, cfg: EmulationConfig) -> ScenarioResult:
        return run_scenario(name, wl, cfg)

    # each variant reports its peaks only
    base = dataclasses.replace(base, count_reserved=False, peaks_only=True)
    gpus, batch = base.gpus, base.step.batch
    own = run.backend == "emulated"

    def scenario(name: str) -> ScenarioResult | None:
        return run.scenario(name) if own else None

    primary = scenario(DP_LOSS_PRIMARY)
    ddp = scenario(DDP)
    if not own or measured is None:
        measured = alongside(batch, gpus)
    if not _ok(primary):  # the variants measured in this emulation's loop
        measured.splits = BalancedSplits(batch, gpus)
        measured.output_device_result = None
        primary = run_scenario(DP_LOSS_PRIMARY, wl, base, alongside=measured)
    if not _ok(primary) or gpus < 2:
        return []
    assert primary is not None
    fixes: list[Fix] = []

    def add(name: str, title: str, s: ScenarioResult | None, detail: str, code: str,
            chunks: list[int] | None = None) -> None:
        assert primary is not None
        f = _fix(name, title, s, primary, detail, code, chunks)
        if f is not None:
            fixes.append(f)

    def keep(f: Fix | None) -> None:
        if f is not None:
            fixes.append(f)

    fwd = scenario(DP_LOSS_FORWARD)
    keep(_loss_in_forward(fwd if _ok(fwd) else em(DP_LOSS_FORWARD, base), primary))
    if not _ok(ddp):
        measured.bucket_view_result = None
        ddp = run_scenario(DDP, wl, base, alongside=measured)
    keep(_ddp(ddp, primary, gpus, batch))
    gabv = measured.bucket_view_result or em(DDP, base.with_step(
        ddp=dataclasses.replace(base.step.ddp, gradient_as_bucket_view=True)))
    if _ok(gabv) and _ok(ddp):
        assert ddp is not None and gabv is not None
        extra = _peaks(ddp)[0] - _peaks(gabv)[0]
        add("gradient-as-bucket-view", "DDP with gradient_as_bucket_view=True", gabv,
            f".grad becomes a view of the reducer's bucket: {fmt_bytes(extra)} less than "
            "plain DDP per GPU at the peak" + (
                "" if extra > 0 else " (the peak comes before the gradients all exist; the "
                "gradient-sized copy is still saved later in the step)"), CODE_BUCKET_VIEW)
    dev = output_device(batch, gpus)
    if dev is not None:
        out = measured.output_device_result or em(
            DP_LOSS_PRIMARY, dataclasses.replace(base, dp_output_device=dev))
        if _ok(out):
            heavy = max((d for d in out.devices if d.used),
                        key=lambda d: d.peak_allocated_bytes)
            add("output-device", f"DataParallel(output_device={dev})", out,
                f"the gathered outputs and the loss move to cuda:{dev}, which then peaks at "
                f"{fmt_bytes(heavy.peak_allocated_bytes)} (cuda:{heavy.index} is the "
                "heaviest): it moves the imbalance, it does not remove it",
                CODE_OUTPUT_DEVICE.format(dev=dev))
    splits = measured.splits
    bal = (splits.result if isinstance(splits, BalancedSplits) and splits.finished
           else balanced_split(primary, batch, gpus, base, em))
    if bal is not None:
        chunks, s = bal
        add("balanced-split", "A smaller share of the batch on cuda:0", s,
            f"rows per GPU {chunks} instead of {shard_sizes(batch, gpus)}; a "
            "BalancedDataParallel-style scatter override (Scatter.apply with chunk_sizes)",
            CODE_BALANCED.format(shares=chunks, batch=batch), chunks)
    return fixes


class BalancedSplits:
    """The balanced split's search, as :class:`~dpprof.backends.emulated.FurtherSplits`:
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
            if _ok(last):
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
        if not _ok(primary) or self.gpus < 2 or not every_gpu_used or even[0] < 2:
            return None
        d0, dk = used[0], used[k]
        first = solve_split(self.batch, self.gpus, even[0], d0.peak_allocated_bytes,
                            per_row_bytes(d0, OWN_ROWS_ON_PRIMARY), even[k],
                            dk.peak_allocated_bytes, per_row_bytes(dk, OWN_ROWS_ELSEWHERE))
        return None if first is None or first.chunks == even else first.chunks

    def _after(self, chunks: list[int], s: ScenarioResult) -> list[int] | None:
        self._tried.append((chunks, s))
        self.result = min(self._tried, key=lambda t: _peaks(t[1])[1])  # the first on ties
        if len(self._tried) > 1:
            return None
        assert self._primary is not None
        even, k = self.even, 1
        used = [d for d in self._primary.devices if d.used]
        used_a = [d for d in s.devices if d.used]
        heaviest = _peaks(s)[1]
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
