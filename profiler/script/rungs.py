"""The ladder for ``dpprof run``: when even the data-parallel floor of a script is out of
memory, the script is run again with each rung applied as it runs, and each rung becomes a
fix beside DataParallel's, with its change to the script.

The floor is the DDP alternative of a DataParallel script (its own DataParallel run is not:
the rungs replace nothing there), else the script as written (one GPU, DDP under
``torchrun`` or ``mp.spawn``, a model placed by hand). The rungs, cheapest first, are
:func:`dpprof.measure.ladder_rungs.rungs`' (mixed precision; activation checkpointing of the
model's repeated blocks; both), applied by :class:`RungHooks` to the running script:

* **mixed precision**: from the start of each outermost forward to the ``backward()`` call
  (or the optimizer's step), the script runs under the GPU's autocast
  (:class:`dpprof.emulator.emulated_autocast.EmulatedAutocast`: CUDA's op lists), as a user wraps
  forward and loss in ``torch.autocast("cuda")``; the change to the script is that
  ``with`` block around the script's own lines (:func:`dpprof.script.autocast_diff.autocast_at`);
* **activation checkpointing**: at the model's first call, each of its repeated blocks
  (:func:`dpprof.measure.rung_models.repeated_blocks`, the model unwrapped from DataParallel or
  DDP) has its forward wrapped in non-reentrant ``torch.utils.checkpoint``, exactly as the
  lines handed to the user do (:func:`dpprof.script.checkpointing_diff.checkpointing`).

A rung's change is one diff of the user's file (:func:`dpprof.script.rung_diff.rung_changes`):
its own edits and, where it ran on a DataParallel script's DDP alternative, the DDP change
too, so that the script patched with it, run as the diff says (torchrun), is the run the
rung measured.

Gradient accumulation and FSDP2 change the script's loop and process group, which dpprof
does not rewrite in a running script: ``dpprof compare`` measures them on a workload.
A script that already runs under ``torch.autocast("cuda")`` gets no mixed-precision rungs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dpprof.answers.answer_figures import need_bytes
from dpprof.answers.setups import SETUPS
from dpprof.measure.ladder_code import CODE_CHECKPOINT, CODE_LOOP_BF16, CODE_LOOP_FP16, detail
from dpprof.measure.ladder_rungs import Rung, rungs
from dpprof.result import STATUS_OK, STATUS_OOM, Fix
from dpprof.scenarios.names import (
    DATA_PARALLEL,
    DDP,
    FSDP2,
    MODEL_PARALLEL,
    SINGLE,
    TENSOR_PARALLEL,
)
from dpprof.script.ddp_run import ddp_state, library_wrap, rank_output_device
from dpprof.script.hooks import StepCallback
from dpprof.script.rewrite import Rewrite, rewrite_text
from dpprof.script.rung_diff import RungSites, rung_changes
from dpprof.script.runner import ScriptConfig, ScriptRun, run_script
from dpprof.script.strategy import Alternative, data_parallel_gpus, scattered_as_in
from dpprof.script.strategy_registry import alternative_named
from dpprof.script.trainer_settings import run_by_trainer, settings_of

__all__ = ["floor_of", "run_ladder", "rung_fix"]

# The words a rung's detail and the verdict use for the run it changes
FLOOR_WORDS = {DDP: "DDP", SINGLE: "one GPU", MODEL_PARALLEL: "the model as placed"}


def floor_of(main: ScriptRun, runs: list[tuple[str, ScriptRun]]
             ) -> tuple[Alternative | None, ScriptRun] | None:
    """The run the rungs change (the alternative it ran, None for the script as written,
    and the run): the alternative a ladder starts from (DDP's) of a DataParallel script,
    else the script as written; None for a DataParallel script without one (the rungs
    would run under DataParallel, which they do not fix)."""
    if SETUPS.get(main.scenario.name) == DATA_PARALLEL:
        return next(((alt, r) for alt, r in ((alternative_named(v), r) for v, r in runs)
                     if alt is not None and alt.ladder_floor), None)
    if main.scenario.name in (DDP, SINGLE, MODEL_PARALLEL):
        return None, main
    return None


def wanted(floor: ScriptRun, asked: bool | None) -> bool:
    """``--ladder`` (True), ``--no-ladder`` (False), else: the floor is out of memory."""
    if asked is not None:
        return asked
    return floor.scenario.status == STATUS_OOM


def run_ladder(cfg: ScriptConfig, main: ScriptRun, runs: list[tuple[str, ScriptRun]],
               step_cb: Callable[[str], StepCallback], notes: list[str],
               fixes: list[Fix], ran: list[tuple[str, ScriptRun]]) -> str | None:
    """Measure the rungs on the floor run (found among ``runs``) where wanted: each rung's
    run goes into ``ran`` (by the rung's name), its fix into ``fixes`` (rungs are fixes, as
    in ``compare``, not scenarios), why a rung was not run into ``notes``; the words for
    the run they change (None: no ladder)."""
    found = floor_of(main, runs)
    if found is None:
        if main.scenario.name in (FSDP2, TENSOR_PARALLEL) and wanted(main, cfg.ladder):
            notes.append(f"no ladder: the script shards its model itself ({main.scenario.name}"
                         "); the rungs dpprof measures start from DDP or one GPU")
        elif cfg.ladder:
            notes.append("no ladder: it runs on the DDP alternative, which this script has "
                         "none of")
        return None
    alternative, floor = found
    if floor.scenario.status not in (STATUS_OK, STATUS_OOM) or not wanted(floor, cfg.ladder):
        return None
    blocks = floor.blocks_words.get("count", 0)
    ladder = rungs(cfg.gpu.compute_capability, blocks > 0)
    if main.autocast_regions:
        ladder = [r for r in ladder if r.amp is None]
        notes.append("ladder: no mixed-precision rung: the script already runs under "
                     "torch.autocast('cuda')")
    if blocks == 0:
        notes.append("ladder: no activation checkpointing: the model has no repeated blocks "
                     "(no ModuleList of two or more, no module type repeated)")
    on = FLOOR_WORDS.get(floor.scenario.name, "")  # the DDP alternative's is ddp
    # Hugging Face's Trainer given the rung as its own settings where it runs the floor
    # itself (under a launcher, or on one GPU). On the DDP alternative of its DataParallel
    # the Trainer still runs as DataParallel, where it neither autocasts (accelerate does
    # not prepare a DataParallel model) nor wraps DDP: the rung's hooks measure what the
    # settings do under torchrun, whose own DDP options the DDP note beside them names
    by_trainer = alternative is None and run_by_trainer(floor.forward_sites,
                                                        floor.backward_sites)
    for rung in ladder:
        # on the DDP alternative each rank makes its share of a hand-made batch, as the
        # alternative's own run did (the rows DataParallel scattered)
        # a rung measures what the script needs with it, past where a GPU would run out
        run = run_script(scattered_as_in(cfg, main, alternative=alternative, rung=rung,
                                         rung_by_trainer=by_trainer, raise_oom=False),
                         step_cb(rung.name))
        if run.scenario.status not in (STATUS_OK, STATUS_OOM) or not run.scenario.devices:
            notes.append(f"ladder: {rung.title} could not be measured: {run.scenario.message}")
            continue
        ran.append((rung.name, run))
        fixes.append(rung_fix(rung, main, floor, run, cfg, on))
    return on


def rung_fix(rung: Rung, main: ScriptRun, floor: ScriptRun, run: ScriptRun,
             cfg: ScriptConfig, on: str) -> Fix:
    """The rung as a fix: against the script as written (cuda:0 and the heaviest GPU), its
    need as the out-of-memory check counts it, its change to the script."""
    used = [d for d in run.scenario.devices if d.used]
    base = [d for d in main.scenario.devices if d.used] or used
    need = need_bytes(run.scenario)
    return Fix(
        name=rung.name, title=rung.title,
        primary_peak_bytes=used[0].peak_allocated_bytes,
        max_peak_bytes=max(d.peak_allocated_bytes for d in used),
        saves_bytes=base[0].peak_allocated_bytes - used[0].peak_allocated_bytes,
        heaviest_saves_bytes=(max(d.peak_allocated_bytes for d in base)
                              - max(d.peak_allocated_bytes for d in used)),
        detail=detail(rung, run.checkpointed_blocks, on),
        code=rung_code(rung, floor, cfg, main),
        need_bytes=need, baseline=main.scenario.name,
        predicted_step_time_s=run.scenario.predicted_step_time_s)


def rung_code(rung: Rung, floor: ScriptRun, cfg: ScriptConfig,
              main: ScriptRun | None = None) -> str:
    """The rung's change as one diff of the script's own lines: its blocks checkpointed, its
    forward to ``backward()`` under autocast, and where it ran on a DataParallel script's
    DDP alternative (``main`` the script as written), the DDP change too: the script patched
    with it is the one the rung measured. Where the lines cannot be changed so, the reason,
    then the rung's change to the typical loop."""
    change = _rung_rewrite(rung, floor, cfg, main)
    if change.ok:
        return rewrite_text(change)
    if run_by_trainer(floor.forward_sites, floor.backward_sites):
        # the Trainer's settings: no loop of the script's to show the change in
        return rewrite_text(change)
    why = f"# (no rewrite of the script's lines: {change.reason}; the change by hand:)\n"
    parts = []
    if rung.checkpoint:
        parts.append("# after the model is built (before it is wrapped):\n"
                     + CODE_CHECKPOINT.format(**floor.blocks_words))
    if rung.amp is not None:
        loop = CODE_LOOP_BF16 if rung.amp == "bfloat16" else CODE_LOOP_FP16
        parts.append(loop.replace("(rank)", "()"))
    return why + "\n".join(parts)


def _rung_rewrite(rung: Rung, floor: ScriptRun, cfg: ScriptConfig,
                  main: ScriptRun | None) -> Rewrite:
    script = str(Path(cfg.launch.target).resolve()) if not cfg.launch.is_module else ""
    on_ddp = main is not None and SETUPS.get(main.scenario.name) == DATA_PARALLEL
    # the script's own lines: where a library's code called the model or backward()
    # (accelerate's accelerator.backward, Lightning's Trainer), the script's call of it
    sites = [next((s for s in chain if s.rpartition(":")[0] == script), chain[0] if chain
                  else "")
             for chain in (floor.forward_sites, floor.backward_sites)]
    ddp_note = ""
    gpus = cfg.gpus  # on DDP: a rank on each GPU DataParallel used
    if on_ddp:
        assert main is not None
        if not main.dp_sites:
            return Rewrite(reason="dpprof did not see the DataParallel wrap's line")
        gpus = data_parallel_gpus(main)
        # a library's wrap (Hugging Face's Trainer): the DDP change is a note, not an edit
        ddp_note = library_wrap(main.dp_sites[0], gpus, main.batch_rows)
        if not ddp_note:
            sites.append(main.dp_sites[0])
    if not script or not all(s.rpartition(":")[0] == script for s in sites):
        return Rewrite(reason="the model's call and backward() are not in the script")
    forward, backward, *dp = (int(s.rpartition(":")[2]) for s in sites)
    # where the floor is the DDP alternative's run: the batches and loaders it divided
    divided = ddp_state(floor)
    batches = tuple(int(n) for p, _, n in (b.rpartition(":") for b in (
        divided.batch_sites if divided is not None else ())) if p == script and n.isdigit())
    loaders = tuple(divided.loader_sites) if divided is not None else ()
    trainer = (settings_of(rung) if run_by_trainer(floor.forward_sites, floor.backward_sites)
               else None)
    return rung_changes(
        RungSites(script, forward, backward, dp[0] if dp else 0, batches,
                  main.batch_rows if main is not None else 0, loaders, ddp_note,
                  dim=main.batch_dim if main is not None else 0,
                  output_device=rank_output_device(divided) if divided is not None else None),
        gpus, rung.title, rung.amp, floor.blocks_words if rung.checkpoint else None,
        trainer)
