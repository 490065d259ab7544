"""The ladder's rungs against real execution on CPU tensors, and the verdict that names one.

Mixed precision: the emulator re-enacts autocast at the function level over meta tensors
(:class:`dpprof.emulator.emulated_autocast.EmulatedAutocast`); with torch's CPU op lists it must give
the peak that ``torch.autocast("cpu", torch.bfloat16)`` gives on real tensors, recorded by
torch.profiler, to the byte. Activation checkpointing: the blocks the ladder wraps
(:func:`dpprof.measure.rung_models.checkpointed`) run for real under the profiler and in the
emulator; the peaks are equal, less the CPU generator's state that each checkpointed block
stashes on the host until its recompute (``torch.get_rng_state()``, made outside the
dispatcher: host memory on a GPU, never device memory).

The records the emulator has no event for must be explained: the CPU allocator's known
kernel scratch (:func:`dpprof.backends.memtrace.cpu_only_reason`), a bfloat16 CPU gemm's
scratch (allocated and freed inside one ``aten::mm``/``addmm``/``bmm``; a GPU gemm takes
none from the caching allocator), or the stashed generator states.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from emulated_trace import live_at_start_and_step
from torch import nn
from typer.testing import CliRunner

from dpprof.answers.answer import answer_of
from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.backends.gloo import RankResult, RankSpec, run_rank
from dpprof.backends.memtrace import SCALAR_BYTES, Alloc, align, peak_of, relative_peak
from dpprof.fixes.policy import MARGIN
from dpprof.measure.rung_models import checkpointed, repeated_blocks
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import load_workload
from dpprof.units import fmt_bytes

HERE = Path(__file__).parent
LADDER = HERE / "ladder_models.py"
FIDELITY = HERE / "fidelity_models.py"
WORLD = 2  # the rows below are per rank: the global batch is rows * WORLD


@pytest.fixture
def nccl_as_at_world_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL over shared host memory on one ring channel: its GPU memory at two ranks is its
    world-1 figure (dpprof.emulator.nccl_memory), so the capacities below weigh the rungs
    alone, as they were chosen to."""
    for name, value in (("NCCL_P2P_DISABLE", "1"), ("NCCL_ALGO", "Ring"),
                        ("NCCL_MAX_NCHANNELS", "1")):
        monkeypatch.setenv(name, value)
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm")
RNG_STATE_BYTES = torch.get_rng_state().numel()


def _real(spec: str, rows: int, amp: str | None, micro_batches: int = 1) -> RankResult:
    return run_rank(RankSpec(workload=spec, step=StepConfig(
        batch=rows * WORLD, amp=amp, micro_batches=micro_batches),
        wrap="none", autocast="native"), 0, WORLD)


def _emulated(spec: str, rows: int, amp: str | None, compute: bool, micro_batches: int = 1
              ) -> tuple[int, list[int]]:
    """Live bytes (blocks over SCALAR_BYTES) when the measured iteration began, and the
    iteration's signed sizes, device 0 and host, with torch's CPU autocast lists."""
    trace: dict[str, Any] = {}
    r = run_scenario("single", load_workload(spec), EmulationConfig(
        gpus=WORLD, gpu_memory_bytes=2**40, compute=compute, autocast_ops="cpu",
        step=StepConfig(batch=rows * WORLD, amp=amp, micro_batches=micro_batches)), trace)
    assert r.status == "ok", r.message
    return live_at_start_and_step(trace)


def _unexplained(records: list[Alloc], unmatched: list[Alloc], missing: list[int]
                 ) -> list[Alloc]:
    """Allocations left unmatched in order that match no unmatched emulator allocation of
    the same size either (the casts' order among themselves differs, so difflib leaves
    some out of order), and are neither a gemm's in-kernel scratch nor a stashed generator
    state."""
    from collections import Counter

    spare = Counter(x for x in missing if x > 0)
    def in_gemm(op: str) -> bool:
        return any(g in op.split(" < ") for g in GEMMS)

    def gemm_scratch(e: Alloc) -> bool:  # its free follows, inside a gemm too
        after = records[records.index(e) + 1:]
        free = next((f for f in after if f.ptr == e.ptr), None)
        return in_gemm(e.op) and free is not None and free.size == -e.size and in_gemm(free.op)

    out = []
    for e in unmatched:
        if e.size <= 0 or e.size == RNG_STATE_BYTES or gemm_scratch(e):
            continue
        if spare[e.size]:
            spare[e.size] -= 1
        else:
            out.append(e)
    return out


def _check(spec: str, rows: int, amp: str | None, meta: bool, host_only_bytes: int = 0,
           strict: bool = True, micro_batches: int = 1) -> None:
    """The records against the emulator over CPU tensors (the same kernels); the peak over
    CPU tensors and, with ``meta``, over meta tensors (the GPU's kernels), to the byte.
    ``strict=False``: the peaks only (lm in bfloat16: the CPU's bf16 matmul and its
    backward make 256 KiB copies the order-insensitive match does not place; open)."""
    measured = _real(spec, rows, amp, micro_batches)
    records = [Alloc(0, s, op, p) for s, op, p in measured.step_events if abs(s) > SCALAR_BYTES]
    assert records and measured.start_large_requested_bytes is not None
    for compute in (True, False) if meta else (True,):
        start, events = _emulated(spec, rows, amp, compute, micro_batches)
        al = align(events, records)
        if compute and strict:
            left = _unexplained(records, al.unexplained, al.missing)
            assert not left, [(e.size, e.op[:100]) for e in left[:6]]
        assert start == measured.start_large_requested_bytes
        real_peak = measured.start_large_requested_bytes + peak_of(al.kept)
        assert real_peak - (start + relative_peak(events)) == host_only_bytes, (
            spec, amp, compute, real_peak, start + relative_peak(events))


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "rows", "meta"), [
    (f"{FIDELITY}:lm_small", 1, True),
    (f"{FIDELITY}:attention_small", 4, False),  # over meta SDPA takes the GPU's kernel
])
def test_autocast_equals_torch_cpu_autocast(spec: str, rows: int, meta: bool) -> None:
    _check(spec, rows, "bfloat16", meta, strict="lm_small" not in spec)


@pytest.mark.slow
@pytest.mark.parametrize("amp", [None, "bfloat16"])
def test_checkpointing_equals_the_profiler(amp: str | None) -> None:
    _check(f"{LADDER}:lm_checkpointed", 1, amp, True, strict=amp is None)
    # two blocks, each with the generator's state stashed at the peak
    _check(f"{LADDER}:attention_checkpointed", 4, amp, False,
           host_only_bytes=2 * RNG_STATE_BYTES, strict=amp is None)


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "rows", "micro_batches"), [
    # CPU tensors (the CPU's kernels): over meta lm's attention takes the GPU's SDPA kernel,
    # whose saved tensors differ from the CPU's at these rows, accumulating or not
    (f"{FIDELITY}:lm_small", 4, 2),
    ("mlp", 7, 3),  # micro-batches of 3, 3, 1 rows: the loader's last one shorter
    (f"{LADDER}:attention_checkpointed", 4, 2),
])
def test_accumulation_equals_the_profiler(spec: str, rows: int, micro_batches: int) -> None:
    """k micro-batches (zero_grad, k x (forward, loss / k, backward), step) run for real
    under the profiler and in the emulator: the same peak, to the byte (checkpointed
    blocks: less the generator state each of the two stashes on the host)."""
    _check(spec, rows, None, False, micro_batches=micro_batches,
           host_only_bytes=2 * RNG_STATE_BYTES if "checkpointed" in spec else 0)
    if spec == "mlp":  # no kernel of its differs on a GPU: over meta the same peak
        peaks = [start + relative_peak(events) for start, events in
                 (_emulated(spec, rows, None, compute, micro_batches)
                  for compute in (True, False))]
        assert peaks[0] == peaks[1]


def test_the_repeated_blocks_are_the_largest_module_list() -> None:
    model = load_workload("lm").model()
    names = [n for n, _ in repeated_blocks(model)]
    assert names and all(n.rpartition(".")[2].isdigit() for n in names)
    assert len({n.rpartition(".")[0] for n in names}) == 1

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).relu())

    seq = nn.Sequential(nn.Linear(4, 4), Block(), Block(), Block(), nn.Linear(4, 2))
    assert [n for n, _ in repeated_blocks(seq)] == ["1", "2", "3"]
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) == []


def test_a_cnns_repeated_blocks_are_its_residual_blocks_not_its_convolutions() -> None:
    class Residual(nn.Module):  # a ResNet's BasicBlock: its Conv2d and BatchNorm2d repeat more
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
            self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x + self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))).relu()

    # stages as plain Sequentials (more of them than blocks would be if the head were one)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(Residual(), Residual()),
                          nn.Sequential(Residual(), Residual()),
                          nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))
    assert [(n, type(m)) for n, m in repeated_blocks(model)] == [
        ("1.0", Residual), ("1.1", Residual), ("2.0", Residual), ("2.1", Residual)]


def test_a_checkpointed_model_computes_the_same_gradients() -> None:
    wl = load_workload(f"{FIDELITY}:attention_small")
    grads = []
    for w in (wl, checkpointed(wl)):
        torch.manual_seed(0)
        model = w.model()
        torch.manual_seed(1)
        x, y = w.batch(2, torch.device("cpu"))
        model.eval()  # no dropout: the same numbers either way
        w.loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.allclose(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.usefixtures("nccl_as_at_world_one")
def test_compare_names_the_cheapest_rung_that_fits(tmp_path: Path) -> None:
    from dpprof.cli.app import app

    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["compare", "-w", "lm", "-b", "64", "-g", "2",
                                 "--gpu-memory", "6GiB", "-o", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    fixes = {f["name"]: f for f in data["fixes"]}
    rungs = [f for f in data["fixes"] if f["name"].startswith("ladder-")]
    assert [f["name"] for f in rungs] == ["ladder-bf16", "ladder-checkpoint",
                                          "ladder-bf16-checkpoint", "ladder-fsdp2-zero2",
                                          "ladder-fsdp2-zero3",
                                          "ladder-fsdp2-zero3-bf16-checkpoint",
                                          "ladder-accumulate"]
    # CPU offload, the last resort, is not measured where a rung before it fits
    assert any("CPU offload not measured: a rung before it fits" in n for n in data["notes"])
    ddp = next(s for s in data["scenarios"] if s["name"] == "ddp")
    assert ddp["status"] == "oom"
    fit = next(f for f in rungs if f["need_bytes"] <= 6 << 30)
    assert all(f["need_bytes"] > 6 << 30 for f in rungs[:rungs.index(fit)])
    verdict = " ".join(data["comparison"]["verdict"].split())
    assert data["recommended"]["fix"] == fit["name"]
    assert (f"recommended: {fit['title']} on DDP, the cheapest change measured that fits"
            in verdict)
    assert "torch.utils.checkpoint" in fixes["ladder-checkpoint"]["code"]
    assert "torch.autocast" in fixes["ladder-bf16"]["code"]
    # FSDP2 shards parameters, gradients and optimizer state: below DDP's rank
    zero3 = fixes["ladder-fsdp2-zero3"]
    assert zero3["max_peak_bytes"] < ddp["devices"][0]["peak_allocated_bytes"]
    assert "fully_shard(block, reshard_after_forward=True)" in zero3["code"]
    assert "reshard_after_forward=False" in fixes["ladder-fsdp2-zero2"]["code"]


@pytest.mark.usefixtures("nccl_as_at_world_one")
def test_fsdp2_with_its_bf16_and_checkpointing_fits_where_ddp_rungs_do_not(
        tmp_path: Path) -> None:
    """FSDP2's own mixed precision (MixedPrecisionPolicy, no autocast) and the blocks
    checkpointed, on ZeRO-3: at 5 GiB per GPU neither DDP's lightest rung (bf16 autocast
    and checkpointing) nor plain ZeRO-3 fits, it does, with the margin by which an FSDP2
    rung's need may be understated (at 4 GiB it may not fit); gradient accumulation, which
    the policy ranks cheaper, fits only without the policy's margin, so the verdict names
    the combined rung; its code checkpoints the blocks before sharding them under the
    policy."""
    data = _compare(tmp_path, "-b", "64", "--gpu-memory", "5GiB")
    fixes = {f["name"]: f for f in data["fixes"]}
    combined = fixes["ladder-fsdp2-zero3-bf16-checkpoint"]
    assert combined["need_bytes"] <= 5 << 30
    for lighter_elsewhere in ("ladder-bf16-checkpoint", "ladder-fsdp2-zero3"):
        assert fixes[lighter_elsewhere]["need_bytes"] > 5 << 30
        assert combined["max_peak_bytes"] < fixes[lighter_elsewhere]["max_peak_bytes"]
    answers = {a["fix"]: a for a in data["recommended"]["fixes"]}
    assert answers[combined["name"]]["fits"] is True
    assert "it fits in 5.00 GiB" in " ".join(answers[combined["name"]]["why"].split())
    accumulate = answers["ladder-accumulate"]
    assert accumulate["cost_rank"] < answers[combined["name"]]["cost_rank"]
    assert accumulate["fits"] is True
    assert accumulate["spare_bytes"] < MARGIN * (5 << 30)  # tight: the policy passes it
    assert data["recommended"]["fix"] == combined["name"]
    verdict = " ".join(data["comparison"]["verdict"].split())
    assert (f"recommended: {combined['title']}, the cheapest change measured that fits"
            in verdict)  # not "on DDP"
    code = combined["code"]
    assert "torch.autocast" not in code
    assert ("MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
            in code)
    assert code.index("checkpointed(block)") < code.index("fully_shard(block")
    assert "fully_shard(model, reshard_after_forward=True, mp_policy=mp)" in code


def _linear_blocks(width: int, count: int) -> Any:
    """A workload of ``count`` Linear(width, width) + ReLU blocks in a ModuleList, MSE loss."""
    from torch import nn

    from dpprof.scenarios.workloads import Workload

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(count))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = torch.relu(b(x))
            return x

    return Workload(name=f"blocks{count}x{width}", model=Blocks,
                    batch=lambda rows, device: (torch.randn(rows, width, device=device),
                                                torch.randn(rows, width, device=device)),
                    loss=nn.functional.mse_loss)


def test_cpu_offload_is_not_emulated_where_the_model_would_not_fit_in_this_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulating CPU offload builds the whole model on the real host: on a machine whose
    free memory is too small for that (a 70B model on a laptop), the rung is left out with
    a note naming the bytes, and the other rungs are measured as before."""

    from dpprof.measure import ladder
    from dpprof.pipeline import CompareConfig, run_compare
    from dpprof.units import fmt_bytes

    wl = _linear_blocks(width=256, count=4)
    params_bytes = 4 * (256 * 256 + 256) * 4

    def ladder_of(free_bytes: int) -> tuple[list[str], list[str]]:
        monkeypatch.setattr(ladder, "available_host_bytes", lambda: free_bytes)
        run = run_compare(CompareConfig(gpus=2, scenarios=("ddp",), fixes=False, ladder=True,
                                        gpu_memory_bytes=1 << 20,  # no rung fits
                                        step=StepConfig(batch=8)), workload=wl)
        assert run is not None
        return [f.name for f in run.fixes], run.notes

    names, notes = ladder_of(params_bytes)  # the model would take all of it
    assert "ladder-fsdp2-zero3-offload" not in names
    assert "ladder-fsdp2-zero3" in names
    note = next(n for n in notes if "CPU offload not measured" in n)
    assert f"{fmt_bytes(params_bytes)} free here" in note
    names, notes = ladder_of(8 * params_bytes)  # a quarter of it is enough
    assert "ladder-fsdp2-zero3-offload" in names
    assert not any("CPU offload not measured" in n for n in notes)


@pytest.mark.usefixtures("nccl_as_at_world_one")
def test_cpu_offload_fits_where_the_weights_and_optimizer_state_leave_no_other_rung(
        ) -> None:
    """A model whose parameters, gradients and AdamW state outweigh its activations: at
    1100 MiB per GPU (its CUDA context and NCCL's memory counted) no rung fits but FSDP2's
    CPU offload, with the 11 % by which its need may be understated to spare (at 1 GiB it
    may not fit, and the answer says so), which the verdict names, its cost in the answer;
    measured after the other FSDP2 rungs and before accumulation; its code builds the model on the CPU and shards it with the policy, and
    its detail says the host memory each rank keeps, as read from the rank's tensors."""

    from dpprof.pipeline import CompareConfig, run_compare

    wl = _linear_blocks(width=2048, count=6)
    capacity_bytes = 1100 << 20
    run = run_compare(CompareConfig(gpus=2, gpu_memory_bytes=capacity_bytes, scenarios=("ddp",),
                                    fixes=False, ladder=True, step=StepConfig(batch=8)),
                      workload=wl)
    assert run is not None
    rungs = [f for f in run.fixes if f.name.startswith("ladder-")]
    names = [f.name for f in rungs]
    offload = rungs[names.index("ladder-fsdp2-zero3-offload")]
    assert names.index("ladder-fsdp2-zero3-bf16-checkpoint") + 1 == names.index(offload.name)
    assert names.index(offload.name) < names.index("ladder-accumulate")
    assert offload.need_bytes is not None and offload.need_bytes <= capacity_bytes
    assert all((f.need_bytes or 0) > capacity_bytes for f in rungs if f is not offload)
    answer = answer_of(run)
    assert answer.fix == offload.name and answer.fits is True
    verdict = " ".join(run.comparison.verdict.split())
    assert (f"recommended: {offload.title}, the cheapest change measured that fits"
            in verdict)
    assert "the optimizer step on the CPU" in answer.why
    code = offload.code
    assert "model.cuda(" not in code.replace("-model = nn.DataParallel(model.cuda())", "")
    assert "fully_shard(model, reshard_after_forward=True, offload_policy=CPUOffloadPolicy())" \
        in code
    # per rank (1 of 2): half of each 2048 x 2048 weight and 2048 bias, float32; the same
    # gradients; AdamW's two moments and a step scalar per parameter
    share = 6 * (1024 * 2048 + 1024) * 4
    detail = " ".join(offload.detail.split())
    assert (f"parameters ({fmt_bytes(share)}), their gradients ({fmt_bytes(share)}) and the "
            f"optimizer state ({fmt_bytes(2 * share + 12 * 4)})") in detail
    assert "0.089 s with CPU offload" in detail


def test_the_ladder_stays_away_when_ddp_fits(tmp_path: Path) -> None:
    from dpprof.cli.app import app

    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["compare", "-w", "mlp", "-b", "10", "-q", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert not [f for f in json.loads(out.read_text())["fixes"]
                if f["name"].startswith("ladder-")]


def _ddp_need(wl_spec: str, batch: int, micro_batches: int, amp: str | None = None,
              checkpoint: bool = False) -> int:
    wl = load_workload(wl_spec)
    r = run_scenario("ddp", checkpointed(wl) if checkpoint else wl, EmulationConfig(
        gpus=2, gpu_memory_bytes=2**40, count_reserved=True,
        step=StepConfig(batch=batch, micro_batches=micro_batches, amp=amp)))
    assert r.status == "ok", r.message
    return max(d.total_peak_bytes for d in r.devices if d.used)


def _compare(tmp_path: Path, *args: str, workload: str = "lm") -> dict[str, Any]:
    from dpprof.cli.app import app

    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["compare", "-w", workload, "-g", "2", "-q", "-o", str(out),
                                 *args])
    assert r.exit_code == 0, r.output
    return dict(json.loads(out.read_text()))


def test_accumulation_takes_the_fewest_micro_batches_that_fit(tmp_path: Path) -> None:
    # 16 rows per rank: 8 micro-batches fit, 4 do not (at 64 rows, 16 and 8: twice the
    # micro-batches to emulate for the same point)
    data = _compare(tmp_path, "-b", "32", "--gpu-memory", "3GiB")
    rungs = [f for f in data["fixes"] if f["name"].startswith("ladder-")]
    acc = rungs[-1]
    assert acc["name"] == "ladder-accumulate"
    k = int(acc["title"].split("(")[1].split()[0])
    assert acc["need_bytes"] <= 3 << 30 < _ddp_need("lm", 32, k // 2)
    assert all(f["need_bytes"] > 3 << 30 for f in rungs[:-1])  # the cheaper rungs do not fit
    assert f"Gradient accumulation ({k} micro-batches) on DDP" in " ".join(
        data["comparison"]["verdict"].split())
    assert "model.no_sync()" in acc["code"] and f"/ {k}" in acc["code"]
    assert f"{k} forward/backward passes per step" in acc["detail"]


def test_where_no_micro_batch_count_fits_the_lightest_rung_accumulates(tmp_path: Path) -> None:
    # one row per micro-batch: fp32 just over the capacity, bf16 + checkpointing under it
    # (attention's rows are long: lm's one row weighs less than autocast's bf16 copies of
    # its weights, so there bf16 + checkpointing is no lighter at one row). Four rows per
    # rank: the counts tried, 2 and 4, reach one row with few micro-batches to emulate
    plain = _ddp_need("attention", 8, 4)
    light = _ddp_need("attention", 8, 4, "bfloat16", checkpoint=True)
    assert light < plain
    data = _compare(tmp_path, "-b", "8", "--gpu-memory", f"{(light + plain) // 2}B",
                    workload="attention")
    names = [f["name"] for f in data["fixes"] if f["name"].startswith("ladder-")]
    assert names[-2:] == ["ladder-accumulate", "ladder-bf16-checkpoint-accumulate"]
    fit = data["fixes"][-1]
    assert fit["need_bytes"] == light and "4 micro-batches" in fit["title"]
    assert "torch.autocast" in fit["code"] and "checkpoint(" in fit["code"]


def test_ladder_flag_measures_it_where_ddp_fits_and_no_ladder_leaves_it_out(
        tmp_path: Path) -> None:
    from dpprof.cli.app import app

    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["compare", "-w", "mlp", "-b", "16", "-q", "--ladder",
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    names = [f["name"] for f in data["fixes"] if f["name"].startswith("ladder-")]
    assert names[0] == "ladder-bf16" and names[-1] == "ladder-accumulate"
    # ddp fits: the fewest micro-batches tried, 2, fit too
    assert "(2 micro-batches)" in data["fixes"][-1]["title"]
    data = _compare(tmp_path, "-b", "64", "--gpu-memory", "3GiB", "--no-ladder")
    assert not [f for f in data["fixes"] if f["name"].startswith("ladder-")]
    assert "rung" not in data["comparison"]["verdict"]


def test_the_ladder_help_says_when_it_runs() -> None:
    from dpprof.cli.app import app

    r = CliRunner().invoke(app, ["compare", "--help"], env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert "--ladder" in text and "--no-ladder" in text
    assert "only when ddp (or single) is out of memory" in text


def test_a_rung_that_cannot_run_is_said_not_dropped() -> None:
    # fully_shard refuses a scalar parameter (a ReZero-style gain), as it does on a GPU:
    # FSDP2's rungs are missing from the table, and the run's notes say which and why
    from dpprof.pipeline import CompareConfig, run_compare

    run = run_compare(CompareConfig(gpus=2, scenarios=("ddp",), fixes=False, ladder=True,
                                    gpu_memory_bytes=1 << 20,  # no rung fits: all are tried
                                    step=StepConfig(batch=8)),
                      workload=_conv_blocks(scalar_gain=True))
    assert run is not None
    names = {f.name for f in run.fixes}
    missing = {"ladder-fsdp2-zero2", "ladder-fsdp2-zero3", "ladder-fsdp2-zero3-offload"} - names
    assert len(missing) == 3, "FSDP2 now shards scalar parameters: test another unrunnable rung"
    for rung in missing:
        title = {"zero2": "FSDP2, ZeRO-2", "zero3": "FSDP2, ZeRO-3 (",
                 "offload": "FSDP2, ZeRO-3 and CPU offload"}[rung.rsplit("-", 1)[1]]
        assert any(n.startswith(f"ladder: {title}") and "could not be measured" in n
                   and "scalar parameters" in n for n in run.notes), run.notes
    assert "ladder-bf16" in names  # the others still measured


def _conv_blocks(scalar_gain: bool = False) -> Any:
    """Conv + BatchNorm blocks (with a learnable scalar gain each where ``scalar_gain``)."""
    from torch import nn

    from dpprof.scenarios.workloads import Workload

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
            if scalar_gain:
                self.gain = nn.Parameter(torch.tensor(1.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn(self.conv(x)))
            return y * self.gain if scalar_gain else y

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(4 * 8 * 8, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return self.head(x.flatten(1))

    return Workload(name="bn-blocks", model=Net,
                    batch=lambda rows, device: (torch.randn(rows, 4, 8, 8, device=device),
                                                torch.randint(0, 10, (rows,), device=device)),
                    loss=nn.functional.cross_entropy)


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_moves_a_batchnorm_s_host_buffers_to_the_gpu(offload: bool) -> None:
    # fully_shard moves the buffers (num_batches_tracked: made by torch.tensor, a real host
    # tensor) to the GPU by assigning .data, which a host tensor cannot take from a virtual
    # GPU's meta bytes: swapped instead, the buffer ends on cuda:0 as on a GPU
    from dpprof.emulator.fsdp import emulated_ranks
    from dpprof.measure.ladder_rungs import Rung
    from dpprof.measure.rung_models import rung_workload

    rung = Rung("zero3", "ZeRO-3", None, False, reshard_after_forward=True, offload=offload)
    trace: dict[str, Any] = {}
    with emulated_ranks(2):
        r = run_scenario("single", rung_workload(_conv_blocks(), rung), EmulationConfig(
            gpus=1, gpu_memory_bytes=2**40, step=StepConfig(batch=4), host_model=offload),
            trace)
    assert r.status == "ok", r.message
    tracked = [m.bn.num_batches_tracked for m in trace["model"].blocks]
    assert all(trace["rt"].storages.device_of(t) == 0 for t in tracked)


def test_an_fsdp2_rung_says_its_reserved_memory_may_be_understated() -> None:
    # an H200 reserved up to 10 % more than the simulation of FSDP2's streams: the rung says so
    from dpprof.measure.ladder_code import detail
    from dpprof.measure.ladder_rungs import Rung

    zero3 = Rung("ladder-fsdp2-zero3", "FSDP2, ZeRO-3", None, False, reshard_after_forward=True)
    plain = Rung("ladder-bf16", "Mixed precision", "bfloat16", False)
    assert "streams pooled apart" in detail(zero3, 4, "ddp", 128)
    assert "need may be understated" in detail(zero3, 4, "ddp", 128)
    assert "understated" not in detail(plain, 4, "ddp", 128)
    # CPU offload's own gap against the H200 (tests/test_measured_ladder.py), not the others'
    offload = Rung("ladder-fsdp2-zero3-offload", "FSDP2, ZeRO-3 and CPU offload", None, False,
                   reshard_after_forward=True, offload=True)
    assert "7-11 % under with CPU offload: its need may be understated" in detail(
        offload, 4, "ddp", 128)
    assert "CPU offload" not in detail(zero3, 4, "ddp", 128)


def test_without_fsdp2_in_torch_the_ladder_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # an older torch (before 2.6) has no fully_shard to emulate: no FSDP2 rungs, one note
    from dpprof.emulator import fsdp
    from dpprof.pipeline import CompareConfig, run_compare

    monkeypatch.setattr(fsdp, "missing", lambda: "this torch (2.4.0) has no FSDP2 to emulate")
    run = run_compare(CompareConfig(workload="lm", gpus=2, scenarios=("ddp",), fixes=False,
                                    ladder=True, step=StepConfig(batch=4)))
    assert run is not None
    assert not any("fsdp2" in f.name for f in run.fixes)
    assert "ladder: no FSDP2 rungs: this torch (2.4.0) has no FSDP2 to emulate" in run.notes
    assert any(f.name == "ladder-bf16" for f in run.fixes)


# the names the typical DataParallel script that compare's rung codes change has already
TYPICAL_SCRIPT_NAMES = {"torch", "nn", "os", "dist", "DDP", "DataLoader", "DistributedSampler",
                        "model", "dataset", "loss_fn", "optimizer"}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


@pytest.mark.parametrize("model", [
    nn.Sequential(_Block(), _Block(), nn.LayerNorm(4)),  # blocks at the root, beside a norm
    nn.ModuleDict({"layers": nn.ModuleList([_Block(), _Block()]), "head": nn.Linear(4, 2)})])
def test_compare_rung_code_compiles_and_names_only_the_typical_scripts(model: nn.Module) -> None:
    """Each rung's change to the typical loop (mixed precision, checkpointing, accumulation,
    FSDP2's) is Python once applied and uses nothing that script lacks: it called an
    undefined ``make_optimizer``, used ``contextlib`` unimported, and where the blocks
    shared no parent wrote ``for block in model.modules()  # 0, 1:`` (the colon commented
    out)."""
    from test_run_diffs import undefined_names

    from dpprof.measure.ladder_code import code
    from dpprof.measure.ladder_rungs import accumulation_rung, fsdp_rungs, rungs

    base = rungs((9, 0), True)
    for rung in [*base, *fsdp_rungs(4, True), *(accumulation_rung(r, 4) for r in base)]:
        new = "\n".join(line[1:] for line in code(rung, 4, 64, model).splitlines()
                        if line[:1] in "+ ")
        compile(new, rung.name, "exec")
        missing = {n.split(": ")[1] for n in undefined_names(new)}
        assert missing <= TYPICAL_SCRIPT_NAMES, (rung.name, missing - TYPICAL_SCRIPT_NAMES)
