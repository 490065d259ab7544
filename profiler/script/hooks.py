"""What ``dpprof run`` hooks into the running script: optimizer steps counted, phases
marked and the script stopped after enough steps (:class:`Stepper`), the loss's memory
labelled (:func:`label_losses`), a rung of the ladder applied (:class:`RungHooks`), and
``torch.compile`` run eagerly (:func:`compile_eagerly`). An alternative's own patches are its
strategy's (:mod:`dpprof.script.strategy`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from dpprof.emulator.call_sites import caller_site, caller_sites
from dpprof.emulator.cuda_devices import CudaDevices
from dpprof.emulator.data_parallel import Gather
from dpprof.emulator.emulated_autocast import EmulatedAutocast
from dpprof.emulator.events import DeviceCounters
from dpprof.emulator.flex_attention import (
    compiled_region,
    enter_compiled_region,
    leave_compiled_region,
)
from dpprof.emulator.patcher import Patcher
from dpprof.emulator.step_time import EVALUATION
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.measure.ladder_code import blocks_words
from dpprof.measure.ladder_rungs import Rung
from dpprof.measure.rung_models import checkpoint_blocks
from dpprof.scenarios.losses import functional_loss_names, is_loss
from dpprof.script.trainer_settings import checkpointing_layers

__all__ = ["AS_WRITTEN", "RungHooks", "StepCallback", "StepListener", "Stepper", "StopScript",
           "compile_eagerly", "label_losses", "unwrapped"]

AS_WRITTEN = "as-written"


class StopScript(BaseException):
    """Raised in the script once it has run enough optimizer steps (a BaseException, so
    the script's own ``except Exception`` does not swallow it)."""


StepCallback = Callable[[int], None]


class StepListener(Protocol):
    """What follows the script's step as :class:`Stepper` sees it (a rung of the ladder:
    :class:`RungHooks`)."""

    def forward_started(self, module: nn.Module) -> None:
        """An outermost call of a module with parameters begins (the model's)."""

    def backward_started(self) -> None:
        """``backward()`` is called."""

    def step_started(self) -> None:
        """An optimizer's ``step()`` is called."""


class Stepper:
    """Counts optimizer steps, marks phases, stops the script after ``steps``."""

    def __init__(self, rt: CudaDevices, steps: int, on_step: StepCallback | None) -> None:
        self.rt = rt
        self.steps = steps
        self.done = 0
        # optimizer steps under way: an optimizer whose step calls another's (torch's
        # ZeroRedundancyOptimizer, a Lookahead built on torch.optim.Optimizer) makes one
        # step of the script, the outermost
        self._stepping = 0
        self.on_step = on_step
        self.measure_start = 0
        # each device's counters when the warm-up ended (their peaks: the warm-up's)
        self.warmup_peaks: list[DeviceCounters] = []
        # weakly: an optimizer the script drops (a finished mp.spawn job's, a stage's) frees
        # its parameters and state as it would on a GPU
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # the script validating between steps: the phase EVALUATION until the next training
        # forward, backward or step
        self._evaluating = False
        self._handles: list[Any] = []
        self._phase: contextlib.ExitStack | None = None
        self.batch_rows = 0  # rows of the first measured batch that reached backward
        self._rows_at = 0  # the steps done when batch_rows was noted
        self.warmup_rows = 0  # rows of the warm-up step's batch
        self._last_rows = 0  # rows of the last outermost module call
        # whether those rows are a count of objects that are no tensors (PyG's graphs): how
        # many of them each GPU got is its scatter's, unknown here
        self.rows_are_items = False
        self._rows_from_kwargs = False  # that call had no tensor argument but by keyword
        self.forwards = 0  # outermost module calls
        self.backwards = 0  # backward() calls
        # no optimizer made: a script that updates its parameters itself (word_language_model)
        # takes a step per backward, and is stopped after ``steps`` of them
        self.optimizer_made = False
        self.by_backwards = False  # stopped by that count
        self._orig_optimizer_init: Any = None
        self._depth = 0
        self.listeners: list[StepListener] = []
        # the first outermost module with parameters the script called (its model): the
        # words of the checkpointing code for its repeated blocks (blocks_words: "count"
        # of them); the script's lines of that call and of its first backward()
        self.blocks_words: dict[str, Any] = {}
        # each of those calls' every line outside torch and dpprof, innermost first (a
        # library's that called torch, then the script's that called the library)
        self.forward_sites: tuple[str, ...] = ()
        self.backward_sites: tuple[str, ...] = ()
        # the op log's length as each measured optimizer step ended (the predicted step
        # time's steps: dpprof.emulator.step_time.predict_steps)
        self.step_ends: list[int] = []
        # the backward passes done as each optimizer step ended (gradient accumulation:
        # several a step, each over a batch)
        self._backwards_at_ends: list[int] = []

    @property
    def batches_per_step(self) -> float:
        """The batches (backward passes) of a measured optimizer step, their mean: more
        than one where the script accumulates gradients; 1 before a second step ends."""
        ends = self._backwards_at_ends
        if len(ends) < 2 or ends[-1] == ends[0]:
            return 1.0
        return (ends[-1] - ends[0]) / (len(ends) - 1)

    def _start_measuring(self) -> None:
        """Peaks restart here, after the warm-up step; the warm-up's are kept
        (:meth:`keep_higher_warmup_peaks`)."""
        self.warmup_peaks = [dataclasses.replace(c) for c in self.rt.storages.counters]
        self.rt.reset_peaks()
        self.measure_start = len(self.rt.storages.events)
        if self.rt.op_log is not None:  # the measured steps' ops, for their time
            self.rt.op_log.on = True

    def keep_higher_warmup_peaks(self) -> dict[int, int]:
        """Where the warm-up step peaked higher than the steps after it (a script that
        trains one step, then evaluates; a first step's transients), that peak is the
        device's again: the peak reported is the highest the GPU reaches, and never below
        what ``torch.cuda.max_memory_allocated`` told the script. The devices where it was,
        with the steps' own peaks (``{device: bytes}``)."""
        steps_peaks: dict[int, int] = {}
        if not self.warmup_peaks:  # no warm-up ended: the peaks are the whole run's
            return steps_peaks
        counters = self.rt.storages.counters
        for i, (warm, c) in enumerate(zip(self.warmup_peaks, counters, strict=True)):
            if warm.peak_allocated > c.peak_allocated:
                steps_peaks[i] = c.peak_allocated
                c.peak_allocated, c.peak_requested = warm.peak_allocated, warm.peak_requested
                c.peak_event, c.peak_phase = warm.peak_event, warm.peak_phase
        return steps_peaks

    def phase(self, name: str) -> None:
        self._evaluating = name.startswith(EVALUATION)
        if self._phase is not None:
            self._phase.close()
        self._phase = contextlib.ExitStack()
        self._phase.enter_context(self.rt.phase(name))

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizers.add(opt)
        self._label(opt)
        self._stepping += 1
        if self._stepping > 1:  # an optimizer stepped inside another's step
            return
        for listener in self.listeners:
            listener.step_started()
        self.phase(f"optimizer (step {self.done + 1})")

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._label(opt)
        self._stepping = max(self._stepping - 1, 0)
        if self._stepping:  # the inner step of an optimizer stepping inside another's
            return
        self.done += 1
        self._backwards_at_ends.append(self.backwards)
        log = self.rt.op_log
        if log is not None and log.on:
            self.step_ends.append(len(log.records))
        if self.on_step is not None:
            self.on_step(self.done)
        if self.done == 1 and self.steps > 1:
            self._start_measuring()  # step 1 was the warm-up: measure from here
            # the batch reported is a measured step's (the model-parallel tutorial's first
            # step trains a toy on 20 rows, the measured ones ResNet-50 on 120); the
            # warm-up's where no other step follows
            self.warmup_rows, self.batch_rows = self.batch_rows, 0
        if self.done >= self.steps:
            # its words are what a framework that logs the exception on its way out shows
            # (ignite: "Engine run is terminating due to exception: ...")
            raise StopScript(f"dpprof stops the script here: {self.done} optimizer steps "
                             "measured (--steps)")
        self.phase(f"forward (step {self.done + 1})")

    def _label(self, opt: torch.optim.Optimizer) -> None:
        rt = self.rt
        params = [p for g in opt.param_groups for p in g["params"]]
        rt.storages.label(params, "parameters")
        rt.storages.label([p.grad for p in params if p.grad is not None], "gradients")
        rt.storages.label([t for st in opt.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor)], "optimizer_state")

    def abandoned(self) -> None:
        """The step under way ran out of memory (and the script went on: a smaller batch):
        its batch, where it is the one noted, is not the one the run trains on (a batch of
        a step that ended is kept). An optimizer step it stopped is no longer under way."""
        if self._rows_at == self.done:
            self.batch_rows = 0
        self._stepping = 0

    def backward_started(self) -> None:
        self.backwards += 1
        if not self.optimizer_made and not self.done:
            if self.backwards > self.steps:
                self.by_backwards = True
                raise StopScript(f"dpprof stops the script here: {self.steps} backward "
                                 "passes measured (--steps)")
            if self.backwards == 2:
                self._start_measuring()  # the first step was the warm-up
        if not self.backward_sites:
            self.backward_sites = caller_sites()
        for listener in self.listeners:
            listener.backward_started()
        self.phase(f"backward (step {self.done + 1})")
        if not self.batch_rows:
            self.batch_rows = self._last_rows  # the batch of the forward this backs
            self._rows_at = self.done  # ... in the step under way

    def _pre_forward(self, module: Any, args: Any) -> None:
        # a module called inside backward (checkpoint's recompute) is no forward of the step;
        # nor is a module without parameters called on its own: the loss (nn.CrossEntropyLoss
        # on an LM's logits flattened to batch x seq rows)
        first = next(module.parameters(), None) if self._depth == 0 else None
        if first is not None and torch._C._current_graph_task_id() == -1:
            if self._evaluates(module, first) != self._evaluating:
                self.phase(f"{EVALUATION if not self._evaluating else 'forward'} "
                           f"(step {self.done + 1})")
            self.forwards += 1
            self._rows_from_kwargs = not self._note_rows(args)
            if not self.forward_sites:
                # the script's model, read at its first call and not kept (a reference
                # would keep its memory counted after the script let it go)
                self.blocks_words = blocks_words(unwrapped(module))
                self.forward_sites = caller_sites()
            for listener in self.listeners:
                listener.forward_started(module)
        self._depth += 1

    def _evaluates(self, module: nn.Module, first: nn.Parameter) -> bool:
        """Whether this outermost call is the script validating: its model, whose parameters
        an optimizer steps, in eval mode with gradients off. A teacher or an EMA copy (not
        stepped) and a GAN's generator called under ``no_grad`` (in train mode) are steps'."""
        return (not module.training and not torch.is_grad_enabled()
                and any(p is first for opt in self.optimizers
                        for group in opt.param_groups for p in group["params"]))

    def _note_rows(self, inputs: Any) -> bool:
        """The rows of the first tensor among ``inputs`` noted as the batch's (of a batch
        given as one mapping, its largest tensor's: Ultralytics' labels sort before its
        images, 24 boxes of 8 images; of a list of objects that are no tensors, as PyTorch
        Geometric's DataParallel takes graphs, their count); whether there was one."""
        tensors = [a for a in tree_leaves(inputs) if isinstance(a, torch.Tensor)]
        if not tensors:
            items = inputs[0] if isinstance(inputs, (tuple, list)) and len(inputs) == 1 else None
            if isinstance(items, (list, tuple)) and items:
                self._last_rows, self.rows_are_items = len(items), True
                return True
            return False
        one_mapping = isinstance(inputs, (tuple, list)) and len(inputs) == 1 and isinstance(
            inputs[0], Mapping)
        first = max(tensors, key=lambda t: t.numel()) if one_mapping else tensors[0]
        if first.dim() > 0:
            self._last_rows, self.rows_are_items = int(first.shape[0]), False
        return True

    def _post_forward(self, module: Any, args: Any, *kwargs_output: Any) -> None:
        # (kwargs, output); (output) where torch calls it after forward raised
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0 and self._rows_from_kwargs and len(kwargs_output) == 2:
            # a model called with keywords only (Hugging Face's model(**batch)): a global
            # pre-hook is never given them, the hook after forward is
            self._rows_from_kwargs = False
            self._note_rows(kwargs_output[0])

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
                         register_module_forward_hook(self._post_forward, with_kwargs=True,
                                                      always_call=True)]
        orig_init = self._orig_optimizer_init = torch.optim.Optimizer.__init__

        def optimizer_init(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            self.optimizer_made = True
            orig_init(opt, *args, **kwargs)

        torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign,assignment]
        self.phase("forward (step 1)")

    def remove(self) -> None:
        if self._orig_optimizer_init is not None:
            torch.optim.Optimizer.__init__ = self._orig_optimizer_init  # type: ignore[method-assign]
            self._orig_optimizer_init = None
        for h in self._handles:
            h.remove()
        if self._phase is not None:
            self._phase.close()
            self._phase = None



def compile_eagerly(patcher: Patcher, sites: list[str],
                    graph_sites: list[str] | None = None) -> None:
    """``torch.compile(model)`` / ``@torch.compile`` / ``module.compile()`` in the script:
    the model or function as given, run eagerly. Dynamo cannot trace the emulation (its
    virtual devices, its patched ``torch.device``) and Inductor's CUDA kernels are not
    played; each call's site goes into ``sites`` so the report can say so. A call of what
    Inductor would compile (the default backend) runs as a compiled region
    (:func:`dpprof.emulator.flex_attention.enter_compiled_region`): the kernels it fuses
    whole, FlexAttention's, take the fused kernel's memory there. The sites whose mode
    captures CUDA graphs go into ``graph_sites`` too (none is captured here)."""
    def compile_(model: Any = None, **kwargs: Any) -> Any:
        if caller_in_torch():  # torch compiling its own helper (flex's eager wrapper)
            return model if model is not None else (lambda fn: fn)
        site = caller_site()
        sites.append(site)
        inductor = kwargs.get("backend", "inductor") == "inductor"
        if inductor and graph_sites is not None and captures_graphs(kwargs):
            graph_sites.append(site)
        if model is None:  # @torch.compile(mode=...): the decorator
            return lambda fn: as_compiled(fn, inductor)
        return as_compiled(model, inductor)

    def module_compile(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        sites.append(caller_site())
        as_compiled(self, kwargs.get("backend", "inductor") == "inductor")

    patcher.patch(torch, "compile", compile_)
    patcher.patch(torch.nn.Module, "compile", module_compile)


def captures_graphs(kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.compile``'s options have Inductor capture CUDA graphs (its
    ``reduce-overhead`` and ``max-autotune`` modes, or ``triton.cudagraphs``)."""
    options = kwargs.get("options") or {}
    return (kwargs.get("mode") in ("reduce-overhead", "max-autotune")
            or bool(isinstance(options, dict) and options.get("triton.cudagraphs")))


def caller_in_torch() -> bool:
    """Whether ``torch.compile``'s caller (two frames up: this, then ``compile_``) is torch's
    own code."""
    frame = sys._getframe(2)
    return frame.f_globals.get("__name__", "").startswith("torch.")


def as_compiled(target: Any, inductor: bool) -> Any:
    """``target`` (a module or a function) whose calls run as a compiled region, where
    Inductor compiles it; as given otherwise (another backend runs its graph op by op)."""
    if not inductor or target is None:
        return target
    if isinstance(target, nn.Module):
        if not getattr(target, "_dpprof_compiled_region", False):
            target.register_forward_pre_hook(lambda *_: enter_compiled_region())
            target.register_forward_hook(lambda *_: leave_compiled_region(), always_call=True)
            target._dpprof_compiled_region = True  # type: ignore[assignment]
        return target
    if not callable(target):
        return target

    @functools.wraps(target)
    def compiled(*args: Any, **kwargs: Any) -> Any:
        with compiled_region():
            return target(*args, **kwargs)

    return compiled


# how far back from a loss module's argument its expression of DataParallel's outputs may
# reach (views, slices, transposes, .float(): a few nodes each)
_EXPRESSION_NODES = 16


def _reaches_gather(tensors: list[torch.Tensor]) -> bool:
    """Whether the graph of ``tensors`` reaches DataParallel's gather within a few nodes
    (the loss is computed on an expression of the gathered outputs)."""
    stack: list[tuple[Any, int]] = [(t.grad_fn, 0) for t in tensors if t.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node, depth = stack.pop()
        if node is None or node in seen or depth > _EXPRESSION_NODES:
            continue
        seen.add(node)
        if isinstance(node, Gather._backward_cls):  # type: ignore[attr-defined]
            return True
        stack.extend((n, depth + 1) for n, _ in node.next_functions)
    return False


def label_losses(vc: VirtualCuda, patcher: Patcher) -> None:
    """A loss (:mod:`dpprof.scenarios.losses`: a loss module, one of torch.nn.functional's,
    a module without parameters given the outputs and the targets) called on (an expression
    of) DataParallel's gathered outputs files its memory under "loss", as compare's steps
    do: what its call allocates, the tensors its arguments' expression made of the outputs
    (``logits.float()``, a copy of a slice), and, in backward, what its autograd nodes and
    the expression's allocate, down to the gather."""
    rt = vc.rt
    inside: list[bool] = []  # a loss module's call under way: its F.* call is the same loss

    def labelled(call: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        if inside or not torch.is_grad_enabled():
            return call(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not _reaches_gather(inputs):
            return call(*args, **kwargs)
        for t in inputs:  # made by the expression: not the outputs or the batch themselves
            if rt.storages.category_of(t) == "activations":
                rt.storages.label(t, "loss")
        inside.append(True)
        try:
            with rt.category("loss"):
                out = call(*args, **kwargs)
        finally:
            inside.pop()
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            _label_loss_backward(rt, out.grad_fn)
        return out

    orig_call = nn.Module.__call__

    def module_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if len(args) + len(kwargs) < 2 or not is_loss(module, len(args) + len(kwargs)):
            return orig_call(module, *args, **kwargs)
        return labelled(functools.partial(orig_call, module), args, kwargs)

    patcher.patch(nn.Module, "__call__", module_call)
    for name in functional_loss_names():
        orig_fn = getattr(F, name)

        @functools.wraps(orig_fn)
        def functional(*args: Any, _orig: Callable[..., Any] = orig_fn, **kwargs: Any) -> Any:
            return labelled(_orig, args, kwargs)

        patcher.patch(F, name, functional)


def _label_loss_backward(rt: Any, root: Any) -> None:
    """Backward from the loss down to (not into) the gather runs under "loss"."""
    seen: set[Any] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen or isinstance(
                node, Gather._backward_cls):  # type: ignore[attr-defined]
            continue
        seen.add(node)
        node.register_prehook(lambda *_: rt.set_category("loss"))
        node.register_hook(lambda *_: rt.set_category("activations"))
        stack.extend(n for n, _ in node.next_functions)


# ---- a rung of the ladder, applied as the script runs (dpprof.script.rungs) ----


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's model inside DataParallel or DDP (their ``.module``), else ``model``."""
    inner = getattr(model, "module", None)
    while isinstance(inner, nn.Module):
        model, inner = inner, getattr(inner, "module", None)
    return model


class RungHooks:
    """One rung applied to the running script, following :class:`Stepper`'s view of its
    step (a :class:`~dpprof.script.hooks.StepListener`); ``by_trainer``: the rung is given
    to Hugging Face's Trainer as its own settings
    (:func:`dpprof.script.trainer_settings.given_to_trainer`), which checkpoints and
    autocasts itself: the hooks only count the layers it checkpoints."""

    def __init__(self, rung: Rung, by_trainer: bool = False) -> None:
        self.rung = rung
        self.by_trainer = by_trainer
        self.blocks = 0  # repeated blocks checkpointed
        self._checkpointed = False
        self._region: EmulatedAutocast | None = None

    def forward_started(self, module: nn.Module) -> None:
        if self.rung.checkpoint and not self._checkpointed:
            self._checkpointed = True
            self.blocks = (checkpointing_layers(unwrapped(module)) if self.by_trainer
                           else checkpoint_blocks(unwrapped(module)))
        if self.by_trainer:
            return
        # a forward without grad (evaluation) has no backward to end a region: the rung's
        # change puts the training step's forward and loss under autocast, not evaluation
        if self.rung.amp is not None and self._region is None and torch.is_grad_enabled():
            self._region = EmulatedAutocast(getattr(torch, self.rung.amp))
            self._region.__enter__()

    def backward_started(self) -> None:
        self.close()  # the region (forward and loss) ends where backward begins

    def step_started(self) -> None:
        self.close()

    def close(self) -> None:
        if self._region is not None:
            region, self._region = self._region, None
            region.__exit__(None, None, None)
