"""One answer, the same in every format: for results hypothesis generates and every saved
result in ``tests/data``, the change JSON names (``recommended``), HTML ("Recommended: <the
fix's title>"), Markdown and the terminal recommend is the same; it fits; no cheaper change
that lowers the heaviest GPU fits with the policy's margin; every size and ratio in the
answer's sentences is one of the result's. And a command computes it once."""

from __future__ import annotations

import dataclasses
import html as std_html
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from reports_data import SAVED, saved
from test_answers import SIZE, _figures, results
from typer.testing import CliRunner

from dpprof.answers import answer as answers
from dpprof.answers.answer import answer_of, settled
from dpprof.fixes.fix_registry import cost_of
from dpprof.fixes.policy import IMBALANCE_THRESHOLD, margin_bytes
from dpprof.reports.formats import renderers
from dpprof.result import Recommendation, RunResult

NOTHING = "nothing to change"
NONE_FOUND = "none found"  # the heading "No recommendation": nothing measured fits
RATIO = re.compile(r"(?<![\w.])(\d+\.\d\d)x\b")


def named(run: RunResult) -> dict[str, str]:
    """The change each format recommends, by title ("nothing to change": none wanted, "none
    found": the heading says there is no recommendation)."""
    data = json.loads(renderers()["json"].render(run))["recommended"]
    titles = {a["fix"]: a["title"] for a in data["fixes"]}  # the fixes it read, by name
    page = renderers()["html"].render(run)
    text = renderers()["markdown"].render(run)
    term = renderers()["terminal"].render(run)
    heading = r"(?:Recommended: (.*?)|No recommendation)"
    html_title = re.search(rf"<h3>{heading}</h3>", page)
    md_title = re.search(rf"^\*\*{heading}\*\*$", text, re.M)
    term_title = re.search(rf"^{heading}\s*$", term, re.M)
    assert html_title and md_title and term_title
    json_title = (titles.get(data["fix"], data["fix"]) if data["fix"] else
                  NOTHING if data["fits"] else NONE_FOUND)
    return {
        "json": json_title,
        "html": std_html.unescape(html_title.group(1) or NONE_FOUND),
        "markdown": re.sub(r"\\(.)", r"\1",
                           std_html.unescape(md_title.group(1) or NONE_FOUND)),
        "terminal": term_title.group(1) or NONE_FOUND,
    }


def _ratios(run: RunResult) -> set[str]:
    out = {f"{IMBALANCE_THRESHOLD:.2f}"}
    out |= {f"{c.imbalance:.2f}" for c in run.comparison.scenarios.values()}
    ratio = answers.maxbatch_ratio(run)
    if ratio is not None:
        out.add(f"{ratio[3]:.2f}")
    return out


def check(run: RunResult) -> Recommendation:
    run = settled(run)  # as a command does, once its result is complete
    answer = run.recommended
    assert answer is not None
    said = named(run)
    assert len(set(said.values())) == 1, said
    if answer.fix is None:
        # "nothing to change" only where the scenario the user runs was measured and fits
        base = run.scenario(answer.baseline) if answer.baseline else None
        fits = base is not None and base.status == "ok"
        assert said["html"] == (NOTHING if fits else NONE_FOUND), (said, answer.why)
        # and the verdict's words agree with the heading
        assert ("recommended: nothing to change" in answer.verdict) <= fits, answer.verdict
    else:
        chosen = next(a for a in answer.fixes if a.fix == answer.fix)
        assert said["html"] == chosen.title
        # it fits, and it lowers the heaviest GPU of the scenario the user ran
        assert chosen.fits is True and chosen.need_bytes is not None
        assert chosen.need_bytes <= run.gpu_memory_bytes
        assert chosen.heaviest_saves_bytes > 0
        # no cheaper change that lowers it fits with the margin
        for a in answer.fixes:
            if a.cost_rank < chosen.cost_rank and a.heaviest_saves_bytes > 0 and a.fits:
                margin = margin_bytes(run.gpu_memory_bytes, a.need_bytes or 0, cost_of(a.fix))
                lowers = next(p.reason for p in answer.passed_over if p.fix == a.fix)
                assert (a.spare_bytes or 0) < margin or "does not lower" in lowers, (a, answer)
    # every size and ratio in the answer's own sentences is one of the result's
    details = {f.name: f.detail for f in run.fixes}
    sentences = [answer.verdict, answer.why, *answer.why_heavier.values(),
                 *(p.reason for p in answer.passed_over),
                 *(a.why.replace(details[a.fix].rstrip(".") + ".", "")
                   if details.get(a.fix) else a.why for a in answer.fixes)]
    text = " ".join(sentences)
    figures = _figures(run)
    assert not [m for m in SIZE.findall(text) if m not in figures], text
    ratios = _ratios(run)
    assert not [m for m in RATIO.findall(text) if m not in ratios], text
    return answer


@pytest.mark.parametrize("name", list(SAVED))
def test_every_saved_result_says_one_answer(name: str) -> None:
    check(saved(name))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(results())
def test_generated_results_say_one_answer(run: RunResult) -> None:
    check(run)


def test_the_issue_s_24_gb_case_recommends_bf16_on_ddp() -> None:
    """``compare --gpu rtx-4090 -b 512``: the verdict named bf16 autocast on DDP, the HTML
    recommended FSDP2 with bf16 and checkpointing (the lowest peak) and the Markdown listed
    that first. The loss inside forward fits by less than the margin, DDP does not fit: the
    cheapest rung that fits with the margin is the answer, everywhere."""
    run = saved("emulated-lm")
    gib = 2**30
    # the saved run is 4 A100s': DataParallel's NCCL communicators over NVLink hold 0.5 GiB a
    # GPU more than over the 4090s' PCIe; 24.5 GiB puts the loss inside forward where the
    # 4090s' own run has it, fitting by less than the margin
    capacity = int(24.5 * gib)
    from dpprof.result import STATUS_OOM, Fix

    scenarios = []
    for s in run.scenarios:
        s = dataclasses.replace(s, devices=tuple(
            dataclasses.replace(d, capacity_bytes=capacity) for d in s.devices))
        if max(d.total_peak_bytes for d in s.devices) > capacity:
            s = dataclasses.replace(s, status=STATUS_OOM, oom_device=0)
        scenarios.append(s)
    run = dataclasses.replace(run, gpu_memory_bytes=capacity, scenarios=tuple(scenarios))
    fixes = list(run.fixes)
    base = next(d.peak_allocated_bytes for d in run.scenario("dp-loss-primary").devices)
    for name, title, peak, need in (
            ("ladder-bf16", "Mixed precision (bf16 autocast)", 16.7, 21.2),
            ("ladder-fsdp2-zero3-bf16-checkpoint", "FSDP2, ZeRO-3, bf16 and checkpointing",
             8.13, 9.65)):
        fixes.append(Fix(name=name, title=title, primary_peak_bytes=int(peak * gib),
                         max_peak_bytes=int(peak * gib),
                         heaviest_saves_bytes=base - int(peak * gib),
                         need_bytes=int(need * gib), baseline="dp-loss-primary"))
    answer = check(dataclasses.replace(run, fixes=tuple(fixes)))
    assert answer.fix == "ladder-bf16"
    passed = {p.fix: p.reason for p in answer.passed_over}
    assert "under the margin" in passed["loss-in-forward"]
    assert passed["ddp"].startswith("it does not fit")


def test_a_command_builds_the_answer_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """One ``compare`` called the builder five times (the comparison, the answers, and each
    of three formats); now once, and every format shows what it stored."""
    from dpprof.cli.app import app

    calls: list[int] = []
    real = answers.build_answer

    def counted(run: RunResult) -> Recommendation:
        calls.append(1)
        return real(run)

    monkeypatch.setattr(answers, "build_answer", counted)
    out = [str(tmp_path / f"r.{x}") for x in ("html", "md", "json")]
    r = CliRunner().invoke(app, ["compare", "-w", "mlp", "-b", "16", "-o", out[0], "-o", out[1],
                                 "-o", out[2]])
    assert r.exit_code == 0, r.output
    assert len(calls) == 1
    stored = RunResult.from_dict(json.loads(Path(out[2]).read_text()))
    assert stored.recommended is not None
    assert answer_of(stored) is stored.recommended
    title = stored.recommended.title or NOTHING
    assert f"Recommended: {title}" in r.output
    assert f"<h3>Recommended: {std_html.escape(title)}</h3>" in Path(out[0]).read_text()


def test_maxbatch_names_the_scenario_that_fits_the_most() -> None:
    """maxbatch's summary compared DDP with DataParallel only, and left out dp-loss-forward,
    which fits more (1,800 against DDP's 1,520)."""
    from dpprof.result import MaxBatch, MaxBatchEntry

    gib = 2**30
    run = RunResult(backend="emulated", workload="lm", batch=0, gpus=4,
                    gpu_memory_bytes=int(79.25 * gib),
                    maxbatch=MaxBatch(capacity_bytes=int(79.25 * gib), gpu="a100-80gb",
                                      multiple_of=8, entries=(
                                          MaxBatchEntry("dp-loss-primary", 544, 0, 78 * gib),
                                          MaxBatchEntry("dp-loss-forward", 1800, 0, 79 * gib),
                                          MaxBatchEntry("ddp", 1520, 0, 79 * gib),
                                          MaxBatchEntry("single", 1536, 0, 79 * gib))))
    answer = check(run)
    assert "dp-loss-forward fits the largest, 3.31x the batch of dp-loss-primary " \
           "(1800 vs 544)" in answer.verdict
    assert "DDP fits" not in answer.verdict
    assert answer.why == "dp-loss-forward fits the largest batch (1800)."
