"""The HTML report against every saved result: order, content, escaping, size, offline."""

import dataclasses
import html as std_html
import json
import re

import pytest
from reports_data import HOSTILE, SAVED, hostile, saved

from dpprof.reports import html, html_page
from dpprof.result import RunResult


def _figures(page: str) -> dict:
    m = re.search(r'<script id="dpprof-figures" type="application/json">(.*?)</script>', page,
                  re.S)
    assert m
    return json.loads(m.group(1))


def _legend(fig: dict) -> list[str]:
    """The names a figure's legend shows."""
    return [t["name"] for t in fig["data"] if t.get("showlegend", True)]


def _headings(page: str) -> list[str]:
    return [std_html.unescape(h) for h in re.findall(r"<h2><span class='n'>\d+</span>(.*?)</h2>",
                                                      page)]


def test_the_default_comparison_reads_top_to_bottom() -> None:
    run = saved("emulated-lm")
    page = html.render(run)
    heads = _headings(page)
    # emulated: the step time predicted, no largest batch (absent, not empty)
    assert heads == ["Peak memory per GPU", "Why cuda:0 is heavier", "Memory over the step",
                     "Step time, predicted", "What to change",
                     "How these numbers were obtained"]
    figs = _figures(page)
    peaks = figs["peaks"]
    # one legend entry per scenario (the hatched parts above the bars share theirs), then
    # the capacity line's
    assert _legend(peaks) == [*(s.name for s in run.scenarios), "capacity 79.2 GiB per GPU"]
    cap_line = peaks["layout"]["shapes"][0]
    assert cap_line["y0"] == pytest.approx(79.25)  # the default A100 80GB's capacity line
    wf = figs["excess-0"]["data"][0]
    assert wf["y"][0] == "median other GPU" and wf["y"][-1] == "cuda:0"
    # the largest cause first, wrapped for a phone's width
    assert wf["y"][1] == "loss, its temporaries<br>and its gradient"
    # the waterfall's steps lead from the median other GPU to cuda:0
    level = wf["x"][0]
    for step, base in zip(wf["x"][1:-1], wf["base"][1:-1], strict=True):
        assert base == pytest.approx(level, abs=1e-3)
        level += step
    assert level == pytest.approx(wf["x"][-1], abs=0.01)
    assert "timeline-0" in figs and "Compute the loss inside forward" in page
    assert "Emulated: 4 virtual GPU(s) of 79.2 GiB over meta tensors" in page
    # phases are marked on the timelines
    tl = figs["timeline-0"]["layout"]
    assert {a["text"] for a in tl["annotations"]} >= {"forward", "backward"}
    assert any(sh["type"] == "rect" for sh in tl["shapes"])


def test_default_comparison_report_is_small_and_offline() -> None:
    page = html.render(saved("emulated-lm"))
    assert len(page.encode()) < 5 * 2**20
    assert len(page.encode()) < 2 * 2**20  # the basic bundle, not the full 4.8 MB one
    # nothing is fetched: no src/href attribute to anywhere, a CSP that forbids it anyway
    assert not re.search(r"""\s(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "default-src 'none'" in page


def test_real_gpu_shapes_show_timing_max_batch_and_nvml() -> None:
    run = saved("synthetic-nvml")
    page = html.render(run)
    heads = _headings(page)
    assert "Step time and throughput" in heads and "Largest batch that fits" in heads
    assert "610.0 ms" in page  # dp-loss-primary's step time
    figs = _figures(page)
    assert figs["timing"]["data"][0]["x"][0] == pytest.approx(512 / 0.61)
    assert figs["maxbatch"]["data"][0]["x"] == [s.max_batch for s in run.scenarios
                                                if s.max_batch is not None]
    names = [t["name"] for t in figs["timeline-0"]["data"]]
    assert "cuda:0" in names and "cuda:0 allocated" in names  # NVML used, and allocated
    assert "seconds since the step began" in json.dumps(figs["timeline-0"]["layout"])
    assert "synthetic: built by tests/synthetic.py" in page
    assert "Measured on 4 CUDA GPU(s)" in page


def test_oom_is_called_out_in_red() -> None:
    page = html.render(saved("synthetic-oom"))
    m = re.search(r"<p class='verdict bad' id='verdict'>(.*?)</p>", page, re.S)
    assert m and "<span class='oom'>out of memory at 24.0 GiB per GPU" in m.group(1)
    assert "<li class='oom'>dp-loss-primary ran out of memory on cuda:0 (tried to allocate " \
           "3.00 GiB)" in page
    assert "<span class='oom'>OOM</span>" in page
    peaks = _figures(page)["peaks"]["data"]
    # the label sits on the top of the bar: allocated, reserved beyond it and the context
    top = next(t for t in peaks if t["name"] == "dp-loss-primary: reserved and context")
    assert top["text"][0] == "OOM<br>24.3"


def test_ddp_over_two_nodes_labels_devices_by_host() -> None:
    page = html.render(saved("synthetic-ddp-2-nodes"))
    ddp = next(t for t in _figures(page)["peaks"]["data"] if t["name"] == "ddp")
    assert ddp["x"] == ["node-a/cuda:0", "node-a/cuda:1", "node-b/cuda:0", "node-b/cuda:1"]


def test_emulated_ddp_shows_one_rank_and_says_why() -> None:
    page = html.render(saved("emulated-lm"))
    assert "Emulated DDP: every rank runs the same program; rank 0 shown." in page


def test_a_hostile_result_renders_as_text() -> None:
    for name in SAVED:
        page = html.render(hostile(saved(name)))
        assert "<script>window.__pwned" not in page
        assert "<img src=x" not in page
        assert "<b>bold</b>" not in page
        assert std_html.escape(HOSTILE, quote=True) in page  # shown, as text
        # inside the figure JSON, '<' never appears raw; plotly labels get entities
        m = re.search(r'<script id="dpprof-figures" type="application/json">(.*?)</script>',
                      page, re.S)
        assert m and "<" not in m.group(1)
        figs = json.loads(m.group(1))
        text = json.dumps(figs)
        assert "&lt;script&gt;" in text  # the labels plotly draws carry entities
        assert not re.search(r"<(script|img|b>|a )", text)
        # exactly the three scripts dpprof writes
        assert page.count("<script") == 3


def test_nothing_to_fix_when_balanced() -> None:
    run = saved("emulated-lm")
    run = dataclasses.replace(
        run, scenarios=tuple(s for s in run.scenarios if s.name in ("ddp", "single")),
        fixes=(), attribution={},  # a run of these two scenarios has neither
        recommended=None)  # edited: its stored answer is of the run it was
    page = html.render(run)
    assert "Switch to DistributedDataParallel" in page or "Nothing to change" in page
    assert "Compute the loss inside forward" not in page


def test_a_run_where_every_scenario_failed_still_renders() -> None:
    from dpprof.reports import markdown

    run = saved("cpu-mlp")
    run = dataclasses.replace(run, scenarios=tuple(
        dataclasses.replace(s, status="error", message="RuntimeError: boom <b>", devices=())
        for s in run.scenarios))
    from dpprof.answers.comparison import compare

    # edited: its stored answer is of the run it was
    run = dataclasses.replace(run, comparison=compare(run), recommended=None)
    page = html.render(run)
    assert "failed: dp-loss-primary" in page and "RuntimeError: boom &lt;b&gt;" in page
    assert _figures(page) == {}
    assert _headings(page) == ["What to change", "How these numbers were obtained"]
    text = markdown.render(run)
    assert "```mermaid" not in text and "boom &lt;b&gt;" in text


def test_small_runs_are_charted_in_mib() -> None:
    page = html.render(saved("cpu-mlp"))
    figs = _figures(page)
    assert figs["peaks"]["layout"]["yaxis"]["title"]["text"] == "peak memory (MiB)"
    assert max(figs["peaks"]["data"][0]["y"]) == pytest.approx(288, abs=1)
    assert "capacity 79.2 GiB per GPU (above the scale)" in _legend(figs["peaks"])
    assert "shapes" not in figs["peaks"]["layout"]  # no line: it is off the scale


def test_reserved_and_nvml_peaks_only_where_known() -> None:
    assert "<th>NVML used</th>" in html.render(saved("synthetic-nvml"))
    assert "NVML used" not in html.render(saved("emulated-lm"))


def test_the_results_own_attribution_fixes_and_max_batch_are_rendered() -> None:
    """The reports render the result's attribution, fixes and largest batch as they are."""
    from dpprof.reports import markdown
    from dpprof.result import Attribution, Fix, MaxBatch, MaxBatchEntry

    run = saved("emulated-lm")
    excess = run.comparison.scenarios["dp-loss-primary"].primary_excess_bytes
    run = dataclasses.replace(
        run, attribution={"dp-loss-primary": Attribution(
            scenario="dp-loss-primary", excess_bytes=excess,
            causes_bytes={"loss": excess - 2**30, "gathered_outputs": 2**30})},
        fixes=(Fix(name="ddp", title="Emulated fix", detail="measured with the change applied",
                   code="fixed = True", saves_bytes=3 * 2**30,
                   heaviest_saves_bytes=3 * 2**30, max_peak_bytes=60 * 2**30),
               Fix(name="output-device", title="Moves it", code="moved = True",
                   saves_bytes=2**30, heaviest_saves_bytes=0)),
        maxbatch=MaxBatch(capacity_bytes=run.gpu_memory_bytes, entries=(
            MaxBatchEntry(scenario="ddp", max_batch=2048),
            MaxBatchEntry(scenario="dp-loss-primary", max_batch=None))),
        recommended=None)  # edited: its stored answer is of the run it was
    page = html.render(run)
    figs = _figures(page)
    wf = figs["excess-0"]["data"][0]
    assert wf["y"][1:3] == ["loss, its temporaries<br>and its gradient", "gathered outputs"]
    assert "Recommended: Emulated fix" in page
    assert "Against dp-loss-primary: the heaviest GPU peaks at 60.0 GiB, 3.00 GiB less." in page
    # each change against the scenario the user ran, with what it needs and whether it fits
    assert re.search(r"<td>Emulated fix</td><td>3.00 GiB</td><td>60.0 GiB</td><td>[^<]+ GiB"
                     r"</td><td>fits</td>", page)
    assert "fixed = True" in page and "ModelWithLoss(model, loss_fn)" not in page
    assert "moved = True" not in page  # the heaviest GPU is as heavy: not recommended
    assert figs["maxbatch"]["data"][0]["y"] == ["ddp"]
    text = markdown.render(run)
    assert "| ddp | 2048 |" in text and "**Recommended: Emulated fix**" in text
    assert "| gathered outputs | +1.00 GiB |" in text


# ---- readable charts ----------------------------------------------------------------------


def _tight_ddp(run: RunResult) -> RunResult:
    """The default comparison on 25 GiB GPUs, DDP out of memory on cuda:0 as the emulator
    reports it: allocated (22.8 GiB) under the capacity, reserved and context (26.6 GiB) over."""
    cap = 25 * 2**30
    scenarios = []
    for s in run.scenarios:
        s = dataclasses.replace(s, devices=tuple(
            dataclasses.replace(d, capacity_bytes=cap) for d in s.devices))
        if s.name == "ddp":
            s = dataclasses.replace(
                s, status="oom", oom_device=0, message="out of memory on cuda:0: needs "
                "26.6 GiB at its peak (backward), has 25.0 GiB")
        scenarios.append(s)
    return dataclasses.replace(run, gpu_memory_bytes=cap, scenarios=tuple(scenarios))


def test_a_bar_marked_out_of_memory_reaches_past_the_capacity_line() -> None:
    run = _tight_ddp(saved("emulated-lm"))
    ddp = next(s for s in run.scenarios if s.name == "ddp").devices[0]
    assert ddp.peak_allocated_bytes < run.gpu_memory_bytes < ddp.total_peak_bytes
    peaks = _figures(html.render(run))["peaks"]
    cap = peaks["layout"]["shapes"][0]["y0"]
    bars = [t for t in peaks["data"] if t["type"] == "bar" and t["legendgroup"] == "ddp"]
    tops = [b + y for b, y in zip(bars[-1]["base"], bars[-1]["y"], strict=True)]
    assert all(top > cap for top in tops)  # drawn as the OOM check counts it
    assert all(t.startswith("OOM<br>") for t in bars[-1]["text"])
    assert float(bars[-1]["text"][0].split("<br>")[1]) == pytest.approx(
        ddp.total_peak_bytes / 2**30, abs=0.05)
    assert bars[0]["y"][0] == pytest.approx(ddp.peak_allocated_bytes / 2**30, abs=1e-3)


def test_capacity_and_peaks_are_named_in_the_legend_not_over_the_bars() -> None:
    figs = _figures(html.render(saved("synthetic-oom")))
    for key in ("peaks", "timeline-0"):
        notes = [a["text"] for a in figs[key]["layout"].get("annotations", [])]
        assert not [t for t in notes if "capacity" in t or "peak" in t], (key, notes)
        assert "capacity 24.0 GiB per GPU" in _legend(figs[key])
    assert "cuda:0 peak 20.7 GiB (loss)" in _legend(figs["timeline-0"])


def _hue_and_saturation(colour: str) -> tuple[float, float]:
    import colorsys

    h = colour.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) / 255 for i in (0, 2, 4))
    hue, _, sat = colorsys.rgb_to_hls(r, g, b)
    return hue * 360, sat


def _reddish(colour: str) -> bool:
    hue, sat = _hue_and_saturation(colour)
    return (hue < 15 or hue > 340) and sat > 0.35


def test_red_means_out_of_memory_and_gpus_have_colours_of_their_own() -> None:
    figs = _figures(html.render(saved("emulated-lm")))
    scenario = {t["marker"]["color"] for t in figs["peaks"]["data"] if t["type"] == "bar"
                and isinstance(t["marker"]["color"], str) and t["marker"]["color"].startswith("#")}
    gpus = {t["line"]["color"] for k, f in figs.items() if k.startswith("timeline")
            for t in f["data"] if t.get("mode") == "lines" and t["x"] != [None]}
    assert len(scenario) == 4 and len(gpus) >= 2
    assert not scenario & gpus
    steps = set(figs["excess-0"]["data"][0]["marker"]["color"])
    categories = {t["marker"]["color"] for t in figs["breakdown"]["data"]}
    for colour in scenario | gpus | steps | categories:
        assert not _reddish(colour), colour
    capacity = figs["peaks"]["layout"]["shapes"][0]["line"]["color"]
    assert _reddish(capacity)


def test_identical_timelines_are_one_line_with_every_name() -> None:
    tl = _figures(html.render(saved("emulated-lm")))["timeline-0"]
    lines = [t["name"] for t in tl["data"] if t["mode"] == "lines" and t["x"] != [None]]
    # cuda:1-3 allocate the same bytes in the same order (their events interleave): drawn
    # one over the other, only the last was visible
    assert lines == ["cuda:0", "cuda:1, cuda:2, cuda:3 (identical)"]


def test_what_a_ddp_rank_holds_is_not_called_gathered_outputs() -> None:
    bd = _figures(html.render(saved("emulated-lm")))["breakdown"]
    names = [t["name"] for t in bd["data"]]
    assert "outputs" in names and "gathered outputs" not in names
    assert "parameters" in names and "master parameters" not in names


def _many_gpus(run: RunResult, n: int) -> RunResult:
    """``run`` on ``n`` GPUs: every device past cuda:0 a copy of cuda:1."""
    return dataclasses.replace(run, gpus=n, scenarios=tuple(
        dataclasses.replace(s, devices=tuple(
            dataclasses.replace(d, index=i)
            for i, d in enumerate([s.devices[0], *(s.devices[1] for _ in range(n - 1))])))
        if len(s.devices) > 1 else s for s in run.scenarios))


def test_sixty_four_gpus_keep_the_page_narrow() -> None:
    page = html.render(_many_gpus(saved("emulated-lm"), 64))
    # the table of peaks, a column per GPU, scrolls inside its card
    assert "<div class='card scroll'><table id='peaks-table' class='sticky'>" in page
    assert "<th>cuda:63</th>" in page
    tl = _figures(page)["timeline-0"]
    assert _legend(tl)[:2] == ["cuda:0", "cuda:1 to cuda:63 (63 GPUs, identical)"]
    peaks = _figures(page)["peaks"]
    assert all("text" not in t for t in peaks["data"])  # 256 bar labels would be a smear


def test_configuration_and_environment_are_closed() -> None:
    page = html.render(saved("emulated-lm"))
    assert "<details id='configuration'><summary>" in page
    assert "<details id='environment'><summary>" in page


def test_every_figure_is_checked_by_plotly() -> None:
    import plotly.graph_objects as go

    for name in SAVED:
        for fig in _figures(html.render(saved(name))).values():
            go.Figure(fig)  # raises on a property plotly.js does not have
    with pytest.raises(ValueError, match="colour"):
        html_page.page_scripts({"bad": {"data": [{"type": "bar", "colour": "red"}], "layout": {}}})
