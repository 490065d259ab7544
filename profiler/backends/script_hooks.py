"""What ``dpprof run`` hooks into the running script: optimizer steps counted, phases
marked and the script stopped after enough steps (:class:`Stepper`), and the paired
alternatives' patches (:class:`Variant`: DDP in place of DataParallel, or the loss inside
forward)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from dpprof.emulator import script_parallel
from dpprof.emulator.cuda_devices import CudaDevices
from dpprof.emulator.patcher import Patcher
from dpprof.emulator.script_parallel import DDP_IN_PLACE, LOSS_IN_FORWARD
from dpprof.emulator.virtual_cuda import VirtualCuda

__all__ = ["AS_WRITTEN", "StepCallback", "Stepper", "StopScript", "Variant"]

AS_WRITTEN = "as-written"


class StopScript(BaseException):
    """Raised in the script once it has run enough optimizer steps (a BaseException, so
    the script's own ``except Exception`` does not swallow it)."""


StepCallback = Callable[[int], None]


class Stepper:
    """Counts optimizer steps, marks phases, stops the script after ``steps``."""

    def __init__(self, rt: CudaDevices, steps: int, on_step: StepCallback | None) -> None:
        self.rt = rt
        self.steps = steps
        self.done = 0
        self.on_step = on_step
        self.measure_start = 0
        # weakly: an optimizer the script drops (a finished mp.spawn job's, a stage's) frees
        # its parameters and state as it would on a GPU
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handles: list[Any] = []
        self._phase: contextlib.ExitStack | None = None
        self.batch_rows = 0  # rows of the first measured batch that reached backward
        self.warmup_rows = 0  # rows of the warm-up step's batch
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
        self.optimizers.add(opt)
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
            # the batch reported is a measured step's (the model-parallel tutorial's first
            # step trains a toy on 20 rows, the measured ones ResNet-50 on 120); the
            # warm-up's where no other step follows
            self.warmup_rows, self.batch_rows = self.batch_rows, 0
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



class Variant:
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
