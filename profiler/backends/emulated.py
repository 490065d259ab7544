"""The emulated backend: every scenario re-enacted on virtual devices.

Meta tensors by default (memory only: any model size, seconds, cost independent of the
batch size); CPU tensors with ``compute=True`` (real numbers, for checks and tests).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from dpprof.emulator.context import ContextModel, device_context
from dpprof.emulator.counting import HOST
from dpprof.emulator.cuda_devices import STAND_INS, CudaDevices
from dpprof.emulator.data_parallel import EmulatedDataParallel
from dpprof.emulator.ddp import EmulatedDDP
from dpprof.emulator.heap import frozen_heap
from dpprof.emulator.kernels import (
    DEFAULT_COMPUTE_CAPABILITY,
    CudaAutocastNames,
    EmulatedAutocast,
    GpuKernels,
)
from dpprof.emulator.ledgers import VariantLedger
from dpprof.emulator.reserved import fill_gpu_overheads
from dpprof.emulator.vdevice import VirtualDevices, to_device
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    DeviceResult,
    ScenarioResult,
    TimelinePoint,
)
from dpprof.scenarios.base import DDP, DP_LOSS_PRIMARY, StepHooks, error_site, training_loop
from dpprof.scenarios.kind import Scenario
from dpprof.scenarios.registry import find
from dpprof.scenarios.step import StepConfig, build_model, scenario_batch, step_stream
from dpprof.scenarios.workloads import Workload, map_tensors, shard_sizes, tensors_in
from dpprof.units import fmt_bytes

TIMELINE_POINTS = 400  # points kept per device and scenario (maxima of equal slices)

PHASE_CATEGORY = {
    "inputs": "inputs",
    "forward": "activations",
    "loss": "loss",
    "backward": "activations",
    "optimizer": "optimizer_state",
    "zero_grad": "other",
}

ASSUMPTIONS = [
    "Emulated: the training step runs on virtual devices over meta tensors (memory only); "
    "no GPU was used.",
    "Allocated = live tensor storages, each rounded up to 512 B as the CUDA caching "
    "allocator rounds them; peaks are over the loop's measured (last) iteration and "
    "include what was resident before it.",
    "DataParallel is re-enacted step by step from torch.nn.parallel (scatter, replicate with "
    "10 MiB coalesced broadcasts, parallel_apply, gather, reduce-add of gradients onto "
    "cuda:0), taking the NCCL paths of a CUDA build.",
    "DDP: one rank per GPU, each with ceil(B / N) rows (DistributedSampler pads the last "
    "shard); the reducer re-enacted from reducer.cpp: one bucket per dtype on iteration 1, "
    "rebuilt in gradient-ready order at the start of iteration 2 (first bucket 1 MiB, then "
    "bucket_cap_mb, default 25), kept for good; options as configured.",
    "Optimizers use the foreach implementation, as PyTorch picks by default on CUDA.",
    "Allocated excludes, and the report shows separately per device: reserved (the caching "
    "allocator simulated over the allocation sequence, cuBLAS workspaces included) and the "
    "CUDA context (+ cuDNN library code where convolutions run). Not included anywhere: "
    "NCCL's buffers, other processes, cuDNN's transient convolution workspace.",
]


@dataclass
class EmulationConfig:
    gpus: int  # virtual devices
    gpu_memory_bytes: int  # capacity of each
    # the step's options as they are (batch, seed, warm-up, dtype, autocast, DDP's options)
    step: StepConfig = field(default_factory=StepConfig)
    compute: bool = False  # CPU tensors (real numbers) instead of meta tensors
    debug: bool = False  # keep tracebacks of failing scenarios
    # the target GPU's compute capability: which kernels it runs (SDPA, fused dropout)
    compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY
    # Variants the fixes analysis emulates (dpprof.analysis.fixes); the defaults are plain PyTorch
    # (gradient_as_bucket_view above serves it too).
    dp_output_device: int | None = None  # DataParallel(output_device=...); targets go there
    # BalancedDataParallel: rows per device at the batch (a micro-batch in proportion)
    dp_chunk_sizes: tuple[int, ...] | None = None
    # Over CPU tensors (compute): also simulate reserved memory and the context, as over meta
    # (dpprof.emulator.reserved.fill_gpu_overheads), and count them in the out-of-memory check.
    count_reserved: bool = False
    # The run stands for one rank of a process group over NCCL beside DDP's (FSDP2's
    # fully_shard): its context counts NCCL's memory, as a DDP rank's does.
    collectives: bool = False
    # DataParallel replicas on equal shards: one runs, the others' devices mirror its device
    # (meta only; every device's own events are the same, see VirtualDevices.set_mirrors)
    dedupe_replicas: bool = True
    # Peaks only: each device's peaks and its categories at the peak, no timeline and no
    # reserved/context simulation (the fixes' variants, which report nothing else).
    peaks_only: bool = False
    # Whose autocast op lists --amp re-enacts: the GPU's ("cuda"), or torch's CPU autocast
    # ("cpu"), which the checks compare with torch.autocast("cpu") on real tensors.
    autocast_ops: str = "cuda"

    def with_step(self, **changes: Any) -> EmulationConfig:
        """A copy with the step's options changed (``batch=...``, ``ddp=...``)."""
        return dataclasses.replace(self, step=dataclasses.replace(self.step, **changes))






class _CategoryHooks:
    """Files allocations made while the loss's autograd nodes run under 'loss'."""

    def __init__(self, rt: VirtualDevices) -> None:
        self.rt = rt
        self.output_nodes: set[Any] = set()
        self.handles: list[Any] = []

    def after_forward(self, outputs: Any) -> None:
        self.rt.label(list(tensors_in(outputs)), "outputs")
        self.output_nodes = {t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None}

    def after_loss(self, loss: torch.Tensor, outputs: Any) -> None:
        rt = self.rt
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in self.output_nodes:
                continue
            seen.add(node)
            self.handles.append(node.register_prehook(lambda *_: rt._set_category("loss")))
            self.handles.append(node.register_hook(lambda *_: rt._set_category("activations")))
            stack.extend(n for n, _ in node.next_functions)

    def clear(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def build_on_device(
    rt: VirtualDevices, wl: Workload, base: torch.device, device: int, seed: int
) -> tuple[nn.Module, Any, torch.optim.Optimizer, list[nn.Parameter]]:
    """The model (from ``seed``, :func:`dpprof.scenarios.step.build_model`), the loss
    module and the optimizer on virtual device ``device``."""
    with rt.device(device), rt.category("parameters"):
        model = build_model(wl, seed)
        # Parameters built outside the mode (or on the CPU) are copied onto the device;
        # those the model placed on a GPU itself (.to("cuda:1")) stay there.
        model._apply(lambda t: t if rt.device_of(t) != HOST else t.to(base, copy=True))
        if wl.dtype != torch.float32:
            model.to(wl.dtype)
        loss_fn = wl.loss
        if isinstance(loss_fn, nn.Module):
            loss_fn = copy.deepcopy(loss_fn)
            loss_fn._apply(lambda t: t.to(base, copy=True))
            if wl.dtype != torch.float32:
                loss_fn.to(wl.dtype)
    params = list(model.parameters())
    if isinstance(loss_fn, nn.Module):
        params += list(loss_fn.parameters())
    opt = wl.optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer() returned {type(opt).__name__}, not a torch Optimizer")
    for group in opt.param_groups:
        # torch picks foreach by default for CUDA tensors; meta and CPU would not.
        if group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True
    return model, loss_fn, opt, params


def run_scenario(
    name: str, wl: Workload, cfg: EmulationConfig, trace: dict[str, Any] | None = None,
    alongside: Alongside | None = None,
) -> ScenarioResult:
    """Emulate one scenario; a failure is a result (status "error"), not an exception.

    With ``alongside``, the emulation also measures what it asks for that belongs to this
    scenario (:class:`Alongside`); what it could not is left undone, for the caller to
    emulate on its own.

    With ``trace`` (a dict), it receives the runtime (``"rt"``), the wrapped model
    (``"wrapped"``), the parameters (``"params"``) and the event indices where the measured
    iteration began and ended (``"step_start"``, ``"step_end"``), for the checks.

    Full garbage collections meanwhile skip the objects made before it
    (:func:`dpprof.emulator.heap.frozen_heap`).
    """
    with frozen_heap():
        return _run_scenario(name, wl, cfg, trace, alongside or Alongside())


def _run_scenario(
    name: str, wl: Workload, cfg: EmulationConfig, trace: dict[str, Any] | None,
    alongside: Alongside,
) -> ScenarioResult:
    step = cfg.step
    wl = step.workload(wl)  # --dtype
    kind = find(name)
    shards = (list(cfg.dp_chunk_sizes) if cfg.dp_chunk_sizes and kind and kind.scatters_batch
              else shard_sizes(step.batch, cfg.gpus))
    base = torch.device("cpu" if cfg.compute else "meta")
    # single: one GPU, unless the model places its layers on several itself
    n_dev = cfg.gpus
    rt = CudaDevices(n_dev, base="cpu" if cfg.compute else "meta", real_host=False,
                     fix=DATA_DEPENDENT_FIX)
    rt.dedupe_replicas = cfg.dedupe_replicas and not cfg.compute and step.amp is None
    # ddp with gradient_as_bucket_view=True, followed from the first allocation on
    ledger = (VariantLedger() if alongside.bucket_view and alongside.ledger_in == name
              and not cfg.compute
              and not step.ddp.gradient_as_bucket_view else None)
    if ledger is not None:
        rt.ledgers[0] = ledger
    # the model's own "cuda", "cuda:1", .cuda(), .to(...) name the virtual devices
    cuda = VirtualCuda(n_dev, rt=rt, enter_runtime=False, honour_visible_devices=False)
    result = ScenarioResult(name=name, batch=step.batch)
    cats = _CategoryHooks(rt)
    kernels = GpuKernels(cfg.compute_capability, rt)
    amp = EmulatedAutocast(getattr(torch, step.amp), cfg.autocast_ops) if step.amp else None
    autocast_names = CudaAutocastNames()  # the user's own torch.autocast("cuda", ...)
    try:
        with rt, cuda, (contextlib.nullcontext() if cfg.compute else kernels), (  # type: ignore[attr-defined]
                amp or contextlib.nullcontext()), autocast_names:
            model, loss_fn, opt, params = build_on_device(rt, wl, base, 0, step.seed)
            if kind is None:
                raise ValueError(f"unknown scenario {name!r}")
            loss_inside = kind.loss_inside
            wrapped: Any = kind.wrap(model, loss_fn, _Wrappers(rt, cfg, params, ledger))
            rank = kind.rank  # None: the whole batch, scattered; r: rank r's rows

            def after_backward() -> None:
                rt.label([p.grad for p in params if p.grad is not None], "gradients")

            def after_optimizer() -> None:
                rt.label([t for st in opt.state.values() for t in st.values()
                          if isinstance(t, torch.Tensor)], "optimizer_state")

            def phase(p: str) -> contextlib.AbstractContextManager[None]:
                if amp is not None and p == "backward":
                    amp.clear_cache()  # autocast's region (forward + loss) has ended
                    amp.caching = False
                elif amp is not None and p == "forward":
                    amp.caching = True
                # Factories take the current device: cuda:0 for the step (as after
                # torch.cuda.set_device), the host inside optimizer.step (its CPU scalars).
                return rt.phase(p, PHASE_CATEGORY.get(p), HOST if p == "optimizer" else 0)

            hooks = StepHooks(
                phase=phase,
                after_forward=cats.after_forward,
                after_loss=cats.after_loss,
                after_backward=after_backward,
                after_optimizer=after_optimizer,
            )
            model.train()
            # DataParallel(output_device=k): the loss runs there, so the targets go there.
            target_dev = (cfg.dp_output_device or 0) if kind.targets_on_output_device else 0
            warm = step.warmup_steps("emulated")
            further = (_FurtherSteps(rt, wrapped, alongside, cfg, name)
                       if alongside.further_steps_in == name and not cfg.compute
                       and cfg.dp_output_device is None else None)
            # The loader's host batches, one per iteration, made before the loop: the
            # scenario's part of each step's global batch (the one seed rule).
            steps = warm + 1 + (further.max_steps if further is not None else 0)
            with rt.device(HOST), rt.category("inputs"):
                batches = [scenario_batch(wl, step.seed, k, step.batch, cfg.gpus, rank)
                           for k in range(steps)]

            def move(x: Any, is_target: bool) -> Any:
                dev = (further.target_device if further is not None else target_dev)
                with rt.category("inputs"):
                    moved = map_tensors(x, lambda t: to_device(rt, t, dev if is_target else 0))
                if is_target and further is not None:
                    further.note_targets(moved)
                return moved

            marks: dict[str, int] = {}

            def figures() -> None:
                """The measured step's figures, taken as it ends (the loop may go on)."""
                used = (wrapped.used_devices if isinstance(wrapped, EmulatedDataParallel)
                        else placed_devices(rt))
                sources: dict[int, int] = {}  # a device -> the one whose events it stands on
                result.devices = _device_results(rt, cfg, kind, shards, used, marks["start"],
                                                 sources)
                if rt.stand_ins.counts:
                    result.notes.append(stand_in_note(rt))
                if not cfg.peaks_only and (not cfg.compute or cfg.count_reserved):
                    fill_gpu_overheads(result.devices, rt.events, context_model(cfg, model),
                                       source=lambda d: sources.get(d.index, d.index),
                                       nccl=cfg.collectives or None)
                if autocast_names.regions:
                    result.notes.append(
                        f"torch.autocast('cuda') in the workload's code: "
                        f"{autocast_names.regions} region(s) re-enacted as on a GPU "
                        "(autocast's CUDA op lists)")
                if kernels.chosen:
                    result.notes.append(
                        "kernels as on a GPU of compute capability {}.{}: {}".format(
                            *cfg.compute_capability,
                            ", ".join(f"{k} x{v}" for k, v in sorted(kernels.chosen.items())))
                    )

            @contextlib.contextmanager
            def iteration(k: int, measured: bool) -> Iterator[None]:
                if further is not None and k > warm:  # a variant, in the same loop
                    try:
                        further.begin(result)
                    except _StepsDone:
                        raise
                    except Exception as e:  # the scenario's own figures stand
                        raise _StepsDone from e
                elif k == warm:
                    rt.reset_peaks()
                    marks["start"] = len(rt.events)
                    if further is not None:
                        further.step_began()
                try:
                    yield
                except Exception as e:
                    if further is None or k <= warm:
                        raise
                    # a variant failed (or needs replica-by-replica emulation): the
                    # scenario's own figures stand; the variant is left to be emulated alone
                    rt.dedupe_failure = None
                    raise _StepsDone from e
                finally:
                    cats.clear()
                if further is not None and k > warm:
                    further.end(step.batch)
                elif k == warm:
                    marks["end"] = len(rt.events)
                    figures()
                if further is not None and k in (warm - 1, warm):
                    further.step_ended(k == warm)

            hooks.iteration = iteration
            loss: torch.Tensor | None = None
            with step_stream(step.seed), contextlib.suppress(_StepsDone):
                loss = training_loop(wrapped, loss_fn, opt, batches, move, loss_inside,
                                     hooks, step=wl.step, micro_batches=step.micro_batches)
                if further is not None:  # every further step ran
                    further.finish()
            del batches
            if ledger is not None and ledger.unsure is None and result.devices:
                alongside.bucket_view_result = _ledger_result(ledger, result, cfg)
            loss_val = float(loss) if cfg.compute and loss is not None else None
            del loss
            result.loss = loss_val
            if trace is not None:
                trace.update(rt=rt, wrapped=wrapped, params=params, model=model,
                             step_start=marks["start"], step_end=marks["end"])
            if isinstance(wrapped, EmulatedDDP):
                wrapped.remove_hooks()
    except Exception as e:  # the user's code, or an impossible program: a result
        if rt.dedupe_failure is not None:  # a mirror could not stand for a replica
            cats.clear()
            return run_scenario(name, wl, dataclasses.replace(cfg, dedupe_replicas=False),
                                trace)
        result.status = STATUS_ERROR
        result.message = f"{type(e).__name__}: {e}".strip() + error_site(e)
        if cfg.debug:
            result.notes.append(traceback.format_exc())
        return result
    finally:
        cats.clear()
    if kind is not None:
        result.notes.extend(kind.notes(cfg.step.batch, cfg.gpus, shards))
    _judge(result, cfg)
    return result


class _Wrappers:
    """The emulator's DataParallel and DDP (:class:`~dpprof.scenarios.kind.Wrappers`)."""

    def __init__(self, rt: VirtualDevices, cfg: EmulationConfig, params: list[nn.Parameter],
                 ledger: VariantLedger | None) -> None:
        self.rt, self.cfg, self.params, self.ledger = rt, cfg, params, ledger

    def data_parallel(self, module: nn.Module) -> EmulatedDataParallel:
        wrapped = EmulatedDataParallel(module, self.rt, list(range(self.cfg.gpus)),
                                       output_device=self.cfg.dp_output_device)
        wrapped.chunk_sizes = self.cfg.dp_chunk_sizes
        return wrapped

    def ddp(self, model: nn.Module) -> EmulatedDDP:
        rt, ddp = self.rt, self.cfg.step.ddp
        spans = sorted({rt.device_of(p) for p in self.params})
        if len(spans) > 1:
            raise ValueError(
                "the model places its layers on {} GPUs itself ({}): DDP with one "
                "process per GPU does not apply; each rank would need that many "
                "GPUs (see single for this model's share of each)".format(
                    len(spans), ", ".join(f"cuda:{i}" for i in spans)))
        with rt.device(0):
            return EmulatedDDP(
                model, rt, world_size=self.cfg.gpus, bucket_cap_mb=ddp.bucket_cap_mb,
                gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                find_unused_parameters=ddp.find_unused_parameters,
                broadcast_buffers=ddp.broadcast_buffers,
                bucket_view_ledger=self.ledger,
            )


class _StepsDone(Exception):
    """Nothing more to measure after the scenario's step: the loop stops there."""


# What the loop may have left on cuda:0 after dp-loss-primary's step, by category: what
# DataParallel(output_device=k) leaves on cuda:k instead (the gathered outputs, the loss,
# and the targets, marked as they are moved), and what it leaves on cuda:0 as well.
ON_THE_OUTPUT_DEVICE = ("outputs", "loss")
ON_CUDA0 = ("parameters", "gradients", "optimizer_state", "inputs")


class _FurtherSteps:
    """``dp-loss-primary``'s loop after its measured step (:class:`Alongside`): the splits
    the plan asks for, then one step of ``DataParallel(output_device=k)``.

    Only after a steady step (:meth:`step_ended`). A split's step starts from what the
    scenario's own step left (it leaves the same, whatever the split). The output
    device's step starts from it too, with the loop's leftovers that live on cuda:k under
    that option (the outputs, the loss, the targets) moved there first
    (:meth:`VirtualDevices.rehome`); where the step left anything else on cuda:0 of no
    known kind, or anything on another GPU, it is not run (the caller emulates it on its
    own). ``tests/test_fixes.py`` checks both against emulating each variant alone, byte
    for byte.
    """

    def __init__(self, rt: VirtualDevices, wrapped: EmulatedDataParallel, alongside: Alongside,
                 cfg: EmulationConfig, name: str) -> None:
        self.rt, self.wrapped, self.alongside, self.cfg = rt, wrapped, alongside, cfg
        self.kind = find(name)
        self.name = name
        self.splits = alongside.splits
        self.splits_open = self.splits is not None
        self.output_device = alongside.output_device
        self.max_steps = ((self.splits.max_steps if self.splits is not None else 0)
                          + (self.output_device is not None))
        self.active: str | None = None  # "split" | "output_device" while one runs
        self._targets: set[int] = set()  # serials of the targets moved (any step)
        self._step_serial = 0  # the first serial of the scenario's measured step
        self._start = 0
        self._last: ScenarioResult | None = None
        self._before: list[int] | None = None  # live bytes after the step before
        self.steady = False

    @property
    def target_device(self) -> int:
        """Where the step now running moves the targets: the output device's step's."""
        return self.wrapped.output_device if self.active == "output_device" else 0

    def note_targets(self, moved: Any) -> None:
        for t in tensors_in(moved):
            serial = self.rt.serial_of(t)
            if serial is not None:
                self._targets.add(serial)

    def step_began(self) -> None:
        self._step_serial = self.rt.last_serial

    def step_ended(self, measured: bool) -> None:
        """The step before the measured one, or the measured one, ended: each device's
        live bytes. The loop is steady when the measured step left what the one before
        it left; only then is a further step what a variant's own measured step is (a
        user's step that keeps something of every step is not)."""
        live = [self.rt.live_bytes(i) for i in range(self.rt.num_devices)]
        if measured:
            self.steady = live == self._before
        else:
            self._before = live

    def begin(self, scenario: ScenarioResult) -> None:
        """Before a further step: the next variant set up, or :class:`_StepsDone`."""
        if not self.steady:
            raise _StepsDone
        if self._last is None:
            self._last = scenario
        chunks = self._next_split()
        if chunks is not None:
            self.active = "split"
            self.wrapped.chunk_sizes = chunks
        elif self.output_device is not None and self.alongside.output_device_result is None:
            if not self._move_leftovers(self.output_device):
                raise _StepsDone
            self.active = "output_device"
            self.wrapped.chunk_sizes = None
            self.wrapped.output_device = self.output_device
        else:
            raise _StepsDone
        self.rt.reset_peaks()
        self._start = len(self.rt.events)

    def _next_split(self) -> tuple[int, ...] | None:
        if not self.splits_open or self.splits is None or self._last is None:
            return None
        chunks = self.splits(self._last)
        if chunks is None:
            self.splits_open = False
        return chunks

    def _move_leftovers(self, device: int) -> bool:
        rt = self.rt
        if any(rt.live_bytes(i) for i in range(1, rt.num_devices)):
            return False
        moving = []
        for serial, category in rt.live_storages(0):
            if category in ON_THE_OUTPUT_DEVICE or serial in self._targets:
                moving.append(serial)
            elif category not in ON_CUDA0 and serial > self._step_serial:
                return False  # left by the step, of no known kind
        rt.rehome(set(moving), device)
        return True

    def end(self, batch: int) -> None:
        """After a further step: its figures (peaks only)."""
        wrapped = self.wrapped
        s = ScenarioResult(name=self.name, batch=batch)
        chunks = (list(wrapped.chunk_sizes) if wrapped.chunk_sizes is not None
                  else shard_sizes(batch, self.cfg.gpus))
        s.devices = _device_results(self.rt, dataclasses.replace(self.cfg, peaks_only=True),
                                    self.kind, chunks, wrapped.used_devices,
                                    self._start, {})
        _judge(s, self.cfg)
        if self.active == "output_device":
            self.alongside.output_device_result = s
        else:
            self._last = s
        self.active = None

    def finish(self) -> None:
        """Every further step ran: the plan gets the last split's figures."""
        if self.splits_open:
            self._next_split()


@dataclass
class Alongside:
    """What a comparison's scenarios measure besides themselves, over meta tensors, for
    the fixes (:mod:`dpprof.analysis.fixes`):

    * ``splits``: further splits of the batch, measured in ``further_steps_in``'s own loop
      (``dp-loss-primary``) after its measured step (:class:`FurtherSplits`);
    * ``bucket_view``: ``ddp`` with ``gradient_as_bucket_view=True``, followed in a ledger
      while ``ledger_in`` (``ddp``) runs plain
      (:class:`~dpprof.emulator.ddp.BucketViewFollower`); its figures (peaks only) land
      in ``bucket_view_result``, None where it could not be followed;
    * ``output_device``: ``DataParallel(output_device=k)`` as one more step of
      ``further_steps_in``'s loop, after the splits; its figures (peaks only) land in
      ``output_device_result``, None where it could not run there.

    The fixes (:mod:`dpprof.analysis.fix_registry`) say which scenario hosts each.
    """

    splits: FurtherSplits | None = None
    further_steps_in: str = DP_LOSS_PRIMARY  # a DataParallel scenario with its loss on cuda:0
    bucket_view: bool = False
    ledger_in: str = DDP
    bucket_view_result: ScenarioResult | None = None
    output_device: int | None = None
    output_device_result: ScenarioResult | None = None


class FurtherSplits(Protocol):
    """Splits of the batch measured after ``dp-loss-primary``'s step, in its own loop.

    A DataParallel step leaves the same state whatever the split (the parameters, their
    gradients and optimizer state on cuda:0; the gathered outputs, the loss and the batch,
    all the whole batch's, on cuda:0; nothing on the other GPUs), so the step after the
    measured one, run with other chunk sizes, is what that split's own measured step is
    (``tests/test_fixes.py`` checks it byte for byte). Called with the last measured
    figures (the scenario's, then each split's, peaks only), it returns the next chunk
    sizes, or None to stop; at most :attr:`max_steps` further steps.
    """

    max_steps: int

    def __call__(self, last: ScenarioResult) -> tuple[int, ...] | None: ...


def _ledger_result(ledger: VariantLedger, scenario: ScenarioResult,
                   cfg: EmulationConfig) -> ScenarioResult:
    """The variant a ledger followed, as its scenario's result with the ledger's peaks
    (every DDP rank the same; no breakdown, no timeline)."""
    d = scenario.devices[0]
    template = DeviceResult(
        index=0, peak_allocated_bytes=ledger.peak_allocated,
        peak_requested_bytes=ledger.peak_requested, capacity_bytes=d.capacity_bytes,
        used=True, batch_rows=d.batch_rows, timeline=[])
    out = ScenarioResult(name=scenario.name, batch=scenario.batch,
                         devices=ddp_ranks(template, len(scenario.devices)))
    _judge(out, cfg)
    return out


def _judge(result: ScenarioResult, cfg: EmulationConfig) -> None:
    """Status "oom" (the first device over the GPU's memory) or "ok"."""
    # total_peak_bytes: allocated, or reserved + context where they were counted.
    over = [d for d in result.devices if d.total_peak_bytes > cfg.gpu_memory_bytes]
    if over:
        worst = over[0]
        result.status = STATUS_OOM
        result.oom_device = worst.index
        result.oom_bytes = worst.total_peak_bytes
        result.message = (
            f"out of memory on cuda:{worst.index}: needs {fmt_bytes(worst.total_peak_bytes)}"
            f" at its peak ({worst.peak_phase}), has {fmt_bytes(cfg.gpu_memory_bytes)}"
        )
    else:
        result.status = STATUS_OK


DATA_DEPENDENT_FIX = ("rerun with --compute (the same emulation over CPU tensors, real "
                      "numbers) or --backend cpu")


def probe_model(wl: Workload, gpus: int) -> nn.Module:
    """The workload's model over meta tensors, to see what it contains (a model that
    names its GPUs builds under a virtual CUDA)."""
    rt = CudaDevices(gpus, "meta", real_host=False)
    with VirtualCuda(gpus, rt=rt, honour_visible_devices=False), torch.device("meta"):
        return build_model(wl, 0)  # no values over meta; the caller's RNG untouched


def model_devices(wl: Workload, gpus: int) -> list[int]:
    """The GPUs the workload's model puts its parameters on itself (``[0]``: one GPU)."""
    rt = CudaDevices(gpus, "meta", real_host=False)
    with VirtualCuda(gpus, rt=rt, honour_visible_devices=False), torch.device("meta"):
        model = build_model(wl, 0)
        return sorted({max(rt.device_of(p), 0) for p in model.parameters()}) or [0]


def placed_devices(rt: VirtualDevices) -> list[int]:
    """The devices the model used: cuda:0, and any other it placed layers on itself."""
    return [0] + [i for i in range(1, rt.num_devices) if rt.counters[i].peak_allocated > 0]


def stand_in_note(rt: CudaDevices) -> str:
    """The values read from emulated tensors (``.item()`` & co.) and where."""
    st = rt.stand_ins
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(st.counts.items()))
    sites = "; ".join(f"{s} x{c}" for s, c in list(st.sites.items())[:3])
    return (f"{st.total} value(s) read from emulated tensors answered with stand-ins "
            f"({kinds}: {STAND_INS}): {sites}")


def device_result(rt: VirtualDevices, i: int, index: int, capacity_bytes: int, used: bool,
                  batch_rows: int, timeline: list[TimelinePoint]) -> DeviceResult:
    """Virtual device ``i``'s figures (its peaks, the categories at its peak moment, the
    phase of the peak), reported as ``index``."""
    c = rt.counters[i]
    snap = rt.peak_snapshot(i)
    return DeviceResult(
        index=index,
        peak_allocated_bytes=c.peak_allocated,
        peak_requested_bytes=c.peak_requested,
        capacity_bytes=capacity_bytes,
        breakdown_bytes={k: v for k, v in sorted(snap.by_category.items()) if v},
        peak_phase=c.peak_phase,
        used=used,
        batch_rows=batch_rows,
        timeline=timeline,
    )


def ddp_ranks(template: DeviceResult, world: int) -> list[DeviceResult]:
    """Every DDP rank runs the same program on as many rows: ``template`` (rank 0's device)
    stands for all ``world`` ranks."""
    return [DeviceResult(**{**template.__dict__, "index": r, "rank": r, "used": True,
                            "timeline": list(template.timeline)})
            for r in range(world)]


def _device_results(
    rt: VirtualDevices, cfg: EmulationConfig, kind: Scenario | None, shards: list[int],
    used: list[int], measure_start: int, sources: dict[int, int],
) -> list[DeviceResult]:
    """Each device's figures; a mirror's (:meth:`VirtualDevices.mirror_shift`) are its
    device's and every DDP rank's are rank 0's, noted in ``sources`` (the device shown ->
    the one whose event sequence it is)."""
    assert kind is not None
    # DDP: rank 0's device stands for every rank; single: the GPUs a model-parallel model
    # placed itself on, else one; DataParallel: every GPU
    shown = kind.shown_devices(rt.num_devices, used)
    out: list[DeviceResult] = []
    for i in range(shown):
        rows = kind.rows_of(shards, i)
        of = rt.mirrored_device(i)
        shift = None if of is None or of > i else rt.mirror_shift(i, of)
        if shift is not None:  # a mirror: its device's figures, the timeline shifted
            assert of is not None
            sources[i] = of
            src = out[of]
            out.append(DeviceResult(**{
                **src.__dict__, "index": i, "used": i in used, "batch_rows": rows,
                "timeline": shift_timeline(rt, src.timeline, shift, measure_start)}))
            continue
        out.append(device_result(rt, i, i, cfg.gpu_memory_bytes, i in used, rows,
                                 [] if cfg.peaks_only else timeline_points(rt, i, measure_start)))
    if kind.ranks_alike:
        sources.update(dict.fromkeys(range(cfg.gpus), 0))
        return ddp_ranks(out[0], cfg.gpus)
    return out


def context_model(cfg: EmulationConfig, model: nn.Module) -> ContextModel:
    """The context/workspace model for the target GPU (cuDNN where convolutions run)."""
    uses_cudnn = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return device_context(cfg.compute_capability, uses_cudnn)


def shift_timeline(rt: VirtualDevices, points: list[TimelinePoint], shift: int,
                   start: int) -> list[TimelinePoint]:
    """A mirror's timeline from its device's (:meth:`VirtualDevices.mirror_shift`): every
    point but the window's first ``shift`` events later, each labelled with its own
    phase (a phase may begin between an event and its mirror's)."""
    marks = [(m.event_index, m.name) for m in rt.phases if m.event_index >= start]
    firsts = [idx for idx, _ in marks]
    names = ["", *(name for _, name in marks)]
    out = points[:1]
    for p in points[1:]:
        t = p.t + shift
        out.append(TimelinePoint(t, p.allocated_bytes,
                                 names[bisect.bisect_right(firsts, start + int(t))],
                                 p.used_bytes))
    return out


def timeline_points(rt: VirtualDevices, index: int, start: int, *,
                    phase_before_start: bool = False) -> list[TimelinePoint]:
    """Device ``index``'s live bytes from event ``start`` on, each point labelled with its
    phase, kept to at most :data:`TIMELINE_POINTS` (the maximum of each equal slice).

    ``phase_before_start``: a point before the window's first phase mark carries the phase
    begun before the window (``dpprof run``, whose window starts mid-phase); otherwise it
    is unlabelled (``compare``, whose window starts at a phase mark).
    """
    at, live = rt.timeline_arrays(index, start)
    marks = [(m.event_index, m.name) for m in rt.phases
             if phase_before_start or m.event_index >= start]

    def phase_at(ev: int) -> str:
        name = ""
        for idx, p in marks:
            if idx <= ev:
                name = p
            else:
                break
        return name

    if len(at) > TIMELINE_POINTS:
        # the maximum of each equal slice (its first point where several reach it)
        step = len(at) / TIMELINE_POINTS
        bounds = [(int(k * step), int((k + 1) * step) or len(at))
                  for k in range(TIMELINE_POINTS)]
        bounds = [(a, b) for a, b in bounds if b > a]
        starts = np.array([a for a, _ in bounds])
        ends = np.array([b for _, b in bounds])
        used = live[: ends[-1]]  # the slices follow each other from 0 to the last's end
        slice_of = np.repeat(np.arange(len(bounds)), ends - starts)
        hit = np.flatnonzero(used == np.maximum.reduceat(used, starts)[slice_of])
        first = hit[np.unique(slice_of[hit], return_index=True)[1]]
        at, live = at[first], live[first]
    return [TimelinePoint(float(ev - start), b, phase_at(ev))
            for ev, b in zip(at.tolist(), live.tolist(), strict=True)]
