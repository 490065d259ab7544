"""``dpprof run -- python train.py``: the user's unmodified script on virtual GPUs.

The script runs in dpprof's process (``runpy``: ``__main__``, ``sys.argv`` as given, its
folder first on ``sys.path``) under a :class:`~dpprof.emulator.virtual_cuda.VirtualCuda`,
and is stopped after ``steps`` optimizer steps (counted with torch's global optimizer step
hooks; the first is the warm-up, peaks are over the others), or when it ends, or when it
raises. ``torchrun`` / ``python -m torch.distributed.run|launch`` commands run rank 0 with
the environment torchrun gives it; ``mp.spawn`` runs rank 0 in place; the ranks of DDP are
alike (DistributedSampler pads the shards), so rank 0 stands for every rank.

Paired answers: a script that wraps its model in ``nn.DataParallel`` is also run with
DDP in its place (one emulated rank, each DataLoader's batch divided among the GPUs, as a
DDP script sets it) and, where its loss is an ``nn.Module`` loss called on the gathered
outputs, with that loss computed inside forward on every replica.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from dpprof.analysis import script_rewrite
from dpprof.backends.emulated import ddp_ranks, device_result, timeline_points
from dpprof.backends.script_effects import ScriptEffects, Writes
from dpprof.emulator import script_parallel
from dpprof.emulator.catalog import GpuSpec, lookup_gpu
from dpprof.emulator.context import device_context
from dpprof.emulator.cuda_devices import STAND_INS, CudaDevices
from dpprof.emulator.kernels import CudaAutocastNames
from dpprof.emulator.patcher import Patcher
from dpprof.emulator.reserved import DeviceFigures, fill_gpu_overheads
from dpprof.emulator.script_parallel import DDP_IN_PLACE, LOSS_IN_FORWARD
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.errors import Interrupted, UsageError
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    Fix,
    RunResult,
    ScenarioResult,
    new_result,
)
from dpprof.scenarios.base import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY, MODEL_PARALLEL, SINGLE
from dpprof.scenarios.registry import scenario
from dpprof.units import fmt_bytes

AS_WRITTEN = "as-written"


class StopScript(BaseException):
    """Raised in the script once it has run enough optimizer steps (a BaseException, so
    the script's own ``except Exception`` does not swallow it)."""


@dataclass
class Launch:
    """What the command after ``--`` runs."""

    target: str  # a script path, or a module name
    is_module: bool
    argv: list[str]  # sys.argv[1:] of the script
    env: dict[str, str] = field(default_factory=dict)  # set for the run (torchrun's)
    launcher: str = "python"  # python | torchrun | torch.distributed.launch
    nproc: int | None = None  # torchrun --nproc-per-node

    @property
    def display(self) -> str:
        name = self.target if self.is_module else Path(self.target).name
        return " ".join([name, *self.argv])


def parse_command(command: list[str], gpus: int) -> Launch:
    """``python [-u] train.py args``, ``python -m pkg args``, ``train.py args``,
    ``torchrun [opts] train.py args``, ``python -m torch.distributed.run|launch ...``."""
    if not command:
        raise UsageError("dpprof run: give the command after --, e.g. dpprof run -- python "
                         "train.py")
    head, rest = command[0], list(command[1:])
    base = Path(head).name
    if base.endswith(".py"):
        return Launch(head, False, rest)
    if base in ("torchrun",):
        return _torchrun(rest, gpus, "torchrun")
    if not base.startswith("python"):
        raise UsageError(
            f"dpprof run: cannot run {head!r}: give a Python command (python train.py, python "
            "-m pkg.train, torchrun ... train.py)")
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest.pop(0)  # interpreter flags: -u, -O, -W...
    if not rest:
        raise UsageError("dpprof run: the python command names no script")
    if rest[0] == "-c":
        raise UsageError("dpprof run: python -c is not supported; put the code in a file")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise UsageError("dpprof run: python -m needs a module name")
        mod = rest[1]
        if mod in ("torch.distributed.run", "torch.distributed.launch"):
            return _torchrun(rest[2:], gpus, mod)
        return Launch(mod, True, rest[2:])
    return Launch(rest[0], False, rest[1:])


def _torchrun(args: list[str], gpus: int, launcher: str) -> Launch:
    if launcher == "torch.distributed.launch":
        from torch.distributed.launch import get_args_parser as launch_parser

        parser = launch_parser()
    else:
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit:
        raise UsageError(f"dpprof run: {launcher}: cannot parse {' '.join(args)!r}") from None
    nproc_text = str(ns.nproc_per_node)
    nproc = gpus if nproc_text in ("gpu", "auto") else int(nproc_text)
    nnodes = str(ns.nnodes).split(":")[-1]
    world = nproc * int(nnodes or 1)
    env = {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "dpprof",
    }
    argv = list(ns.training_script_args)
    if launcher == "torch.distributed.launch" and not getattr(ns, "use_env", False):
        argv = ["--local-rank=0", *argv]
    return Launch(ns.training_script, bool(ns.module), argv, env, launcher, nproc)


@dataclass
class ScriptConfig:
    launch: Launch
    gpus: int = 4
    gpu: GpuSpec = field(default_factory=lambda: lookup_gpu("a100-80gb"))
    gpu_memory_bytes: int | None = None  # None: the GPU's
    steps: int = 3  # optimizer steps before stopping; the first is the warm-up
    compute: bool = False  # CPU tensors (real numbers) instead of meta tensors
    variant: str = AS_WRITTEN  # AS_WRITTEN | DDP_IN_PLACE | LOSS_IN_FORWARD
    debug: bool = False

    @property
    def capacity_bytes(self) -> int:
        return self.gpu_memory_bytes or self.gpu.total_memory_bytes


@dataclass
class ScriptRun:
    """What one run of the script gave."""

    scenario: ScenarioResult
    steps_done: int = 0
    ended: str = ""  # "steps" | "script ended" | "script raised"
    exit_status: int = 0
    script_traceback: str | None = None
    stand_ins: dict[str, int] = field(default_factory=dict)
    stand_in_sites: dict[str, int] = field(default_factory=dict)
    data_parallel: bool = False
    ddp: bool = False
    world_size: int = 1
    batch_rows: int = 0
    seconds: float = 0.0
    loss_modules: int = 0  # loss module calls on DataParallel outputs (loss-in-forward)
    autocast_regions: int = 0  # torch.autocast("cuda") regions the script entered
    forwards: int = 0  # outermost module calls seen
    backwards: int = 0  # backward() calls seen
    replica_scalars: bool = False  # the DataParallel replicas returned their losses
    materialized: list[str] = field(default_factory=list)  # see script_parallel.LOG
    dp_sites: list[str] = field(default_factory=list)  # see script_parallel.LOG
    call_sites: list[str] = field(default_factory=list)
    loss_sites: list[str] = field(default_factory=list)
    writes: Writes = field(default_factory=Writes)  # what dpprof kept from the user's files
    output_tail: str = ""  # an alternative's run: the end of what it printed (not shown)
    interrupted_by: int = 0  # the signal that cut the run short (ended == "interrupted")
    # the DDP alternative: its rank's peak under gradient_as_bucket_view=True (followed in a
    # ledger while it ran plain), or why it could not be followed
    bucket_view_peak_bytes: int | None = None
    bucket_view_unsure: str | None = None
    shard_rows: dict[int, int] = field(default_factory=dict)  # see script_parallel.LOG
    visible_gpus: int = 0  # the GPUs the script saw (after its CUDA_VISIBLE_DEVICES)


StepCallback = Callable[[int], None]


class _Stepper:
    """Counts optimizer steps, marks phases, stops the script after ``steps``."""

    def __init__(self, rt: CudaDevices, steps: int, on_step: StepCallback | None) -> None:
        self.rt = rt
        self.steps = steps
        self.done = 0
        self.on_step = on_step
        self.measure_start = 0
        self.optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[Any] = []
        self._phase: contextlib.ExitStack | None = None
        self.batch_rows = 0  # rows of the first batch that reached backward
        self._last_rows = 0  # rows of the last outermost module call
        self.forwards = 0  # outermost module calls
        self.backwards = 0  # backward() calls
        self._depth = 0

    def phase(self, name: str) -> None:
        if self._phase is not None:
            self._phase.close()
        self._phase = contextlib.ExitStack()
        self._phase.enter_context(self.rt.phase(name))

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt not in self.optimizers:
            self.optimizers.append(opt)
        self._label(opt)
        self.phase(f"optimizer (step {self.done + 1})")

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._label(opt)
        self.done += 1
        if self.on_step is not None:
            self.on_step(self.done)
        if self.done == 1 and self.steps > 1:
            self.rt.reset_peaks()  # step 1 was the warm-up: measure from here
            self.measure_start = len(self.rt.events)
        if self.done >= self.steps:
            raise StopScript
        self.phase(f"forward (step {self.done + 1})")

    def _label(self, opt: torch.optim.Optimizer) -> None:
        rt = self.rt
        params = [p for g in opt.param_groups for p in g["params"]]
        rt.label(params, "parameters")
        rt.label([p.grad for p in params if p.grad is not None], "gradients")
        rt.label([t for st in opt.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor)], "optimizer_state")

    def backward_started(self) -> None:
        self.backwards += 1
        self.phase(f"backward (step {self.done + 1})")
        if not self.batch_rows:
            self.batch_rows = self._last_rows  # the batch of the forward this backs

    def _pre_forward(self, module: Any, args: Any) -> None:
        if self._depth == 0:
            self.forwards += 1
            first = next((a for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
            if first is not None and first.dim() > 0:
                self._last_rows = int(first.shape[0])
        self._depth += 1

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        self._depth = max(self._depth - 1, 0)

    def install(self) -> None:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._handles = [register_optimizer_step_pre_hook(self.pre),
                         register_optimizer_step_post_hook(self.post),
                         register_module_forward_pre_hook(self._pre_forward),
                         register_module_forward_hook(self._post_forward, always_call=True)]
        self.phase("forward (step 1)")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        if self._phase is not None:
            self._phase.close()
            self._phase = None


@contextlib.contextmanager
def _script_process(launch: Launch) -> Iterator[None]:
    """sys.argv, sys.path[0], the environment and __main__ as the script expects them;
    all restored afterwards."""
    saved_argv = list(sys.argv)
    saved_path = list(sys.path)
    saved_env = dict(os.environ)
    saved_main = sys.modules.get("__main__")
    root = logging.getLogger()
    saved_logging = (list(root.handlers), root.level)
    try:
        os.environ.update(launch.env)
        if launch.is_module:
            sys.argv = [launch.target, *launch.argv]
            sys.path.insert(0, os.getcwd())
        else:
            path = Path(launch.target).resolve()
            sys.argv = [str(launch.target), *launch.argv]
            sys.path.insert(0, str(path.parent))
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        # logging.basicConfig in the script: the next run configures it afresh, as a new
        # process would (and an alternative's run does not log through this run's handlers)
        for handler in root.handlers:
            if handler not in saved_logging[0]:
                handler.flush()
        root.handlers[:] = saved_logging[0]
        root.setLevel(saved_logging[1])


def _user_traceback(e: BaseException, launch: Launch) -> str:
    """The traceback as Python would print it for the script: dpprof's and runpy's frames
    left out (a script that does not compile, or a module not found, has none of its own)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(_DPPROF_DIR) and "runpy" not in f.filename]
    if launch.is_module and isinstance(e, ImportError) and not frames:
        return f"{sys.executable}: {e}"  # python -m no_such_module says just this
    head = ["Traceback (most recent call last):\n"] if frames else []
    return "".join([*head, *traceback.format_list(frames),
                    *traceback.format_exception_only(type(e), e)])


_DPPROF_DIR = str(Path(__file__).resolve().parents[1])


def run_script(cfg: ScriptConfig, on_step: StepCallback | None = None) -> ScriptRun:
    """Run the script once on virtual GPUs and measure it (see the module)."""
    launch = cfg.launch
    if not launch.is_module and not Path(launch.target).is_file():
        raise UsageError(f"dpprof run: {launch.target}: no such file")
    vc = VirtualCuda(cfg.gpus, cfg.gpu, base="cpu" if cfg.compute else "meta",
                     gpu_memory_bytes=cfg.capacity_bytes)
    rt = vc.rt
    stepper = _Stepper(rt, cfg.steps, on_step)
    run = ScriptRun(scenario=ScenarioResult(name=AS_WRITTEN))
    variant = _Variant(cfg.variant, vc, cfg.gpus)
    # torch.autocast("cuda") in the script: re-enacted as on a GPU (autocast's CUDA lists)
    autocast = CudaAutocastNames()
    start = time.perf_counter()
    exc: BaseException | None = None
    # an alternative's run writes into a private folder and prints nothing (script_effects)
    sandbox = (tempfile.TemporaryDirectory(prefix="dpprof-run-") if cfg.variant != AS_WRITTEN
               else contextlib.nullcontext(None))
    with _script_process(launch), sandbox as private:
        seed_state = torch.random.get_rng_state()
        torch.manual_seed(0)
        effects = ScriptEffects(rt.is_emulated, Path(private) if private else None)
        try:
            with vc, autocast, effects, Patcher() as patcher:
                variant.install(vc, patcher)
                orig_backward = torch.autograd.backward

                def backward(*args: Any, **kwargs: Any) -> Any:
                    stepper.backward_started()
                    return orig_backward(*args, **kwargs)

                patcher.patch(torch.autograd, "backward", backward)
                stepper.install()
                try:
                    if launch.is_module:
                        runpy.run_module(launch.target, run_name="__main__", alter_sys=True)
                    else:
                        runpy.run_path(launch.target, run_name="__main__")
                    run.ended = "script ended"
                except StopScript:
                    run.ended = "steps"
                except (KeyboardInterrupt, Interrupted) as e:  # Ctrl-C: keep what it measured
                    run.ended = "interrupted"
                    run.interrupted_by = (e.signum if isinstance(e, Interrupted)
                                          else signal.SIGINT)
                except SystemExit as e:
                    code = e.code
                    run.exit_status = code if isinstance(code, int) else (0 if code is None
                                                                          else 1)
                    run.ended = "script ended" if run.exit_status == 0 else "script raised"
                    if run.exit_status:
                        run.script_traceback = f"SystemExit: {code}"
                except Exception as e:  # the script's own error: its result
                    exc = e
                    run.ended = "script raised"
                    run.exit_status = 1
                    run.script_traceback = _user_traceback(e, launch)
                finally:
                    stepper.remove()
                    script_parallel.cleanup(vc)
                    log = script_parallel.state_of(vc).log
                    run.data_parallel = log.data_parallel > 0
                    run.ddp = log.ddp > 0 or (cfg.variant == DDP_IN_PLACE
                                               and bool(log.ddp_devices))
                    run.replica_scalars = log.replica_scalars
                    run.materialized = list(log.materialized)
                    run.dp_sites = list(log.dp_sites)
                    run.call_sites = list(log.call_sites)
                    run.loss_sites = list(log.loss_sites)
                    run.world_size = max(log.world_size, log.spawned, launch.nproc or 1,
                                         vc.device_count() if cfg.variant == DDP_IN_PLACE
                                         else 1)
                    used = list(log.used_devices)
                    ddp_devices = list(log.ddp_devices)
                    run.shard_rows = dict(log.shard_rows)
                    run.batch_rows = (sum(log.shard_rows.values()) or stepper.batch_rows
                                      or variant.batch_rows)
                    run.loss_modules = variant.loss_calls
        finally:
            torch.random.set_rng_state(seed_state)
    run.seconds = time.perf_counter() - start
    run.writes = effects.writes
    run.output_tail = effects.output_tail
    run.steps_done = stepper.done
    run.forwards, run.backwards = stepper.forwards, stepper.backwards
    run.stand_ins = dict(rt.stand_ins.counts)
    run.stand_in_sites = dict(rt.stand_ins.sites)
    run.autocast_regions = autocast.regions
    run.scenario = _scenario(cfg, vc, run, stepper, used, ddp_devices, exc)
    ledger = rt.ledgers.get(ddp_devices[0]) if ddp_devices else None
    if cfg.variant == DDP_IN_PLACE and ledger is not None:
        run.bucket_view_peak_bytes = ledger.peak_allocated if ledger.unsure is None else None
        run.bucket_view_unsure = ledger.unsure
    return run


class _Variant:
    """The paired alternatives: DDP in place of DataParallel, or the loss inside forward."""

    def __init__(self, name: str, vc: VirtualCuda, gpus: int) -> None:
        self.name = name
        self.vc = vc
        self.gpus = gpus
        self.batch_rows = 0
        self.loss_calls = 0

    def install(self, vc: VirtualCuda, patcher: Patcher) -> None:
        """The variant's patches, through the run's ``patcher`` (undone with the run's)."""
        from torch import nn
        from torch.utils.data import DataLoader

        variant = self
        script_parallel.state_of(vc).mode = "" if self.name == AS_WRITTEN else self.name
        if self.name == DDP_IN_PLACE:
            orig_init = DataLoader.__init__

            def loader_init(loader: Any, dataset: Any, batch_size: int | None = 1,
                            *args: Any, **kwargs: Any) -> None:
                if batch_size:
                    # one rank per GPU the script sees: asked here, not before the script
                    # ran (CUDA reads CUDA_VISIBLE_DEVICES once, and the script may set it)
                    world = vc.device_count()
                    batch_size = -(-batch_size // world)  # each rank's share, as DDP sets it
                    variant.batch_rows = variant.batch_rows or batch_size
                orig_init(loader, dataset, batch_size, *args, **kwargs)

            patcher.patch(DataLoader, "__init__", loader_init)
        elif self.name == LOSS_IN_FORWARD:
            from dpprof.emulator.script_parallel import loss_in_forward_loss_call

            loss_cls = nn.modules.loss._Loss
            orig_call = loss_cls.__call__

            def loss_call(loss: nn.Module, *args: Any, **kwargs: Any) -> Any:
                out = loss_in_forward_loss_call(vc, loss, args, kwargs)
                if out is None:
                    return orig_call(loss, *args, **kwargs)
                variant.loss_calls += 1
                return out

            patcher.patch(loss_cls, "__call__", loss_call)



def _kind(run: ScriptRun, used: list[int], devices_touched: list[int]) -> str:
    if run.ddp:
        return DDP
    if run.data_parallel:
        return DP_LOSS_FORWARD if run.replica_scalars else DP_LOSS_PRIMARY
    if len(devices_touched) > 1:
        return MODEL_PARALLEL
    return SINGLE


def _scenario(cfg: ScriptConfig, vc: VirtualCuda, run: ScriptRun, stepper: _Stepper,
              used: list[int], ddp_devices: list[int],
              exc: BaseException | None) -> ScenarioResult:
    rt = vc.rt
    n = vc.device_count()
    run.visible_gpus = n
    visible = vc.visible
    touched = [i for i in visible if rt.counters[i].peak_allocated > 0]
    name = _kind(run, used, touched)
    s = ScenarioResult(name=name, batch=run.batch_rows)
    start = stepper.measure_start
    kind = scenario(name)
    split = kind.scatters_batch and run.shard_rows
    devices = [
        device_result(
            rt, i, logical, cfg.capacity_bytes,
            rt.counters[i].peak_allocated > 0 or (name == DP_LOSS_PRIMARY and i in used),
            run.shard_rows.get(i, 0) if split else run.batch_rows,
            timeline_points(rt, i, start, phase_before_start=True))
        for logical, i in enumerate(visible)
    ]
    if kind.ranks_alike and run.world_size > 1:
        devices = ddp_ranks(next((d for d in devices if d.used), devices[0]),
                            min(run.world_size, n))
    s.devices = devices
    if not cfg.compute:
        _overheads(s, vc, cfg)
    if exc is not None or (run.ended == "script raised"):
        s.status = STATUS_ERROR
        s.message = (f"the script raised {type(exc).__name__}: {exc}" if exc is not None
                     else f"the script exited with status {run.exit_status}")
        s.traceback = run.script_traceback
    else:
        over = [d for d in s.devices if d.used and d.total_peak_bytes > cfg.capacity_bytes]
        if over:
            worst = max(over, key=lambda d: d.total_peak_bytes)
            s.status = STATUS_OOM
            s.oom_device = worst.index
            s.oom_bytes = worst.total_peak_bytes
            s.message = (f"out of memory on cuda:{worst.index}: needs "
                         f"{fmt_bytes(worst.total_peak_bytes)} at its peak ({worst.peak_phase}),"
                         f" has {fmt_bytes(cfg.capacity_bytes)}")
        else:
            s.status = STATUS_OK
    return s


def _overheads(s: ScenarioResult, vc: VirtualCuda, cfg: ScriptConfig) -> None:
    """Reserved and the CUDA context per used device: the emulator's one model
    (:func:`dpprof.emulator.reserved.fill_gpu_overheads`) over the script's allocations."""
    ctx = device_context(cfg.gpu.compute_capability, uses_cudnn=vc.rt.saw_convolution)

    def source(d: DeviceFigures) -> int:
        if d.rank is None:
            return vc.visible[d.index]
        # a DDP rank: the visible device that ran it stands for every rank
        return next((i for i in vc.visible if vc.rt.counters[i].peak_allocated > 0),
                    vc.visible[0])

    fill_gpu_overheads(s.devices, vc.rt.events, ctx, source=source)



ALTERNATIVES = {
    DDP_IN_PLACE: "the same script with DistributedDataParallel in place of DataParallel (one "
    "emulated rank of {n}; each DataLoader's batch divided by {n}, as a DDP script sets it)",
    LOSS_IN_FORWARD: "the same script with its loss computed inside forward on every replica "
    "(dpprof.ModelWithLoss: the replicas return their losses, cuda:0 gets {n} numbers "
    "instead of the gathered outputs)",
}

Progress = Callable[[str, int, int], None]  # (what, steps done, steps)


def run_command(cfg: ScriptConfig, alternatives: bool = True,
                progress: Progress | None = None) -> tuple[RunResult, ScriptRun]:
    """Run the script as written (and its paired alternatives); the result and the
    as-written run (its traceback and exit status)."""
    import dataclasses

    from dpprof.analysis.answers import partial_sentence
    from dpprof.analysis.attribution import attribute_run
    from dpprof.analysis.comparison import compare
    from dpprof.analysis.fix_registry import run_variants

    def step_cb(what: str) -> StepCallback:
        return lambda k: progress(what, k, cfg.steps) if progress else None

    main = run_script(cfg, step_cb("as written"))
    n = len(main.scenario.devices) if main.scenario.name != DDP else main.visible_gpus
    runs = [(AS_WRITTEN, main)]
    notes: list[str] = []
    fixes: list[Fix] = []
    if (alternatives and main.scenario.name == DP_LOSS_PRIMARY
            and main.ended not in ("script raised", "interrupted")):
        for kind in run_variants():  # the fixes a script's alternative measures
            variant = kind.run_variant or ""
            alt = run_script(dataclasses.replace(cfg, variant=variant), step_cb(variant))
            if variant == DDP_IN_PLACE and not alt.batch_rows:
                notes.append("no DDP alternative: the script makes its batches without a "
                             "DataLoader, so dpprof cannot give each rank its share")
                continue
            if variant == LOSS_IN_FORWARD and not alt.loss_modules:
                notes.append("no loss-inside-forward alternative: the script's loss is not an "
                             "nn.Module loss called on DataParallel's outputs")
                continue
            alt.scenario.notes.insert(0, ALTERNATIVES[variant].format(n=n))
            alt.scenario.notes.extend(_alternative_notes(alt))
            if alt.materialized:
                alt.scenario.notes.append(
                    "the script also uses the outputs besides the loss ("
                    + ", ".join(sorted(set(alt.materialized)))
                    + "): after the loss, this alternative gives them as stand-ins of the "
                    "gathered shape on cuda:0 (no gradient); before it, as written")
            runs.append((variant, alt))
            fix = script_fix(variant, main, alt, n)
            if fix is not None:
                fixes.append(fix)
            if variant == DDP_IN_PLACE:
                bucket_view = bucket_view_fix(main, alt, n)
                if bucket_view is not None:
                    fixes.append(bucket_view)
                elif alt.bucket_view_unsure:
                    notes.append("no gradient_as_bucket_view alternative: "
                                 f"{alt.bucket_view_unsure}")
    s0 = main.scenario
    s0.notes.insert(0, _how_it_ended(main, cfg))
    if main.autocast_regions:
        s0.notes.append(f"torch.autocast('cuda') in the script: {main.autocast_regions} "
                        "region(s) re-enacted as on a GPU (autocast's CUDA op lists)")
    s0.notes.extend(_write_notes(main.writes))
    if main.stand_ins:
        s0.notes.append(
            f"{sum(main.stand_ins.values())} value(s) read from emulated tensors answered "
            "with stand-ins (" + ", ".join(f"{k} x{v}" for k, v in sorted(
                main.stand_ins.items())) + "): " + "; ".join(
                f"{site} x{c}" for site, c in list(main.stand_in_sites.items())[:5]))
        s0.notes.extend(_library_branches(main.stand_in_sites))
    result = new_result(
        "emulated", cfg.launch.display, batch=main.batch_rows, gpus=n,
        gpu_memory_bytes=cfg.capacity_bytes,
        scenarios=[r.scenario for _, r in runs],
        config={
            "command": "run", "launcher": cfg.launch.launcher, "script": cfg.launch.target,
            "argv": list(cfg.launch.argv), "steps": cfg.steps, "compute": cfg.compute,
            "gpu": cfg.gpu.key, "gpus": n,
            "steps_done": {v: r.steps_done for v, r in runs},
            "seconds": {v: round(r.seconds, 3) for v, r in runs},
            "exit_status": main.exit_status,
        },
        assumptions=_assumptions(cfg),
        notes=notes,
        fixes=fixes,
    )
    result.comparison = compare(result)
    result.attribution = attribute_run(result)
    if main.ended == "interrupted":
        result.interrupted = signal.Signals(main.interrupted_by).name
        result.notes.append(partial_sentence(result))
    result.comparison.verdict = script_verdict(result)
    if main.ended == "interrupted":
        raise Interrupted(main.interrupted_by, partial=result)
    return result, main


def _library_branches(sites: dict[str, int], libraries: set[str] | None = None) -> list[str]:
    """Where a library (not the script) decided something on a stand-in: the GPU, which
    has the real value, may take the other path there. ``libraries``: the folders
    installed packages live in (default: this Python's site-packages)."""
    import sysconfig

    if libraries is None:
        libraries = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    found = []
    for key in sites:
        site, _, kind = key.rpartition(" (")
        path = site.rpartition(":")[0]
        if kind.startswith("bool") and any(path.startswith(lib) for lib in libraries):
            short = site
            for lib in libraries:
                short = short.removeprefix(lib + os.sep)
            found.append(short)
    if not found:
        return []
    return [f"a library decided a branch on a stand-in value at {', '.join(found[:5])}: on a "
            "GPU, which has the real value, it may take the other path (and allocate "
            "otherwise); --compute runs it on real numbers"]


def nothing_on_a_gpu(run: ScriptRun) -> str:
    """One line for a run that put nothing on a GPU: how the script ended."""
    if run.ended == "script raised":
        return (f"the script failed (exit status {run.exit_status}) before it put anything on "
                "a GPU: nothing was measured")
    return ("the script ended without putting anything on a GPU (no tensor or module moved "
            "to cuda): nothing was measured")


def _write_notes(writes: Writes) -> list[str]:
    """What dpprof kept the script from writing, in a line."""
    if not writes.skipped:
        return []
    calls = "; ".join(f"{k} x{v}" if v > 1 else k for k, v in writes.skipped.items())
    return [f"not written, your files untouched: {calls} (what it saved holds tensors of "
            "virtual GPUs, which have no values)"]


def _alternative_notes(alt: ScriptRun) -> list[str]:
    """An alternative's run: its writes kept private, its output not shown."""
    notes = _write_notes(alt.writes)
    if alt.writes.redirected:
        files = sum(alt.writes.redirected.values())
        notes.append(f"its {files} write(s) of files and folders went to a private folder "
                     "(deleted), so nothing of yours was written twice; its output is not shown")
    if alt.ended == "script raised" and alt.output_tail.strip():
        notes.append("its last output: " + alt.output_tail.strip()[-400:])
    return notes


def script_verdict(result: RunResult) -> str:
    """The verdict of a script's result: the one answer builder's
    (:func:`dpprof.analysis.answers.build_answer`), as for every other command."""
    from dpprof.analysis.answers import build_answer

    return build_answer(result).verdict


def diff_loss_in_forward(run: ScriptRun) -> str:
    """The loss-inside-forward change as a diff of the script's own lines (the lines dpprof
    saw: the DataParallel wrap, the model's call and the loss on its outputs)."""
    if not (run.dp_sites and run.call_sites and run.loss_sites):
        return ""
    return script_rewrite.rewrite_text(script_rewrite.loss_in_forward_at(
        run.dp_sites[0], run.call_sites[0], run.loss_sites[0]))


def diff_ddp(run: ScriptRun, gpus: int, bucket_view: bool = False) -> str:
    """The DDP change around the script's own DataParallel line."""
    if not run.dp_sites:
        return ""
    return script_rewrite.rewrite_text(script_rewrite.ddp_at(run.dp_sites[0], gpus,
                                                             bucket_view=bucket_view))


def bucket_view_fix(main: ScriptRun, alt: ScriptRun, gpus: int) -> Fix | None:
    """DDP with ``gradient_as_bucket_view=True``: the DDP alternative's rank as that option
    makes it, followed in a ledger while the alternative ran plain DDP."""
    if alt.bucket_view_peak_bytes is None or not main.scenario.devices:
        return None
    p0 = main.scenario.devices[0].peak_allocated_bytes
    q = alt.bucket_view_peak_bytes
    plain = max((d.peak_allocated_bytes for d in alt.scenario.devices), default=q)
    extra = plain - q
    return Fix(name="gradient-as-bucket-view", title="DDP with gradient_as_bucket_view=True",
               primary_peak_bytes=q, max_peak_bytes=q, saves_bytes=p0 - q,
               detail=f".grad becomes a view of the reducer's bucket: {fmt_bytes(extra)} less "
               "than plain DDP per GPU at the peak" + (
                   "" if extra > 0 else " (the peak comes before the gradients all exist; "
                   "the gradient-sized copy is still saved later in the step)"),
               code=diff_ddp(main, gpus, bucket_view=True))


def script_fix(variant: str, main: ScriptRun, alt: ScriptRun, gpus: int) -> Fix | None:
    """What the alternative saves on cuda:0, with its change to the script's lines."""
    from dpprof.analysis.fix_registry import for_variant

    if not main.scenario.devices or not alt.scenario.devices:
        return None
    p0 = main.scenario.devices[0].peak_allocated_bytes
    q0 = alt.scenario.devices[0].peak_allocated_bytes
    heaviest = max(d.peak_allocated_bytes for d in alt.scenario.devices)
    kind = for_variant(variant)
    return Fix(name=kind.name, title=kind.title, primary_peak_bytes=q0, max_peak_bytes=heaviest,
               saves_bytes=p0 - q0, detail=kind.run_detail.format(gpus=gpus),
               code=(diff_loss_in_forward(alt) if variant == LOSS_IN_FORWARD
                     else diff_ddp(main, gpus)))


def _how_it_ended(run: ScriptRun, cfg: ScriptConfig) -> str:
    steps = f"{run.steps_done} optimizer step(s)"
    if run.ended == "steps":
        how = f"stopped after {steps} (--steps {cfg.steps}; the first is the warm-up, " \
              "peaks are over the others)"
    elif run.ended == "interrupted":
        how = f"interrupted after {steps}"
    elif run.ended == "script ended":
        how = f"the script ended after {steps}"
    else:
        how = f"the script raised after {steps} (exit status {run.exit_status})"
    if run.steps_done == 0:
        how += (f"; it never called optimizer.step() (dpprof saw {run.forwards} forward "
                f"pass(es) and {run.backwards} backward pass(es) instead), so the peaks are "
                "over the whole run (no warm-up step to leave out)")
    elif run.steps_done == 1:
        how += "; only one step: the peaks include the warm-up"
    return how + f"; {run.seconds:.1f} s"


def _assumptions(cfg: ScriptConfig) -> list[str]:
    kind = "CPU tensors (real numbers)" if cfg.compute else "meta tensors (memory only)"
    return [
        f"Emulated: the script ran unchanged in dpprof's process with {cfg.gpus} virtual "
        f"{cfg.gpu.name} GPUs played by {kind}; no GPU was used. The host side (data "
        "loading, the model built on the CPU) ran for real.",
        "Allocated = live tensor storages on each virtual GPU, each rounded up to 512 B as "
        "the CUDA caching allocator rounds them; peaks are over the optimizer steps after the "
        "first (the warm-up) and include what was resident before them.",
        "DataParallel is re-enacted step by step from torch.nn.parallel (scatter, replicate, "
        "parallel_apply, gather, reduce-add of gradients onto cuda:0); "
        "DistributedDataParallel as one rank (the reducer's buckets re-enacted) over a fake "
        "process group: every rank runs the same program, rank 0 stands for all.",
        "Categories: parameters, gradients and optimizer state as the optimizers hold them; "
        "inputs = tensors the script moved to a GPU; outputs = DataParallel's gathered "
        "outputs; activations = everything else the step computed.",
        STAND_INS + ".",
        "Reserved (the caching allocator simulated over each GPU's allocations, cuBLAS "
        "workspaces included) and the CUDA context are shown separately from allocated.",
    ]
