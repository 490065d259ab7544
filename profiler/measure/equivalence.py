"""Does the fix change the math? Each scenario's step against ``single`` on the full batch.

:func:`compare_states` is backend-neutral: it takes, per scenario, the loss, the gradients
and the parameters after one step (a :class:`StepState`), from any backend: the emulator
over CPU tensors (:func:`emulated_states`, here), real gloo DDP on the ``cpu`` backend, or
real GPUs. :func:`check` runs the emulated states and explains the differences with their
size:

* ``uneven-mean``: a plain ``.mean()`` of per-replica losses over uneven shards weights a
  row of a small shard more than a row of a large one; ``ModelWithLoss.combine`` weights
  each replica by its rows (``(loss * rows).sum() / rows.sum()``). DDP's gradient average
  over ranks has the same bias with uneven shards.
* ``batchnorm``: DataParallel replicas and DDP ranks normalise with their shard's
  statistics (DDP: ``nn.SyncBatchNorm.convert_sync_batchnorm``).
* ``dropout``: replicas and ranks draw their own masks (one generator per GPU/process).
* ``sum-reduction``: a loss with ``reduction="sum"`` is a sum over rows; DDP's averaging
  divides its gradient by the world size and ``combine``'s weighting is for means.

Every effect is measured by switching the cause off (dropout) or from the run itself.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpprof.backends.emulated import build_on_device
from dpprof.emulator.data_parallel import EmulatedDataParallel
from dpprof.emulator.device_copies import to_device
from dpprof.emulator.virtual_devices import VirtualDevices
from dpprof.result import Equivalence, EquivalenceEntry, EquivalenceFinding
from dpprof.scenarios.measured_loop import StepHooks, training_loop
from dpprof.scenarios.model_with_loss import ModelWithLoss, call_model
from dpprof.scenarios.names import DDP, DP_LOSS_FORWARD, DP_LOSS_PRIMARY
from dpprof.scenarios.shards import shard_sizes
from dpprof.scenarios.step import build_model, scenario_batch, step_stream
from dpprof.scenarios.workloads import Workload, map_tensors

TOLERANCE = 1e-4  # relative: float32 sums in another order differ by ~1e-6
REFERENCE = "single-full-batch"
DP_SCENARIOS = (DP_LOSS_PRIMARY, DP_LOSS_FORWARD, DDP)


@dataclass
class StepState:
    """One scenario after one training step, as any backend reports it."""

    loss: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # before the step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after the step
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. per-replica losses


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    """Largest |a - b| over every tensor, relative to the largest |b|."""
    keys = [k for k in b if k in a]
    if not keys:
        return None
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)
    scale = max(float(b[k].double().abs().max()) for k in keys)
    return diff / scale if scale > 0 else diff


def _max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    keys = [k for k in b if k in a]
    if not keys:
        return None
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def compare_states(reference: StepState, states: dict[str, StepState],
                   tolerance: float = TOLERANCE) -> list[EquivalenceEntry]:
    """Each scenario against the reference: loss, gradients (relative), parameters."""
    out = []
    for name, st in states.items():
        ld = abs(st.loss - reference.loss)
        gd = _max_rel(st.grads, reference.grads)
        pd = _max_abs(st.params, reference.params)
        rel_loss = ld / max(abs(reference.loss), 1e-12)
        ok = rel_loss <= tolerance and (gd is None or gd <= tolerance)
        out.append(EquivalenceEntry(scenario=name, loss=st.loss, loss_diff=ld,
                                    grad_max_diff=gd, param_max_diff=pd, equivalent=ok))
    return out


# ---- the emulated producer ---------------------------------------------------------------


def _named(model: nn.Module, loss_fn: Any) -> list[tuple[str, nn.Parameter]]:
    named = list(model.named_parameters())
    if isinstance(loss_fn, nn.Module):
        named += [(f"loss.{k}", p) for k, p in loss_fn.named_parameters()]
    return named


def _no_dropout(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        m = factory()
        for mod in m.modules():
            if isinstance(mod, nn.modules.dropout._DropoutNd):
                mod.p = 0.0
        return m
    return build


def _batch(wl: Workload, batch: int, gpus: int, seed: int) -> tuple[Any, Any]:
    """Step 0's batch by the one seed rule: the ``batch`` rows DataParallel takes."""
    return scenario_batch(wl, seed, 0, batch, gpus)


def _step_state(named: list[tuple[str, nn.Parameter]], loss: torch.Tensor,
                grads: dict[str, torch.Tensor], extra: dict[str, Any]) -> StepState:
    return StepState(loss=float(loss), grads=grads,
                     params={k: p.detach().clone() for k, p in named}, extra=extra)


def _run_emulated(wl: Workload, name: str, batch: int, gpus: int, seed: int) -> StepState:
    """One step of ``name`` over CPU tensors on virtual devices (``single``: one device)."""
    n = 1 if name == REFERENCE else gpus
    rt = VirtualDevices(n, base="cpu")
    inputs0, targets0 = _batch(wl, batch, gpus, seed)
    with rt:
        model, loss_fn, opt, _ = build_on_device(rt, wl, torch.device("cpu"), 0, seed)
        named = _named(model, loss_fn)
        loss_inside = name == DP_LOSS_FORWARD
        wrapped: Any = model
        if name in (DP_LOSS_PRIMARY, DP_LOSS_FORWARD):
            inner = ModelWithLoss(model, loss_fn) if loss_inside else model
            wrapped = EmulatedDataParallel(inner, rt, list(range(gpus)))
        grads: dict[str, torch.Tensor] = {}
        extra: dict[str, Any] = {}

        def after_forward(outputs: Any) -> None:
            if loss_inside:
                weighted, rows = outputs
                extra["replica_losses"] = (weighted / rows).detach().tolist()
                extra["replica_rows"] = rows.detach().tolist()

        def after_backward() -> None:
            grads.update({k: p.grad.detach().clone() for k, p in named if p.grad is not None})

        hooks = StepHooks(phase=lambda p: rt.device(0), after_forward=after_forward,
                          after_backward=after_backward)
        model.train()
        with step_stream(seed):  # the dropout stream
            loss = training_loop(wrapped, loss_fn, opt, [(inputs0, targets0)],
                                 lambda x, _: map_tensors(x, lambda t: to_device(rt, t, 0)),
                                 loss_inside, hooks, step=wl.step)
        if loss is None:
            raise ValueError(f"workload {wl.name!r}: its step returned no loss; return it "
                             "from step() for the equivalence checks")
        return _step_state(named, loss, grads, extra)


def _run_ddp(wl: Workload, batch: int, gpus: int, seed: int) -> StepState:
    """DDP's math on the CPU: every rank its shard (``tensor.chunk``) from the same
    weights and the same generator state (one process each), gradients averaged over the
    ranks (the all-reduce), one optimizer step; buffers from rank 0 (broadcast_buffers)."""
    inputs0, targets0 = _batch(wl, batch, gpus, seed)
    model = build_model(wl, seed)
    if wl.dtype != torch.float32:
        model.to(wl.dtype)
    loss_fn = copy.deepcopy(wl.loss) if isinstance(wl.loss, nn.Module) else wl.loss
    named = _named(model, loss_fn)
    opt = wl.optimizer([p for _, p in named])
    rows = shard_sizes(batch, gpus)
    shards_in = _chunks(inputs0, len(rows))
    shards_t = _chunks(targets0, len(rows))
    init = copy.deepcopy((model, loss_fn))
    sums: dict[str, torch.Tensor] = {}
    losses: list[float] = []
    rank0: nn.Module | None = None
    for r in range(len(rows)):
        m, lf = copy.deepcopy(init)
        m.train()
        with step_stream(seed):  # each rank's process seeds the same
            out = call_model(m, shards_in[r])
            loss = lf(out, shards_t[r])
            loss.backward()
        losses.append(float(loss.detach()))
        for k, p in _named(m, lf):
            if p.grad is not None:
                sums[k] = sums[k] + p.grad if k in sums else p.grad.clone()
        if r == 0:
            rank0 = m
    grads = {k: g / len(rows) for k, g in sums.items()}
    for k, p in named:
        if k in grads:
            p.grad = grads[k].clone()
    opt.step()
    if rank0 is not None:  # broadcast_buffers: rank 0's running statistics win
        for b, b0 in zip(model.buffers(), rank0.buffers(), strict=True):
            b.copy_(b0)
    loss_all = sum(losses) / len(losses)  # what an all-reduce(AVG) of the loss reports
    return StepState(loss=loss_all, grads={k: g.clone() for k, g in grads.items()},
                     params={k: p.detach().clone() for k, p in named},
                     extra={"rank_losses": losses, "rank_rows": rows})


def _chunks(x: Any, n: int) -> list[Any]:
    if isinstance(x, torch.Tensor):
        return list(x.chunk(n))
    if isinstance(x, tuple):
        parts = [_chunks(v, n) for v in x]
        return [tuple(p[i] for p in parts) for i in range(n)]
    if isinstance(x, list):
        parts = [_chunks(v, n) for v in x]
        return [[p[i] for p in parts] for i in range(n)]
    if isinstance(x, dict):
        parts_d = {k: _chunks(v, n) for k, v in x.items()}
        return [{k: v[i] for k, v in parts_d.items()} for i in range(n)]
    return [x] * n


def emulated_states(wl: Workload, batch: int, gpus: int, seed: int = 0,
                    scenarios: tuple[str, ...] = DP_SCENARIOS) -> dict[str, StepState]:
    """The reference (``single`` on the full batch) and each scenario, over CPU tensors."""
    states = {REFERENCE: _run_emulated(wl, REFERENCE, batch, gpus, seed)}
    for name in scenarios:
        if name == DDP:
            states[name] = _run_ddp(wl, batch, gpus, seed)
        elif name in (DP_LOSS_PRIMARY, DP_LOSS_FORWARD):
            states[name] = _run_emulated(wl, name, batch, gpus, seed)
    return states


# ---- explanations ------------------------------------------------------------------------


def _has(model: nn.Module, kind: type) -> bool:
    return any(isinstance(m, kind) for m in model.modules())


def _worst(entries: Sequence[EquivalenceEntry]) -> float:
    vals = [e.grad_max_diff or 0.0 for e in entries]
    vals += [(e.loss_diff or 0.0) for e in entries]
    return max(vals, default=0.0)


def is_sum_reduction(wl: Workload, batch: int, gpus: int, seed: int) -> bool:
    """The loss over the full batch equals the sum of the losses over the shards."""
    rows = shard_sizes(batch, gpus)
    if len(rows) < 2:
        return False
    inputs, targets = _batch(wl, batch, gpus, seed)
    model = build_model(wl, seed).eval()
    with torch.no_grad():
        out = call_model(model, inputs)
        full = float(wl.loss(out, targets))
        parts = [float(wl.loss(o, t)) for o, t in zip(
            _chunks(out, len(rows)), _chunks(targets, len(rows)), strict=True)]
    total = sum(parts)
    return math.isclose(full, total, rel_tol=1e-4) and not math.isclose(
        full, total / len(rows), rel_tol=1e-4)


def check(wl: Workload, batch: int, gpus: int, seed: int = 0,
          scenarios: tuple[str, ...] = DP_SCENARIOS, tolerance: float = TOLERANCE,
          backend: str = "emulated") -> Equivalence:
    """Compare every scenario with single on the full batch and explain the differences."""
    scenarios = tuple(s for s in scenarios if s in DP_SCENARIOS)
    states = emulated_states(wl, batch, gpus, seed, scenarios)
    ref = states.pop(REFERENCE)
    entries = compare_states(ref, states, tolerance)
    findings: list[EquivalenceFinding] = []
    probe_model = build_model(wl, seed)
    rows = shard_sizes(batch, gpus)
    # 1. a plain mean of per-replica losses over uneven shards
    fwd = states.get(DP_LOSS_FORWARD)
    if fwd is not None and len(set(rows)) > 1 and fwd.extra.get("replica_losses"):
        losses = fwd.extra["replica_losses"]
        rws = fwd.extra["replica_rows"]
        plain = sum(losses) / len(losses)
        weighted = sum(lo * r for lo, r in zip(losses, rws, strict=True)) / sum(rws)
        findings.append(EquivalenceFinding(
            kind="uneven-mean", scenario=DP_LOSS_FORWARD, effect=abs(plain - weighted),
            message=(
                f"shards {rows} are uneven: a plain .mean() of the per-replica losses gives "
                f"{plain:.6g}, off by {abs(plain - weighted):.3g} from the batch's loss "
                f"{weighted:.6g}, which ModelWithLoss.combine computes by weighting each "
                "replica by its rows: (loss * rows).sum() / rows.sum(). DDP's gradient "
                "average over ranks has the same bias with uneven shards"
            )))
    # 2. dropout: measured by switching it off
    base_entries = entries
    no_drop_entries = base_entries
    if _has(probe_model, nn.modules.dropout._DropoutNd):
        wl_nd = _with_model(wl, _no_dropout(wl.model))
        st = emulated_states(wl_nd, batch, gpus, seed, scenarios)
        ref_nd = st.pop(REFERENCE)
        no_drop_entries = compare_states(ref_nd, st, tolerance)
        effect = max(0.0, _worst(base_entries) - _worst(no_drop_entries))
        findings.append(EquivalenceFinding(
            kind="dropout", effect=effect,
            message=(
                "the model has dropout: each replica (each GPU's generator) and each DDP rank "
                "draws its own masks, so no scenario reproduces a single GPU's masks; "
                f"switching dropout off changes the largest relative difference by {effect:.3g}"
                " (a different sample of the same noise, not a bias)"
            )))
    # 3. BatchNorm per shard: what remains without dropout
    if _has(probe_model, nn.modules.batchnorm._BatchNorm) and len(rows) > 1:
        effect = _worst(no_drop_entries)
        findings.append(EquivalenceFinding(
            kind="batchnorm", effect=effect,
            message=(
                "the model has BatchNorm: DataParallel replicas and DDP ranks normalise with "
                f"their shard's statistics ({rows} rows), not the batch's (largest relative "
                f"difference without dropout: {effect:.3g}); under DDP use "
                "model = nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping; "
                "DataParallel keeps only cuda:0's shard's running statistics"
            )))
    # 4. reduction="sum"
    if is_sum_reduction(wl, batch, gpus, seed):
        ddp = next((e for e in entries if e.scenario == DDP), None)
        effect = ddp.grad_max_diff if ddp and ddp.grad_max_diff is not None else 0.0
        findings.append(EquivalenceFinding(
            kind="sum-reduction", scenario=DDP if ddp else "", effect=effect,
            message=(
                "the loss uses reduction=\"sum\" (the full-batch loss is the sum of the shard "
                f"losses): DDP averages gradients over {len(rows)} ranks, so its step is "
                f"1/{len(rows)} of a single GPU's (relative gradient difference {effect:.3g}); "
                "scale the loss by the world size or use reduction=\"mean\"; for a sum, "
                "combine per-replica losses with (weighted / rows).sum(), not "
                "ModelWithLoss.combine"
            )))
    return Equivalence(backend=backend, batch=batch, tolerance=tolerance,
                       reference_loss=ref.loss, entries=tuple(entries), findings=tuple(findings),
                       largest_diff=_worst(entries))


def _with_model(wl: Workload, factory: Callable[[], nn.Module]) -> Workload:
    new = copy.copy(wl)
    new.model = factory
    return new
