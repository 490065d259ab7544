"""One run of the user's script on virtual GPUs (:func:`run_script`), measured: the script
runs in dpprof's process (``runpy``) under a :class:`~dpprof.emulator.virtual_cuda.VirtualCuda`
until it has run :attr:`ScriptConfig.steps` optimizer steps, ends or raises; what it ran
(DataParallel, DDP, a model placed by hand on several GPUs, one GPU) becomes a scenario's
result (:class:`ScriptRun`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import runpy
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dpprof.backends.emulated_figures import (
    ddp_ranks,
    device_result,
    timeline_points,
    transient_note,
)
from dpprof.emulator.catalog import GpuSpec, lookup_gpu
from dpprof.emulator.data_parallel import replicas_float16_note
from dpprof.emulator.device_readings import beside_tensors_bytes
from dpprof.emulator.dispatch_state import VirtualDeviceError
from dpprof.emulator.emulated_autocast import CudaAutocastNames
from dpprof.emulator.kernels import GpuKernels
from dpprof.emulator.oom_guard import OomGuard, OutOfMemoryRaised
from dpprof.emulator.op_log import OpLog
from dpprof.emulator.patcher import Patcher
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.errors import (
    Interrupted,
    NotEmulated,
    deferred_interrupts,
    interrupt_delivered,
    interrupt_signal,
    interrupts_allowed,
    pending_interrupt,
    take_interrupt,
)
from dpprof.measure.ladder_rungs import Rung
from dpprof.result import STATUS_ERROR, STATUS_OK, STATUS_OOM, ScenarioResult
from dpprof.scenarios.names import (
    DDP,
    DP_LOSS_FORWARD,
    DP_LOSS_PRIMARY,
    FSDP2,
    MODEL_PARALLEL,
    SINGLE,
    TENSOR_PARALLEL,
)
from dpprof.scenarios.registry import scenario
from dpprof.script import parallel_state, seal, wrappers
from dpprof.script.census import Snapshot
from dpprof.script.computed_values import sharded_values_note
from dpprof.script.distributed_checkpoint import stand_ins as distributed_checkpoints
from dpprof.script.effects import ScriptEffects
from dpprof.script.hooks import (
    AS_WRITTEN,
    RungHooks,
    StepCallback,
    Stepper,
    StopScript,
    compile_eagerly,
    label_losses,
)
from dpprof.script.launch import (
    Launch,
    ProcessExit,
    as_rank,
    process_exit_caught,
    run_main_file,
    script_process,
    started_in,
    user_traceback,
)
from dpprof.script.lightning_launch import LaunchedRanks
from dpprof.script.process_end import run_at_the_end
from dpprof.script.rank_broadcasts import Broadcasts
from dpprof.script.run_figures import (
    AllocatorLimit,
    NcclOnDevices,
    below_what_the_script_was_told,
    predict_time,
    rank_device,
    with_overheads,
)
from dpprof.script.scenario_messages import headline, past_the_oom, stopped_by_oom
from dpprof.script.script_error import RaisedAt, raised_at
from dpprof.script.seal import SealBreach
from dpprof.script.sealed_run import SealedRun, SealOutcome, written_but_missing
from dpprof.script.seeds import same_seeds
from dpprof.script.shared_files import SharedFiles
from dpprof.script.stop_handlers import scripts_stop_handlers
from dpprof.script.strategy import Alternative, AlternativeState
from dpprof.script.trainer_settings import asked_precision, given_to_trainer
from dpprof.units import fmt_bytes

__all__ = ["RunInterrupted", "ScriptConfig", "ScriptRun", "run_script"]


@dataclass
class ScriptConfig:
    launch: Launch
    gpus: int = 4
    gpu: GpuSpec = field(default_factory=lambda: lookup_gpu("a100-80gb"))
    gpu_memory_bytes: int | None = None  # None: the GPU's
    steps: int = 3  # optimizer steps before stopping; the first is the warm-up
    compute: bool = False  # CPU tensors (real numbers) instead of meta tensors
    # the fix the script is run with (dpprof.script.strategy); None: as written
    alternative: Alternative | None = None
    debug: bool = False
    rung: Rung | None = None  # a rung of the ladder applied as the script runs
    # the rung given as Hugging Face's Trainer's own settings (its TrainingArguments), where
    # the Trainer runs the model and backward() (dpprof.script.trainer_settings)
    rung_by_trainer: bool = False
    # the loss inside forward: the replicas return their outputs too (the script uses them)
    keep_outputs: bool = False
    ladder: bool | None = None  # --ladder / --no-ladder; None: where the floor is out of memory
    keep_writes: str | None = None  # --keep-writes DIR: each run's overlay copied there
    # False only to measure the seal's cost (benchmarks/bench_seal.py) and, in tests, what
    # it keeps out: the script then writes into the user's files
    seal: bool = True
    # the user's files before the runs (dpprof.script.census), checked after each; None:
    # noted before this run
    files_before: Snapshot | None = None
    # the link the predicted step time assumes ("nvlink", "pcie"; "": the GPU's own)
    interconnect: str = ""
    # the measured steps' time predicted (off only to measure what that costs)
    predict_time: bool = True
    # torch.OutOfMemoryError raised where the GPU runs out (False: the run goes on past it)
    raise_oom: bool = True
    # the rows DataParallel scattered in the run as written, and along which dimension (in
    # the DDP alternative each rank's share of a batch the script makes by hand follows)
    scattered_rows: int = 0
    scattered_dim: int = 0
    scattered_gpus: int = 0  # ... and to how many GPUs (0: every GPU the script sees)
    # the rank this run plays (its launcher's environment, mp.spawn's argument, its own
    # virtual GPU); the script as written is rank 0
    rank: int = 0
    # --ranks: the ranks besides 0 run as written ("last": the world's last; "all")
    ranks: str = "none"
    # the filesystem the ranks share (dpprof.script.shared_files): rank 0's run keeps its
    # files there, a later rank's run is shown them; None: no other rank runs
    shared_files: SharedFiles | None = None
    # what rank 0's run broadcast (dpprof.script.rank_broadcasts), given to the later ranks'
    # runs; None: no other rank runs
    broadcasts: Broadcasts | None = None

    @property
    def capacity_bytes(self) -> int:
        return self.gpu_memory_bytes or self.gpu.total_memory_bytes

    @property
    def variant(self) -> str:
        """The run's name: the fix's it is run with, else :data:`AS_WRITTEN`."""
        return self.alternative.name if self.alternative is not None else AS_WRITTEN


@dataclass
class ScriptRun:
    """What one run of the script gave."""

    scenario: ScenarioResult
    steps_done: int = 0
    by_backwards: bool = False  # no optimizer: stopped after --steps backward passes
    no_optimizer: bool = False  # the script made none (a step per backward pass)
    ended: str = ""  # "steps" | "script ended" | "script raised"
    exit_status: int = 0
    script_traceback: str | None = None
    raised_at: RaisedAt | None = None  # the script's line its error was raised at
    # a file the run wrote that the script's error says was missing (read outside Python)
    written_but_missing: str | None = None
    stand_ins: dict[str, int] = field(default_factory=dict)
    stand_in_sites: dict[str, int] = field(default_factory=dict)
    data_parallel: bool = False
    ddp: bool = False
    fsdp: bool = False  # the script sharded its model with FSDP2's fully_shard
    tensor_parallel: bool = False  # and its layers with parallelize_module
    tensor_parallel_ranks: int = 1  # the ranks of its tensor-parallel mesh (one batch)
    world_size: int = 1
    batch_rows: int = 0
    batch_dim: int = 0  # the dimension DataParallel split them along (its dim)
    seconds: float = 0.0
    autocast_regions: int = 0  # torch.autocast("cuda") regions the script entered
    # the mixed precision Hugging Face's TrainingArguments asked for ("bf16", "fp16")
    trainer_precision: list[str] = field(default_factory=list)
    replicas_float16: str | None = None  # data_parallel.replicas_float16_note, where it held
    kernels: dict[str, int] = field(default_factory=dict)  # GpuKernels.chosen
    compiled: list[str] = field(default_factory=list)  # torch.compile's sites, run eagerly
    # those of them whose mode captures CUDA graphs on a GPU (reduce-overhead, max-autotune)
    compiled_graphs: list[str] = field(default_factory=list)
    # PYTORCH_ALLOC_CONF (or its older name) and its value, as the run read it (None: unset)
    allocator_setting: tuple[str, str] | None = None
    # the report's words on what the emulation left out or answered otherwise: NVML's activity
    # readings, GPU profiling and tuning, another thread's CUDA work, a subclass's replicate
    emulation_notes: list[str] = field(default_factory=list)
    # the calls that switched the caching allocator off (caching_allocator_enable(False))
    uncached_by: list[str] = field(default_factory=list)
    memory_fraction_set: bool = False  # set_per_process_memory_fraction was called
    # the allocator's settings were set at run time after the first allocation (there)
    allocator_settings_late: str | None = None
    # the out-of-memory errors the run raised where the GPU would have, in words
    oom_raised: list[str] = field(default_factory=list)
    # the one the script did not catch (it ended the run), None: none
    oom_uncaught: OutOfMemoryRaised | None = None
    forwards: int = 0  # outermost module calls seen
    backwards: int = 0  # backward() calls seen
    replica_scalars: bool = False  # the DataParallel replicas returned their losses
    dp_sites: list[str] = field(default_factory=list)  # see wrappers.LOG
    seal: SealOutcome = field(default_factory=SealOutcome)  # what it wrote, the check after
    # stand-in files written for checkpoints of emulated tensors, and loaded back:
    # "torch.save ckpt.pt at train.py:40" -> times (dpprof.script.effects)
    stand_in_files: dict[str, int] = field(default_factory=dict)
    read_back: dict[str, int] = field(default_factory=dict)
    output_tail: str = ""  # an alternative's run: the end of what it printed (not shown)
    interrupted_by: int = 0  # the signal that cut the run short (ended == "interrupted")
    shard_rows: dict[int, int] = field(default_factory=dict)  # see wrappers.LOG
    visible_gpus: int = 0  # the GPUs the script saw (after its CUDA_VISIBLE_DEVICES)
    # the script's model: the words of the checkpointing code for its repeated blocks
    # (dpprof.measure.ladder_code.blocks_words, their "count" among them); the lines of its
    # first call and of the first backward() (file:line), each with every line outside torch
    # and dpprof that led to it, innermost first (where a library's code called the model or
    # backward(), the script's line that called that library)
    blocks_words: dict[str, Any] = field(default_factory=dict)
    forward_sites: tuple[str, ...] = ()
    backward_sites: tuple[str, ...] = ()
    checkpointed_blocks: int = 0  # a checkpointing rung's run: the blocks it wrapped
    variant: str = AS_WRITTEN  # the run's ScriptConfig.variant
    # what the fix it ran with followed (its strategy's record, dpprof.script.strategy,
    # read through the strategy's module); None: no fix
    alternative_state: AlternativeState | None = None
    rung: str | None = None  # the name of the ladder's rung it ran, if any
    rank: int = 0  # the run's ScriptConfig.rank
    local_rank: int = 0  # its GPU on the node (LOCAL_RANK; mp.spawn's rank)
    # the script as written: the other ranks' runs (dpprof.script.rank_runs), their record
    rank_runs: list[ScriptRun] = field(default_factory=list)
    ranks: dict[str, object] = field(default_factory=dict)
    # it raised because the emulation found tensors of two GPUs in one op (VirtualDeviceError)
    devices_mixed: bool = False
    spawned: bool = False  # the script called mp.spawn / start_processes (it gets a rank)
    spawned_by: str = ""  # the library's function spawned, where not the script's own
    # the ranks Lightning's own launcher asked for as processes (none started), where it ran
    launched: LaunchedRanks | None = None
    noted: bool = False  # the as-written run's notes are made (dpprof.script.session)


class RunInterrupted(Interrupted):
    """A run of the script stopped by ``signum``: ``run`` holds what it measured (cut short
    where the script was running, else whole), ``cfg`` the run it was."""

    def __init__(self, signum: int, run: ScriptRun, cfg: ScriptConfig) -> None:
        super().__init__(signum)
        self.run = run
        self.cfg = cfg


def run_script(cfg: ScriptConfig, on_step: StepCallback | None = None) -> ScriptRun:
    """Run the script once on virtual GPUs and measure it (see the module).

    A stop signal while the script runs stops it (the run ends "interrupted"); one while
    dpprof sets the run up or puts everything back waits until that is done. Either way
    :class:`RunInterrupted` is raised with what the run measured."""
    with deferred_interrupts():
        run = _run_script(cfg, on_step)
        if run.oom_uncaught is not None and not pending_interrupt():
            # the GPU stops the script there; run it again past that point to measure what
            # it needs (the figures the out-of-memory would leave unknown)
            stopped = run.oom_uncaught
            run = _run_script(dataclasses.replace(cfg, raise_oom=False), on_step)
            run.scenario = past_the_oom(run.scenario, stopped)
        signum = run.interrupted_by if run.ended == "interrupted" else pending_interrupt()
        if signum:
            raise RunInterrupted(signum, run, cfg)
    return run


def _run_script(cfg: ScriptConfig, on_step: StepCallback | None) -> ScriptRun:
    """Run the script once, sealed (:mod:`dpprof.script.sealed_run`), and measure it."""
    launch = as_rank(cfg.launch, cfg.rank)
    launch.check_script()
    vc = VirtualCuda(cfg.gpus, cfg.gpu, base="cpu" if cfg.compute else "meta",
                     gpu_memory_bytes=cfg.capacity_bytes, installers=[wrappers.install],
                     quiet_thread_ends=(StopScript,))  # a loop on a thread of the script's
    rt = vc.rt
    guard = OomGuard(vc.memory, functools.partial(beside_tensors_bytes, vc), vc.logical)
    if cfg.raise_oom:
        guard.install()
    if cfg.predict_time:
        rt.op_log = OpLog()  # on from the first measured step (the Stepper turns it on)
        rt.op_log.on = cfg.steps <= 1  # no warm-up: every step is measured
    stepper = Stepper(rt, cfg.steps, on_step)
    guard.listeners.append(stepper.abandoned)
    alternative = cfg.alternative
    state = alternative.new_state(cfg) if alternative is not None else None
    run = ScriptRun(scenario=ScenarioResult(name=AS_WRITTEN), variant=cfg.variant,
                    rung=cfg.rung.name if cfg.rung is not None else None, rank=cfg.rank,
                    local_rank=int(launch.env.get("LOCAL_RANK", cfg.rank)), alternative_state=state)
    vc.nccl_bytes_on = NcclOnDevices(vc, cfg, run.local_rank)
    # torch.autocast("cuda") in the script: re-enacted as on a GPU (autocast's CUDA lists)
    autocast = CudaAutocastNames()
    # SDPA, dropout, rms_norm and the embedding backward as the target GPU runs them; over
    # CPU tensors (--compute) the CPU kernels run, as the CPU runs them
    kernels = GpuKernels(cfg.gpu.compute_capability, rt)
    start = time.perf_counter()
    exc: BaseException | None = None
    rung = RungHooks(cfg.rung, cfg.rung_by_trainer) if cfg.rung is not None else None
    if rung is not None:
        stepper.listeners.append(rung)
    _note_first_stand_in(rt)
    name = cfg.variant if cfg.rung is None else f"{cfg.variant}+{cfg.rung.name}"
    if cfg.rank:
        name += f" rank {cfg.rank}"
    sealed = (SealedRun(name, None if launch.is_module else launch.target, cfg.keep_writes,
                        cfg.files_before, publish_to=cfg.shared_files if cfg.rank == 0 else None,
                        seed_from=cfg.shared_files if cfg.rank != 0 else None)
              if cfg.seal else contextlib.nullcontext())
    # an alternative's run prints nothing (dpprof.script.effects), nor does a rank's other
    # than 0 (the terminal shows one rank's output)
    effects = ScriptEffects(rt.is_emulated, silenced=(cfg.variant != AS_WRITTEN
                                                      or cfg.rung is not None or cfg.rank != 0))
    with script_process(launch), sealed, started_in(launch.cwd), same_seeds(), vc, \
            (contextlib.nullcontext() if cfg.compute else kernels), autocast, effects, \
            Patcher() as patcher, distributed_checkpoints(patcher.patch):
        label_losses(vc, patcher)  # before an alternative's loss call, which calls it
        parallel_state.state_of(vc).alternative = alternative
        parallel_state.state_of(vc).keep_outputs = cfg.keep_outputs
        if alternative is not None and state is not None:
            alternative.install(state, vc, patcher)
        parallel_state.state_of(vc).spawn_rank = cfg.rank
        parallel_state.state_of(vc).broadcasts = cfg.broadcasts
        compile_eagerly(patcher, run.compiled, run.compiled_graphs)
        _count_backwards(patcher, stepper)
        stepper.install()
        try:
            with (given_to_trainer(cfg.rung) if cfg.rung is not None
                  and cfg.rung_by_trainer else contextlib.nullcontext()), \
                    asked_precision(run.trainer_precision):
                exc = _run_until_stopped(launch, run)
        finally:
            vc.memory.allocator_config()  # the script's own environment's
            run.allocator_setting = vc.memory.setting
            run.emulation_notes = [n for n in (
                vc.readings.note(), vc.profiled.note(), vc.other_threads_note(),
                wrappers.replicate_note(vc)) if n]
            run.uncached_by = list(vc.memory.uncached_by)
            run.memory_fraction_set = bool(vc.memory.fractions)
            run.allocator_settings_late = vc.memory.settings_late
            run.oom_raised = [raised.words() for raised in guard.raised]
            run.oom_uncaught = guard.raised_by(exc)
            if rung is not None:
                rung.close()
            stepper.remove()
            wrappers.cleanup(vc)
            used, ddp_devices = _read_log(run, cfg, vc, stepper, state)
            if alternative is not None and state is not None:
                alternative.after_run(state, vc, ddp_devices)
    run.seconds = time.perf_counter() - start
    if isinstance(sealed, SealedRun):
        run.seal = sealed.outcome
        if exc is not None:
            run.written_but_missing = written_but_missing(exc, sealed.outcome)
    run.stand_in_files = dict(effects.stand_ins)
    run.read_back = dict(effects.read_back)
    run.output_tail = effects.output_tail
    run.steps_done = stepper.done
    run.forwards, run.backwards = stepper.forwards, stepper.backwards
    run.by_backwards = stepper.by_backwards
    run.no_optimizer = not stepper.optimizer_made
    run.stand_ins = dict(rt.stand_ins.counts)
    run.stand_in_sites = dict(rt.stand_ins.sites)
    run.autocast_regions = autocast.regions
    run.blocks_words = stepper.blocks_words
    run.forward_sites, run.backward_sites = stepper.forward_sites, stepper.backward_sites
    run.checkpointed_blocks = rung.blocks if rung is not None else 0
    run.replicas_float16 = replicas_float16_note(rt)
    run.kernels = dict(kernels.chosen)
    warmup_higher = stepper.keep_higher_warmup_peaks()
    run.scenario = _scenario(cfg, vc, run, stepper, used, ddp_devices, exc, warmup_higher)
    if rt.op_log is not None:
        run.scenario = predict_time(run.scenario, vc, cfg, stepper, run.local_rank)
        rt.op_log = None
    if run.seal.breach is not None and run.ended == "script raised":
        # dpprof stopped it, not the script's error
        run.scenario = dataclasses.replace(run.scenario, message=run.seal.breach)
    return run


def _note_first_stand_in(rt: Any) -> None:
    """The run's seal told when the run first reads a value from an emulated tensor (a
    stand-in made up, or, under --compute, a host copy of a virtual GPU's values): a file
    written after it may hold such values."""
    add, remember = rt.stand_ins.add, rt.remember_emulated_on_host

    def note() -> None:
        if (sealed := seal.active()) is not None:
            sealed.note_stand_in()

    def counted(kind: str, times: int = 1) -> None:
        note()
        add(kind, times)

    def remembered(t: torch.Tensor) -> None:
        note()
        remember(t)

    rt.stand_ins.add = counted
    rt.remember_emulated_on_host = remembered


def _count_backwards(patcher: Patcher, stepper: Stepper) -> None:
    """``torch.autograd.backward`` patched to tell ``stepper`` each backward's start."""
    orig_backward = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        stepper.backward_started()
        return orig_backward(*args, **kwargs)

    patcher.patch(torch.autograd, "backward", backward)


def _run_until_stopped(launch: Launch, run: ScriptRun) -> BaseException | None:
    """Run the script as ``__main__`` until it has run its steps, ends or raises; how it
    ended goes into ``run``; the script's own error is returned. A stop signal delivered
    while it ran ends it "interrupted", however the script took it (an ``except
    KeyboardInterrupt`` that saves and exits, a worker it ended that fails the loop)."""
    error: BaseException | None = None
    try:
        with scripts_stop_handlers() as theirs, interrupts_allowed(theirs), \
                process_exit_caught(), run_at_the_end(launch):
            # the script's own time: a stop signal stops it
            if launch.is_module:
                runpy.run_module(launch.target, run_name="__main__", alter_sys=True)
            else:
                run_main_file(launch.target)
        run.ended = "script ended"
    except StopScript:
        run.ended = "steps"
    except SealBreach as e:  # a write around the seal, stopped: the run's result says so
        run.ended = "script raised"
        run.exit_status = 1
        run.script_traceback = f"dpprof: {e.line()}"
    except (KeyboardInterrupt, Interrupted) as e:  # Ctrl-C: keep what it measured
        run.ended = "interrupted"
        run.interrupted_by = interrupt_signal(e)
    except ProcessExit as e:  # os._exit: the process ends with its status, nothing else runs
        run.exit_status = e.status
        run.ended = "script ended" if e.status == 0 else "script raised"
        if e.status:
            run.script_traceback = user_traceback(e, launch)
    except SystemExit as e:
        code = e.code
        run.exit_status = code if isinstance(code, int) else (0 if code is None
                                                              else 1)
        run.ended = "script ended" if run.exit_status == 0 else "script raised"
        if run.exit_status:
            run.script_traceback = f"SystemExit: {code}"
    except BaseException as e:  # the script's own error, an Exception or not (torch's
        # CheckpointException is a BaseException): its result, as Python would end with it
        run.ended = "script raised"
        run.exit_status = 1
        run.script_traceback, run.raised_at = user_traceback(e, launch), raised_at(e)
        run.devices_mixed = isinstance(e, VirtualDeviceError)
        error = e
    delivered = interrupt_delivered()
    if run.ended != "interrupted" and delivered is not None:
        run.ended, run.interrupted_by = "interrupted", delivered
        run.exit_status, run.script_traceback, error = 0, None, None
    if run.ended == "interrupted":
        take_interrupt(run.interrupted_by)  # dpprof stops: the next signal is held
    return error


def _read_log(run: ScriptRun, cfg: ScriptConfig, vc: VirtualCuda, stepper: Stepper,
              state: AlternativeState | None) -> tuple[list[int], list[int]]:
    """What the wrappers logged while the script ran (:mod:`dpprof.script.wrappers`)
    into ``run``; the devices used and those DDP ran on."""
    launch = cfg.launch
    log = parallel_state.state_of(vc).log
    run.data_parallel = log.data_parallel > 0
    as_ranks = cfg.alternative is not None and cfg.alternative.as_ranks
    run.ddp = log.ddp > 0 or (as_ranks and bool(log.ddp_devices))
    run.fsdp = log.fsdp > 0
    run.tensor_parallel = log.tensor_parallel > 0
    run.tensor_parallel_ranks = log.tensor_parallel_ranks
    run.replica_scalars = log.replica_scalars
    run.dp_sites = list(log.dp_sites)
    run.spawned = log.spawned > 0
    run.spawned_by = log.spawned_by
    run.launched = log.launched
    run.world_size = max(log.world_size, log.spawned, launch.nproc or 1,
                         log.launched.world if log.launched is not None else 1,
                         (cfg.scattered_gpus or vc.device_count()) if as_ranks else 1)
    used = list(log.used_devices)
    # objects a forward of the script's own scatters (PyG's graphs): no GPU's count known
    objects = used if stepper.rows_are_items else []
    run.shard_rows = dict(log.shard_rows) or dict.fromkeys(objects, 0)
    run.batch_dim = log.shard_dim
    run.batch_rows = (sum(log.shard_rows.values()) or stepper.batch_rows
                      or stepper.warmup_rows or (state.batch_rows if state is not None else 0))
    return used, list(log.ddp_devices)


def _kind(run: ScriptRun, used: list[int], devices_touched: list[int]) -> str:
    if run.fsdp:
        return FSDP2
    if run.tensor_parallel:
        return TENSOR_PARALLEL
    if run.ddp:
        return DDP
    if run.data_parallel:
        # the replicas return their losses: as written, or as the alternative made them
        alternative = run.alternative_state
        inside = alternative is not None and alternative.losses_inside_forward
        return DP_LOSS_FORWARD if run.replica_scalars or inside else DP_LOSS_PRIMARY
    if len(devices_touched) > 1:
        return MODEL_PARALLEL
    return SINGLE


def _scenario(cfg: ScriptConfig, vc: VirtualCuda, run: ScriptRun, stepper: Stepper,
              used: list[int], ddp_devices: list[int], exc: BaseException | None,
              warmup_higher: dict[int, int]) -> ScenarioResult:
    rt = vc.rt
    n = vc.device_count()
    run.visible_gpus = n
    visible = vc.visible
    touched = [i for i in visible if rt.storages.counters[i].peak_allocated > 0]
    name = _kind(run, used, touched)
    kind = scenario(name)
    # the global batch, as compare's scenarios hold it: a rank's rows times the ranks
    world = run.world_size if kind.ranks_alike and run.world_size > 1 else 1
    tp = run.tensor_parallel_ranks
    if tp > 1 and world % tp == 0:  # the ranks of a tensor-parallel mesh share one batch
        world //= tp
    start = stepper.measure_start
    split = kind.scatters_batch and run.shard_rows
    devices = [
        device_result(
            rt, i, logical, cfg.capacity_bytes,
            rt.storages.counters[i].peak_allocated > 0 or (name == DP_LOSS_PRIMARY and i in used),
            run.shard_rows.get(i, 0) if split else run.batch_rows,
            timeline_points(rt, i, 0 if i in warmup_higher else start,
                            phase_before_start=True),
            0 if i in warmup_higher else start)
        for logical, i in enumerate(visible)
    ]
    notes = list(
        f"cuda:{logical} peaked in the warm-up step, at "
        f"{fmt_bytes(rt.storages.counters[i].peak_allocated)} "
        f"({rt.storages.counters[i].peak_phase}), above "
        f"all that followed it ({fmt_bytes(warmup_higher[i])}): that peak is reported, as "
        "the GPU reaches it" for logical, i in enumerate(visible) if i in warmup_higher)
    if kind.ranks_alike and run.world_size > 1:
        own = vc.visible.index(rank_device(vc, run.local_rank))
        devices = ddp_ranks(devices[own], min(run.world_size, n))
    limits: list[AllocatorLimit] = []
    if not cfg.compute:
        figured, limits, more = with_overheads(devices, vc, cfg, run.local_rank, run.world_size)
        devices, notes = list(figured), notes + more
    notes += sharded_values_note(cfg.compute, name, run.world_size)
    alike = kind.ranks_alike  # a DDP scenario's ranks: one note for all
    for d in [d for d in devices if d.used][:1 if alike else None]:
        if (note := transient_note(d, "each rank" if alike else None)) is not None:
            notes.append(note)
    s = ScenarioResult(name=name, batch=run.batch_rows * world, devices=tuple(devices),
                       notes=tuple(notes), allocator_limit_bytes=min(
                           (x.limit_bytes for x in limits), default=None))
    if run.oom_uncaught is not None:  # the GPU's out-of-memory, raised in the run, ended it
        return stopped_by_oom(s, run.oom_uncaught, run.script_traceback)
    if exc is not None or (run.ended == "script raised"):
        if isinstance(exc, NotEmulated):  # dpprof stopped it, where the script reached that
            message = str(exc)
        elif exc is not None:
            message = f"the script raised {type(exc).__name__}" + headline(str(exc))
        else:
            message = f"the script exited with status {run.exit_status}"
        return dataclasses.replace(s, status=STATUS_ERROR, message=message,
                                   traceback=run.script_traceback)
    over = [d for d in s.devices if d.used and d.total_peak_bytes > cfg.capacity_bytes]
    untold = below_what_the_script_was_told(s, vc, run.local_rank)
    if untold:
        return dataclasses.replace(s, status=STATUS_ERROR, message=untold)
    if over_limit := [x for x in limits if x.over]:
        first = over_limit[0]
        return dataclasses.replace(s, status=STATUS_OOM, oom_device=first.device.index,
                                   oom_bytes=first.device.peak_reserved_bytes,
                                   message=first.message())
    if over:
        worst = max(over, key=lambda d: d.total_peak_bytes)
        return dataclasses.replace(
            s, status=STATUS_OOM, oom_device=worst.index, oom_bytes=worst.total_peak_bytes,
            message=(f"out of memory on cuda:{worst.index}: needs "
                     f"{fmt_bytes(worst.total_peak_bytes)} at its peak ({worst.peak_phase}),"
                     f" has {fmt_bytes(cfg.capacity_bytes)}"))
    return dataclasses.replace(s, status=STATUS_OK)
