"""The one view of a result (``dpprof.reports.view``) and the renderers' contract: every human
format renders the view and nothing else.

The contract is tested by rendering views whose numbers and labels were changed after they
were built: a renderer that read the result, or derived a number or a label of its own,
would show the result's value instead of the view's.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from reports_data import SAVED, report_words, saved

from dpprof.answers.answer import answer_of
from dpprof.reports import diff, terminal
from dpprof.reports.formats import renderers
from dpprof.reports.view import (
    AttributionView,
    CauseView,
    FixView,
    ReportView,
    ScenarioView,
)
from dpprof.reports.view_builder import build_view
from dpprof.result import Comparison
from dpprof.units import fmt_bytes

HUMAN = ("html", "markdown", "terminal")
REPORTS = Path(__file__).parent.parent / "reports"


def _render(fmt: str, view: ReportView) -> str:
    return report_words(fmt, renderers()[fmt].render_view(view))


# Distinct values no saved result has: each one can only come from the edited view.
EXCESS_BYTES = 5 * 2**40 + 3 * 2**38  # "+5.75 TiB"
PEAK_BYTES = 7 * 2**40 + 2**38  # "7.25 TiB"
CAUSE_BYTES = 3 * 2**40 + 2**39  # "+3.50 TiB"


def _edited(view: ReportView) -> ReportView:
    """``view`` with labels and numbers replaced after it was built."""
    first = view.drawn[0]
    d0 = dataclasses.replace(first.devices[0], peak_allocated_bytes=PEAK_BYTES,
                             over_capacity=False, out_of_memory=False)
    cells = tuple(d0 if c is first.devices[0] else c for c in first.cells)
    scenario = dataclasses.replace(first, excess_bytes=EXCESS_BYTES, imbalance=9.87,
                                   cells=cells, devices=(d0, *first.devices[1:]),
                                   notes=("scenario note from the view",))
    scenarios = tuple(scenario if s is first else s for s in view.scenarios)
    att: AttributionView = view.attributions[0]
    key = att.causes[0].key
    cause = CauseView(key, "cause label from the view", CAUSE_BYTES)
    att = dataclasses.replace(att, causes=(cause, *att.causes[1:]), steps=(cause,),
                              answer="answer from the view", balanced=False)
    fix = FixView(name="x", title="fix title from the view", detail="fix detail from the view",
                  code="print('code from the view')", code_lang="python",
                  saves_bytes=CAUSE_BYTES, heaviest_saves_bytes=CAUSE_BYTES,
                  primary_peak_bytes=1, max_peak_bytes=1, why="fix detail from the view",
                  need_bytes=1, fits=True, cost="cost from the view")
    return dataclasses.replace(
        view,
        headline=dataclasses.replace(view.headline, verdict="verdict from the view",
                                     verdict_parts=None),
        columns=tuple(f"gpu {k} from the view" for k in range(len(view.columns))),
        scenarios=scenarios,
        attributions=(att, *view.attributions[1:]),
        cause_rows=((key, "cause label from the view"), *view.cause_rows[1:]),
        fixes=(fix,), recommended=fix,
        recommendation_heading="Recommended: fix title from the view",
        notes=("note from the view",),
        assumptions=("assumption from the view",),
    )


@pytest.mark.parametrize("fmt", HUMAN)
@pytest.mark.parametrize("name", list(SAVED))
def test_every_format_renders_the_view_it_is_given(name: str, fmt: str) -> None:
    view = _edited(build_view(saved(name)))
    words = _render(fmt, view)
    shown = [
        "verdict from the view",
        *view.columns,
        fmt_bytes(EXCESS_BYTES, signed=True),
        fmt_bytes(PEAK_BYTES),
        "9.87",
        "cause label from the view",
        fmt_bytes(CAUSE_BYTES, signed=True),
        "fix title from the view",
    ]
    if fmt == "terminal":  # each scenario's notes under the table; no provenance section
        shown += ["answer from the view", "fix detail from the view",
                  "scenario note from the view"]
    else:
        shown += ["note from the view", "assumption from the view",
                  "code from the view", "fix detail from the view"]
    missing = [s for s in shown if s not in words]
    assert not missing, (fmt, missing)
    # the result's own verdict is gone: nothing was read past the view
    assert " ".join(saved(name).comparison.verdict.split()) not in words


@pytest.mark.parametrize("name", list(SAVED))
def test_the_formats_show_the_same_numbers_and_labels(name: str) -> None:
    """The view's strings, formatted once, appear in every human format."""
    view = build_view(saved(name))
    rendered = {fmt: _render(fmt, view) for fmt in HUMAN}
    expected: list[str] = [*view.columns]
    for s in view.scenarios:
        expected.append(s.name)
        if s.excess_bytes is not None:
            expected.append(fmt_bytes(s.excess_bytes, signed=True))
        if s.imbalance is not None:
            expected.append(f"{s.imbalance:.2f}")
        expected += [fmt_bytes(d.peak_allocated_bytes) for d in s.cells if d is not None]
    for a in view.attributions:
        expected.append(fmt_bytes(a.excess_bytes, signed=True))
        expected += [c.label for c in a.causes
                     if c.bytes and abs(c.bytes) > 0.01 * max(a.primary_bytes, 1)]
    for fmt, words in rendered.items():
        missing = [e for e in expected if e not in words]
        assert not missing, (fmt, missing)


def test_the_terminal_shows_every_host_s_gpus() -> None:
    """Defect: the terminal looked devices up by CUDA index, so on two hosts it showed
    node-a's cuda:0 and cuda:1 under "cuda:0".."cuda:3" and node-b's GPUs not at all (the
    heaviest DDP rank, node-b/cuda:0 at 15.7 GiB, was missing). Now its columns are the
    view's, as in Markdown and HTML."""
    run = saved("synthetic-ddp-2-nodes")
    ddp = run.scenario("ddp")
    assert ddp is not None
    heaviest = max(ddp.devices, key=lambda d: d.peak_allocated_bytes)
    assert heaviest.node == "node-b"
    text = renderers()["terminal"].render(run)
    header = next(line for line in text.splitlines() if "scenario" in line)
    assert header.split()[1:5] == ["node-a/cuda:0", "node-a/cuda:1", "node-b/cuda:0",
                                   "node-b/cuda:1"]
    row = next(line for line in text.splitlines() if line.split()[:1] == ["ddp"])
    assert re.findall(r"\d+\.\d+ GiB", row)[:4] == [
        fmt_bytes(d.peak_allocated_bytes) for d in ddp.devices]
    assert fmt_bytes(heaviest.peak_allocated_bytes) in row


@pytest.mark.parametrize("name", list(SAVED))
def test_headline_is_the_comparison_s_most_imbalanced_scenario(name: str) -> None:
    run = saved(name)
    h = build_view(run).headline
    worst = max(run.comparison.scenarios, key=lambda k: run.comparison.scenarios[k].imbalance)
    c = run.comparison.scenarios[worst]
    assert h.verdict == answer_of(run).verdict
    assert (h.scenario, h.imbalance, h.heaviest_bytes, h.excess_bytes) == (
        worst, c.imbalance, c.max_bytes, c.primary_excess_bytes)


@pytest.mark.parametrize("name", list(SAVED))
def test_attribution_in_the_view_is_the_comparison_s_excess_split(name: str) -> None:
    run = saved(name)
    view = build_view(run)
    assert view.attributions
    for a in view.attributions:
        assert sum(c.bytes for c in a.causes) == a.excess_bytes
        assert sum(c.bytes for c in a.steps) == a.excess_bytes  # folding keeps the total
        assert a.excess_bytes == run.comparison.scenarios[a.scenario].primary_excess_bytes
        s = view.scenario(a.scenario)
        assert isinstance(s, ScenarioView) and a.primary_bytes == s.devices[0].peak_allocated_bytes


def test_the_diff_is_made_of_the_two_views() -> None:
    before, after = saved("synthetic-nvml"), saved("synthetic-ddp-2-nodes")
    rd = diff.diff(before, after)
    assert isinstance(rd.before, ReportView) and isinstance(rd.after, ReportView)
    ddp = next(s for s in rd.scenarios if s.name == "ddp")
    # device labels are the view's: node-b's GPUs are new in the after run
    new = [d for d in ddp.devices if d.before_bytes is None]
    assert [d.label for d in new] == ["node-a/cuda:0", "node-a/cuda:1", "node-b/cuda:0",
                                      "node-b/cuda:1"]


def test_json_is_the_result_not_a_view() -> None:
    run = saved("emulated-lm")
    with pytest.raises(TypeError, match="not a view"):
        renderers()["json"].render_view(build_view(run))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


@pytest.mark.parametrize("module", ["html", "html_figures", "html_page", "markdown", "terminal",
                                    "diff", "answer_sections", "watch_sections", "sentences"])
def test_renderers_read_no_analysis_and_no_result_fields(module: str) -> None:
    """Only the view builder reads the answers; a renderer imports from the result module
    no more than ``RunResult`` (for its one-line ``render(run)``) and ``json_safe``."""
    imported = _imports(REPORTS / f"{module}.py")
    assert not [m for m in imported if m.startswith("dpprof.answers")], module
    assert {m for m in imported if m.startswith("dpprof.result.")} <= {
        "dpprof.result.RunResult", "dpprof.result.json_safe"}, module


def test_terminal_render_is_the_view_rendered() -> None:
    run = saved("cpu-mlp")
    from rich.console import Console

    def text(renderable: object) -> str:
        c = Console(record=True, width=160, color_system=None)
        with c.capture():
            c.print(renderable)
        return c.export_text()

    assert text(terminal.render(run)) == text(terminal.render_view(build_view(run)))


@pytest.mark.parametrize("fmt", HUMAN)
def test_a_result_without_a_comparison_says_so_in_every_format(fmt: str) -> None:
    run = dataclasses.replace(saved(next(iter(SAVED))), scenarios=(), comparison=Comparison(),
                              recommended=None)  # its answer was of the scenarios taken out
    view = build_view(run)
    assert view.headline.verdict in _render(fmt, view)
    assert view.headline.verdict == "No scenario was run."
