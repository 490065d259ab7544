"""A rung of the ladder as one rewrite of the user's file: its edits (checkpointing,
autocast, and DDP's where it ran on a DataParallel script's DDP alternative) made one after
the other, each at the lines the one before left."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpprof.script.autocast_diff import autocast_until
from dpprof.script.checkpointing_diff import checkpointing
from dpprof.script.ddp_diff import OutputDevice, ddp, own_process_group
from dpprof.script.rewrite import (
    Rewrite,
    read_source,
    site_of,
)
from dpprof.script.source import (
    NoRewrite,
    ScriptSource,
)
from dpprof.script.trainer_precision_diff import fit_of_trainer, trainer_precision
from dpprof.script.trainer_settings_diff import arguments_of_trainer, trainer_settings


def _line_map(old: str, new: str) -> dict[int, int]:
    """Where each line of ``old`` that ``new`` keeps as it was is in ``new`` (1-based)."""
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(),
                                      autojunk=False)
    out: dict[int, int] = {}
    for tag, i1, i2, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            out.update({i1 + k + 1: j1 + k + 1 for k in range(i2 - i1)})
    return out


@dataclass(frozen=True)
class RungSites:
    """What ``dpprof run`` saw of the script its rung changed: the model's first call and the
    first ``backward()``; for a DataParallel script whose rung ran on its DDP alternative,
    the wrap (and the batches it makes by hand)."""

    path: str
    forward_line: int
    backward_line: int
    dp_line: int = 0  # 0: the rung ran on the script as written
    batch_lines: tuple[int, ...] = ()
    rows: int = 0  # the batch DataParallel scattered
    # "file:line" of the script's calls that made the DataLoaders the alternative divided
    loader_sites: tuple[str, ...] = ()
    # the DDP change where it is no edit of the script (a library's code wrapped
    # DataParallel: how to start the script under a launcher instead)
    ddp_note: str = ""
    dim: int = 0  # the dimension DataParallel split the batch along
    # DataParallel's output_device, where it is another GPU than its first (None: it is not)
    output_device: OutputDevice | None = None


def rung_changes(sites: RungSites, gpus: int, title: str, dtype: str | None,
                 blocks: dict[str, object] | None,
                 trainer: dict[str, Any] | None = None) -> Rewrite:
    """A ladder rung as one diff of the user's file: its blocks checkpointed (``blocks``,
    where it checkpoints), its forward to ``backward()`` under autocast (``dtype``, where it
    has one; Lightning's Trainer given its precision where Lightning calls both the model
    and ``backward()``); where Hugging Face's Trainer runs the model, its
    ``TrainingArguments`` given the rung's settings instead (``trainer``: the keywords);
    and, where it ran on a DataParallel script's DDP alternative, the DDP change too, so
    that the script patched with it is the one the rung measured (a script with its own
    DDP path, or a library's wrap: a note of how to start it as DDP ranks, beside the
    diff)."""
    try:
        original = read_source(sites.path)
        text, notes = original, list[str]()
        if sites.ddp_note:
            notes.append(f"DDP: {sites.ddp_note}")
        # a script with its own DDP path (torchvision's reference) needs no DDP edit, only
        # its launcher and batch, which a note says; the rung's own edits are still a diff
        own = own_process_group(original, sites.path, gpus, sites.rows) if sites.dp_line else ""
        if own:
            notes.append(f"DDP: {own}")
        loader_lines = [n for p, n in map(site_of, sites.loader_sites) if p == sites.path]
        output_sites = sites.output_device.sites if sites.output_device is not None else ()
        output_lines = [n for p, n in map(site_of, output_sites) if p == sites.path]
        lines = {k: k for k in (sites.forward_line, sites.backward_line, sites.dp_line,
                                *sites.batch_lines, *loader_lines, *output_lines) if k}

        def then(change: Rewrite, what: str) -> None:
            nonlocal text, lines
            if not change.ok:
                raise NoRewrite(f"{what}: {change.reason}")
            moved = _line_map(text, change.new_source)
            lines = {k: moved[v] for k, v in lines.items() if v in moved}
            text = change.new_source
            notes.extend(change.notes)

        def at(line: int) -> int:
            if line not in lines:
                raise NoRewrite(f"line {line} was changed by the rung's other edits")
            return lines[line]

        def moved_site(site: str) -> str:
            """A loader's ``file:line`` in the script as the rung's other edits left it."""
            path, num = site_of(site)
            return f"{path}:{at(num)}" if path == sites.path else site

        if trainer is not None:
            src = ScriptSource(text, sites.path)
            then(trainer_settings(src, arguments_of_trainer(src, at(sites.forward_line),
                                                            trainer), trainer, title),
                 "the Trainer's settings")
            blocks, dtype = None, None
        if blocks:
            then(checkpointing(text, sites.path, at(sites.forward_line), blocks),
                 "activation checkpointing")
        if dtype is not None:
            src = ScriptSource(text, sites.path)
            forward, backward = at(sites.forward_line), at(sites.backward_line)
            # both under the script's `trainer.fit(...)`: Lightning's own precision
            lightning = fit_of_trainer(src, forward) if forward == backward else None
            then(autocast_until(src, forward, backward, dtype) if lightning is None
                 else trainer_precision(src, lightning, dtype, title), "autocast")
        if sites.dp_line and not own:
            output_device = sites.output_device
            if output_device is not None:  # its lines where the rung's other edits left them
                output_device = OutputDevice(output_device.index, tuple(
                    moved_site(site) for site in output_device.sites
                    if site_of(site)[0] != sites.path or site_of(site)[1] in lines))
            then(ddp(text, sites.path, at(sites.dp_line), gpus,
                     batch_lines=tuple(lines[b] for b in sites.batch_lines if b in lines),
                     rows=sites.rows,
                     loader_sites=tuple(map(moved_site, sites.loader_sites)),
                     dim=sites.dim, output_device=output_device),
                 "DDP")
        name = Path(sites.path).name
        diff = difflib.unified_diff(original.splitlines(), text.splitlines(),
                                    f"{name} (as written)", f"{name} ({title[:1].lower()}"
                                    f"{title[1:]})", lineterm="")
        return Rewrite(diff="\n".join(diff), new_source=text, notes=tuple(notes))
    except NoRewrite as e:
        # the rung ran as DDP ranks: starting them is part of the change made by hand
        return Rewrite(reason=f"{e}; DDP: {sites.ddp_note}" if sites.ddp_note else str(e))


