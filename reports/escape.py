"""User text is data: escaping for every place dpprof shows a string it did not write.

A workload name, a path, an exception message, a note or a result file's field may hold
anything: rich markup (``[red]``, ``[/x]``), ``:emoji:`` codes, terminal control sequences
(``ESC ]0;title BEL`` retitles the terminal, ``ESC [2J`` clears it), Markdown, HTML,
``@mentions``, mermaid directives. Here, one function per destination:

* :func:`terminal_text`: control characters (C0, DEL, C1, bidirectional overrides, zero-width
  characters, lone surrogates) shown as visible escapes (``\\x1b``, ``\\u202e``); newlines kept
  only where asked. Print the result with markup and emoji off (``dpprof.cli.common``'s
  consoles) or inside a ``rich.text.Text``.
* :func:`for_terminal`: a copy of a result (any dataclass tree) with every string passed
  through :func:`terminal_text`: what the terminal renderers receive.
* :func:`markdown_text`: one line of Markdown (tables, headings, list items): every
  special character escaped, HTML as entities, ``@mentions`` neutralised.
* :func:`mermaid_label`: a quoted mermaid string: no quotes, brackets, ``%%`` directives,
  ``|``, ``;``, ``#`` or newlines.
* :func:`for_files`: a copy of a result with every control character removed from its
  strings (newlines and tabs kept): what the HTML and Markdown files are rendered from, so
  a report opened with ``cat`` or ``less -r`` cannot retitle or clear the terminal either.

:func:`without_host` is what a public report may show of the machine: a copy of a result
without the host name, the GPUs' UUIDs and PCI bus ids, and with nodes named by rank.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, TypeVar

from dpprof.result import RunResult

__all__ = [
    "code_fence", "code_span", "file_text", "for_files", "for_terminal", "markdown_text",
    "mermaid_label", "terminal_text", "without_host",
]

# C0 (but tab/newline handled apart), DEL, C1, zero-width and bidirectional controls,
# line/paragraph separators, BOM, lone surrogates.
_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2064"
    "\u2066-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff]"
)
_NEWLINES = re.compile("[\n\t]")


def _escape_char(m: re.Match[str]) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def terminal_text(text: object, newlines: bool = False) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``); newlines and
    tabs kept when ``newlines`` (multi-line notes, tracebacks), escaped otherwise."""
    s = _CONTROL.sub(_escape_char, str(text))
    if not newlines:
        s = _NEWLINES.sub(_escape_char, s)
    return s


T = TypeVar("T")


def for_terminal(obj: T) -> T:
    """A copy of ``obj`` (dataclasses, lists, dicts, strings) with every string escaped by
    :func:`terminal_text` (newlines kept); other values as they are."""
    return _walk(obj)  # type: ignore[no-any-return]


def file_text(text: object) -> str:
    """``text`` without its control characters (newlines and tabs kept)."""
    return _CONTROL.sub("", str(text))


def for_files(obj: T) -> T:
    """A copy of ``obj`` with :func:`file_text` applied to every string."""
    return _walk(obj, file_text)  # type: ignore[no-any-return]


def _walk(obj: Any, text: Any = None) -> Any:
    if isinstance(obj, str):
        return terminal_text(obj, newlines=True) if text is None else text(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _walk(getattr(obj, f.name), text) for f in dataclasses.fields(obj)
                   if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, list):
        return [_walk(v, text) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_walk(v, text) for v in obj)
    if isinstance(obj, dict):
        return {_walk(k, text): _walk(v, text) for k, v in obj.items()}
    return obj


# The environment's keys and the GPUs' fields that name this machine, not its setup.
HOST_KEYS = ("hostname", "hostnames")
GPU_IDENTITY_KEYS = ("uuid", "pci_bus_id", "serial")
_GPU_ID = re.compile(r"\b(?:GPU|MIG)-[0-9A-Za-z-]+")
LEFT_OUT = "left out (--include-host keeps it)"


def without_host(run: RunResult) -> RunResult:
    """A copy of a result (a :class:`dpprof.result.RunResult`) without what identifies the
    machine: the host name(s), the GPUs' UUIDs (in ``CUDA_VISIBLE_DEVICES`` too), PCI bus
    ids and serials; nodes are called ``node0``, ``node1``... in rank order."""
    copy: RunResult = _walk(run, str)  # a deep copy of the dataclass tree
    env = copy.environment
    if isinstance(env, dict):
        for key in HOST_KEYS:
            if key in env:
                env[key] = LEFT_OUT
        for gpu in env.get("gpus") or []:
            if isinstance(gpu, dict):
                for key in GPU_IDENTITY_KEYS:
                    if gpu.get(key):
                        gpu[key] = LEFT_OUT
        if isinstance(env.get("cuda_visible_devices"), str):
            env["cuda_visible_devices"] = _GPU_ID.sub("GPU-…", env["cuda_visible_devices"])
    names: dict[str, str] = {}
    devices = [d for s in copy.scenarios for d in s.devices]
    for d in sorted(devices, key=lambda d: (d.node_rank is None, d.node_rank or 0)):
        if d.node and d.node not in names:
            names[d.node] = f"node{len(names)}"
    words = [(re.compile(rf"(?<![\w.-]){re.escape(host)}(?![\w-])"), alias)
             for host, alias in names.items()]

    def aliased(text: str) -> str:  # a note may name a node ("rank 3 on host-a failed")
        for word, alias in words:
            text = word.sub(alias, text)
        return text

    scenarios = tuple(dataclasses.replace(
        s, devices=tuple(dataclasses.replace(d, node=names[d.node] if d.node else d.node,
                                             uuid=None) for d in s.devices),
        notes=tuple(aliased(n) for n in s.notes), message=aliased(s.message))
        for s in copy.scenarios)
    watch = copy.watch
    if watch is not None:
        watch = dataclasses.replace(watch, devices=tuple(
            dataclasses.replace(d, uuid=None) for d in watch.devices))
    return dataclasses.replace(copy, scenarios=scenarios, watch=watch,
                               notes=tuple(aliased(n) for n in copy.notes))


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|#!~$])")
_EMOJI = re.compile(r":(?=[\w+-]+:)")  # :name: is an emoji on GitHub
# a list item or a setext underline at the start of a line
_LINE_START = re.compile(r"^([-+=](?=\s|$)|\d+(?=[.)](?:\s|$)))")
_MENTION = re.compile(r"@(?=[\w-])")


def markdown_text(x: object) -> str:
    """One line of Markdown (GitHub's: tables, headings, lists) that shows ``x`` as it is:
    whitespace runs as one space, control characters as escapes, ``&``, ``<``, ``>`` and
    quotes as HTML entities, Markdown's special characters backslash-escaped, and an
    ``@`` followed by a name broken by a zero-width space (no one is pinged)."""
    text = " ".join(terminal_text(x, newlines=True).split())
    text = (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))
    text = _MD_SPECIAL.sub(r"\\\1", text)
    text = _EMOJI.sub("\\\\:", text)
    text = _LINE_START.sub(lambda m: m.group(1) + "\\" if m.group(1)[0].isdigit()
                           else "\\" + m.group(1), text)
    return _MENTION.sub("@\u200b", text)


_MERMAID_BAD = re.compile(r"[\"'`\[\](){}<>|;#%\\\n\r\t]")


def mermaid_label(x: object) -> str:
    """A quoted mermaid string that draws ``x`` without being read as syntax: quotes,
    brackets, braces, ``|``, ``;``, ``#``, ``%`` (``%%{init}%%`` directives),
    backslashes and control characters replaced by spaces; ``@`` neutralised."""
    text = _MERMAID_BAD.sub(" ", terminal_text(x))
    text = _MENTION.sub("@\u200b", text)
    return '"' + " ".join(text.split()) + '"'


def code_fence(text: str, lang: str = "") -> str:
    """A Markdown code block whose fence is longer than any run of backticks inside."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{re.sub(r'[^A-Za-z0-9_+-]', '', lang)}\n{text.rstrip()}\n{fence}"


def code_span(x: object) -> str:
    """Inline code showing ``x`` literally: one line, control characters escaped, delimited by
    more backticks than any run inside (padded with a space where it touches one)."""
    text = " ".join(terminal_text(x, newlines=True).split())
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    tick = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{tick}{pad}{text}{pad}{tick}"
