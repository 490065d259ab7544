"""The one view of a result built from it (:func:`build_view`): each scenario's rows per
device and timelines, the headline, the alerts and tracebacks, cuda:0's excess by cause, the
fixes, the largest batches, the equivalence check and ``dpprof watch``'s part, each number
read off the :class:`~dpprof.result.RunResult` once and every sentence from the one answer
the result stores (:func:`dpprof.answers.answer.answer_of`). The view's types are
:mod:`dpprof.reports.view`."""

from __future__ import annotations

from dpprof.answers.answer import answer_of, maxbatch_ratio
from dpprof.answers.answer_figures import (
    BALANCED_FRACTION,
    counts,
    primary_label,
    run_primary_label,
)
from dpprof.answers.attribution import CAUSES, attribute, cause_label
from dpprof.answers.post_mortem import post_mortem
from dpprof.answers.speed import speed_sentence, speed_ups
from dpprof.reports.view import (
    Alert,
    AttributionView,
    BusyView,
    CauseView,
    DeviceView,
    EquivalenceEntryView,
    EquivalenceView,
    FixView,
    Headline,
    MaxBatchEntryView,
    MaxBatchView,
    MemoryRow,
    ReportView,
    ScenarioView,
    SeriesView,
    TimelineView,
    TimingView,
    WatchRowView,
    WatchView,
    WriteRow,
    WritesView,
)
from dpprof.result import (
    CATEGORIES,
    STATUS_OK,
    STATUS_OOM,
    Attribution,
    DeviceResult,
    Fix,
    FixAnswer,
    Recommendation,
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
    # the peaks once a warm-up's transients are gone, where the peaks above count some
    ("steady_peak_allocated_bytes", "steady allocated"),
    ("steady_peak_reserved_bytes", "steady reserved"),
)
TRACEBACK_MAX_CHARS = 20_000  # the end of a long traceback (where the error is) is shown
TRACEBACK_TAIL_LINES = 6  # the terminal's share of it
SMALL_CAUSE_DIVISOR = 200  # causes under 1/200 of cuda:0's peak: one step, "smaller causes"
NEGATIVE_NOTE = ("A negative cause: the reference GPU holds more of it at its own peak "
                 "(e.g. its replica's gradients, or its share of the output gradient).")


def build_view(run: RunResult) -> ReportView:
    """The one view of ``run`` every human format renders."""
    real = run.backend == "cuda"
    answer = answer_of(run)
    scenarios = tuple(_scenario(run, s) for s in run.scenarios)
    ref = max(scenarios, key=lambda s: len(s.all_devices), default=None)
    columns = tuple(d.label for d in ref.all_devices) if ref and ref.all_devices else tuple(
        f"cuda:{i}" for i in range(run.gpus))
    drawn = [s for s in scenarios if s.measured and s.devices]
    attributions = tuple(a for s in run.scenarios if s.name in answer.why_heavier
                         and (a := _attribution(run, s, answer)) is not None)
    found = {f.name: f for f in run.fixes}
    fixes = tuple(_fix(found.get(a.fix), a) for a in answer.fixes)
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
        cause_rows=tuple((c, cause_label(c, run_primary_label(run))) for c in CAUSES
                         if any(a.bytes_of(c) for a in attributions)),
        attribution_top_bytes=max((max(a.primary_bytes, a.reference_bytes)
                                   for a in attributions), default=0),
        fixes=fixes,
        recommended=next((f for f in fixes if f.name == answer.fix), None),
        recommendation_heading=_heading(answer),
        recommendation_why=answer.why,
        passed_over=tuple((p.title, p.reason) for p in answer.passed_over),
        baseline=answer.baseline or "",
        need_counts=counts(run),
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
        watch=_watch(run, run.watch) if run.watch is not None else None,
        speed_sentence=speed_sentence(run),
        timings=_timings(run),
        primary=run_primary_label(run),
        writes=_writes(run),
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


def _busy(label: str, split: dict[str, float], step_s: float | None) -> BusyView:
    """One GPU's split of the predicted step. A result saved before the overlap of its two
    streams was predicted counts it at least as the time their sum exceeds the step (a GPU
    is never busy longer than the step)."""
    compute, communication = split.get("compute", 0.0), split.get("communication", 0.0)
    overlap = split.get("overlap")
    if overlap is None:
        overlap = max(compute + communication - (step_s or 0.0), 0.0) if step_s else 0.0
    return BusyView(label, compute, communication, split.get("waiting", 0.0), overlap)


def _timings(run: RunResult) -> tuple[TimingView, ...]:
    """Each timed scenario's step (predicted; measured on real GPUs) and each GPU's split."""
    ups = {u.scenario: u for u in speed_ups(run)}
    out = []
    for s in run.scenarios:
        if s.status != "ok" or (s.predicted_step_time_s is None and s.step_time_s is None):
            continue
        up = ups.get(s.name)
        busy = tuple(_busy(_label(s, d), d.predicted_busy_s, s.predicted_step_time_s)
                     for d in s.devices if d.used and d.predicted_busy_s)
        out.append(TimingView(
            scenario=s.name, predicted_step_s=s.predicted_step_time_s,
            predicted_samples_per_s=s.predicted_samples_per_s,
            speedup_predicted=up.predicted if up else None,
            measured_step_s=s.step_time_s, speedup_measured=up.measured if up else None,
            busy=busy))
    return tuple(out)


def _heading(answer: Recommendation) -> str:
    """The recommendation's heading: the change, or whether none is wanted (what the user
    runs fits) or none was found (it does not fit, or nothing was measured)."""
    if answer.fix is not None:
        return f"Recommended: {answer.title}"
    return "Recommended: nothing to change" if answer.fits else "No recommendation"


def _headline(answer: Recommendation, scenarios: tuple[ScenarioView, ...]) -> Headline:
    verdict, parts = answer.verdict, None
    cut = verdict.find(answer.verdict_oom) if answer.verdict_oom else -1
    if cut >= 0:
        end = cut + len(answer.verdict_oom)
        parts = (verdict[:cut], verdict[cut:end], verdict[end:])
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


def _attribution(run: RunResult, s: ScenarioResult, answer: Recommendation
                 ) -> AttributionView | None:
    """cuda:0's excess by cause in ``s``: the result's attribution (computed by the same
    function for results saved without one), with the answer's sentence."""
    att: Attribution | None = run.attribution.get(s.name) or attribute(s)
    used = [d for d in s.devices if d.used]
    if att is None or not used or not _measured(s):
        return None
    primary, gpu = used[0].peak_allocated_bytes, primary_label(s)
    causes = tuple(CauseView(k, cause_label(k, gpu), v) for k, v in att.causes_bytes.items())
    small = max(primary // SMALL_CAUSE_DIVISOR, 1)
    steps = sorted((c for c in causes if abs(c.bytes) >= small), key=lambda c: -abs(c.bytes))
    folded = sum(c.bytes for c in causes if abs(c.bytes) < small)
    if folded:
        steps.append(CauseView("", "smaller causes", folded))
    return AttributionView(
        scenario=s.name, primary_bytes=primary, reference_bytes=primary - att.excess_bytes,
        excess_bytes=att.excess_bytes, causes=causes,
        answer=answer.why_heavier.get(s.name, att.answer),
        negative_note=NEGATIVE_NOTE if any(c.bytes < 0 for c in causes) else None,
        balanced=abs(att.excess_bytes) <= BALANCED_FRACTION * max(primary, 1),
        steps=tuple(steps), primary=gpu)


def _fix(f: Fix | None, a: FixAnswer) -> FixView:
    """A fix as the answer reads it against the scenario the user ran (``a``)."""
    code = f.code if f is not None else ""
    lang = "diff" if code.lstrip().startswith(("-", "+", "@@")) else "python"
    return FixView(name=a.fix, title=a.title, detail=f.detail if f is not None else "",
                   code=code, code_lang=lang, saves_bytes=a.primary_saves_bytes,
                   heaviest_saves_bytes=a.heaviest_saves_bytes,
                   primary_peak_bytes=f.primary_peak_bytes if f is not None else None,
                   max_peak_bytes=f.max_peak_bytes if f is not None else None,
                   need_bytes=a.need_bytes, fits=a.fits, cost=a.cost, why=a.why)


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
        best_vs_primary=maxbatch_ratio(run))


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


def _watch(run: RunResult, w: WatchResult) -> WatchView:
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
    # stored by the watch (dpprof.watch.analysis); built for a result saved without them
    lines, steps = (w.post_mortem, w.next_steps) if w.post_mortem else post_mortem(w)
    series = tuple(SeriesView(f"cuda:{d.index}", tuple(d.timeline))
                   for d in (run.scenarios[0].devices if run.scenarios else []) if d.timeline)
    return WatchView(
        interval_s=w.interval_s,
        message=run.scenarios[0].message if run.scenarios else "",
        rows=tuple(rows), post_mortem=tuple(lines),
        oom_text=w.ooms[0].text if w.ooms else None,
        oom_times_s=tuple(o.t_s for o in w.ooms if o.t_s is not None),
        next_steps=tuple(steps),
        signals=tuple((float(s.get("t_s", 0)), str(s.get("signal") or ""),
                       str(s.get("action", ""))) for s in w.signals),
        samples_path=w.samples_path, series=series)


MAX_WRITE_ROWS = 200  # rows of the writes' table (the JSON result holds them all)


def _writes(run: RunResult) -> WritesView | None:
    """What a script under ``dpprof run`` wrote into its runs' overlays, and the seal's
    check."""
    seal = run.seal
    if seal is None:
        return None
    files = [w for w in run.writes if w.kind in ("file", "link")]
    removed = [w for w in run.writes if w.kind == "removed"]
    total = len(run.writes) + seal.omitted_writes
    how = ("by Python's file calls and the kernel's mount namespace" if "kernel" in seal.lines
           else "by Python's file calls (no mount namespace here: an audit hook stops a "
           "write around them)")
    if seal.changed:
        check = (f"SEAL BROKEN: {len(seal.changed)} file(s) of yours changed while the "
                 "script ran")
    else:
        check = (f"your files are as they were after every run ({seal.checked_entries} "
                 "checked" + ("" if seal.checked_all else ", the shallowest of more") + ")")
    if total:
        emulated = sum(w.emulated_values for w in files)
        what = (f"the script wrote {len(files)} file(s)"
                + (f" ({emulated} with values of the virtual GPUs)" if emulated else "")
                + (f" and removed {len(removed)}" if removed else "")
                + f", each run into a private overlay {how}, never into your files")
    else:
        what = f"the script wrote nothing (each run was sealed {how})"
    kept = f"; kept in {seal.kept_in}" if seal.kept_in else ""
    rows = tuple(WriteRow(w.run, w.path, w.kind, w.size_bytes, w.emulated_values, w.replaced,
                          _write_note(w.kind, w.emulated_values, w.replaced))
                 for w in run.writes[:MAX_WRITE_ROWS])
    return WritesView(summary=f"{what}; {check}{kept}", rows=rows,
                      more=total - len(rows), changed=tuple(seal.changed))


def _write_note(kind: str, emulated_values: bool, replaced: bool) -> str:
    words = []
    if emulated_values:
        words.append("values of the virtual GPUs (stand-ins)")
    if replaced and kind != "removed":
        words.append("in place of your file, which is as it was")
    elif kind == "removed":
        words.append("removed in the run's view; your file is as it was")
    return "; ".join(words)
