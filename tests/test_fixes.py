"""What each fix buys: measured in the scenarios' own loops (or emulated alone), and the balanced
split."""

import dataclasses

import pytest
import torch
from fix_helpers import count_emulations, micro_batches

from dpprof.backends.emulated import Alongside, EmulationConfig, run_scenario
from dpprof.fixes.kinds.balanced_split import BalancedSplits, balanced_split, secant_split
from dpprof.measure.fix_savings import alongside as fixes_alongside
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.scenarios.shards import shard_sizes
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import (
    LMConfig,
    Workload,
    classifier,
    convnet,
    lm,
)

SMALL_LM = LMConfig(vocab=8000, seq=64, d_model=128, layers=1)


def balance_chunks(*measured: float) -> list[int] | None:
    split = secant_split(*measured)
    return None if split is None else split.chunks


def test_a_secant_solves_affine_peaks() -> None:
    # cuda:0: 1000 + 10 r0 + 500 (a loss that does not depend on r0); others: 1000 + 10 r
    def p0(r: int) -> int:
        return 1500 + 10 * r

    def pk(r: float) -> int:
        return int(1000 + 10 * r)

    chunks = balance_chunks(40, 4, 10, p0(10), 5, p0(5), 10, pk(10), 35 / 3, pk(35 / 3))
    assert chunks is not None and sum(chunks) == 40 and len(chunks) == 4
    # exact solution: 1500 + 10 r0 = 1000 + 10 (40 - r0) / 3  ->  r0 = -3.5 -> clipped to 1
    assert chunks[0] == 1
    chunks = balance_chunks(400, 4, 100, 2000 + 10 * 100, 50, 2000 + 10 * 50,
                            100, 1000 + 10 * 100, 350 / 3, int(1000 + 10 * 350 / 3))
    # 2000 + 10 r0 = 1000 + 10 (400 - r0) / 3  ->  r0 = 25
    assert chunks == [25, 125, 125, 125]


def test_no_slope_gives_no_split() -> None:
    assert balance_chunks(40, 4, 10, 100, 10, 100, 10, 100, 11, 100) is None
    assert balance_chunks(40, 1, 10, 100, 5, 50, 10, 100, 11, 110) is None


def test_each_fix_is_measured_on_the_workload() -> None:
    wl = lm(SMALL_LM)
    run = run_compare(CompareConfig(step=StepConfig(batch=32)), workload=wl)
    fixes = {f.name: f for f in run.fixes}
    assert set(fixes) == {"loss-in-forward", "ddp", "gradient-as-bucket-view",
                          "output-device", "balanced-split"}
    base0 = run.scenario("dp-loss-primary").devices[0].peak_allocated_bytes
    for f in fixes.values():
        assert f.saves_bytes == base0 - f.primary_peak_bytes
        assert f.code.strip()
    assert fixes["loss-in-forward"].saves_bytes == run.comparison.savings_bytes["dp-loss-forward"]
    assert fixes["ddp"].saves_bytes == run.comparison.savings_bytes["ddp"]
    # the gathered logits and the loss leave cuda:0 for cuda:3 ...
    out = fixes["output-device"]
    assert out.saves_bytes > 0 and out.max_peak_bytes > out.primary_peak_bytes
    assert "output_device=3" in out.code
    # ... and gradient_as_bucket_view never costs more than plain DDP
    assert fixes["gradient-as-bucket-view"].primary_peak_bytes <= fixes["ddp"].primary_peak_bytes
    assert "gradient_as_bucket_view=True" in fixes["gradient-as-bucket-view"].code
    assert "ModelWithLoss.combine" in fixes["loss-in-forward"].code


def test_balanced_split_lowers_the_heaviest_device() -> None:
    wl = lm(SMALL_LM)
    run = run_compare(CompareConfig(scenarios=("dp-loss-primary",), step=StepConfig(batch=32)), workload=wl)
    bal = next(f for f in run.fixes if f.name == "balanced-split")
    assert sum(bal.chunk_sizes) == 32 and len(bal.chunk_sizes) == 4
    assert bal.chunk_sizes[0] < 8  # cuda:0 takes less than its even share
    even_max = max(d.peak_allocated_bytes for d in run.scenario("dp-loss-primary").devices)
    assert bal.max_peak_bytes < even_max
    # the reported figures are those of an emulation with these chunk sizes
    check = run_scenario("dp-loss-primary", wl, EmulationConfig(
        gpus=4, gpu_memory_bytes=80 << 30,
        dp_chunk_sizes=tuple(bal.chunk_sizes),
        step=StepConfig(batch=32),
    ))
    assert [d.batch_rows for d in check.devices] == list(bal.chunk_sizes)
    assert max(d.peak_allocated_bytes for d in check.devices) == bal.max_peak_bytes
    assert "BalancedDataParallel" in bal.code


def _snippet_scatter(monkeypatch, shares, batch):
    """The BalancedDataParallel code handed to users, its Scatter.apply recording the
    sizes (the one part that needs GPUs) and returning CPU splits."""
    from torch import nn
    from torch.nn.parallel import _functions

    from dpprof.fixes.kinds.balanced_split import CODE_BALANCED

    code = "\n".join(line[1:] for line in CODE_BALANCED.format(shares=shares,
                                                                batch=batch).splitlines()
                     if line.startswith("+"))
    calls = []

    def fake_apply(devices, sizes, dim, x):
        calls.append(list(sizes))
        return tuple(x.split(sizes, dim))

    monkeypatch.setattr(_functions.Scatter, "apply", staticmethod(fake_apply))
    scope = {"nn": nn, "torch": torch}
    exec(code.split("model = BalancedDataParallel")[0], scope)
    assert f"shares={shares}" in code
    dp = scope["BalancedDataParallel"](nn.Linear(2, 2), shares=shares)
    dp.dim = 0  # DataParallel.__init__ stops before setting it when no GPU is visible
    return dp, calls


def test_balanced_snippet_is_valid_python_and_splits_by_shares(monkeypatch) -> None:
    dp, calls = _snippet_scatter(monkeypatch, [4, 12, 12, 12], 40)
    inputs, kwargs = dp.scatter((torch.zeros(40, 2), torch.ones(40)), {}, [0, 1, 2, 3])
    assert calls[0] == [4, 12, 12, 12]
    assert [tuple(t.shape[0] for t in args) for args in inputs] == [(4, 4), (12, 12), (12, 12), (12, 12)]
    assert len(kwargs) == 4


@pytest.mark.parametrize("rows", [512, 256, 100, 7])
def test_the_emulator_splits_as_the_snippet_does(monkeypatch, rows) -> None:
    """At the batch, exactly the measured rows (no rounding of shares); a micro-batch in
    proportion, as the emulated BalancedDataParallel splits it."""
    from dpprof.emulator.data_parallel import balanced_sizes

    chunks = [1, 73, 73, 73, 73, 73, 73, 73]
    dp, calls = _snippet_scatter(monkeypatch, chunks, 512)
    dp.scatter((torch.zeros(rows, 2),), {}, list(range(8)))
    assert calls[0] == balanced_sizes(chunks, rows)
    if rows == 512:
        assert calls[0] == chunks


# ---- the balanced split's search, in dp-loss-primary's own loop ----------------------------

def _peaks_by_device(s):
    return [(d.index, d.used, d.batch_rows, d.peak_allocated_bytes, d.peak_requested_bytes,
             d.peak_phase, d.breakdown_bytes) for d in s.devices]


class _Recorded(BalancedSplits):
    """The search, keeping every figure it was fed."""

    def __init__(self, batch, gpus):
        super().__init__(batch, gpus)
        self.fed = []

    def __call__(self, last):
        self.fed.append(last)
        return super().__call__(last)


def _clipped(model, batch, criterion, optimizer):
    """A user's step: the outputs deleted before backward, gradients clipped."""
    inputs, targets = batch
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = criterion(outputs, targets)
    del outputs
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


@pytest.mark.parametrize("workload, batch, gpus, steps, options", [
    (lambda: lm(SMALL_LM), 32, 4, 1, {}),  # cuda:0 down to one row
    # eight GPUs, mirrored replicas: with cuDNN's workspace per convolution the first split
    # is where the secant through it points again (29 rows on cuda:0)
    (classifier, 512, 8, 1, {}),
    (convnet, 80, 4, 2, {}),  # a secant step after the first split (11, then 8 rows)
    (convnet, 100, 3, 1, {}),  # uneven shards
    (lambda: lm(SMALL_LM), 32, 4, 1, {"amp": "bfloat16"}),  # autocast: no mirrors
    (lambda: lm(SMALL_LM), 32, 4, 1, {"dtype": "bfloat16"}),
    (lambda: dataclasses.replace(lm(SMALL_LM), step=_clipped), 64, 4, 1, {}),
    (lambda: dataclasses.replace(lm(SMALL_LM), step=micro_batches), 64, 4, 1, {}),
])
def test_each_further_split_is_that_splits_own_measured_step(workload, batch, gpus, steps,
                                                              options) -> None:
    """The steps after the measured one, with other chunk sizes, give what emulating each
    split on its own gives, byte for byte, and leave the scenario's own figures as they
    are without them."""
    wl = workload()
    base = EmulationConfig(gpus=gpus, gpu_memory_bytes=80 << 30,
                           step=StepConfig(batch=batch, **options))
    plan = _Recorded(batch, gpus)
    chained = run_scenario("dp-loss-primary", wl, base, alongside=Alongside(splits=plan))
    assert chained == run_scenario("dp-loss-primary", wl, base)
    assert plan.finished and plan.result is not None
    splits = plan.fed[1:]
    # the measured step the plan was fed is the scenario's own (its notes are added
    # after the plan has read its figures)
    assert len(splits) == steps
    assert dataclasses.replace(plan.fed[0], notes=()) == dataclasses.replace(chained, notes=())
    for s in splits:
        chunks = tuple(d.batch_rows for d in s.devices)
        assert chunks != tuple(shard_sizes(batch, gpus))
        alone = run_scenario("dp-loss-primary", wl, dataclasses.replace(
            base, dp_chunk_sizes=chunks, peaks_only=True))
        assert _peaks_by_device(s) == _peaks_by_device(alone)
    chunks, best = plan.result
    assert best in splits and [d.batch_rows for d in best.devices] == chunks


def test_the_search_in_the_loop_finds_what_emulating_each_split_finds() -> None:
    wl = classifier()
    base = EmulationConfig(gpus=8, gpu_memory_bytes=80 << 30, step=StepConfig(batch=512),
                           peaks_only=True)
    plan = BalancedSplits(512, 8)
    primary = run_scenario("dp-loss-primary", wl, base, alongside=Alongside(splits=plan))
    alone = balanced_split(primary, 512, 8, base, lambda name, cfg: run_scenario(name, wl, cfg))
    assert plan.result is not None and alone is not None
    assert plan.result[0] == alone[0]
    assert _peaks_by_device(plan.result[1]) == _peaks_by_device(alone[1])


def test_compare_measures_the_balanced_split_in_the_scenarios_loop(monkeypatch) -> None:
    """No split is emulated on its own when dp-loss-primary's loop measured them."""
    emulated = count_emulations(monkeypatch)
    run = run_compare(CompareConfig(step=StepConfig(batch=32)), workload=lm(SMALL_LM))
    bal = next(f for f in run.fixes if f.name == "balanced-split")
    assert bal.chunk_sizes[0] < 8
    assert not emulated  # nothing emulated on its own: every variant measured in a loop


class _BatchNormNet(torch.nn.Module):
    """Fails on a one-row shard in training mode (BatchNorm needs two values)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 256)
        self.bn = torch.nn.BatchNorm1d(256)
        self.out = torch.nn.Linear(256, 5000)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


def _bn_workload() -> Workload:
    return Workload(name="bn", description="", model=_BatchNormNet,
                    batch=lambda rows, device: (torch.randn(rows, 64, device=device),
                                                torch.randint(0, 5000, (rows,), device=device)),
                    loss=torch.nn.functional.cross_entropy)


class _OneRowFirst:
    max_steps = 2

    def __init__(self) -> None:
        self.fed = []

    def __call__(self, last):
        self.fed.append(last)
        return (1, 11, 10, 10)


def test_a_failing_split_leaves_the_scenario_and_stops_the_search() -> None:
    wl = _bn_workload()
    base = EmulationConfig(gpus=4, gpu_memory_bytes=80 << 30, step=StepConfig(batch=32))
    plan = _OneRowFirst()
    chained = run_scenario("dp-loss-primary", wl, base, alongside=Alongside(splits=plan))
    assert chained.status == "ok"
    assert chained == run_scenario("dp-loss-primary", wl, base)
    assert len(plan.fed) == 1  # the failed split fed nothing back: the caller emulates it
    alone = run_scenario("dp-loss-primary", wl, dataclasses.replace(
        base, dp_chunk_sizes=(1, 11, 10, 10)))
    assert alone.status == "error" and "channel" in alone.message


def test_no_further_splits_over_cpu_tensors() -> None:
    """Over CPU tensors each step's data differ: the search is left to its own
    emulations."""
    wl = lm(SMALL_LM)
    plan = BalancedSplits(32, 4)
    run_scenario("dp-loss-primary", wl, EmulationConfig(
        gpus=4, gpu_memory_bytes=80 << 30, step=StepConfig(batch=32), compute=True),
        alongside=Alongside(splits=plan))
    assert not plan.finished and plan.result is None


def test_a_failed_one_row_split_is_measured_with_two_rows() -> None:
    """BatchNorm cannot train on one row: the search that put one row on cuda:0 measures
    two instead, and still answers."""
    run = run_compare(CompareConfig(scenarios=("dp-loss-primary",), step=StepConfig(batch=64)),
                      workload=_bn_workload())
    bal = next(f for f in run.fixes if f.name == "balanced-split")
    assert bal.chunk_sizes == (2, 21, 21, 20)
    plan = BalancedSplits(64, 4)
    assert plan(run.scenario("dp-loss-primary"))[0] == 1  # what it tried first


# ---- DataParallel(output_device=k), one more step of the same loop -------------------------

def _keeps_losses():
    """A user's step that keeps every step's loss (a running history)."""
    history = []

    def step(model, batch, criterion, optimizer):
        inputs, targets = batch
        optimizer.zero_grad()
        loss = criterion(model(inputs), targets)
        loss.backward()
        optimizer.step()
        history.append(loss.detach())
        return loss

    return step


def _leaves_a_tensor(model, batch, criterion, optimizer):
    """A user's step that leaves a tensor of its own on cuda:0 (made after the step)."""
    loss = _clipped(model, batch, criterion, optimizer)
    model.scratch = torch.zeros(1024, device="cuda")
    return loss


def _exact(s, alone) -> bool:
    return _peaks_by_device(s) == _peaks_by_device(alone)


@pytest.mark.parametrize("workload, batch, gpus, options", [
    (lambda: lm(SMALL_LM), 32, 4, {}),
    (lambda: lm(SMALL_LM), 13, 4, {}),  # uneven shards
    (lambda: lm(SMALL_LM), 3, 4, {}),  # fewer rows than GPUs: cuda:2 is the output device
    (convnet, 100, 3, {}),
    (lambda: lm(SMALL_LM), 32, 4, {"amp": "bfloat16"}),
    (lambda: lm(SMALL_LM), 32, 4, {"dtype": "bfloat16"}),
    (lambda: lm(SMALL_LM), 32, 4, {"warmup": 3}),
    (lambda: dataclasses.replace(lm(SMALL_LM), step=_clipped), 32, 4, {}),
])
def test_the_output_device_step_is_that_options_own_measured_step(workload, batch, gpus,
                                                                   options) -> None:
    """After the scenario's step (and the splits), one step with output_device=k, the loop's
    outputs, loss and targets moved to cuda:k first: what emulating that option on its own
    gives, byte for byte."""
    wl = workload()
    base = EmulationConfig(gpus=gpus, gpu_memory_bytes=80 << 30,
                           step=StepConfig(batch=batch, **options))
    seen = fixes_alongside(batch, gpus)
    chained = run_scenario("dp-loss-primary", wl, base, alongside=seen)
    assert chained == run_scenario("dp-loss-primary", wl, base)
    assert seen.output_device_result is not None
    alone = run_scenario("dp-loss-primary", wl, dataclasses.replace(
        base, dp_output_device=seen.output_device, peaks_only=True))
    assert _exact(seen.output_device_result, alone)
    assert alone.devices[seen.output_device].peak_allocated_bytes > 0


@pytest.mark.parametrize("step, options", [
    (_keeps_losses, {"warmup": 2}),  # not steady: one more step keeps one more loss
    (lambda: micro_batches, {}),  # it returns loss / 2, made in backward: where is it?
    (lambda: None, {"warmup": 0}),  # no step before the measured one: steady or not?
])
def test_no_further_steps_where_the_loop_does_not_say_they_are_exact(step, options) -> None:
    wl = dataclasses.replace(lm(SMALL_LM), step=step())
    base = EmulationConfig(gpus=4, gpu_memory_bytes=80 << 30,
                           step=StepConfig(batch=32, **options))
    seen = fixes_alongside(32, 4)
    chained = run_scenario("dp-loss-primary", wl, base, alongside=seen)
    assert chained == run_scenario("dp-loss-primary", wl, base)
    assert seen.output_device_result is None
    if step() is not micro_batches:
        assert not seen.splits.finished


def test_a_step_that_leaves_its_own_tensors_gets_the_output_device_emulated_alone(
        monkeypatch) -> None:
    wl = dataclasses.replace(lm(SMALL_LM), step=_leaves_a_tensor)
    base = EmulationConfig(gpus=4, gpu_memory_bytes=80 << 30, step=StepConfig(batch=32))
    seen = fixes_alongside(32, 4)
    run_scenario("dp-loss-primary", wl, base, alongside=seen)
    assert seen.output_device_result is None  # where would that tensor be? not known
    emulated = count_emulations(monkeypatch)
    run = run_compare(CompareConfig(step=StepConfig(batch=32)), workload=wl)
    assert [cfg.dp_output_device for _, cfg in emulated] == [3]
    fix = next(f for f in run.fixes if f.name == "output-device")
    alone = run_scenario("dp-loss-primary", wl, dataclasses.replace(base, dp_output_device=3))
    assert fix.primary_peak_bytes == alone.devices[0].peak_allocated_bytes


@pytest.mark.parametrize("gpus, batch", [(1, 8), (4, 1), (4, 3), (2, 2)])
def test_few_gpus_or_rows_leave_every_scenario_whole(gpus, batch) -> None:
    """One GPU, fewer rows than GPUs, one row each: nothing to split or move, and the
    scenarios' own figures are what they are without the fixes."""
    cfg = CompareConfig(gpus=gpus, step=StepConfig(batch=batch))
    run = run_compare(cfg, workload=lm(SMALL_LM))
    plain = run_compare(dataclasses.replace(cfg, fixes=False), workload=lm(SMALL_LM))
    assert all(s.status == "ok" for s in run.scenarios)
    assert [s.devices for s in run.scenarios] == [s.devices for s in plain.scenarios]
    names = {f.name for f in run.fixes}
    assert "balanced-split" not in names
    assert ("output-device" in names) == (min(gpus, batch) >= 2)
