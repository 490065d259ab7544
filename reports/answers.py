"""The answers of a run (attribution, fixes, largest batch, equivalence, CI checks) for
every format: rich renderables for the terminal, Markdown, and HTML sections.

Kept apart from the per-format renderers so each can call them with one line:
``terminal.render`` appends :func:`terminal_parts`, ``html.render`` inserts
:func:`html_sections`, a Markdown renderer appends :func:`markdown_sections`.
"""

from __future__ import annotations

import html as _html

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from dpprof.analysis.attribution import attribute_run, cause_label
from dpprof.reports.escape import code_fence, code_span, markdown_text
from dpprof.result import Fix, RunResult
from dpprof.units import fmt_bytes


def _b(n: int | None, signed: bool = False) -> str:
    return "-" if n is None else fmt_bytes(n, signed=signed)


def _e(x: object) -> str:
    return _html.escape(str(x), quote=True)


def _gpu_label(run: RunResult) -> str:
    mb = run.maxbatch
    name = f" ({mb.gpu})" if mb and mb.gpu else ""
    return f"{run.gpus} GPUs of {fmt_bytes(run.gpu_memory_bytes)}{name}"


# ---- rows shared by every format ----------------------------------------------------------


NEGATIVE_NOTE = ("A negative cause: the reference GPU holds more of it at its own peak "
                 "(e.g. its replica's gradients, or its share of the output gradient).")


def attribution_rows(run: RunResult) -> list[tuple[str, list[tuple[str, int]], int, str]]:
    """(scenario, [(cause label, bytes)], excess, answer) for scenarios with an excess."""
    out = []
    # results saved without an attribution: the same function, computed here
    for name, att in (run.attribution or attribute_run(run)).items():
        if att.excess_bytes == 0 and not att.causes_bytes:
            continue
        causes = [(cause_label(k), v) for k, v in att.causes_bytes.items()]
        out.append((name, causes, att.excess_bytes, att.answer))
    return out


def maxbatch_rows(run: RunResult) -> list[list[str]]:
    mb = run.maxbatch
    if mb is None:
        return []
    rows = []
    for e in mb.entries:
        best = "none" if e.max_batch is None else (
            f"≥ {e.max_batch}" if e.capped else str(e.max_batch))
        limit = "-" if e.limit_device is None else f"cuda:{e.limit_device}"
        rows.append([e.scenario, best, _b(e.needed_bytes), _b(e.next_needed_bytes), limit,
                     str(e.emulations)])
    return rows


MAXBATCH_HEADER = ["scenario", "largest batch", "needs", "next step needs", "limited by",
                   "emulated steps"]


def _saves(n: int | None) -> str:
    if n is None:
        return "-"
    return fmt_bytes(n) if n >= 0 else f"none ({fmt_bytes(-n)} more)"


def fix_rows(run: RunResult) -> list[list[str]]:
    return [[f.title, _saves(f.saves_bytes), _b(f.primary_peak_bytes), _b(f.max_peak_bytes)]
            for f in run.fixes]


FIX_HEADER = ["fix", "saves on cuda:0", "cuda:0 peak", "heaviest GPU"]


def _float(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def equivalence_rows(run: RunResult) -> list[list[str]]:
    eq = run.equivalence
    if eq is None:
        return []
    return [[e.scenario, _float(e.loss), _float(e.loss_diff), _float(e.grad_max_diff),
             _float(e.param_max_diff), "yes" if e.equivalent else "no"] for e in eq.entries]


EQ_HEADER = ["scenario", "loss", "|Δloss|", "max rel. Δgrad", "max |Δparam|", "same math"]


# ---- terminal -----------------------------------------------------------------------------


def _table(title: str, header: list[str], rows: list[list[str]]) -> Group:
    """A titled table; the title is a line of its own (a table's title wraps to its width)."""
    t = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        t.add_row(*r)
    return Group(Text(""), Text(title, style="bold"), t)


def terminal_parts(run: RunResult) -> list[Group | Table | Text]:
    parts: list[Group | Table | Text] = []
    for name, causes, excess, answer in attribution_rows(run):
        t = _table(f"why cuda:0 is heavier under {name}: {fmt_bytes(excess, signed=True)} at "
                   "its peak", ["cause", "bytes"],
                   [[label, fmt_bytes(v, signed=True)] for label, v in causes])
        parts += [t, Text(answer)]
        if any(v < 0 for _, v in causes):
            parts.append(Text(NEGATIVE_NOTE, style="dim"))
    if run.fixes:
        parts.append(_table("what each fix buys (emulated on this workload and batch)",
                            FIX_HEADER, fix_rows(run)))
        for f in run.fixes:
            parts.append(Text(f"{f.title}: {f.detail}", style="dim"))
    if run.maxbatch is not None:
        parts.append(maxbatch_table(run))
    if run.equivalence is not None:
        parts.append(_table(
            f"same math? each scenario vs single on the full batch ({run.equivalence.batch} "
            f"rows, tolerance {run.equivalence.tolerance:g})", EQ_HEADER, equivalence_rows(run)))
        for finding in run.equivalence.findings:
            parts.append(Text(f"{finding.kind}: {finding.message}"))
    for reason in run.fail_reasons:
        parts.append(Text(f"check failed: {reason}", style="bold red"))
    return parts


def maxbatch_table(run: RunResult) -> Group:
    mb = run.maxbatch
    assert mb is not None
    return _table(f"largest global batch on {_gpu_label(run)}, multiples of {mb.multiple_of}; "
                  f"counts {mb.counts}", MAXBATCH_HEADER, maxbatch_rows(run))


def maxbatch_renderable(run: RunResult) -> Group:
    parts: list[Group | Table | Text] = [maxbatch_table(run)]
    mb = run.maxbatch
    assert mb is not None
    best = {e.scenario: e.max_batch for e in mb.entries}
    prim, ddp = best.get("dp-loss-primary"), best.get("ddp")
    if prim and ddp:
        parts.append(Text(f"DDP fits {ddp / prim:.2f}x the batch of DataParallel with the "
                          f"loss on cuda:0 ({ddp} vs {prim}).", style="bold"))
    for e in mb.entries:
        if e.message:
            parts.append(Text(f"{e.scenario}: {e.message}", style="dim"))
    return Group(*parts)


# ---- markdown -----------------------------------------------------------------------------


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(markdown_text(h) for h in header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(markdown_text(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown_sections(run: RunResult, parts: tuple[str, ...] = ("attribution", "fixes",
                                                                  "maxbatch", "equivalence",
                                                                  "checks")) -> str:
    """The answers as Markdown sections; ``parts`` picks which. Every string from the result
    goes through :func:`dpprof.reports.escape.markdown_text` (code through a fence longer
    than any run of backticks in it)."""
    m = markdown_text
    out: list[str] = []
    for name, causes, excess, answer in attribution_rows(run) if "attribution" in parts else []:
        out.append(f"### Why cuda:0 is heavier under {code_span(name)} "
                   f"({m(fmt_bytes(excess, signed=True))})"
                   "\n\n" + _md_table(["cause", "bytes"],
                                      [[lbl, fmt_bytes(v, signed=True)] for lbl, v in causes])
                   + f"\n\n{m(answer)}."
                   + (f" {m(NEGATIVE_NOTE)}" if any(v < 0 for _, v in causes) else ""))
    if run.fixes and "fixes" in parts:
        out.append("### What each fix buys\n\n" + _md_table(FIX_HEADER, fix_rows(run)))
        for f in run.fixes:
            out.append(f"**{m(f.title)}**: {m(f.detail)}\n\n{code_fence(f.code, 'diff')}")
    if run.maxbatch is not None and "maxbatch" in parts:
        mb = run.maxbatch
        out.append(f"### Largest batch on {m(_gpu_label(run))}\n\nMultiples of "
                   f"{mb.multiple_of}; counts {m(mb.counts)}.\n\n"
                   + _md_table(MAXBATCH_HEADER, maxbatch_rows(run)))
    if run.equivalence is not None and "equivalence" in parts:
        eq = run.equivalence
        out.append(f"### Same math?\n\nEach scenario against `single` on the full batch "
                   f"({eq.batch} rows, tolerance {eq.tolerance:g}).\n\n"
                   + _md_table(EQ_HEADER, equivalence_rows(run))
                   + "".join(f"\n\n- **{m(f.kind)}**: {m(f.message)}" for f in eq.findings))
    if run.fail_reasons and "checks" in parts:
        out.append("### Checks failed\n\n" + "\n".join(f"- {m(r)}" for r in run.fail_reasons))
    return "\n\n".join(out) + ("\n" if out else "")


# ---- HTML ---------------------------------------------------------------------------------


def _html_table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='{_e(cls)}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_fix_table(run: RunResult) -> str:
    """Every fix emulated, recommended or not, with what it saves (collapsed)."""
    if not run.fixes:
        return ""
    return ("<details><summary>Every fix, emulated on this workload and batch</summary>"
            + _html_table(FIX_HEADER, fix_rows(run)) + "</details>")


def _fix_html(f: Fix) -> str:
    return (f"<h3>{_e(f.title)}</h3><p>{_e(f.detail)}</p>"
            f"<pre><code>{_e(f.code)}</code></pre>")


ALL_PARTS = ("attribution", "fixes", "maxbatch", "equivalence", "checks")


def html_sections(run: RunResult, parts: tuple[str, ...] = ALL_PARTS) -> str:
    """The answers as HTML sections; ``parts`` picks which (the report page draws its own
    attribution, fixes and largest batch, and takes the rest from here)."""
    out: list[str] = []
    rows = attribution_rows(run) if "attribution" in parts else []
    if rows:
        out.append("<section id='attribution'><h2>Why cuda:0 is heavier, by cause</h2>")
        for name, causes, excess, answer in rows:
            out.append(f"<h3>{_e(name)}: {_e(fmt_bytes(excess, signed=True))} at cuda:0's peak"
                       "</h3>" + _html_table(["cause", "bytes"], [
                           [lbl, fmt_bytes(v, signed=True)] for lbl, v in causes])
                       + f"<p class='answer'>{_e(answer)}</p>"
                       + (f"<p class='sub'>{_e(NEGATIVE_NOTE)}</p>"
                          if any(v < 0 for _, v in causes) else ""))
        out.append("</section>")
    if run.fixes and "fixes" in parts:
        out.append("<section id='fixes'><h2>What each fix buys</h2>"
                   + _html_table(FIX_HEADER, fix_rows(run))
                   + "".join(_fix_html(f) for f in run.fixes) + "</section>")
    if run.maxbatch is not None and "maxbatch" in parts:
        mb = run.maxbatch
        out.append(f"<section id='maxbatch'><h2>Largest batch on {_e(_gpu_label(run))}</h2>"
                   f"<p>Multiples of {mb.multiple_of}; counts {_e(mb.counts)}.</p>"
                   + _html_table(MAXBATCH_HEADER, maxbatch_rows(run)) + "</section>")
    if run.equivalence is not None and "equivalence" in parts:
        eq = run.equivalence
        out.append("<section id='equivalence'><h2>Same math?</h2>"
                   f"<p>Each scenario against single on the full batch ({eq.batch} rows, "
                   f"tolerance {eq.tolerance:g}).</p>"
                   + _html_table(EQ_HEADER, equivalence_rows(run))
                   + "<ul>" + "".join(f"<li><b>{_e(f.kind)}</b>: {_e(f.message)}</li>"
                                      for f in eq.findings) + "</ul></section>")
    if run.fail_reasons and "checks" in parts:
        out.append("<section id='checks'><h2>Checks failed</h2><ul>"
                   + "".join(f"<li class='oom'>{_e(r)}</li>" for r in run.fail_reasons)
                   + "</ul></section>")
    return "".join(out)
