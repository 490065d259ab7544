"""One view of a result: what every human format (terminal, Markdown, HTML, the diff of two
results) shows, built once from a :class:`RunResult` by :func:`build_view`.

The view holds every number and label a report shows: the scenarios' rows per device, the
headline (verdict, heaviest GPU, max/mean, cuda:0's excess), cuda:0's excess by cause with
the attribution's labels, the recommended fixes with their code and savings, the largest
batches, the equivalence check, notes, warnings, errors and the environment. Renderers read
this view and nothing else: they choose markup and human units, never a number or a label,
so the formats cannot drift apart. Numbers are bytes (``*_bytes``), seconds (``*_s``) and
plain counts; human units are the renderers' (:mod:`dpprof.reports.common` formats the
sentences several formats share).

JSON is not a view: ``-o run.json`` writes the result itself (the saved session that
``dpprof report run.json`` reads back and renders again through this module).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpprof.analysis.answer_figures import BALANCED_FRACTION
from dpprof.analysis.answers import Advice, Answer, build_answer, maxbatch_ratio
from dpprof.analysis.attribution import CAUSES, attribute, cause_label
from dpprof.result import (
    CATEGORIES,
    STATUS_OK,
    STATUS_OOM,
    Attribution,
    DeviceResult,
    Fix,
    RunResult,
    ScenarioResult,
    TimelinePoint,
    WatchResult,
)
from dpprof.scenarios.registry import find

MEASURED = (STATUS_OK, STATUS_OOM)
# (DeviceResult field, column name) of the table of what a GPU adds to allocated memory
MEMORY_COLUMNS = (
    ("peak_allocated_bytes", "allocated"),
    ("peak_requested_bytes", "requested"),
    ("peak_reserved_bytes", "reserved"),
    ("workspace_bytes", "of which workspaces"),
    ("context_bytes", "context"),
    ("nvml_peak_used_bytes", "NVML used"),
)
TRACEBACK_MAX_CHARS = 20_000  # the end of a long traceback (where the error is) is shown
TRACEBACK_TAIL_LINES = 6  # the terminal's share of it
SMALL_CAUSE_DIVISOR = 200  # causes under 1/200 of cuda:0's peak: one step, "smaller causes"
NEGATIVE_NOTE = ("A negative cause: the reference GPU holds more of it at its own peak "
                 "(e.g. its replica's gradients, or its share of the output gradient).")


# ---- devices and scenarios ---------------------------------------------------------------


@dataclass(frozen=True)
class DeviceView:
    """One device of one scenario."""

    label: str  # "cuda:1"; across several hosts "host/cuda:1" (plain text)
    index: int
    used: bool
    peak_allocated_bytes: int
    capacity_bytes: int
    over_capacity: bool  # allocated above the GPU's capacity
    out_of_memory: bool  # over capacity, or the device the scenario ran out of memory on
    peak_reserved_bytes: int | None
    context_bytes: int | None
    nccl_bytes: int  # of context_bytes: a DDP rank's NCCL, outside the allocator
    total_peak_bytes: int  # reserved (or allocated) + context
    total_over_capacity: bool
    nvml_peak_used_bytes: int | None
    breakdown_bytes: Mapping[str, int]  # category -> bytes at the device's peak
    timeline: tuple[TimelinePoint, ...]


@dataclass(frozen=True)
class SeriesView:
    """One device's memory over the measured step (a timeline chart's line)."""

    label: str
    points: tuple[TimelinePoint, ...]


@dataclass(frozen=True)
class TimelineView:
    """A scenario's memory over the step: its lines, phases and peak."""

    series: tuple[SeriesView, ...]
    nvml: bool  # lines of NVML's used memory (real GPUs), allocated dotted
    note: str  # e.g. emulated DDP: rank 0 shown
    phase_spans: tuple[tuple[float, float, str], ...]  # (start, end, phase) of the first line
    peak_label: str  # the device of the highest point
    peak_t: float
    peak_bytes: int
    peak_phase: str  # "" when unknown, with spaces for underscores
    top_bytes: int  # the highest value drawn (the capacity line's scale)


@dataclass(frozen=True)
class ScenarioView:
    """One scenario: its status, one cell per column of the peak table, its comparison."""

    name: str
    status: str  # "ok" | "oom" | "error" | ...
    status_label: str  # "ok", "OOM", or the status as is
    measured: bool  # ok or out of memory: it has peaks
    cells: tuple[DeviceView | None, ...]  # per column of ReportView.columns; None: nothing
    devices: tuple[DeviceView, ...]  # the used devices, in order
    all_devices: tuple[DeviceView, ...]
    excess_bytes: int | None  # cuda:0 minus the median other device (the comparison's)
    imbalance: float | None  # max / mean of peak allocated
    message: str
    traceback_tail: tuple[str, ...]  # a failure's last lines (where the error is)
    notes: tuple[str, ...]  # without the ones that carry a traceback
    oom_device: int | None
    step_time_s: float | None
    step_time_spread_s: float | None
    throughput_samples_per_s: float | None
    has_reserved: bool  # some device has a reserved peak (measured or modelled)
    timeline: TimelineView | None


@dataclass(frozen=True)
class Alert:
    """A scenario that ran out of memory or failed (one line at the top of a report)."""

    scenario: str
    failed: bool  # False: out of memory
    message: str
    device: str | None  # the device that ran out ("cuda:1"), None: unknown
    needed_bytes: int | None  # what it needed (emulated) or tried to allocate (real)


@dataclass(frozen=True)
class MemoryRow:
    scenario: str
    device: str
    values_bytes: tuple[int | None, ...]  # per ReportView.memory_columns
    phase: str  # phase of the peak, "-" when unknown


# ---- answers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CauseView:
    key: str  # CAUSES' key ("" for the folded small causes)
    label: str
    bytes: int


@dataclass(frozen=True)
class AttributionView:
    """cuda:0 against the median other device of one scenario, by cause: the attribution
    (:mod:`dpprof.analysis.attribution`, the only split of the excess)."""

    scenario: str
    primary_bytes: int  # cuda:0's peak allocated
    reference_bytes: int  # the median other device's peak
    excess_bytes: int
    causes: tuple[CauseView, ...]  # sums to the excess
    answer: str  # one sentence: what dominates and what fixes it
    negative_note: str | None  # why a cause is negative, where one is
    balanced: bool  # cuda:0 within 1 % of the others
    steps: tuple[CauseView, ...]  # the waterfall: large causes first, small ones folded

    def bytes_of(self, cause: str) -> int | None:
        """The bytes of ``cause``; None where the attribution does not name it."""
        return next((c.bytes for c in self.causes if c.key == cause), None)

    @property
    def shown(self) -> bool:
        """Worth a table of its own: it names a cause or an excess."""
        return bool(self.excess_bytes or self.causes)


@dataclass(frozen=True)
class FixView:
    name: str
    title: str
    detail: str
    code: str
    code_lang: str  # "diff" or "python"
    saves_bytes: int | None  # on cuda:0
    heaviest_saves_bytes: int | None  # on the heaviest GPU of the scenario it changes
    why: str  # the answer's sentence: its detail, what it saves against what, what is unknown
    primary_peak_bytes: int | None  # cuda:0's peak with the fix
    max_peak_bytes: int | None  # the heaviest GPU's peak with the fix


@dataclass(frozen=True)
class MaxBatchEntryView:
    scenario: str
    max_batch: int | None
    capped: bool
    needed_bytes: int | None
    next_needed_bytes: int | None
    limit_device: str | None
    emulations: int
    message: str


@dataclass(frozen=True)
class MaxBatchView:
    capacity_bytes: int
    gpu: str
    multiple_of: int
    counts: str
    entries: tuple[MaxBatchEntryView, ...]
    ddp_vs_primary: tuple[int, int, float] | None  # (ddp, dp-loss-primary, ratio)


@dataclass(frozen=True)
class EquivalenceEntryView:
    scenario: str
    loss: float | None
    loss_diff: float | None
    grad_max_diff: float | None
    param_max_diff: float | None
    equivalent: bool | None


@dataclass(frozen=True)
class EquivalenceView:
    batch: int
    tolerance: float
    entries: tuple[EquivalenceEntryView, ...]
    findings: tuple[tuple[str, str], ...]  # (kind, message)


@dataclass(frozen=True)
class WatchRowView:
    gpu: str  # "cuda:0"
    name: str
    peak_used_bytes: int | None
    peak_percent: float | None  # of the GPU's total
    peak_t_s: float | None
    command_peak_bytes: int | None
    baseline_used_bytes: int | None
    at_oom_bytes: int | None


@dataclass(frozen=True)
class WatchView:
    """``dpprof watch -- CMD``: the command, each GPU, the post-mortem."""

    interval_s: float
    message: str  # how the command ended
    rows: tuple[WatchRowView, ...]
    post_mortem: tuple[str, ...]
    oom_text: str | None  # the first OOM message, as printed
    oom_times_s: tuple[float, ...]
    next_steps: tuple[str, ...]
    signals: tuple[tuple[float, str, str], ...]  # (t_s, signal, action)
    samples_path: str
    series: tuple[SeriesView, ...]  # NVML used memory per GPU over the run


@dataclass(frozen=True)
class Headline:
    """The verdict, and the scenario with the largest imbalance."""

    verdict: str  # the comparison's sentence, or a sentence saying there is none
    verdict_parts: tuple[str, str, str] | None  # (before, "out of memory…", after)
    scenario: str | None  # the most imbalanced scenario
    heaviest_device: str | None
    heaviest_bytes: int | None
    imbalance: float | None
    excess_bytes: int | None  # cuda:0's excess in that scenario


@dataclass(frozen=True)
class ReportView:
    """Everything a report of one result shows (see the module docstring)."""

    backend: str
    workload: str
    batch: int
    gpus: int
    gpu_memory_bytes: int
    dtype: str
    seed: int
    dpprof_version: str
    created: str
    real: bool  # measured on CUDA GPUs, not emulated
    over_cpu_tensors: bool  # emulated with real numbers (cpu backend, --compute)
    batch_label: str  # "batch 512", or "largest batch" for a search of it (dpprof maxbatch)
    headline: Headline
    has_comparison: bool  # the result has a verdict
    columns: tuple[str, ...]  # device labels of the peak table
    scenarios: tuple[ScenarioView, ...]
    alerts: tuple[Alert, ...]
    tracebacks: tuple[tuple[str, str], ...]  # (scenario, the end of its traceback)
    memory_columns: tuple[str, ...]  # empty: only allocated is known
    memory_rows: tuple[MemoryRow, ...]
    top_allocated_bytes: int  # the largest peak allocated drawn
    top_bytes: int  # ... or NVML used
    breakdown_categories: tuple[tuple[str, str], ...]  # (category, label) with bytes
    attributions: tuple[AttributionView, ...]
    cause_rows: tuple[tuple[str, str], ...]  # (cause, label) any attribution names
    attribution_top_bytes: int  # the largest of cuda:0's and the references' peaks
    fixes: tuple[FixView, ...]  # every fix emulated
    recommended: tuple[FixView, ...]  # those that lower the heaviest GPU's peak
    nothing_to_change: str  # what to say when none is recommended
    advice_notes: tuple[str, ...]  # the fixes that make the heaviest GPU worse, and why
    max_batches: tuple[tuple[str, int], ...]  # (scenario, largest global batch)
    maxbatch: MaxBatchView | None
    equivalence: EquivalenceView | None
    fail_reasons: tuple[str, ...]
    assumptions: tuple[str, ...]
    run_notes: tuple[str, ...]  # the run's own notes
    notes: tuple[str, ...]  # the run's, then each scenario's ("name: note")
    config: Mapping[str, Any]
    full_configuration: Mapping[str, Any]  # the run's fields and every option
    environment: Mapping[str, Any]
    watch: WatchView | None

    @property
    def kind(self) -> str:
        return "measured" if self.real else "emulated"

    @property
    def drawn(self) -> tuple[ScenarioView, ...]:
        """The scenarios with peaks to draw."""
        return tuple(s for s in self.scenarios if s.measured and s.devices)

    @property
    def timed(self) -> tuple[ScenarioView, ...]:
        return tuple(s for s in self.scenarios if s.step_time_s is not None)

    def scenario(self, name: str) -> ScenarioView | None:
        return next((s for s in self.scenarios if s.name == name), None)


# ---- the builder -------------------------------------------------------------------------


def build_view(run: RunResult) -> ReportView:
    """The one view of ``run`` every human format renders."""
    real = run.backend == "cuda"
    answer = build_answer(run)
    scenarios = tuple(_scenario(run, s) for s in run.scenarios)
    ref = max(scenarios, key=lambda s: len(s.all_devices), default=None)
    columns = tuple(d.label for d in ref.all_devices) if ref and ref.all_devices else tuple(
        f"cuda:{i}" for i in range(run.gpus))
    drawn = [s for s in scenarios if s.measured and s.devices]
    attributions = tuple(a for s in run.scenarios if s.name in answer.explained
                         and (a := _attribution(run, s, answer)) is not None)
    advice = {a.fix.name: a for a in (*answer.recommended, *answer.worse)}
    memory_columns, memory_rows = _memory(run, scenarios)
    return ReportView(
        backend=run.backend, workload=run.workload, batch=run.batch, gpus=run.gpus,
        gpu_memory_bytes=run.gpu_memory_bytes, dtype=run.dtype, seed=run.seed,
        dpprof_version=run.dpprof_version, created=run.created, real=real,
        over_cpu_tensors=run.backend == "cpu" or bool(run.config.get("compute")),
        batch_label=(f"batch {run.batch}" if run.scenarios or run.maxbatch is None
                     else "largest batch"),
        headline=_headline(answer, scenarios),
        has_comparison=bool(answer.verdict),
        columns=columns,
        scenarios=scenarios,
        alerts=tuple(_alerts(run)),
        tracebacks=tuple(_tracebacks(run)),
        memory_columns=memory_columns,
        memory_rows=memory_rows,
        top_allocated_bytes=max((d.peak_allocated_bytes for s in drawn for d in s.devices),
                                default=0),
        top_bytes=max((max(d.peak_allocated_bytes, d.nvml_peak_used_bytes or 0)
                       for s in drawn for d in s.devices), default=0),
        breakdown_categories=_categories(drawn),
        attributions=attributions,
        cause_rows=tuple((c, cause_label(c)) for c in CAUSES
                         if any(a.bytes_of(c) for a in attributions)),
        attribution_top_bytes=max((max(a.primary_bytes, a.reference_bytes)
                                   for a in attributions), default=0),
        fixes=tuple(_fix(f, advice.get(f.name)) for f in run.fixes),
        recommended=tuple(_fix(a.fix, a) for a in answer.recommended),
        nothing_to_change=answer.nothing_to_change,
        advice_notes=answer.notes,
        max_batches=_max_batches(run),
        maxbatch=_maxbatch(run),
        equivalence=_equivalence(run),
        fail_reasons=tuple(run.fail_reasons),
        assumptions=tuple(run.assumptions),
        run_notes=tuple(run.notes),
        notes=(*run.notes, *(f"{s.name}: {n}" for s in run.scenarios for n in s.notes
                             if "Traceback" not in n)),
        config=run.config,
        full_configuration={
            "backend": run.backend, "workload": run.workload, "batch": run.batch,
            "gpus": run.gpus, "gpu_memory_bytes": run.gpu_memory_bytes, "dtype": run.dtype,
            "seed": run.seed, "dpprof_version": run.dpprof_version, "created": run.created,
            "schema_version": run.schema_version, "config": run.config,
        },
        environment=run.environment,
        watch=_watch(run, run.watch, answer) if run.watch is not None else None,
    )


def _measured(s: ScenarioResult) -> bool:
    return s.status in MEASURED


def _nodes(s: ScenarioResult) -> list[str]:
    """The distinct hosts of a scenario's devices, in order (empty: one unnamed host)."""
    return list(dict.fromkeys(d.node for d in s.devices if d.node))


def _label(s: ScenarioResult, d: DeviceResult) -> str:
    if len(_nodes(s)) > 1 and d.node:
        return f"{d.node}/cuda:{d.index}"
    return f"cuda:{d.index}"


def _device(s: ScenarioResult, d: DeviceResult) -> DeviceView:
    over = d.peak_allocated_bytes > d.capacity_bytes > 0
    return DeviceView(
        label=_label(s, d), index=d.index, used=d.used,
        peak_allocated_bytes=d.peak_allocated_bytes, capacity_bytes=d.capacity_bytes,
        over_capacity=over,
        out_of_memory=over or (s.status == STATUS_OOM and d.index == s.oom_device),
        peak_reserved_bytes=d.peak_reserved_bytes, context_bytes=d.context_bytes,
        nccl_bytes=d.context_breakdown_bytes.get("nccl", 0),
        total_peak_bytes=d.total_peak_bytes,
        total_over_capacity=d.total_peak_bytes > d.capacity_bytes > 0,
        nvml_peak_used_bytes=d.nvml_peak_used_bytes,
        breakdown_bytes=dict(d.breakdown_bytes), timeline=tuple(d.timeline),
    )


def _scenario(run: RunResult, s: ScenarioResult) -> ScenarioView:
    every = tuple(_device(s, d) for d in s.devices)
    used = tuple(v for v in every if v.used)
    measured = _measured(s)
    c = run.comparison.scenarios.get(s.name)
    tail: tuple[str, ...] = ()
    if s.traceback and not measured:
        tail = tuple(s.traceback.rstrip().splitlines()[-TRACEBACK_TAIL_LINES:])
    return ScenarioView(
        name=s.name, status=s.status,
        status_label={STATUS_OK: "ok", STATUS_OOM: "OOM"}.get(s.status, s.status),
        measured=measured,
        cells=tuple(v if v.used and measured else None for v in every),
        devices=used, all_devices=every,
        excess_bytes=c.primary_excess_bytes if c else None,
        imbalance=c.imbalance if c else None,
        message=s.message, traceback_tail=tail,
        notes=tuple(n for n in s.notes if "Traceback" not in n),
        oom_device=s.oom_device,
        step_time_s=s.step_time_s, step_time_spread_s=s.step_time_spread_s,
        throughput_samples_per_s=s.throughput_samples_per_s,
        has_reserved=any(d.peak_reserved_bytes is not None for d in s.devices),
        timeline=_timeline(run, s, used) if measured and used else None,
    )


def _headline(answer: Answer, scenarios: tuple[ScenarioView, ...]) -> Headline:
    verdict, parts = answer.verdict, answer.verdict_parts
    compared = [s for s in scenarios if s.imbalance is not None and s.devices]
    if not compared:
        return Headline(verdict, parts, None, None, None, None, None)
    worst = max(compared, key=lambda s: s.imbalance or 0.0)
    heaviest = max(worst.devices, key=lambda d: d.peak_allocated_bytes)
    return Headline(verdict, parts, worst.name, heaviest.label, heaviest.peak_allocated_bytes,
                    worst.imbalance, worst.excess_bytes)


def _alerts(run: RunResult) -> list[Alert]:
    out = []
    for s in run.scenarios:
        if s.status == STATUS_OOM:
            dev = f"cuda:{s.oom_device}" if s.oom_device is not None else None
            out.append(Alert(s.name, False, s.message, dev, s.oom_bytes or None))
        elif not _measured(s):
            out.append(Alert(s.name, True, s.message, None, None))
    return out


def _tracebacks(run: RunResult) -> list[tuple[str, str]]:
    """(scenario, traceback) for each failed scenario that kept one (DDP: the rank that
    caused the failure, not the peers that lost their connection to it)."""
    out = []
    for s in run.scenarios:
        if not _measured(s) and s.traceback:
            tb = s.traceback.rstrip()
            out.append((s.name, tb if len(tb) <= TRACEBACK_MAX_CHARS
                        else "...\n" + tb[-TRACEBACK_MAX_CHARS:]))
    return out


def _memory(run: RunResult, scenarios: tuple[ScenarioView, ...]
            ) -> tuple[tuple[str, ...], tuple[MemoryRow, ...]]:
    """Per scenario and device: allocated, reserved, context and NVML peaks; the columns
    no device has are left out, and the table with them when only allocated is known."""
    devs = [(s, d) for s in run.scenarios if _measured(s) for d in s.devices if d.used]
    cols = [(k, name) for k, name in MEMORY_COLUMNS if any(getattr(d, k) for _, d in devs)]
    if [k for k, _ in cols] in ([], ["peak_allocated_bytes"],
                                ["peak_allocated_bytes", "peak_requested_bytes"]):
        return (), ()
    rows = tuple(MemoryRow(s.name, _label(s, d), tuple(getattr(d, k) for k, _ in cols),
                           d.peak_phase.replace("_", " ") or "-") for s, d in devs)
    return tuple(name for _, name in cols), rows


def _categories(drawn: list[ScenarioView]) -> tuple[tuple[str, str], ...]:
    devs = [d for s in drawn for d in s.devices]
    extra = sorted({c for d in devs for c in d.breakdown_bytes} - set(CATEGORIES))
    # what a device holds, in the categories' own words: a cause's ("gathered outputs") is
    # cuda:0's against the others under DataParallel, wrong for a DDP rank's own outputs
    return tuple((c, c.replace("_", " ")) for c in (*CATEGORIES, *extra)
                 if any(d.breakdown_bytes.get(c, 0) for d in devs))


def _phase_spans(points: tuple[TimelinePoint, ...]) -> tuple[tuple[float, float, str], ...]:
    spans: list[tuple[float, float, str]] = []
    for p in points:
        if spans and spans[-1][2] == p.phase:
            spans[-1] = (spans[-1][0], p.t, p.phase)
        else:
            if spans:
                spans[-1] = (spans[-1][0], p.t, spans[-1][2])
            spans.append((p.t, p.t, p.phase))
    return tuple(sp for sp in spans if sp[2])


def _timeline(run: RunResult, s: ScenarioResult, used: tuple[DeviceView, ...]
              ) -> TimelineView | None:
    devs = [d for d in used if d.timeline]
    note = ""
    kind = find(s.name)
    if run.backend != "cuda" and kind is not None and kind.ranks_alike and len(devs) > 1:
        devs, note = devs[:1], "Emulated DDP: every rank runs the same program; rank 0 shown."
    if not devs:
        return None
    nvml = any(p.used_bytes is not None for d in devs for p in d.timeline)

    def height(p: TimelinePoint) -> int:
        return p.used_bytes if nvml and p.used_bytes is not None else p.allocated_bytes

    top = 0
    for d in devs:
        if nvml:
            top = max(top, *(p.used_bytes for p in d.timeline if p.used_bytes is not None))
        if not nvml or any(p.allocated_bytes for p in d.timeline):
            top = max(top, *(p.allocated_bytes for p in d.timeline))
    peak_dev = max(devs, key=lambda d: max(height(p) for p in d.timeline))
    peak = max(peak_dev.timeline, key=height)
    return TimelineView(
        series=tuple(SeriesView(d.label, d.timeline) for d in devs), nvml=nvml, note=note,
        phase_spans=_phase_spans(devs[0].timeline), peak_label=peak_dev.label, peak_t=peak.t,
        peak_bytes=height(peak), peak_phase=peak.phase.replace("_", " "), top_bytes=top)


def _attribution(run: RunResult, s: ScenarioResult, answer: Answer) -> AttributionView | None:
    """cuda:0's excess by cause in ``s``: the result's attribution (computed by the same
    function for results saved without one), with the answer's sentence."""
    att: Attribution | None = run.attribution.get(s.name) or attribute(s)
    used = [d for d in s.devices if d.used]
    if att is None or not used or not _measured(s):
        return None
    primary = used[0].peak_allocated_bytes
    causes = tuple(CauseView(k, cause_label(k), v) for k, v in att.causes_bytes.items())
    small = max(primary // SMALL_CAUSE_DIVISOR, 1)
    steps = sorted((c for c in causes if abs(c.bytes) >= small), key=lambda c: -abs(c.bytes))
    folded = sum(c.bytes for c in causes if abs(c.bytes) < small)
    if folded:
        steps.append(CauseView("", "smaller causes", folded))
    return AttributionView(
        scenario=s.name, primary_bytes=primary, reference_bytes=primary - att.excess_bytes,
        excess_bytes=att.excess_bytes, causes=causes, answer=answer.why.get(s.name, att.answer),
        negative_note=NEGATIVE_NOTE if any(c.bytes < 0 for c in causes) else None,
        balanced=abs(att.excess_bytes) <= BALANCED_FRACTION * max(primary, 1),
        steps=tuple(steps))


def _fix(f: Fix, advice: Advice | None) -> FixView:
    """A fix; ``advice``: the answer's measure of it against the scenario it changes."""
    lang = "diff" if f.code.lstrip().startswith(("-", "+", "@@")) else "python"
    return FixView(name=f.name, title=f.title, detail=f.detail, code=f.code, code_lang=lang,
                   saves_bytes=advice.primary_saves_bytes if advice else f.saves_bytes,
                   heaviest_saves_bytes=(advice.heaviest_saves_bytes if advice
                                         else f.heaviest_saves_bytes),
                   primary_peak_bytes=f.primary_peak_bytes, max_peak_bytes=f.max_peak_bytes,
                   why=advice.why if advice else f.detail)


def _max_batches(run: RunResult) -> tuple[tuple[str, int], ...]:
    """(scenario, largest global batch that fits) where computed: the result's max-batch
    search when it has one, else ``ScenarioResult.max_batch``."""
    if run.maxbatch is not None and run.maxbatch.entries:
        return tuple((e.scenario, e.max_batch) for e in run.maxbatch.entries
                     if e.max_batch is not None)
    return tuple((s.name, s.max_batch) for s in run.scenarios if s.max_batch is not None)


def _maxbatch(run: RunResult) -> MaxBatchView | None:
    mb = run.maxbatch
    if mb is None:
        return None
    return MaxBatchView(
        capacity_bytes=mb.capacity_bytes, gpu=mb.gpu, multiple_of=mb.multiple_of,
        counts=mb.counts,
        entries=tuple(MaxBatchEntryView(
            e.scenario, e.max_batch, e.capped, e.needed_bytes, e.next_needed_bytes,
            None if e.limit_device is None else f"cuda:{e.limit_device}", e.emulations,
            e.message) for e in mb.entries),
        ddp_vs_primary=maxbatch_ratio(run))


def _equivalence(run: RunResult) -> EquivalenceView | None:
    eq = run.equivalence
    if eq is None:
        return None
    return EquivalenceView(
        batch=eq.batch, tolerance=eq.tolerance,
        entries=tuple(EquivalenceEntryView(e.scenario, e.loss, e.loss_diff, e.grad_max_diff,
                                           e.param_max_diff, e.equivalent)
                      for e in eq.entries),
        findings=tuple((f.kind, f.message) for f in eq.findings))


def _watch(run: RunResult, w: WatchResult, answer: Answer) -> WatchView:
    at = w.ooms[0].used_at_oom_bytes if w.ooms else {}
    rows = []
    for d in w.devices:
        key = f"cuda:{d.cuda_index}"
        rows.append(WatchRowView(
            gpu=key, name=d.name or "?", peak_used_bytes=d.peak_used_bytes,
            peak_percent=(100 * d.peak_used_bytes / d.total_bytes
                          if d.peak_used_bytes is not None and d.total_bytes else None),
            peak_t_s=d.peak_t_s, command_peak_bytes=d.command_peak_bytes,
            baseline_used_bytes=d.baseline_used_bytes, at_oom_bytes=at.get(key)))
    series = tuple(SeriesView(f"cuda:{d.index}", tuple(d.timeline))
                   for d in (run.scenarios[0].devices if run.scenarios else []) if d.timeline)
    return WatchView(
        interval_s=w.interval_s,
        message=run.scenarios[0].message if run.scenarios else "",
        rows=tuple(rows), post_mortem=answer.post_mortem,
        oom_text=w.ooms[0].text if w.ooms else None,
        oom_times_s=tuple(o.t_s for o in w.ooms if o.t_s is not None),
        next_steps=answer.next_steps,
        signals=tuple((float(s.get("t_s", 0)), str(s.get("signal") or ""),
                       str(s.get("action", ""))) for s in w.signals),
        samples_path=w.samples_path, series=series)
