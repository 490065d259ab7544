"""The answers from the command line: maxbatch, compare's new flags, exit 3, every format."""

import html
import json
import re
from pathlib import Path

from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.reports.answer_sections import markdown_sections
from dpprof.reports.view_builder import build_view
from dpprof.saved_result import load

runner = CliRunner()
FAST = ["-w", "mlp", "-b", "10"]


def test_maxbatch_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "mb.json"
    r = runner.invoke(app, ["maxbatch", "-w", "mlp", "--gpu-memory", "2GiB", "-g", "2",
                            "--multiple-of", "4", "-s", "dp-loss-primary,ddp", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "largest global batch on 2 GPUs of 2.00 GiB" in r.stdout
    data = json.loads(out.read_text())
    entries = {e["scenario"]: e for e in data["maxbatch"]["entries"]}
    assert set(entries) == {"dp-loss-primary", "ddp"}
    for e in entries.values():
        assert e["max_batch"] % 4 == 0 and e["needed_bytes"] <= 2 << 30 < e["next_needed_bytes"]
        assert str(e["max_batch"]) in r.stdout
        # at 80 columns every column whole: the GPU that limits it and the steps emulated
        assert re.search(rf"^ +{e['scenario']} .* cuda:{e['limit_device']} +{e['emulations']} *$",
                         r.stdout, re.M), r.stdout
    run = load(out)  # and it reads back
    assert run.maxbatch is not None and run.maxbatch.entries[0].max_batch is not None


def test_maxbatch_gpu_from_the_catalog_and_unknown_gpu(tmp_path: Path) -> None:
    r = runner.invoke(app, ["maxbatch", "-w", "mlp", "--gpu", "t4", "-g", "2", "-s", "ddp"])
    assert r.exit_code == 0, r.output
    assert "(t4)" in r.stdout
    r = runner.invoke(app, ["maxbatch", "--gpu", "a100-81gb"])
    assert r.exit_code == 2
    assert "unknown GPU" in r.stderr and "a100-80gb" in r.stderr and "h100-80gb" in r.stderr
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["maxbatch", "--multiple-of", "0"])
    assert r.exit_code == 2 and "--multiple-of" in r.stderr


def test_fail_on_imbalance_exits_3_only_above_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["compare", *FAST, "-q", "--no-fixes", "-o", str(out),
                            "--fail-on-imbalance", "1.5"])
    assert r.exit_code == 3, r.output
    assert "dp-loss-primary: max/mean 1.999 exceeds --fail-on-imbalance 1.5" in r.stderr
    assert out.exists()  # the report is still written
    assert json.loads(out.read_text())["fail_reasons"]
    r = runner.invoke(app, ["compare", *FAST, "-q", "--no-fixes", "-o", str(out),
                            "--fail-on-imbalance", "2.5"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["compare", *FAST, "-q", "-o", str(out), "--fail-on-imbalance", "0.5"])
    assert r.exit_code == 2 and "ratio" in r.stderr


def test_fail_on_oom_exits_3(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["compare", *FAST, "-q", "--no-fixes", "-o", str(out), "--gpu-memory", "200MiB"]
    r = runner.invoke(app, [*args, "--fail-on-oom"])
    assert r.exit_code == 3 and "out of memory" in r.stderr
    r = runner.invoke(app, args)
    assert r.exit_code == 0  # an OOM is a result unless the check is asked for


TINY = """
import torch
from torch import nn
import dpprof


def workload():
    return dpprof.Workload(
        name="tiny",
        model=lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512)),
        batch=lambda rows, device: (torch.randn(rows, 64, device=device),
                                    torch.randint(0, 512, (rows,), device=device)),
        loss=nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
    )
"""


def test_compare_shows_the_answers_in_every_format(tmp_path: Path) -> None:
    js, page = tmp_path / "r.json", tmp_path / "r.html"
    (tmp_path / "tiny.py").write_text(TINY)
    r = runner.invoke(app, ["compare", "-w", f"{tmp_path / 'tiny.py'}:workload", "-b", "8", "-g", "2", "--gpu-memory",
                            "2GiB", "--maxbatch", "--multiple-of", "4096", "--compute",
                            "-o", str(js), "-o", str(page)])
    assert r.exit_code == 0, r.output
    assert "why cuda:0 is heavier under dp-loss-primary" in r.stdout
    assert "what each change buys against dp-loss-primary" in r.stdout
    assert "largest global batch" in r.stdout
    assert "same math?" in r.stdout
    run = load(js)
    assert run.attribution and run.fixes and run.maxbatch and run.equivalence
    # a coarse step: the tiny model's batches run to 10^5 rows, a fine one costs ~9 more
    # probes a scenario
    assert all(e.max_batch and e.max_batch % 4096 == 0 for e in run.maxbatch.entries)
    assert all(e.equivalent for e in run.equivalence.entries)
    text = page.read_text()
    # the page draws the attribution (waterfalls), the fixes and the largest batch itself;
    # the equivalence check comes from reports/answer_sections.py
    for section in ("Why cuda:0 is heavier", "What to change", "Largest batch that fits",
                    "id='equivalence'"):
        assert section in text
    for fix in run.fixes:
        assert html.escape(fix.title) in text
    md = markdown_sections(build_view(run))
    assert "### Why cuda:0 is heavier under `dp-loss-primary`" in md
    assert "```diff" in md and "| scenario | largest batch |" in md
    # re-rendering the saved result shows the same answers
    r = runner.invoke(app, ["report", str(js)])
    assert r.exit_code == 0 and "why cuda:0 is heavier" in r.stdout


def test_compare_with_a_catalog_gpu_counts_reserved_and_context(tmp_path: Path) -> None:
    from dpprof.emulator.catalog import lookup_gpu

    out = tmp_path / "r.json"
    r = runner.invoke(app, ["compare", *FAST, "-q", "--no-fixes", "--gpu", "rtx-4090",
                            "-o", str(out)])
    assert r.exit_code == 0, r.output
    run = load(out)
    assert run.gpu_memory_bytes == lookup_gpu("rtx-4090").total_memory_bytes
    d = run.scenario("dp-loss-primary").devices[0]
    assert d.peak_reserved_bytes >= d.peak_allocated_bytes and d.context_bytes > 0
    assert any("CUDA context" in a for a in run.assumptions)
