"""The saved results every renderer is tested against (``tests/data/``)."""

from __future__ import annotations

import dataclasses
import html as std_html
import re
from pathlib import Path

from dpprof.result import DeviceResult, RunResult
from dpprof.saved_result import load

DATA = Path(__file__).parent / "data"
SAVED = {
    # produced by dpprof itself (scripts/make_test_data.py)
    "emulated-lm": DATA / "emulated-lm.json",
    "cpu-mlp": DATA / "cpu-mlp.json",
    # built by tests/synthetic.py, shaped like real-GPU runs, and saying so
    "synthetic-nvml": DATA / "synthetic-nvml.json",
    "synthetic-oom": DATA / "synthetic-oom.json",
    "synthetic-ddp-2-nodes": DATA / "synthetic-ddp-2-nodes.json",
}

# The HTML report's sections, in the order (the ones a result has appear)
HTML_SECTIONS = [
    "Peak memory per GPU",
    "Why cuda:0 is heavier",
    "Memory over the step",
    "Step time and throughput",
    "Step time, predicted",
    "Largest batch that fits",
    "What to change",
    "How these numbers were obtained",
]

HOSTILE = (
    "</script><script>window.__pwned=1</script>"
    "<img src=x onerror=\"window.__pwned=2\">\"'&<b>bold</b>|`x`*_[a](javascript:alert(1))"
)


def saved(name: str) -> RunResult:
    return load(SAVED[name])


def hostile(run: RunResult) -> RunResult:
    """The same result with hostile text wherever the user or the environment writes."""
    replace = dataclasses.replace

    def device(d: DeviceResult) -> DeviceResult:
        return replace(d, node=HOSTILE + d.node if d.node else d.node, timeline=(
            *(replace(p, phase=HOSTILE) for p in d.timeline[:3]), *d.timeline[3:]))

    return replace(
        run, workload=HOSTILE, config={**run.config, "workload": HOSTILE},
        environment={**run.environment, "hostname": HOSTILE,
                     "gpus": [{"name": HOSTILE, "uuid": HOSTILE}]},
        notes=(*run.notes, HOSTILE), assumptions=(*run.assumptions, HOSTILE),
        scenarios=tuple(replace(s, notes=(*s.notes, HOSTILE), message=s.message and HOSTILE,
                                devices=tuple(device(d) for d in s.devices))
                        for s in run.scenarios),
        comparison=replace(run.comparison, verdict="Verdict: " + HOSTILE))


def report_words(fmt: str, text: str) -> str:
    """The words of a report: markup and escapes removed, whitespace folded."""
    if fmt == "html":
        text = std_html.unescape(re.sub(r"<[^>]+>", " ", text))
    if fmt == "markdown":
        text = re.sub(r"\\(.)", r"\1", std_html.unescape(text))
    return " ".join(text.split())
