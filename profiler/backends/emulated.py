"""The emulated backend: every scenario re-enacted on virtual devices.

Meta tensors by default (memory only: any model size, seconds, cost independent of the
batch size); CPU tensors with ``compute=True`` (real numbers, for checks and tests).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dpprof.backends.emulated_alongside import (
    Alongside,
    FurtherSplits,
    FurtherSteps,
    StepsDone,
    ledger_result,
)
from dpprof.backends.emulated_config import EmulationConfig
from dpprof.backends.emulated_figures import (
    clique_note,
    device_results,
    judge,
    placed_devices,
    stand_in_note,
    transient_note,
    with_gpu_overheads,
)
from dpprof.backends.emulated_time import fill_predicted_time
from dpprof.emulator.catalog import DEFAULT_GPU, lookup_gpu
from dpprof.emulator.context import (
    ContextModel,
    clique_nccl_memory,
    device_context,
    link_of,
)
from dpprof.emulator.cuda_devices import CudaDevices
from dpprof.emulator.data_parallel import EmulatedDataParallel, replicas_float16_note
from dpprof.emulator.ddp import EmulatedDDP
from dpprof.emulator.device_copies import to_device
from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.emulated_autocast import CudaAutocastNames, EmulatedAutocast
from dpprof.emulator.fsdp import host_bytes
from dpprof.emulator.heap import frozen_heap
from dpprof.emulator.kernels import GpuKernels, kernel_notes
from dpprof.emulator.ledgers import VariantLedger
from dpprof.emulator.op_log import OpLog
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.emulator.virtual_devices import VirtualDevices
from dpprof.result import STATUS_ERROR, ScenarioResult
from dpprof.scenarios.kind import Scenario
from dpprof.scenarios.measured_loop import StepHooks, error_site, training_loop
from dpprof.scenarios.registry import find
from dpprof.scenarios.shards import shard_sizes
from dpprof.scenarios.step import Batch, build_model, scenario_batch, step_stream
from dpprof.scenarios.workloads import (
    Workload,
    make_optimizer,
    map_tensors,
    tensors_in,
)

# EmulationConfig, Alongside and FurtherSplits live in modules of their own; the many
# callers of the emulated backend import them from here
__all__ = [
    "ASSUMPTIONS",
    "DATA_DEPENDENT_FIX",
    "PHASE_CATEGORY",
    "Alongside",
    "EmulationConfig",
    "FurtherSplits",
    "build_on_device",
    "context_model",
    "model_devices",
    "probe_model",
    "run_scenario",
]

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
    "allocator simulated over the allocation sequence, cuBLAS workspaces included where "
    "each thread's first matmul allocates them) and the CUDA context (+ cuDNN library code "
    "where convolutions run; + NCCL's memory for DDP ranks and DataParallel's GPUs). "
    "Allocated includes cuDNN's "
    "convolution workspace at each convolution, estimated from what an H200 measured "
    "(dpprof.emulator.cudnn_workspace). Peaks are the worst case a real run reaches: DDP's "
    "first-iteration buckets, which NCCL keeps until its watchdog reaps them, are counted; "
    "the steady state without them is shown beside. Not included: other processes.",
]









class _CategoryHooks:
    """Files allocations made while the loss's autograd nodes run under 'loss'."""

    def __init__(self, rt: VirtualDevices) -> None:
        self.rt = rt
        self.output_nodes: set[Any] = set()
        self.handles: list[Any] = []

    def after_forward(self, outputs: Any) -> None:
        self.rt.storages.label(list(tensors_in(outputs)), "outputs")
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
            self.handles.append(node.register_prehook(lambda *_: rt.set_category("loss")))
            self.handles.append(node.register_hook(lambda *_: rt.set_category("activations")))
            stack.extend(n for n, _ in node.next_functions)

    def clear(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def build_on_device(
    rt: VirtualDevices, wl: Workload, base: torch.device, device: int, seed: int,
    host_model: bool = False,
) -> tuple[nn.Module, Any, torch.optim.Optimizer, list[nn.Parameter]]:
    """The model (from ``seed``, :func:`dpprof.scenarios.step.build_model`), the loss
    module and the optimizer on virtual device ``device``; with ``host_model``, the model
    built on the host (real CPU tensors under a real host) and left where it puts itself."""
    with rt.device(HOST if host_model else device), rt.category("parameters"):
        model = build_model(wl, seed)
    with rt.device(device), rt.category("parameters"):
        # Parameters built outside the mode (or on the CPU) are copied onto the device;
        # those the model placed on a GPU itself (.to("cuda:1")) stay there. A model kept
        # on the host stays where its own code left it (fully_shard's CPU offload).
        if not host_model:
            model._apply(lambda t: t if rt.storages.device_of(t) != HOST else t.to(base, copy=True))
        if wl.dtype != torch.float32:
            model.to(wl.dtype)
        loss_fn = wl.loss
        if isinstance(loss_fn, nn.Module):
            loss_fn = copy.deepcopy(loss_fn)
            loss_fn._apply(lambda t: t.to(base, copy=True))
            if wl.dtype != torch.float32:
                loss_fn.to(wl.dtype)
    opt = make_optimizer(wl, model, loss_fn)
    params = list(model.parameters())
    if isinstance(loss_fn, nn.Module):
        params += list(loss_fn.parameters())
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
    (``"wrapped"``), the model (``"model"``), the optimizer (``"optimizer"``), the
    parameters (``"params"``), with ``host_model`` the host memory its parameters,
    gradients and optimizer state hold after the measured step (``"host_bytes"``,
    :func:`dpprof.emulator.fsdp.host_bytes`) and the event indices where the measured
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
    rt, ledger = _virtual_devices(cfg, name, alongside)
    if cfg.predict_time and not cfg.peaks_only:
        rt.op_log = OpLog()  # the measured step's ops, for its predicted time
    # the model's own "cuda", "cuda:1", .cuda(), .to(...) name the virtual devices
    cuda = VirtualCuda(cfg.gpus, rt=rt, enter_runtime=False, honour_visible_devices=False)
    result = ScenarioResult(name=name, batch=step.batch)
    cats = _CategoryHooks(rt)
    kernels = GpuKernels(cfg.compute_capability, rt)
    amp = EmulatedAutocast(getattr(torch, step.amp), cfg.autocast_ops) if step.amp else None
    autocast_names = CudaAutocastNames()  # the user's own torch.autocast("cuda", ...)
    try:
        with rt, cuda, (contextlib.nullcontext() if cfg.compute else kernels), (  # type: ignore[attr-defined]
                amp or contextlib.nullcontext()), autocast_names:
            model, loss_fn, opt, params = build_on_device(rt, wl, base, 0, step.seed,
                                                          cfg.host_model)
            if kind is None:
                raise ValueError(f"unknown scenario {name!r}")
            wrapped: Any = kind.wrap(model, loss_fn, _Wrappers(rt, cfg, params, ledger))
            hooks = _step_hooks(rt, opt, params, cats, amp)
            model.train()
            # DataParallel(output_device=k): the loss runs there, so the targets go there.
            target_dev = (cfg.dp_output_device or 0) if kind.targets_on_output_device else 0
            warm = step.warmup_steps("emulated")
            further = (FurtherSteps(rt, wrapped, alongside, cfg, name)
                       if alongside.further_steps_in == name and not cfg.compute
                       and cfg.dp_output_device is None else None)
            steps = warm + 1 + (further.max_steps if further is not None else 0)
            batches = _host_batches(rt, wl, cfg, kind.rank, steps)
            marks: dict[str, int] = {}

            def figures() -> None:
                nonlocal result
                result = _measured_figures(result, rt, cfg, kind, shards, wrapped, model,
                                           marks["start"], autocast_names, kernels)
                if isinstance(wrapped, EmulatedDDP):  # its worst case measured: reaped now
                    wrapped.reap()
                if rt.op_log is not None and result.devices:
                    result = fill_predicted_time(result, rt.op_log, cfg.gpu, cfg.interconnect,
                                                 kind is not None and kind.ranks_alike)
                if cfg.host_model:  # what the model keeps on the host
                    result = dataclasses.replace(result, host_bytes=host_bytes(model, opt))
                    if trace is not None:
                        trace["host_bytes"] = dict(result.host_bytes)

            hooks.iteration = _iterations(rt, lambda: result, further, warm, marks, cats,
                                          step.batch, figures)
            loss: torch.Tensor | None = None
            with step_stream(step.seed), contextlib.suppress(StepsDone):
                loss = training_loop(wrapped, loss_fn, opt, batches,
                                     _mover(rt, further, target_dev), kind.loss_inside,
                                     hooks, step=wl.step, micro_batches=step.micro_batches)
                if further is not None:  # every further step ran
                    further.finish()
            del batches
            if ledger is not None and ledger.unsure is None and result.devices:
                alongside.bucket_view_result = ledger_result(ledger, result, cfg)
            loss_val = float(loss) if cfg.compute and loss is not None else None
            del loss
            result = dataclasses.replace(result, loss=loss_val)
            if trace is not None:
                trace.update(rt=rt, wrapped=wrapped, params=params, model=model, optimizer=opt,
                             step_start=marks["start"], step_end=marks["end"])
            if isinstance(wrapped, EmulatedDDP):
                wrapped.remove_hooks()
    except Exception as e:  # the user's code, or an impossible program: a result
        if rt.mirrors.dedupe_failure is not None:  # a mirror could not stand for a replica
            cats.clear()
            return run_scenario(name, wl, dataclasses.replace(cfg, dedupe_replicas=False),
                                trace)
        return dataclasses.replace(
            result, status=STATUS_ERROR,
            message=f"{type(e).__name__}: {e}".strip() + error_site(e),
            notes=result.notes + ((traceback.format_exc(),) if cfg.debug else ()))
    finally:
        cats.clear()
    notes = list(result.notes)
    if kind is not None:
        notes.extend(kind.notes(cfg.step.batch, cfg.gpus, shards))
    if (float16 := replicas_float16_note(rt)) is not None:
        notes.append(float16)
    return judge(dataclasses.replace(result, notes=tuple(notes)), cfg)


def _virtual_devices(cfg: EmulationConfig, name: str,
                     alongside: Alongside) -> tuple[CudaDevices, VariantLedger | None]:
    """The scenario's virtual GPUs, and the ledger that follows ``ddp`` with
    ``gradient_as_bucket_view=True`` beside it from the first allocation on (None where
    :class:`Alongside` does not ask for it here)."""
    step = cfg.step
    # single: one GPU, unless the model places its layers on several itself
    n_dev = cfg.gpus
    # compare's host holds meta tensors too, unless the model lives there (CPU offload)
    rt = CudaDevices(n_dev, base="cpu" if cfg.compute else "meta", real_host=cfg.host_model,
                     fix=DATA_DEPENDENT_FIX)
    rt.mirrors.dedupe_replicas = cfg.dedupe_replicas and not cfg.compute and step.amp is None
    # ddp with gradient_as_bucket_view=True, followed from the first allocation on
    ledger = (VariantLedger() if alongside.bucket_view and alongside.ledger_in == name
              and not cfg.compute
              and not step.ddp.gradient_as_bucket_view else None)
    if ledger is not None:
        rt.ledgers[0] = ledger
    return rt, ledger


def _step_hooks(rt: CudaDevices, opt: torch.optim.Optimizer, params: list[nn.Parameter],
                cats: _CategoryHooks, amp: EmulatedAutocast | None) -> StepHooks:
    """The loop's hooks (but ``iteration``): each phase's category and current device,
    autocast's cache over forward and loss, what each phase leaves labelled."""

    def after_backward() -> None:
        rt.storages.label([p.grad for p in params if p.grad is not None], "gradients")

    def after_optimizer() -> None:
        rt.storages.label([t for st in opt.state.values() for t in st.values()
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

    return StepHooks(
        phase=phase,
        after_forward=cats.after_forward,
        after_loss=cats.after_loss,
        after_backward=after_backward,
        after_optimizer=after_optimizer,
    )


def _host_batches(rt: CudaDevices, wl: Workload, cfg: EmulationConfig, rank: int | None,
                  steps: int) -> list[Batch]:
    """The loader's host batches, one per iteration, made before the loop: the scenario's
    part of each step's global batch (the one seed rule); ``rank`` None: the whole batch,
    scattered; r: rank r's rows."""
    step = cfg.step
    with rt.device(HOST), rt.category("inputs"):
        return [scenario_batch(wl, step.seed, k, step.batch, cfg.gpus, rank)
                for k in range(steps)]


def _mover(rt: CudaDevices, further: FurtherSteps | None,
           target_dev: int) -> Callable[[Any, bool], Any]:
    """The loop's host-to-device copy: inputs to cuda:0, targets to ``target_dev`` (or
    where the further step now running puts them)."""

    def move(x: Any, is_target: bool) -> Any:
        dev = (further.target_device if further is not None else target_dev)
        with rt.category("inputs"):
            moved = map_tensors(x, lambda t: to_device(rt, t, dev if is_target else 0))
        if is_target and further is not None:
            further.note_targets(moved)
        return moved

    return move


def _measured_figures(
    result: ScenarioResult, rt: CudaDevices, cfg: EmulationConfig, kind: Scenario | None,
    shards: list[int], wrapped: Any, model: nn.Module, start: int,
    autocast_names: CudaAutocastNames, kernels: GpuKernels,
) -> ScenarioResult:
    """``result`` with the measured step's figures, taken as it ends (the loop may go on)."""
    used = (wrapped.used_devices if isinstance(wrapped, EmulatedDataParallel)
            else placed_devices(rt))
    sources: dict[int, int] = {}  # a device -> the one whose events it stands on
    devices = tuple(device_results(rt, cfg, kind, shards, used, start, sources))
    notes = list(result.notes)
    if rt.stand_ins.counts:
        notes.append(stand_in_note(rt))
    if not cfg.peaks_only and (not cfg.compute or cfg.count_reserved):
        own_nccl = clique_nccl_memory(rt.nccl_cliques, cfg.compute_capability,
                                      link=_link(cfg), nccl_env=os.environ)
        devices = with_gpu_overheads(devices, rt.storages.events, context_model(cfg, model),
                                     source=lambda d: sources.get(d.index, d.index),
                                     nccl=cfg.collectives or None, blas_first=rt.blas_first,
                                     blas_side=rt.blas_side,
                                     transients=rt.storages.transients,
                                     own_nccl_bytes={d: m.high_bytes
                                                     for d, m in own_nccl.items()})
        if (note := clique_note(own_nccl)) is not None:
            notes.append(note)
    alike = kind is not None and kind.ranks_alike  # DDP's ranks: one note for all
    for d in devices[:1] if alike else devices:
        if (note := transient_note(d, "each rank" if alike else None)) is not None:
            notes.append(note)
    if autocast_names.regions:
        notes.append(
            f"torch.autocast('cuda') in the workload's code: "
            f"{autocast_names.regions} region(s) re-enacted as on a GPU "
            "(autocast's CUDA op lists)")
    notes += kernel_notes(kernels.chosen, cfg.compute_capability)
    return dataclasses.replace(result, devices=devices, notes=tuple(notes))


def _iterations(
    rt: CudaDevices, result: Callable[[], ScenarioResult], further: FurtherSteps | None,
    warm: int,
    marks: dict[str, int], cats: _CategoryHooks, batch: int, figures: Callable[[], None],
) -> Callable[[int, bool], contextlib.AbstractContextManager[None]]:
    """The ``iteration`` hook: the measured step's window (``marks``' ``start`` and
    ``end``) and figures, then each further step as a variant in the same loop."""

    @contextlib.contextmanager
    def iteration(k: int, measured: bool) -> Iterator[None]:
        if further is not None and k > warm:  # a variant, in the same loop
            try:
                further.begin(result())
            except StepsDone:
                raise
            except Exception as e:  # the scenario's own figures stand
                raise StepsDone from e
        elif k == warm:
            rt.reset_peaks()
            marks["start"] = len(rt.storages.events)
            if rt.op_log is not None:
                rt.op_log.on = True
            if further is not None:
                further.step_began()
        try:
            yield
        except Exception as e:
            if further is None or k <= warm:
                raise
            # a variant failed (or needs replica-by-replica emulation): the
            # scenario's own figures stand; the variant is left to be emulated alone
            rt.mirrors.dedupe_failure = None
            raise StepsDone from e
        finally:
            cats.clear()
        if further is not None and k > warm:
            further.end(batch)
        elif k == warm:
            marks["end"] = len(rt.storages.events)
            if rt.op_log is not None:
                rt.op_log.on = False
            figures()
        if further is not None and k in (warm - 1, warm):
            further.step_ended(k == warm)

    return iteration


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
        spans = sorted({rt.storages.device_of(p) for p in self.params})
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
                nccl_stash=self.cfg.ddp_backend == "nccl",
            )


DATA_DEPENDENT_FIX = ("rerun with --compute (the same emulation over CPU tensors, real "
                      "numbers) or --backend cpu")


def probe_model(wl: Workload, gpus: int) -> nn.Module:
    """The workload's model over meta tensors, to see what it contains (a model that
    names its GPUs builds under a virtual CUDA)."""
    # no host of its own (real_host=False): every tensor is meta, a GPU's or the host's
    rt = CudaDevices(gpus, "meta", real_host=False)
    with VirtualCuda(gpus, rt=rt, honour_visible_devices=False):
        return build_model(wl, 0)  # no values over meta; the caller's RNG untouched


def model_devices(wl: Workload, gpus: int) -> list[int]:
    """The GPUs the workload's model puts its parameters on itself (``[0]``: one GPU)."""
    rt = CudaDevices(gpus, "meta", real_host=False)
    with VirtualCuda(gpus, rt=rt, honour_visible_devices=False):
        model = build_model(wl, 0)
        return sorted({max(rt.storages.device_of(p), 0) for p in model.parameters()}) or [0]


def context_model(cfg: EmulationConfig, model: nn.Module) -> ContextModel:
    """The context/workspace model for the target GPU (cuDNN where convolutions run; a DDP
    rank's NCCL at the run's world size, over the GPU's link, with the NCCL_* settings of
    the environment dpprof runs in)."""
    uses_cudnn = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return device_context(cfg.compute_capability, uses_cudnn, world_size=max(cfg.gpus, 1),
                          link=_link(cfg), nccl_env=os.environ)


def _link(cfg: EmulationConfig) -> str:
    """The link NCCL's peers use on the run's GPU."""
    return link_of(lookup_gpu(cfg.gpu) if cfg.gpu else DEFAULT_GPU, cfg.interconnect)


