"""``dpprof run -- python train.py``: the user's unmodified script on virtual GPUs.

The script runs in dpprof's process (``runpy``: ``__main__``, ``sys.argv`` as given, its
folder first on ``sys.path``) under a :class:`~dpprof.emulator.virtual_cuda.VirtualCuda`,
and is stopped after ``steps`` optimizer steps (counted with torch's global optimizer step
hooks; the first is the warm-up, peaks are over the others), or when it ends, or when it
raises. ``torchrun`` / ``python -m torch.distributed.run|launch`` commands run rank 0 with
the environment torchrun gives it; ``mp.spawn`` runs rank 0 in place; the ranks of DDP are
alike (DistributedSampler pads the shards), so rank 0 stands for every rank.

Paired answers: a script that wraps its model in ``nn.DataParallel`` is also run as each
fix that ``dpprof run`` has a strategy for (:mod:`dpprof.script.strategy`): with the loss
computed inside forward on every replica, with DDP in its place (one emulated rank, each
DataLoader's batch divided among the GPUs, as a DDP script sets it).

The pieces, one module each: the command parsed (:mod:`dpprof.script.launch`), one
run of the script (:mod:`dpprof.script.runner`), what dpprof hooks into it
(:mod:`dpprof.script.hooks`), the effects it is kept from having
(:mod:`dpprof.script.effects`), and what the result says of the runs
(:mod:`dpprof.script.notes`). Here: :func:`run_command`, the runs and the result.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable

from dpprof.answers.answer import partial_sentence, settled
from dpprof.answers.answer_figures import device_label
from dpprof.answers.attribution import attribute_run
from dpprof.answers.comparison import compare
from dpprof.answers.setups import SETUPS
from dpprof.emulator.allocator_config import config_from_setting
from dpprof.emulator.call_sites import relative_site
from dpprof.emulator.kernels import kernel_notes
from dpprof.errors import Interrupted, interrupt_signal, take_interrupt
from dpprof.result import STATUS_ERROR, Fix, RunResult, new_result
from dpprof.scenarios.names import DATA_PARALLEL, DDP
from dpprof.script.hooks import AS_WRITTEN, StepCallback
from dpprof.script.launch import parse_command
from dpprof.script.lightning_launch import launched_note, ranks_launch
from dpprof.script.notes import (
    how_it_ended,
    library_branches,
    nothing_on_a_gpu,
    script_assumptions,
    seal_fields,
    seal_notes,
    write_notes,
)
from dpprof.script.rank_broadcasts import Broadcasts
from dpprof.script.rank_runs import merge_ranks
from dpprof.script.rank_spec import ranks_to_run
from dpprof.script.rungs import run_ladder
from dpprof.script.runner import RunInterrupted, ScriptConfig, ScriptRun, run_script
from dpprof.script.sealed_run import finish_removals, prepare_process, take_census
from dpprof.script.shared_files import SharedFiles
from dpprof.script.strategy import AlternativeRuns, data_parallel_gpus
from dpprof.script.strategy_registry import strategies

# ScriptConfig, ScriptRun, parse_command and nothing_on_a_gpu live in modules of their own;
# the CLI, the answers, the benchmarks and the tests import them from here with run_command
__all__ = [
    "ScriptConfig",
    "ScriptRun",
    "nothing_on_a_gpu",
    "parse_command",
    "run_command",
]

Progress = Callable[[str, int, int], None]  # (what, steps done, steps)


def run_command(cfg: ScriptConfig, alternatives: bool = True,
                progress: Progress | None = None) -> tuple[RunResult, ScriptRun]:
    """Run the script as written (and its paired alternatives); the result and the
    as-written run (its traceback and exit status).

    An interrupt at any moment raises :class:`~dpprof.errors.Interrupted` with the partial
    result: the runs that ended, the one it cut short (the script as written with what it
    measured; an alternative as an error, never compared), marked interrupted and naming
    the run it stopped in."""
    def step_cb(what: str) -> StepCallback:
        return lambda k: progress(what, k, cfg.steps) if progress else None

    census = None  # the user's files, checked after each run (a census taken here is let go
    # here: its folder watch holds one of the user's inotify instances)
    if cfg.seal and cfg.files_before is None:
        prepare_process()
        census = take_census(None if cfg.launch.is_module else cfg.launch.target,
                             cfg.keep_writes)
        cfg = dataclasses.replace(cfg, files_before=census)
    runs: list[tuple[str, ScriptRun]] = []
    rungs: list[tuple[str, ScriptRun]] = []
    notes: list[str] = []
    fixes: list[Fix] = []
    doing = ["the script as written"]  # what runs now, in words (the last is)
    # the filesystem the ranks share: what rank 0's run wrote, shown to the later ranks'
    shared = SharedFiles() if cfg.seal and cfg.ranks != "none" else None
    # and what rank 0's run broadcast, given to the later ranks' at the same call
    broadcasts = Broadcasts() if cfg.ranks != "none" else None
    try:
        ranks_cfg = dataclasses.replace(cfg, shared_files=shared, broadcasts=broadcasts)
        main = run_script(ranks_cfg, step_cb("as written"))
        runs.append((AS_WRITTEN, main))
        if main.ended != "script raised":
            doing.append("the other ranks")
            _run_ranks(ranks_cfg, main, step_cb)
        if shared is not None:
            shared.close()
            shared = None
        if (alternatives and SETUPS.get(main.scenario.name) == DATA_PARALLEL
                and main.ended != "script raised"):
            doing.append("the alternatives")
            _run_alternatives(cfg, main, data_parallel_gpus(main), step_cb, runs, notes, fixes)
        ladder_on = None
        if main.ended != "script raised" and not main.exit_status:
            doing.append("the ladder")
            ladder_on = run_ladder(cfg, main, runs, step_cb, notes, fixes, rungs)
        doing.append("the result")
        result = _result(cfg, runs, rungs, notes, fixes, ladder_on)
        finish_removals()  # the runs' overlays, removed while the next set up (and this)
        return result, main
    except (KeyboardInterrupt, Interrupted) as e:
        signum = interrupt_signal(e)
        take_interrupt(signum)  # stopping: the next signal is held until this is written
        finish_removals()
        cut = e.run if isinstance(e, RunInterrupted) else None
        during = run_words(e.cfg) if isinstance(e, RunInterrupted) else doing[-1]
        if cut is not None and cut.rank != 0:  # rank 0's figures stand for every rank
            notes.append(f"{during} was interrupted: not run, rank 0 stands for every rank")
            cut = None
        partial = _partial(cfg, runs, rungs, notes, fixes, cut, signum, during)
        raise Interrupted(signum, partial=partial, during=during) from None
    finally:
        if shared is not None:
            shared.close()
        if census is not None and census.watch is not None:
            census.watch.close()
        finish_removals()  # where anything else ended it


def run_words(cfg: ScriptConfig) -> str:
    """The run of the script ``cfg`` makes, in words ("the DDP alternative")."""
    if cfg.rung is not None:
        return f"the ladder's rung {cfg.rung.name}"
    if cfg.rank:
        return f"the script as written as rank {cfg.rank}"
    if cfg.variant == AS_WRITTEN:
        return "the script as written"
    return f"the {cfg.variant} alternative"


def _run_ranks(cfg: ScriptConfig, main: ScriptRun,
               step_cb: Callable[[str], StepCallback]) -> None:
    """Run the ranks other than 0 that ``cfg.ranks`` names, each as written, and fold them
    into ``main``, rank 0's run (:mod:`dpprof.script.rank_runs`)."""
    world = main.world_size
    ranks, beyond = ranks_to_run(cfg.ranks, world)
    launched = main.launched
    if launched is not None:  # Lightning's launcher: each rank as it would have started it
        cfg = dataclasses.replace(cfg, launch=ranks_launch(cfg.launch, launched))
        main.scenario = dataclasses.replace(main.scenario, notes=(
            *main.scenario.notes, launched_note(launched, cfg.launch)))
    elif main.spawned_by:  # a library's launcher spawned the ranks (Lightning's ddp_spawn)
        main.scenario = dataclasses.replace(main.scenario, notes=(
            *main.scenario.notes,
            f"the ranks are started by torch.multiprocessing.start_processes with "
            f"{main.spawned_by}: no process started, each rank played in place as "
            "mp.spawn's are (rank 0 in dpprof's process, the others as --ranks says)"))
    # a rank is played where dpprof plays the launcher (torchrun's, accelerate's or
    # Lightning's environment, mp.spawn's argument); a script that starts its own
    # processes otherwise would run as rank 0 again
    playable = "WORLD_SIZE" in cfg.launch.env or main.spawned
    if ranks and not playable:
        main.scenario = dataclasses.replace(main.scenario, notes=(
            *main.scenario.notes,
            f"--ranks {cfg.ranks}: the script starts its ranks itself, which dpprof does "
            "not follow (it plays torchrun's, accelerate launch's and mp.spawn's): rank 0 "
            "stands for every rank"))
        ranks, beyond = [], []
    for rank in ranks:  # each shown rank 0's files (cfg.shared_files), not another rank's
        main.rank_runs.append(run_script(dataclasses.replace(cfg, rank=rank),
                                         step_cb(f"rank {rank}")))
    if cfg.broadcasts is not None:  # which of rank 0's objects each rank was given
        main.scenario = dataclasses.replace(main.scenario, notes=(
            *main.scenario.notes, *(n for r in ranks for n in cfg.broadcasts.notes(r))))
    if world > 1:
        main.ranks = merge_ranks(main, main.rank_runs, world,
                                 None if cfg.launch.is_module else cfg.launch.target, beyond,
                                 cfg.ranks)
        if launched is not None:
            main.ranks["started_by"] = launched.launcher


def _gpus_of(main: ScriptRun) -> int:
    return len(main.scenario.devices) if main.scenario.name != DDP else main.visible_gpus


def _result(cfg: ScriptConfig, runs: list[tuple[str, ScriptRun]],
            rungs: list[tuple[str, ScriptRun]], notes: list[str], fixes: list[Fix],
            ladder_on: str | None) -> RunResult:
    """The result of the runs (the first is the script as written)."""
    main = runs[0][1]
    n = _gpus_of(main)
    ranks = [(f"{AS_WRITTEN} rank {r.rank}", r) for r in main.rank_runs]
    if not main.noted:
        _note_the_main_run(main, cfg)
        main.noted = True
    result = new_result(
        "emulated", cfg.launch.display, batch=main.scenario.batch, gpus=n,
        gpu_memory_bytes=cfg.capacity_bytes,
        scenarios=tuple(r.scenario for _, r in runs),
        config={
            "command": "run", "launcher": cfg.launch.launcher, "script": cfg.launch.target,
            "argv": list(cfg.launch.argv), "steps": cfg.steps, "compute": cfg.compute,
            "gpu": cfg.gpu.key, "gpus": n, "interconnect": cfg.interconnect,
            "steps_done": {v: r.steps_done for v, r in runs + ranks + rungs},
            "seconds": {v: round(r.seconds, 3) for v, r in runs + ranks + rungs},
            "exit_status": main.exit_status,
            # the run the ladder's rungs changed, in words (absent: no ladder)
            **({"ladder_on": ladder_on} if ladder_on else {}),
            # the ranks run (dpprof.script.rank_runs; absent: one process)
            **({"ranks": main.ranks} if main.ranks else {}),
        },
        assumptions=tuple(script_assumptions(cfg)),
        notes=tuple(notes),
        fixes=tuple(fixes),
    )
    if cfg.seal:
        writes, seal = seal_fields(runs + ranks + rungs, cfg.keep_writes)
        result = dataclasses.replace(result, writes=tuple(writes), seal=seal,
                                     notes=(*result.notes, *seal_notes(seal)))
    result = dataclasses.replace(result, comparison=compare(result))  # attribution reads it
    return settled(dataclasses.replace(result, attribution=attribute_run(result)))


def _partial(cfg: ScriptConfig, runs: list[tuple[str, ScriptRun]],
             rungs: list[tuple[str, ScriptRun]], notes: list[str], fixes: list[Fix],
             cut: ScriptRun | None, signum: int, during: str) -> RunResult | None:
    """What an interrupt leaves: the runs that ended, and ``cut``, the run it stopped (the
    script as written: what it measured; an alternative: an error, never compared; a
    rung: a note); None where nothing was measured."""
    name = signal.Signals(signum).name
    if cut is not None:
        if not runs:
            runs = [(AS_WRITTEN, cut)]
        elif cut.ended != "interrupted":  # stopped after its script stopped: it is whole
            if cut.rung is None:
                runs = [*runs, (cut.variant, cut)]
        elif cut.rung is not None:
            notes = [*notes, f"ladder: {cut.rung} interrupted by {name} after "
                     f"{cut.steps_done} step(s): not measured"]
        else:
            cut.scenario = dataclasses.replace(cut.scenario, status=STATUS_ERROR, message=(
                f"interrupted by {name} after {cut.steps_done} of {cfg.steps} optimizer "
                "step(s): cut short, so neither reported as measured nor compared"))
            runs = [*runs, (cut.variant, cut)]
    if not runs or not any(d.peak_allocated_bytes for _, r in runs for d in r.scenario.devices):
        return None
    return _marked_interrupted(_result(cfg, runs, rungs, notes, fixes, None), name, during)


def interrupted_while_writing(result: RunResult, signum: int) -> RunResult:
    """A whole result whose reports an interrupt stopped: marked interrupted, in every
    format."""
    return _marked_interrupted(result, signal.Signals(signum).name,
                               "the writing of the reports")


def _marked_interrupted(result: RunResult, signal_name: str, during: str) -> RunResult:
    """``result`` marked interrupted by ``signal_name`` during ``during``: a note, and the
    verdict derived again (it begins with :func:`partial_sentence`)."""
    result = dataclasses.replace(result, interrupted=signal_name,
                                 config={**result.config, "interrupted_in": during})
    return settled(dataclasses.replace(result, notes=(*result.notes,
                                                      partial_sentence(result))))


def _run_alternatives(cfg: ScriptConfig, main: ScriptRun, n: int,
                      step_cb: Callable[[str], StepCallback],
                      runs: list[tuple[str, ScriptRun]], notes: list[str],
                      fixes: list[Fix]) -> None:
    """Measure each fix ``dpprof run`` has a strategy for on a DataParallel script, in the
    fix registry's order (:mod:`dpprof.script.strategy_registry`): each alternative's run
    goes into ``runs``, what it saves into ``fixes``, why it could not run into ``notes``."""
    if n == 1:
        notes.append(_one_gpu_note(main))
        return
    found = AlternativeRuns(cfg, main, n, step_cb, runs, notes, fixes)
    for strategy in strategies():
        strategy.measure(found)


def _one_gpu_note(main: ScriptRun) -> str:
    """Why a DataParallel script on one GPU gets no alternatives, and what spreads it."""
    visible = len(main.scenario.devices)
    rows = main.batch_rows
    if visible > 1 and rows == 1:
        why = (f"its batch of one row splits into one chunk of the {visible} GPUs; a larger "
               "batch spreads over them")
    elif visible > 1:
        why = (f"device_ids names one of the {visible} GPUs; device_ids=None (DataParallel's "
               "default) spreads each batch over all of them")
    else:
        why = "one GPU is seen; run with --gpus N to plan for N"
    gpu = next((d for d in main.scenario.devices if d.used), main.scenario.devices[0])
    return (f"no alternatives: DataParallel ran on one GPU, {device_label(gpu)}, where it "
            "splits and gathers nothing: no imbalance for the loss inside forward or DDP to "
            f"remove; {why}")


def _note_the_main_run(main: ScriptRun, cfg: ScriptConfig) -> None:
    """The as-written run's notes: how it ended, autocast, what it was kept from writing,
    the values read from emulated tensors."""
    s0_notes = list(main.scenario.notes)
    s0_notes.insert(0, how_it_ended(main, cfg))
    if main.autocast_regions:
        s0_notes.append(f"torch.autocast('cuda') in the script: {main.autocast_regions} "
                        "region(s) re-enacted as on a GPU (autocast's CUDA op lists)")
    if main.replicas_float16 is not None:
        s0_notes.append(main.replicas_float16)
    if main.data_parallel and main.trainer_precision and not main.autocast_regions:
        asked = main.trainer_precision[0]
        s0_notes.append(
            f"the script's TrainingArguments ask for {asked}=True, but under DataParallel "
            "Hugging Face's Trainer ran no autocast (it leaves autocast to accelerate, which "
            "does not prepare a DataParallel model): these peaks are float32's; as DDP ranks "
            f"(torchrun --nproc-per-node {cfg.gpus}) it runs in {asked}")
    if main.compiled:
        sites = list(dict.fromkeys(main.compiled))  # in the order the script ran them
        s0_notes.append(
            f"torch.compile at {', '.join(relative_site(x) for x in sites[:3])}: run eagerly "
            "(dpprof does not play compiled kernels, but for FlexAttention's, whose memory "
            "it takes from Inductor's fused kernel); a compiled model may hold less (fused "
            "activations): these peaks are the eager model's")
    if main.compiled_graphs:
        graphs = list(dict.fromkeys(main.compiled_graphs))
        s0_notes.append(
            f"torch.compile at {', '.join(relative_site(x) for x in graphs[:3])} asks for "
            "CUDA graphs (its mode or options): on a GPU Inductor captures the compiled "
            "steps into a private pool that stays reserved; run eagerly here, nothing is "
            "captured, so the reserved figures leave that pool out (torch.cuda.graph in "
            "the script itself is played)")
    setting = main.allocator_setting  # as the run read it, the script's own setting included
    if setting is not None:
        config, differ = config_from_setting(setting[1], main.memory_fraction_set)
        named = (f"{setting[0]}={setting[1]} in the script's environment"
                 if setting[0].startswith("PYTORCH_") else f"{setting[0]} ({setting[1]})")
        if differ:
            s0_notes.append(
                f"{named}: {', '.join(differ)} not modelled; the reserved figures are the "
                "caching allocator's without it, which a GPU run with it does not hold to")
        if config.roundup_power2_divisions:
            s0_notes.append(
                f"{named}: roundup_power2_divisions rounds each block up to a power-of-two "
                "division: the reserved figures follow it; the allocated ones count each "
                "tensor's bytes rounded to 512 B, where torch.cuda.memory_allocated() on a GPU "
                "counts the larger blocks")
        if main.allocator_settings_late:
            s0_notes.append(
                f"{named}: set after the script's first allocation, where the allocator "
                "follows them for its new segments only; the reserved figures take them "
                "from the start")
    if main.uncached_by:
        s0_notes.append(
            f"the caching allocator switched off ({'; '.join(main.uncached_by[:3])}): on a "
            "GPU what is allocated while it is off bypasses it (a cudaMalloc and cudaFree "
            "each, outside torch.cuda's statistics); here it is counted as cached")
    s0_notes.extend(main.emulation_notes)
    if main.oom_raised:
        s0_notes.append(
            f"torch.OutOfMemoryError raised {len(main.oom_raised)} time(s) in the run, where "
            f"the GPU would raise it, and caught by the script, which went on (first: "
            f"{main.oom_raised[0]}; last: {main.oom_raised[-1]}): the figures are those of "
            "what it went on with")
    s0_notes += kernel_notes(main.kernels, cfg.gpu.compute_capability)
    s0_notes.extend(write_notes(main))
    if main.stand_ins:
        s0_notes.append(
            f"{sum(main.stand_ins.values())} value(s) read from emulated tensors answered "
            "with stand-ins (" + ", ".join(f"{k} x{v}" for k, v in sorted(
                main.stand_ins.items())) + "): " + "; ".join(
                f"{relative_site(site)} x{c}"
                for site, c in list(main.stand_in_sites.items())[:5])
            + ("; an op's output shaped by stand-ins (x[mask] of a mask whose values are the "
               "model's selects nothing) is not the GPU's: --compute runs the same "
               "emulation over CPU tensors, with the real values"
               if "shape" in main.stand_ins else ""))
        s0_notes.extend(library_branches(main.stand_in_sites))
    main.scenario = dataclasses.replace(main.scenario, notes=tuple(s0_notes))

