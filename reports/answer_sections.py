"""The answers of a run (attribution, fixes, largest batch, equivalence, CI checks) for
every format: rich renderables for the terminal, Markdown, and HTML sections.

Kept apart from the per-format renderers so each can call them with one line:
``terminal.render`` appends :func:`terminal_parts`, ``html.render`` inserts
:func:`html_sections`, a Markdown renderer appends :func:`markdown_sections`. Each reads the
:class:`~dpprof.reports.view.ReportView` of the result, never the result itself.
"""

from __future__ import annotations

import html as _html

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from dpprof.reports.escape import code_fence, code_span, markdown_text
from dpprof.reports.sentences import b as _b
from dpprof.reports.view import AttributionView, FixView, ReportView
from dpprof.units import fmt_bytes


def _e(x: object) -> str:
    return _html.escape(str(x), quote=True)


def _gpu_label(view: ReportView) -> str:
    mb = view.maxbatch
    name = f" ({mb.gpu})" if mb and mb.gpu else ""
    return f"{view.gpus} GPUs of {fmt_bytes(view.gpu_memory_bytes)}{name}"


# ---- rows shared by every format ----------------------------------------------------------


def attribution_rows(view: ReportView) -> list[AttributionView]:
    """The attributions worth a table: those that name a cause or an excess."""
    return [a for a in view.attributions if a.shown]


def _cause_rows(a: AttributionView) -> list[list[str]]:
    return [[c.label, fmt_bytes(c.bytes, signed=True)] for c in a.causes]


def maxbatch_rows(view: ReportView) -> list[list[str]]:
    mb = view.maxbatch
    if mb is None:
        return []
    rows = []
    for e in mb.entries:
        best = "none" if e.max_batch is None else (
            f"≥ {e.max_batch}" if e.capped else str(e.max_batch))
        rows.append([e.scenario, best, _b(e.needed_bytes), _b(e.next_needed_bytes),
                     e.limit_device or "-", str(e.emulations)])
    return rows


MAXBATCH_HEADER = ["scenario", "largest batch", "needs", "next step needs", "limited by",
                   "emulated steps"]


def _saves(n: int | None) -> str:
    """What a fix saves on cuda:0: ``1.51 GiB``, or ``+845 MiB`` where it adds."""
    if n is None:
        return "-"
    return fmt_bytes(n) if n >= 0 else fmt_bytes(-n, signed=True)


def fits_cell(fits: bool | None) -> str:
    return "fits" if fits else "unknown" if fits is None else "does not fit"


def fix_rows(view: ReportView) -> list[list[str]]:
    """Each fix against the scenario the user ran, cheapest first: what it saves, its
    heaviest GPU, what its fullest GPU needs and whether that fits."""
    return [[f.title, _saves(f.saves_bytes), _b(f.max_peak_bytes), _b(f.need_bytes),
             fits_cell(f.fits)] for f in view.fixes]


FIX_HEADER = ["fix", "saves", "heaviest", "needs", "fits"]
# what the short headers mean, said once under the table
FIX_COLUMNS = ("saves: on {gpu}; heaviest: the heaviest GPU's peak allocated; needs: what "
               "the fullest GPU needs, {counts}")


def fix_columns(view: ReportView) -> str:
    """What the fixes table's short headers mean, said once under it."""
    return FIX_COLUMNS.format(gpu=view.primary, counts=view.need_counts)


def recommendation_lines(view: ReportView) -> tuple[str, list[str]]:
    """(the heading, the answer's sentences): why it (or nothing), and why each
    cheaper change was passed over; the same words in every format."""
    lines = [view.recommendation_why]
    if view.passed_over:
        lines += [f"Passed over: {title}: {why}." for title, why in view.passed_over]
    return view.recommendation_heading, lines


def _float(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def equivalence_rows(view: ReportView) -> list[list[str]]:
    eq = view.equivalence
    if eq is None:
        return []
    return [[e.scenario, _float(e.loss), _float(e.loss_diff), _float(e.grad_max_diff),
             _float(e.param_max_diff), "yes" if e.equivalent else "no"] for e in eq.entries]


EQ_HEADER = ["scenario", "loss", "|Δloss|", "max rel. Δgrad", "max |Δparam|", "same math"]


# ---- terminal -----------------------------------------------------------------------------


# a title's column keeps a word such as "DistributedDataParallel" whole at 80 columns
FIRST_COLUMN_MIN = 23


def _table(title: str, header: list[str], rows: list[list[str]]) -> Group:
    """A titled table; the title is a line of its own (a table's title wraps to its width)."""
    t = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for i, h in enumerate(header):
        widest = max((len(r[i]) for r in rows), default=0)
        if i > 0 and len(h) > widest:
            # a heading wider than its figures takes a line per word: the figures keep
            # their width at 80 columns ("limited by" was cut to "cud")
            h = h.replace(" ", "\n")
        # the first column (a cause, a fix's title) wraps in a narrow terminal; the figures
        # never do
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i > 0,
                     overflow="fold", ratio=1 if i == 0 else None,
                     min_width=FIRST_COLUMN_MIN if i == 0 else None)
    for r in rows:
        t.add_row(*r)
    return Group(Text(""), Text(title, style="bold"), t)


def terminal_parts(view: ReportView) -> list[Group | Table | Text]:
    parts: list[Group | Table | Text] = []
    for a in attribution_rows(view):
        t = _table(f"why {view.primary} is heavier under {a.scenario}: "
                   f"{fmt_bytes(a.excess_bytes, signed=True)} at its peak", ["cause", "bytes"],
                   _cause_rows(a))
        parts += [t, Text(a.answer)]
    # the same footnote for every table with a negative cause: said once, after the last
    note = next((a.negative_note for a in attribution_rows(view) if a.negative_note), None)
    if note:
        parts.append(Text(note, style="dim"))
    if view.fixes:
        parts.append(_table(f"what each change buys against {view.baseline}, cheapest first",
                            FIX_HEADER, fix_rows(view)))
        parts.append(Text(fix_columns(view), style="dim"))
        for f in view.fixes:
            parts.append(Text(f"{f.title}: {f.why}", style="dim"))
    if view.has_comparison:
        head, lines = recommendation_lines(view)
        parts += [Text(""), Text(head, style="bold")]
        parts += [Text(line) for line in lines]
    if view.maxbatch is not None:
        parts.append(maxbatch_table(view))
    if view.equivalence is not None:
        parts.append(_table(
            f"same math? each scenario vs single on the full batch ({view.equivalence.batch} "
            f"rows, tolerance {view.equivalence.tolerance:g})", EQ_HEADER,
            equivalence_rows(view)))
        for kind, message in view.equivalence.findings:
            parts.append(Text(f"{kind}: {message}"))
    for reason in view.fail_reasons:
        parts.append(Text(f"check failed: {reason}", style="bold red"))
    return parts


def maxbatch_table(view: ReportView) -> Group:
    mb = view.maxbatch
    assert mb is not None
    return _table(f"largest global batch on {_gpu_label(view)}, multiples of {mb.multiple_of}; "
                  f"counts {mb.counts}", MAXBATCH_HEADER, maxbatch_rows(view))


def maxbatch_renderable(view: ReportView) -> Group:
    parts: list[Group | Table | Text] = [maxbatch_table(view)]
    mb = view.maxbatch
    assert mb is not None
    parts.append(Text(view.headline.verdict, style="bold"))
    for e in mb.entries:
        if e.message:
            parts.append(Text(f"{e.scenario}: {e.message}", style="dim"))
    return Group(*parts)


# ---- markdown -----------------------------------------------------------------------------


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(markdown_text(h) for h in header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(markdown_text(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown_sections(view: ReportView, parts: tuple[str, ...] = ("attribution", "fixes",
                                                                   "maxbatch", "equivalence",
                                                                   "checks")) -> str:
    """The answers as Markdown sections; ``parts`` picks which. Every string from the result
    goes through :func:`dpprof.reports.escape.markdown_text` (code through a fence longer
    than any run of backticks in it)."""
    m = markdown_text
    out: list[str] = []
    for a in attribution_rows(view) if "attribution" in parts else []:
        out.append(f"### Why {m(view.primary)} is heavier under {code_span(a.scenario)} "
                   f"({m(fmt_bytes(a.excess_bytes, signed=True))})"
                   "\n\n" + md_table(["cause", "bytes"], _cause_rows(a))
                   + f"\n\n{m(a.answer)}."
                   + (f" {m(a.negative_note)}" if a.negative_note else ""))
    if view.fixes and "fixes" in parts:
        out.append("### What each fix buys\n\n" + md_table(FIX_HEADER, fix_rows(view)))
        for f in view.fixes:
            out.append(f"**{m(f.title)}**: {m(f.why)}\n\n{code_fence(f.code, 'diff')}")
    if view.maxbatch is not None and "maxbatch" in parts:
        mb = view.maxbatch
        out.append(f"### Largest batch on {m(_gpu_label(view))}\n\nMultiples of "
                   f"{mb.multiple_of}; counts {m(mb.counts)}.\n\n"
                   + md_table(MAXBATCH_HEADER, maxbatch_rows(view)))
    if view.equivalence is not None and "equivalence" in parts:
        eq = view.equivalence
        out.append(f"### Same math?\n\nEach scenario against `single` on the full batch "
                   f"({eq.batch} rows, tolerance {eq.tolerance:g}).\n\n"
                   + md_table(EQ_HEADER, equivalence_rows(view))
                   + "".join(f"\n\n- **{m(kind)}**: {m(message)}"
                             for kind, message in eq.findings))
    if view.fail_reasons and "checks" in parts:
        out.append("### Checks failed\n\n" + "\n".join(f"- {m(r)}" for r in view.fail_reasons))
    return "\n\n".join(out) + ("\n" if out else "")


# ---- HTML ---------------------------------------------------------------------------------


def _html_table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='{_e(cls)}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_fix_table(view: ReportView) -> str:
    """Every fix emulated, recommended or not, with what it saves (collapsed)."""
    if not view.fixes:
        return ""
    return ("<details open><summary>Every change measured, cheapest first</summary>"
            f"<p class='sub'>{_e(fix_columns(view))}</p>"
            "<div class='card scroll'>" + _html_table(FIX_HEADER, fix_rows(view), "fixes")
            + "</div>" + "".join(f"<p class='sub'><strong>{_e(f.title)}</strong>: {_e(f.why)}</p>"
                                 for f in view.fixes) + "</details>")


def _fix_html(f: FixView) -> str:
    return (f"<h3>{_e(f.title)}</h3><p>{_e(f.why)}</p>"
            f"<pre><code>{_e(f.code)}</code></pre>")


ALL_PARTS = ("attribution", "fixes", "maxbatch", "equivalence", "checks")


def html_sections(view: ReportView, parts: tuple[str, ...] = ALL_PARTS) -> str:
    """The answers as HTML sections; ``parts`` picks which (the report page draws its own
    attribution, fixes and largest batch, and takes the rest from here)."""
    out: list[str] = []
    rows = attribution_rows(view) if "attribution" in parts else []
    if rows:
        out.append(f"<section id='attribution'><h2>Why {_e(view.primary)} is heavier, by "
                   "cause</h2>")
        for a in rows:
            out.append(f"<h3>{_e(a.scenario)}: {_e(fmt_bytes(a.excess_bytes, signed=True))} "
                       f"at {_e(view.primary)}'s peak</h3>"
                       + _html_table(["cause", "bytes"], _cause_rows(a))
                       + f"<p class='answer'>{_e(a.answer)}</p>"
                       + (f"<p class='sub'>{_e(a.negative_note)}</p>"
                          if a.negative_note else ""))
        out.append("</section>")
    if view.fixes and "fixes" in parts:
        out.append("<section id='fixes'><h2>What each fix buys</h2>"
                   + _html_table(FIX_HEADER, fix_rows(view))
                   + "".join(_fix_html(f) for f in view.fixes) + "</section>")
    if view.maxbatch is not None and "maxbatch" in parts:
        mb = view.maxbatch
        out.append(f"<section id='maxbatch'><h2>Largest batch on {_e(_gpu_label(view))}</h2>"
                   f"<p>Multiples of {mb.multiple_of}; counts {_e(mb.counts)}.</p>"
                   + _html_table(MAXBATCH_HEADER, maxbatch_rows(view)) + "</section>")
    if view.equivalence is not None and "equivalence" in parts:
        eq = view.equivalence
        out.append("<section id='equivalence'><h2>Same math?</h2>"
                   f"<p>Each scenario against single on the full batch ({eq.batch} rows, "
                   f"tolerance {eq.tolerance:g}).</p>"
                   + _html_table(EQ_HEADER, equivalence_rows(view))
                   + "<ul>" + "".join(f"<li><b>{_e(kind)}</b>: {_e(message)}</li>"
                                      for kind, message in eq.findings) + "</ul></section>")
    if view.fail_reasons and "checks" in parts:
        out.append("<section id='checks'><h2>Checks failed</h2><ul>"
                   + "".join(f"<li class='oom'>{_e(r)}</li>" for r in view.fail_reasons)
                   + "</ul></section>")
    return "".join(out)
