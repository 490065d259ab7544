"""What a GPU adds: kernel choice (SDPA, fused dropout, embedding backward), autocast,
reserved and context."""

from __future__ import annotations

import torch
from fidelity_models import embedding_sorted, sort_path_bytes_at_peak

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.emulator.kernels import EFFICIENT, FLASH, MATH, SdpaCall, sdpa_backend
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import AttnConfig, attention, mlp
from dpprof.units import fmt_bytes

SEQ, HEADS, ROWS, LAYERS = 1024, 8, 4, 2


def test_sdpa_backend_follows_sdp_utils_rules() -> None:
    assert sdpa_backend((8, 0), SdpaCall(64, torch.bfloat16, False)) == FLASH
    assert sdpa_backend((9, 0), SdpaCall(64, torch.float16, False)) == FLASH
    assert sdpa_backend((8, 0), SdpaCall(64, torch.float32, False)) == EFFICIENT  # no fp32 flash
    assert sdpa_backend((8, 0), SdpaCall(64, torch.bfloat16, True)) == EFFICIENT  # a mask
    assert sdpa_backend((7, 5), SdpaCall(64, torch.bfloat16, False)) == MATH  # bf16 needs sm80
    assert sdpa_backend((7, 5), SdpaCall(64, torch.float16, False)) == EFFICIENT
    assert sdpa_backend((4, 0), SdpaCall(64, torch.float32, False)) == MATH


def _single(cc: tuple[int, int], amp: str | None = None) -> tuple[int, list[str]]:
    wl = attention(AttnConfig(seq=SEQ, heads=HEADS, layers=LAYERS, d_model=256, vocab=1024,
                              dropout=0.0))
    r = run_scenario("single", wl, EmulationConfig(
        gpus=1, gpu_memory_bytes=2**40, compute_capability=cc,
        step=StepConfig(batch=ROWS, amp=amp),
    ))
    assert r.status == "ok", r.message
    return r.devices[0].peak_allocated_bytes, r.notes


def test_the_attention_workload_proves_the_kernel_choice() -> None:
    fused, notes = _single((8, 0))
    assert any("sdpa:efficient" in n for n in notes)
    math, notes = _single((4, 0))
    assert any("sdpa:math" in n for n in notes)
    # The math path saves the softmax output (and the masked scores it came from) per
    # layer: at least one rows x heads x seq x seq float32 matrix per layer more.
    assert math - fused >= LAYERS * ROWS * HEADS * SEQ * SEQ * 4


def test_amp_casts_to_flash_and_keeps_float32_master_weights() -> None:
    peak, notes = _single((8, 0), amp="bfloat16")
    assert any("sdpa:flash" in n for n in notes)  # bf16 inputs: flash on sm80
    full, _ = _single((8, 0))
    assert peak < full  # bf16 activations


def test_fused_dropout_saves_a_bool_mask() -> None:
    # mlp has no dropout; the attention workload with dropout on residuals does
    wl = attention(AttnConfig(seq=128, heads=2, layers=1, d_model=64, vocab=128, dropout=0.1))
    r = run_scenario("single", wl, EmulationConfig(
        gpus=1, gpu_memory_bytes=2**40, step=StepConfig(batch=2),
    ))
    assert any("dropout:fused" in n for n in r.notes)


def test_reserved_and_context_are_shown_separately() -> None:
    r = run_scenario("single", mlp(), EmulationConfig(
        gpus=1, gpu_memory_bytes=2**40, step=StepConfig(batch=64),
    ))
    d = r.devices[0]
    assert d.peak_reserved_bytes is not None and d.context_bytes is not None
    # reserved holds every allocated block plus two cuBLAS workspaces (8.125 MiB each on
    # sm80) and cuBLASLt's 1 MiB, in 2 MiB-rounded segments
    assert d.peak_reserved_bytes >= d.peak_allocated_bytes + 2 * 8_519_680 + 2**20
    assert d.peak_reserved_bytes % (2 * 1024 * 1024) == 0
    assert d.workspace_bytes == 2 * 8_519_680 + 2**20
    assert d.context_bytes == d.context_breakdown_bytes["cuda_context"] > 200 * 2**20
    assert d.total_peak_bytes == d.peak_reserved_bytes + d.context_bytes


def test_reports_show_allocated_reserved_and_context_per_device() -> None:
    from rich.console import Console

    from dpprof.pipeline import CompareConfig, run_compare
    from dpprof.reports import html, terminal

    run = run_compare(CompareConfig(
        workload="mlp", gpus=2, scenarios=("dp-loss-primary",),
        step=StepConfig(batch=8),
    ))
    page = html.render(run)
    assert "id='gpu-overheads'" in page and "of which workspaces" in page
    assert page.count("<td>dp-loss-primary</td><td>cuda:") == 2
    console = Console(width=200, record=True)
    console.print(terminal.render(run))
    text = console.export_text()
    # each GPU's context: the CUDA context (254 MiB) and DataParallel's NCCL communicator
    d = run.scenarios[0].devices[0]
    parts = d.context_breakdown_bytes
    assert parts["cuda_context"] > 250 << 20 and d.context_bytes == sum(parts.values())
    assert "on a GPU: reserved" in text and f"+ {fmt_bytes(d.context_bytes)}" in text
    assert f"+ {fmt_bytes(parts['nccl'])} for NCCL's communicators" in text
    assert any("cuBLAS workspace" in a for a in run.assumptions)


def test_rms_norm_runs_the_fused_kernel_a_cuda_build_runs() -> None:
    """F.rms_norm on a bfloat16 input: CUDA's _fused_rms_norm keeps the bf16 input, a
    bf16 output and a float32 rstd per row; the composite a CPU/meta build runs keeps
    float32 copies of the input-sized tensors."""
    from dpprof.emulator.kernels import GpuKernels
    from dpprof.emulator.virtual_devices import VirtualDevices

    rows, width = 64, 1024
    rt = VirtualDevices(1, base="meta")
    with rt, rt.device(0), GpuKernels() as kernels:
        x = torch.empty(rows, width, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(width, dtype=torch.bfloat16, requires_grad=True)
        before = rt.storages.counters[0].live_requested
        y = torch.nn.functional.rms_norm(x, (width,), w, 1e-6)
        fused = rt.storages.counters[0].live_requested - before
        assert fused == rows * width * 2 + rows * 4  # output (bf16) + rstd (float32)
        y.sum().backward()
        assert x.grad is not None and x.grad.dtype == torch.bfloat16
        assert w.grad is not None and w.grad.shape == (width,)
        del y
    assert kernels.chosen == {"rms_norm:fused": 1}
    rt2 = VirtualDevices(1, base="meta")
    with rt2, rt2.device(0):  # the composite (what meta runs without the routing)
        x = torch.empty(rows, width, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(width, dtype=torch.bfloat16, requires_grad=True)
        before = rt2.storages.counters[0].live_requested
        y = torch.nn.functional.rms_norm(x, (width,), w, 1e-6)
        composite = rt2.storages.counters[0].live_requested - before
        assert y.dtype == torch.bfloat16
    assert composite >= fused + rows * width * 4  # at least one float32 input-sized copy


def _embedding_peaks(compute: bool, rows: int) -> tuple[int, int, list[str]]:
    r = run_scenario("single", embedding_sorted(), EmulationConfig(
        gpus=1, gpu_memory_bytes=2**40,
        compute=compute, step=StepConfig(batch=rows),
    ))
    assert r.status == "ok", r.message
    d = r.devices[0]
    return d.peak_requested_bytes, d.peak_allocated_bytes, r.notes


def test_embedding_backward_plays_the_cuda_sort_path_buffers() -> None:
    """Over meta (the CUDA route) the embedding's backward holds, at its peak, the sort
    path's buffers besides the gradient (Embedding.cu / EmbeddingBackwardKernel.cu); over
    CPU tensors the CPU kernel runs and nothing is added (checked against torch.profiler
    in test_fidelity.py)."""
    rows = 2  # 4096 indices: the sort path
    cuda_req, cuda_alloc, notes = _embedding_peaks(False, rows)
    cpu_req, cpu_alloc, _ = _embedding_peaks(True, rows)
    assert any("embedding_backward:sorted x2" in n for n in notes)  # two iterations
    assert cuda_req - cpu_req == sort_path_bytes_at_peak(rows)
    assert cuda_alloc - cpu_alloc == sort_path_bytes_at_peak(rows, rounded=True)


def test_embedding_backward_direct_path_adds_nothing() -> None:
    """Up to 3072 indices one kernel writes the gradient: nothing besides it."""
    cuda_req, cuda_alloc, notes = _embedding_peaks(False, 1)  # 2048 indices
    cpu_req, cpu_alloc, _ = _embedding_peaks(True, 1)
    assert any("embedding_backward:direct x2" in n for n in notes)
    assert (cuda_req, cuda_alloc) == (cpu_req, cpu_alloc)
