"""One view of a result: what every human format (terminal, Markdown, HTML, the diff of two
results) shows, built once from a :class:`RunResult` by
:func:`dpprof.reports.view_builder.build_view`.

The view holds every number and label a report shows: the scenarios' rows per device, the
headline (verdict, heaviest GPU, max/mean, cuda:0's excess), cuda:0's excess by cause with
the attribution's labels, the recommended fixes with their code and savings, the largest
batches, the equivalence check, notes, warnings, errors and the environment. Renderers read
this view and nothing else: they choose markup and human units, never a number or a label,
so the formats cannot drift apart. Numbers are bytes (``*_bytes``), seconds (``*_s``) and
plain counts; human units are the renderers' (:mod:`dpprof.reports.sentences` formats the
sentences several formats share).

JSON is not a view: ``-o run.json`` writes the result itself (the saved session that
``dpprof report run.json`` reads back and renders again through this module).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpprof.result import TimelinePoint

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
    nccl_bytes: int  # of context_bytes: NCCL's communicators (DDP ranks, DataParallel's GPUs)
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
class BusyView:
    """One GPU's share of a scenario's predicted step: seconds computing, communicating
    (``overlap_s`` of it beside a kernel, on the collective stream), waiting; busy and
    waiting add up to the step."""

    label: str
    compute_s: float
    communication_s: float
    waiting_s: float
    overlap_s: float = 0.0

    @property
    def busy_s(self) -> float:
        """The time the GPU ran anything (its streams' union)."""
        return self.compute_s + self.communication_s - self.overlap_s

    @property
    def exposed_communication_s(self) -> float:
        """The communication no kernel ran beside."""
        return self.communication_s - self.overlap_s


@dataclass(frozen=True)
class TimingView:
    """One scenario's step time: predicted without a GPU, measured beside it on real GPUs,
    and its speed-up over one GPU (``single``)."""

    scenario: str
    predicted_step_s: float | None
    predicted_samples_per_s: float | None
    speedup_predicted: float | None
    measured_step_s: float | None
    speedup_measured: float | None
    busy: tuple[BusyView, ...]


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
    (:mod:`dpprof.answers.attribution`, the only split of the excess)."""

    scenario: str
    primary_bytes: int  # cuda:0's peak allocated
    reference_bytes: int  # the median other device's peak
    excess_bytes: int
    causes: tuple[CauseView, ...]  # sums to the excess
    answer: str  # one sentence: what dominates and what fixes it
    negative_note: str | None  # why a cause is negative, where one is
    balanced: bool  # cuda:0 within 1 % of the others
    steps: tuple[CauseView, ...]  # the waterfall: large causes first, small ones folded
    primary: str = "cuda:0"  # the GPU whose excess it is (DataParallel's first device)

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
    why: str  # the answer's sentence: its detail, what it saves, needs and costs
    primary_peak_bytes: int | None  # cuda:0's peak with the fix
    max_peak_bytes: int | None  # the heaviest GPU's peak with the fix
    need_bytes: int | None  # its fullest GPU, as the out-of-memory check counts
    fits: bool | None  # None: its need is not known
    cost: str  # what the change costs, in the answer's words


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
    # (the scenario that fits the largest batch, its batch, dp-loss-primary's, their ratio)
    best_vs_primary: tuple[str, int, int, float] | None


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
class WriteRow:
    """One thing a script under ``dpprof run`` wrote (into its run's overlay)."""

    run: str
    path: str
    kind: str  # "file" | "folder" | "link" | "removed"
    size_bytes: int
    emulated_values: bool
    replaced: bool  # in place of a file of the user's (untouched)
    note: str  # what the flags mean, in words ("" when neither holds)


@dataclass(frozen=True)
class WritesView:
    """What ``dpprof run``'s script wrote, and the seal's check: the sentences and the rows."""

    summary: str  # how the writes were sealed, how many, what the check found
    rows: tuple[WriteRow, ...]
    more: int  # writes not among the rows
    changed: tuple[str, ...]  # the user's files found changed after a run (the seal broken)


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
    fixes: tuple[FixView, ...]  # every fix against the scenario the user ran, cheapest first
    recommended: FixView | None  # the answer's change (None: nothing to change)
    # "Recommended: <the change's title>", "Recommended: nothing to change" where what the
    # user runs fits as it is, "No recommendation" where nothing measured fits
    recommendation_heading: str
    recommendation_why: str  # why it (or nothing) is the answer
    passed_over: tuple[tuple[str, str], ...]  # (title, why not) of each cheaper change
    baseline: str  # the scenario that stands for what the user runs; the fixes are against it
    need_counts: str  # what a need counts, in words
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
    # the step time, predicted (and measured on real GPUs): one sentence, one row a scenario
    speed_sentence: str = ""
    timings: tuple[TimingView, ...] = ()
    # the GPU DataParallel's excess is measured on (its first device_ids: cuda:0 unless the
    # script names others), as the headings name it
    primary: str = "cuda:0"
    writes: WritesView | None = None  # `dpprof run`: what the script wrote

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
