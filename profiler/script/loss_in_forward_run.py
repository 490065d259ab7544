"""The loss inside forward, as ``dpprof run`` measures it (the ``loss-in-forward`` fix's
strategy, :mod:`dpprof.fixes.kinds.loss_in_forward`): the script run once more with
DataParallel's outputs deferred (:class:`dpprof.script.deferred_outputs.DeferredOutputs`)
until a loss (:mod:`dpprof.scenarios.losses`) is called on them, which then runs inside
forward on every replica (``ModelWithLoss``: cuda:0 gathers one number per GPU instead of the
outputs); a script that uses the outputs besides the loss is run once more with the outputs
kept, as the fix's code keeps them. Its change is the diff of
:mod:`dpprof.script.loss_in_forward_diff`."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dpprof.emulator.call_sites import caller_site, relative_site
from dpprof.fixes.kinds.loss_in_forward import FIX
from dpprof.scenarios.losses import LOSS_FORMS, is_loss
from dpprof.scenarios.names import DP_LOSS_FORWARD
from dpprof.script.deferred_outputs import (
    DeferredOutputs,
    loss_in_forward_loss_call,
    pending_in,
)
from dpprof.script.loss_in_forward_diff import loss_in_forward_at
from dpprof.script.notes import alternative_fix, alternative_notes, raised_on_a_share
from dpprof.script.parallel_state import state_of
from dpprof.script.part_of_model import whole_model
from dpprof.script.rewrite import Rewrite, rewrite_text
from dpprof.script.runner import run_script
from dpprof.script.strategy import (
    Alternative,
    AlternativeRuns,
    AlternativeState,
    scattered_as_in,
)
from dpprof.units import fmt_bytes

if TYPE_CHECKING:
    from dpprof.emulator.patcher import Patcher
    from dpprof.emulator.virtual_cuda import VirtualCuda
    from dpprof.script.runner import ScriptConfig, ScriptRun
    from dpprof.script.wrappers import VirtualDataParallel

__all__ = ["STRATEGY", "LossInForward", "LossInForwardState", "diff_loss_in_forward",
           "loss_in_forward_state"]

_INSIDE = "the same script with its loss computed inside forward on every replica"
SENTENCE = (f"{_INSIDE} (dpprof.ModelWithLoss: the replicas return their losses, cuda:0 gets "
            "{n} numbers instead of the gathered outputs)")
# where the loss is kept per element (reduction="none"), for the loop to reduce as it does
PER_ELEMENT = (f"{_INSIDE} (dpprof.ModelWithLoss: the replicas return their losses, kept per "
               "element as the script computes them (reduction=\"none\"): cuda:0 gathers "
               "those, not the outputs, and reduces them as written)")
# the alternative of a script that also uses the outputs (accuracy)
KEPT_OUTPUTS = (f"{_INSIDE}, the outputs kept (dpprof.ModelWithLoss(..., keep_outputs=True): "
                "the replicas return their losses and their outputs, gathered on cuda:0 as "
                "before)")
DETAIL = ("the same script with DataParallel(ModelWithLoss(model, loss)): cuda:0 gathers "
          "one number per GPU instead of the outputs.")


@dataclass
class LossInForwardState(AlternativeState):
    """What one run of the loss-inside-forward alternative follows (its record,
    :func:`loss_in_forward_state`): the deferred outputs' log
    (:mod:`dpprof.script.deferred_outputs`), read once the run ended."""

    loss_calls: int = 0  # losses on DataParallel's outputs computed inside forward
    materialized: list[str] = field(default_factory=list)  # outputs used otherwise: file:line
    call_sites: list[str] = field(default_factory=list)  # of the DataParallel model's call
    loss_sites: list[str] = field(default_factory=list)  # of the loss on its outputs
    # loss site -> (callee, targets' batch tensor) of a loss on an expression of the outputs
    loss_expressions: dict[str, tuple[str, str]] = field(default_factory=dict)
    no_loss_forward: str = ""  # why the loss could not move inside forward ("" where it did)
    most_losses: int = 0  # the most losses computed inside forward on one forward's outputs
    whole_rows: str = ""  # a loss that reads the whole batch's rows, in words ("": none)
    per_element_losses: int = 0  # of those losses, kept per element (reduction="none")

    @property
    def losses_inside_forward(self) -> bool:
        return self.loss_calls > 0


def loss_in_forward_state(run: ScriptRun) -> LossInForwardState | None:
    """What ``run`` followed where it ran as the loss-inside-forward alternative, else None."""
    state = run.alternative_state
    return state if isinstance(state, LossInForwardState) else None


def diff_loss_in_forward(run: ScriptRun) -> str:
    """The loss-inside-forward change as a diff of the script's own lines (the lines dpprof
    saw in ``run``, the alternative's: the DataParallel wrap, the model's call and the loss
    on its outputs)."""
    state = loss_in_forward_state(run)
    if not (run.dp_sites and state is not None and state.call_sites and state.loss_sites):
        return ""
    if state.most_losses > 1:  # the diff moves one loss call
        return rewrite_text(Rewrite(reason=(
            f"{relative_site(state.loss_sites[0])}: {state.most_losses} losses on the same "
            "outputs, which the alternative computed inside forward together: give "
            "ModelWithLoss one function of the outputs and the targets that computes them "
            "all, by hand")))
    callee, targets = state.loss_expressions.get(state.loss_sites[0], ("", ""))
    return rewrite_text(loss_in_forward_at(run.dp_sites[0], state.call_sites[0],
                                           state.loss_sites[0], callee, targets))


def _kept_outputs_detail(sites: list[str], further_bytes: int) -> str:
    lines = ", ".join(site.rpartition(":")[2] for site in sites)
    further = (f"; computing that inside forward as well would save {fmt_bytes(further_bytes)} "
               "more on cuda:0" if further_bytes > 0 else "")
    return ("the same script with DataParallel(ModelWithLoss(model, loss, keep_outputs=True)): "
            f"the loss and its temporaries on each replica; the outputs, which line {lines} "
            f"uses, still gathered on cuda:0{further}.")


class LossInForward(Alternative):
    """The loss-inside-forward alternative (see the module)."""

    def new_state(self, cfg: ScriptConfig) -> LossInForwardState:
        return LossInForwardState()

    def install(self, state: AlternativeState, vc: VirtualCuda, patcher: Patcher) -> None:
        assert isinstance(state, LossInForwardState)  # this alternative's own (new_state)
        orig_call = nn.Module.__call__

        def module_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # a loss (dpprof.scenarios.losses) on the outputs, or on an expression of them
            # (``out.view(-1, V)``) computed inside forward when the statement first read them
            n = len(args) + len(kwargs)
            if n < 2 or not is_loss(module, n):
                return orig_call(module, *args, **kwargs)
            pending = pending_in(args, kwargs)
            out = (pending.answer() if pending is not None
                   else loss_in_forward_loss_call(module, args, kwargs))
            return orig_call(module, *args, **kwargs) if out is None else out

        patcher.patch(nn.Module, "__call__", module_call)
        orig_backward = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            _release_held(vc)
            return orig_backward(*args, **kwargs)

        patcher.patch(torch.autograd, "backward", backward)

    def dp_forward(self, dp: VirtualDataParallel, inputs: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        if dp.own_split:  # its own split of the batch, which ModelWithLoss's would not be
            log = state_of(dp._vc).log
            log.no_loss_forward = log.no_loss_forward or (
                f"the script's DataParallel subclass {dp.own_split}, which the alternative "
                "does not rewrite; compute the loss in the wrapped module's forward by hand")
            return dp.as_written(inputs, kwargs)
        parts = state_of(dp._vc).parts
        if id(dp) not in parts:  # asked once a wrapper: it walks the calling frames
            parts[id(dp)] = whole_model(dp)
        whole = parts[id(dp)]
        if whole is not None:
            log = state_of(dp._vc).log
            log.no_loss_forward = log.no_loss_forward or (
                f"DataParallel wraps a part of the model ({whole.words}), whose outputs the "
                "model's own forward uses: no loss is computed on them to move inside it "
                "(the rest of the model runs on cuda:0, on the gathered outputs; DDP wraps "
                "the whole model)")
            return dp.as_written(inputs, kwargs)
        # ModelWithLoss takes the model's inputs as one argument: a tuple of positional ones,
        # or a dict of keywords (model(**batch))
        one_kind = not (inputs and kwargs)
        if one_kind and len(dp.device_ids) > 1 and torch.is_grad_enabled():
            _release_held(dp._vc, forward=True)  # the last one's losses are all computed
            deferred = DeferredOutputs(dp, inputs, caller_site(), kwargs)
            last = state_of(dp._vc).log.last_outputs
            deferred.after(last.get(id(dp)))
            last[id(dp)] = weakref.ref(deferred)
            return deferred
        if not one_kind and torch.is_grad_enabled():
            log = state_of(dp._vc).log
            log.no_loss_forward = log.no_loss_forward or (
                f"the model is called with positional and keyword arguments "
                f"({', '.join(sorted(kwargs))}) at {relative_site(caller_site())}, and "
                "ModelWithLoss passes the model one kind: compute the loss in the model's "
                "forward by hand (as a Hugging Face model does when given labels=)")
        return dp.run(dp.module, inputs, kwargs)

    def after_run(self, state: AlternativeState, vc: VirtualCuda,
                  ddp_devices: list[int]) -> None:
        assert isinstance(state, LossInForwardState)  # this alternative's own (new_state)
        log = state_of(vc).log
        state.materialized = list(log.materialized)
        state.call_sites = list(log.call_sites)
        state.loss_sites = list(log.loss_sites)
        state.loss_expressions = dict(log.loss_expressions)
        state.no_loss_forward = log.no_loss_forward
        state.most_losses = log.most_losses_on_outputs
        state.whole_rows = log.whole_rows
        state.loss_calls = log.loss_in_forward
        state.per_element_losses = log.per_element_losses

    def measure(self, runs: AlternativeRuns) -> None:
        cfg, main, n = runs.cfg, runs.main, runs.gpus
        if main.scenario.name == DP_LOSS_FORWARD:
            return  # the replicas compute their loss already: the script is this fix
        alt = run_script(scattered_as_in(cfg, main, alternative=self), runs.step_cb(self.name))
        followed = _followed(alt)
        used = sorted({relative_site(site) for site in followed.materialized})
        unkept: ScriptRun | None = None  # the loss inside forward, the outputs not gathered
        if used and followed.loss_calls:
            # the outputs are used besides the loss: the fix keeps them beside it
            # (ModelWithLoss(keep_outputs=True)), and so does the run it is measured by
            unkept = alt
            alt = run_script(dataclasses.replace(cfg, alternative=self, keep_outputs=True),
                             runs.step_cb(self.name))
            followed = _followed(alt)
        if not followed.loss_calls:
            failed = alt.scenario.status != "ok" and not followed.no_loss_forward
            share = raised_on_a_share(alt, main, n, "replica") if failed else None
            if failed and followed.whole_rows:  # failed at the loss it moved
                runs.notes.append("no loss-inside-forward alternative: with the loss inside "
                                  f"forward {alt.scenario.message} ({followed.whole_rows})")
                return
            runs.notes.append("no loss-inside-forward alternative: " + (
                followed.no_loss_forward or (
                    f"its run, DataParallel's outputs deferred until a loss, stopped before "
                    f"one: {alt.scenario.message} ("
                    + (share or "dpprof's own limit: please report it") + ")"
                    if failed else "the script computes no loss on DataParallel's outputs "
                    f"({LOSS_FORMS})")))
            return
        sentence = (KEPT_OUTPUTS if unkept is not None
                    else PER_ELEMENT if followed.per_element_losses else SENTENCE)
        alt_notes = [sentence.format(n=n),
                     *alt.scenario.notes, *alternative_notes(alt)]
        detail = DETAIL
        if unkept is not None:
            further = 0  # what not gathering the outputs would save besides
            if unkept.scenario.devices and alt.scenario.devices:
                further = (alt.scenario.devices[0].peak_allocated_bytes
                           - unkept.scenario.devices[0].peak_allocated_bytes)
                alt_notes.append(
                    "the script also uses the outputs besides the loss (" + ", ".join(used)
                    + "), so this alternative keeps them, as its code does; computing that "
                    "inside forward as well would leave them off cuda:0: " + (
                        f"{fmt_bytes(further)} less there at its peak" if further > 0 else
                        "no less there at its peak"))
            detail = _kept_outputs_detail(used, further)
        alt.scenario = dataclasses.replace(alt.scenario, notes=tuple(alt_notes))
        runs.runs.append((self.name, alt))
        fix = alternative_fix(self.kind, main, alt, detail, diff_loss_in_forward(alt))
        if fix is not None:
            runs.fixes.append(fix)


def _release_held(vc: VirtualCuda, forward: bool = False) -> None:
    """The replicas' outputs held for another loss on them are let go: the backward begins,
    or the next ``forward`` (a loop with no backward: an evaluation under grad), where those
    held for their first loss (their shape read, ``o1.size(0)`` before ``o2 = model(x2)``,
    no loss and not gathered yet) wait on for it, as the fixed code computes it."""
    log = state_of(vc).log
    held, log.holding_replica_outputs = log.holding_replica_outputs, []
    for outputs in held:
        if forward and not outputs.losses and outputs.value is None:
            log.holding_replica_outputs.append(outputs)  # waits for its first loss
        else:
            outputs.release()


def _followed(run: ScriptRun) -> LossInForwardState:
    """The record of ``run``, a run of this alternative."""
    state = loss_in_forward_state(run)
    assert state is not None  # run with this alternative
    return state


STRATEGY = LossInForward(FIX)
