"""Every rank's code: a script started by a launcher (torchrun, ``mp.spawn``) runs each
rank's code path, not rank 0's alone. The script as written plays rank 0; the ranks
``--ranks`` names (:mod:`dpprof.script.rank_spec`; by default over meta tensors the last,
the one that shares none of rank 0's own work) run again as written, each as its own
emulated run (its launcher's environment, its own virtual GPU, collectives completing at
once as on rank 0). :func:`merge_ranks` folds them into rank 0's scenario: each GPU shows
its own rank's peaks, the ranks not run are said to be taken as the representative one, a
rank that failed makes the run fail with its status and traceback, and a difference
between rank 0 and the others (rank-0-only validation, EMA, saving) is named with the
lines that branch on the rank."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from dpprof.result import STATUS_ERROR, DeviceResult
from dpprof.script.runner import ScriptRun
from dpprof.units import fmt_bytes

__all__ = ["merge_ranks", "rank_branches"]


def merge_ranks(main: ScriptRun, others: list[ScriptRun], world: int,
                script: str | None, beyond: list[int], spec: str) -> dict[str, object]:
    """Fold the runs of the ranks ``others`` into ``main`` (rank 0's run, the script as
    written): each GPU its own rank's figures, the GPUs of ranks not run the last run
    rank's (said so), a failed rank's status and traceback as the run's own. ``script``:
    the script file (its rank branches are named), None for a module; ``spec``: the
    ``--ranks`` the runs were chosen by (the report names it). What the result's
    config records of the ranks is returned."""
    s = main.scenario
    notes = list(s.notes)
    devices = list(s.devices)
    # a rank whose run met tensors of two GPUs in one op (a device the launcher's rank
    # makes current in a way the emulation may not follow): said, not taken as a failure
    unsure = [r for r in others if r.devices_mixed]
    for run in unsure:
        notes.append(
            f"rank {run.rank} of {world} not measured: {run.scenario.message} "
            f"(after {run.steps_done} optimizer step(s)); on a GPU that rank may fail the "
            "same way (set its device with torch.cuda.set_device(local_rank) before anything "
            "else to be sure)")
    others = [r for r in others if not r.devices_mixed]
    ran = [0, *(r.rank for r in others)]
    record: dict[str, object] = {"world": world, "run": ran}
    if unsure:
        record["not_measured"] = [r.rank for r in unsure]
    if not others:  # rank 0's figures (every GPU a copy of them) stand for every rank
        record["taken_as"] = 0
        notes.append(_ranks_sentence(ran, world, list(range(1, world)), 0, beyond, spec))
        main.scenario = dataclasses.replace(s, notes=tuple(notes))
        return record
    representative = others[-1]
    shown: dict[int, DeviceResult] = {}
    for run in others:
        own = _own_device(run)
        if own is not None and run.local_rank < len(s.devices):
            shown[run.local_rank] = dataclasses.replace(
                own, index=run.local_rank, rank=run.rank if own.rank is not None else None,
                used=True, timeline=tuple(own.timeline))
    template = shown.get(representative.local_rank)
    taken: list[int] = []
    for i in range(1, min(world, len(s.devices))):
        if i in shown:
            devices[i] = shown[i]
        elif template is not None:
            devices[i] = dataclasses.replace(template, index=i,
                                               rank=i if template.rank is not None else None,
                                               timeline=tuple(template.timeline))
            taken.append(i)
    if taken:
        record["taken_as"] = representative.rank
    notes.append(_ranks_sentence(ran, world, taken, representative.rank, beyond, spec))
    excess = ("" if main.ended == "script raised" or representative.ended == "script raised"
              else _excess_note(devices, representative, script))
    if excess:
        notes.append(excess)
    failed = next((r for r in others if r.ended == "script raised"), None)
    for run in others:
        if run.ended == "script raised":
            notes.append(f"rank {run.rank} of {world}: {run.scenario.message} after "
                           f"{run.steps_done} optimizer step(s) (exit status "
                           f"{run.exit_status}); its GPU shows what it held until then")
    s = dataclasses.replace(s, notes=tuple(notes), devices=tuple(devices))
    if failed is not None and main.ended != "script raised":
        s = dataclasses.replace(
            s, status=STATUS_ERROR, message=f"rank {failed.rank} of {world}: "
            f"{failed.scenario.message}", traceback=failed.script_traceback, oom_device=None,
            oom_bytes=None)
        main.exit_status = failed.exit_status or 1
        main.script_traceback = _prefixed(failed.script_traceback or "", failed.rank)
        record["failed"] = failed.rank
    main.scenario = s
    return record


def _own_device(run: ScriptRun) -> DeviceResult | None:
    """The figures of a rank's own GPU in its run."""
    devices = run.scenario.devices
    if run.local_rank < len(devices) and devices[run.local_rank].used:
        return devices[run.local_rank]
    return next((d for d in devices if d.used), None)


def _ranks_sentence(ran: list[int], world: int, taken: list[int], representative: int,
                    beyond: list[int], spec: str) -> str:
    ranks = ", ".join(str(r) for r in ran)
    text = (f"ranks run: {ranks} of {world} (--ranks {spec}), each its own emulated process "
            "on its own GPU (cuda:k shows rank k's peaks)")
    if taken:
        text += (f"; ranks {_span(taken)} not run: taken to be as rank {representative} "
                 "(the same code path; --ranks all runs each)")
    if beyond:
        text += f"; --ranks {', '.join(map(str, beyond))}: beyond the world's {world} ranks"
    return text


def _span(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"{ranks[0]} to {ranks[-1]}"
    return ", ".join(map(str, ranks))


def _excess_note(devices: list[DeviceResult], other: ScriptRun,
                 script: str | None) -> str:
    """Where rank 0's GPU peaks above the other rank's (its own work: validation, an EMA,
    saving) or below it, by how much, in which categories, and the script's lines that
    branch on the rank."""
    mine = devices[0] if devices else None
    theirs = _own_device(other)
    if mine is None or theirs is None:
        return ""
    diff = mine.peak_allocated_bytes - theirs.peak_allocated_bytes
    if diff == 0:
        return ""
    high, low = (mine, theirs) if diff > 0 else (theirs, mine)
    high_name = "cuda:0 (rank 0)" if diff > 0 else f"cuda:{other.local_rank} (rank {other.rank})"
    low_name = f"cuda:{other.local_rank} (rank {other.rank})" if diff > 0 else "cuda:0 (rank 0)"
    phases = (f"both at their peaks in {high.peak_phase}" if high.peak_phase == low.peak_phase
              else f"at their peaks in {high.peak_phase or '?'} and {low.peak_phase or '?'}")
    text = (f"{high_name} peaks {fmt_bytes(abs(diff))} above {low_name}: code the ranks "
            f"run differently ({phases})")
    more = {k: v - low.breakdown_bytes.get(k, 0) for k, v in high.breakdown_bytes.items()
            if v > low.breakdown_bytes.get(k, 0)}
    if more:
        text += "; at the peak, more " + ", ".join(
            f"{k} (+{fmt_bytes(v)})" for k, v in sorted(more.items(), key=lambda kv: -kv[1]))
    sites = rank_branches(script) if script else []
    if sites:
        text += "; the script's branches on the rank: " + "; ".join(sites[:4])
    return text


# a condition on the rank: dist.get_rank() == 0, local_rank == 0, accelerator's
# is_main_process, Lightning's global_zero, transformers' should_save / is_world_process_zero
_RANK_TEST = re.compile(r"rank|is_main_process|main_process|is_master|global_zero|"
                        r"world_process_zero|local_process_zero|should_save")


def rank_branches(script: str) -> list[str]:
    """The script's ``if`` statements (and conditional expressions) that test the rank, as
    ``file:line (the condition)``; none where it cannot be read or parsed."""
    try:
        source = Path(script).read_text()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return []
    name = Path(script).name
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            test = ast.get_source_segment(source, node.test) or ""
            if _RANK_TEST.search(test):
                found.append((node.lineno, f"{name}:{node.lineno} (if {test})"))
    return [text for _, text in sorted(found)]


def _prefixed(text: str, rank: int) -> str:
    """A rank's output as torchrun shows it: each line after ``[rankN]:``."""
    return "".join(f"[rank{rank}]: {line}" for line in text.splitlines(keepends=True))
