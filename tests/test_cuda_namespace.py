"""Every public function and class of ``torch.cuda`` and ``torch.cuda.memory`` (their
``__all__``, as the installed torch has them: a new torch's new names are checked too) runs
on virtual GPUs: a script that calls one is not stopped by the CPU build under dpprof
("Torch not compiled with CUDA enabled", a missing ``torch._C._cuda_*`` binding, NVML's
library not found). A few take arguments; :data:`ARGUMENTS` gives them, and
:data:`NOT_CALLED` the names left out, each with why."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.cuda.comm
import torch.cuda.memory
import torch.cuda.nccl
import torch.cuda.profiler
import torch.cuda.tunable
from script_runs import peak_reserved, run_script

from dpprof.emulator.device_readings import ACTIVITY_READINGS
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.result import ScenarioResult
from dpprof.script.session import ScriptConfig, parse_command, run_command

MiB = 2**20

# what each name that needs arguments is called with (inside the emulation: a callable
# makes them there)
ARGUMENTS: dict[str, Callable[[], tuple[Any, ...]]] = {
    "caching_allocator_alloc": lambda: (MiB,),
    "caching_allocator_delete": lambda: (torch.cuda.caching_allocator_alloc(512),),
    "can_device_access_peer": lambda: (0, 1),
    "check_error": lambda: (0,),
    "get_stream_from_external": lambda: (0x1234,),
    "ExternalStream": lambda: (0x1234,),
    "manual_seed": lambda: (0,),
    "manual_seed_all": lambda: (0,),
    "set_device": lambda: (1,),
    "set_per_process_memory_fraction": lambda: (0.5,),
    "set_rng_state": lambda: (torch.cuda.get_rng_state(),),
    "set_rng_state_all": lambda: (torch.cuda.get_rng_state_all(),),
    "set_stream": lambda: (torch.cuda.Stream(),),
    "set_sync_debug_mode": lambda: ("warn",),
    "stream": lambda: (torch.cuda.Stream(),),
    "StreamContext": lambda: (torch.cuda.Stream(),),
    "device": lambda: (0,),
    "device_of": lambda: (torch.empty(1, device="cuda"),),
    "graph": lambda: (torch.cuda.CUDAGraph(),),
}

NOT_CALLED = {
    # tested where CUDA graphs are (tests/test_cuda_graphs.py): a capture needs a stream
    "make_graphed_callables": "played with CUDA graphs, tests/test_cuda_graphs.py",
    # swaps the caching allocator for one compiled into a shared library: nothing to load
    "change_current_allocator": "loads a compiled allocator",
    "CUDAPluggableAllocator": "loads a compiled allocator",
    # a memory pool of a pluggable allocator, and the context that makes it current
    "MemPool": "a pool of its own allocator",
    "use_mem_pool": "a pool of its own allocator",
    # deprecated aliases of classes kept for old code
    "BFloat16Storage": "a storage class", "BFloat16Tensor": "a tensor class",
    "BoolStorage": "a storage class", "BoolTensor": "a tensor class",
    "ByteStorage": "a storage class", "ByteTensor": "a tensor class",
    "CharStorage": "a storage class", "CharTensor": "a tensor class",
    "ComplexDoubleStorage": "a storage class", "ComplexFloatStorage": "a storage class",
    "DoubleStorage": "a storage class", "DoubleTensor": "a tensor class",
    "FloatStorage": "a storage class", "FloatTensor": "a tensor class",
    "HalfStorage": "a storage class", "HalfTensor": "a tensor class",
    "IntStorage": "a storage class", "IntTensor": "a tensor class",
    "LongStorage": "a storage class", "LongTensor": "a tensor class",
    "ShortStorage": "a storage class", "ShortTensor": "a tensor class",
    # torch.cuda's own errors and its typing helpers
    "CudaError": "an exception class",
    "DeferredCudaCallError": "an exception class",
}


def _public(module: Any) -> Iterator[tuple[str, Any]]:
    for name in sorted(getattr(module, "__all__", ())):
        obj = getattr(module, name, None)
        if callable(obj) and not inspect.ismodule(obj):
            yield name, obj


NAMES = sorted({name for m in (torch.cuda, torch.cuda.memory) for name, _ in _public(m)})

# the modules of torch.cuda a script calls by their own names, each walked the same way
MODULES = {"torch.cuda.tunable": torch.cuda.tunable, "torch.cuda.comm": torch.cuda.comm,
           "torch.cuda.profiler": torch.cuda.profiler, "torch.cuda.nccl": torch.cuda.nccl}
MODULE_ARGUMENTS: dict[str, Callable[[], tuple[Any, ...]]] = {
    "set_max_tuning_duration": lambda: (10,),
    "set_max_tuning_iterations": lambda: (10,),
    "set_filename": lambda: ("results.csv",),
    "tune_gemm_in_file": lambda: ("results.csv",),
    "mgpu_tune_gemm_in_file": lambda: ("results*.csv", 2),
    "set_rotating_buffer_size": lambda: (0,),
    "set_numerical_check_tolerances": lambda: (True,),
    "broadcast": lambda: (torch.ones(4, device="cuda"), [0, 1]),
    "broadcast_coalesced": lambda: ([torch.ones(4, device="cuda")], [0, 1]),
    "reduce_add": lambda: ([torch.ones(4, device="cuda:0"), torch.ones(4, device="cuda:1")],),
    "reduce_add_coalesced": lambda: ([[torch.ones(4, device="cuda:0")],
                                      [torch.ones(4, device="cuda:1")]],),
    "scatter": lambda: (torch.ones(4, device="cuda"), [0, 1]),
    "gather": lambda: ([torch.ones(4, device="cuda:0"), torch.ones(4, device="cuda:1")],),
    # a module's own name where two modules share one (torch.cuda.nccl's take a tensor a GPU)
    "torch.cuda.nccl.all_reduce": lambda: (_one_a_gpu(4),),
    "torch.cuda.nccl.reduce": lambda: (_one_a_gpu(4),),
    "torch.cuda.nccl.broadcast": lambda: (_one_a_gpu(4),),
    "torch.cuda.nccl.all_gather": lambda: (_one_a_gpu(4), _one_a_gpu(8)),
    "torch.cuda.nccl.reduce_scatter": lambda: (_one_a_gpu(4), _one_a_gpu(2)),
}


def _one_a_gpu(numel: int) -> list[torch.Tensor]:
    return [torch.ones(numel, device=f"cuda:{i}") for i in range(2)]


def _module_names() -> list[str]:
    out = []
    for label, module in MODULES.items():
        names = getattr(module, "__all__", None) or [
            n for n, f in vars(module).items() if inspect.isfunction(f)
            and f.__module__ == module.__name__ and not n.startswith("_")]
        out += [f"{label}.{n}" for n in names]
    return out


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_the_tables_name_only_what_torch_cuda_has() -> None:
    """A name torch dropped leaves these tables, so that they stay the list of exceptions."""
    assert not (set(ARGUMENTS) | set(NOT_CALLED)) - set(NAMES)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in NOT_CALLED])
def test_every_public_name_of_torch_cuda_runs_on_virtual_gpus(name: str) -> None:
    with VirtualCuda(2):
        torch.empty(MiB, device="cuda")
        for module in (torch.cuda, torch.cuda.memory):
            func = getattr(module, name, None)
            if func is None or not callable(func):
                continue
            args = ARGUMENTS[name]() if name in ARGUMENTS else ()
            out = func(*args)
            if hasattr(out, "__enter__") and hasattr(out, "__exit__"):
                with out:
                    pass


@pytest.mark.parametrize("qualified", _module_names())
def test_every_function_of_torch_cudas_own_modules_runs_on_virtual_gpus(qualified: str) -> None:
    label, name = qualified.rsplit(".", 1)
    with VirtualCuda(2):
        func = getattr(MODULES[label], name)
        given = MODULE_ARGUMENTS.get(qualified) or MODULE_ARGUMENTS.get(name)
        args = given() if given is not None else ()
        out = func(*args)
        if hasattr(out, "__enter__") and hasattr(out, "__exit__"):
            with out:
                pass


def test_profiling_cuda_work_records_the_cpu_side_without_cuda_errors(
        capfd: pytest.CaptureFixture[str]) -> None:
    """A CPU build's profiler asked for CUDA events printed a C++ stack trace per op."""
    with VirtualCuda(1) as vc:
        m = torch.nn.Linear(64, 64).cuda()
        x = torch.randn(8, 64, device="cuda")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            m(x).sum().backward()
        assert "aten::addmm" in prof.key_averages().table(row_limit=50)
        with torch.autograd.profiler.profile(use_device="cuda"):
            m(x)
        with torch.autograd.profiler.emit_nvtx():
            m(x)
        assert len(vc.profiled.sites) == 3
        note = vc.profiled.note()
        assert note is not None and "CUDA activity at" in note
    assert "Failed to record CUDA event" not in capfd.readouterr().err


def test_tunableop_keeps_its_settings() -> None:
    with VirtualCuda(1) as vc:
        tunable = torch.cuda.tunable
        assert not tunable.is_enabled() and tunable.get_max_tuning_iterations() == 100
        tunable.enable()
        tunable.set_max_tuning_iterations(iterations=7)
        tunable.set_filename("gemms.csv", insert_device_ordinal=True)
        assert tunable.is_enabled() and tunable.get_max_tuning_iterations() == 7
        assert tunable.get_filename() == "gemms.csv" and tunable.get_results() == ()
        assert any(site.startswith("torch.cuda.tunable at") for site in vc.profiled.sites)


def test_torch_cuda_comm_moves_the_bytes_comm_cpp_moves() -> None:
    """A broadcast copies to the other device (the first keeps the tensor itself), a
    scatter places each chunk on its device, a gather makes the whole on the destination,
    reduce_add one result there."""
    with VirtualCuda(2):
        t = torch.ones(MiB, dtype=torch.uint8, device="cuda:0")
        on = [torch.cuda.memory_allocated(i) for i in (0, 1)]
        a, b = torch.cuda.comm.broadcast(t, [0, 1])
        assert a is t and b.device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(1) - on[1] == MiB
        pieces = torch.cuda.comm.scatter(t, [0, 1])
        assert [p.device.index for p in pieces] == [0, 1] and pieces[1].numel() == MiB // 2
        whole = torch.cuda.comm.gather(list(pieces), destination=1)
        assert whole.device == torch.device("cuda", 1) and whole.numel() == MiB
        total = torch.cuda.comm.reduce_add([t, b], destination=0)
        assert total.device == torch.device("cuda", 0) and total.shape == t.shape


def test_a_memory_fraction_is_the_devices_own_and_checked_as_torch_checks_it() -> None:
    with VirtualCuda(2) as vc:
        assert torch.cuda.get_per_process_memory_fraction() == 1.0
        torch.cuda.set_per_process_memory_fraction(0.25, device=1)
        assert torch.cuda.get_per_process_memory_fraction(1) == 0.25
        assert torch.cuda.memory.get_per_process_memory_fraction(0) == 1.0
        assert vc.memory.limit_bytes(vc.index_of(1)) == int(0.25 * vc.capacity_bytes)
        assert vc.memory.limit_bytes(vc.index_of(0)) is None
        with pytest.raises(ValueError, match="Allowed range: 0~1"):
            torch.cuda.set_per_process_memory_fraction(1.5)


def test_a_raw_block_is_counted_until_it_is_deleted() -> None:
    with VirtualCuda(1):
        before = torch.cuda.memory_allocated()
        ptr = torch.cuda.caching_allocator_alloc(3 * MiB)
        assert torch.cuda.memory_allocated() == before + 3 * MiB
        assert torch.cuda.memory_reserved() >= 3 * MiB
        torch.cuda.caching_allocator_delete(ptr)
        assert torch.cuda.memory_allocated() == before
        with pytest.raises(RuntimeError, match="invalid device pointer"):
            torch.cuda.caching_allocator_delete(ptr)


def test_nvml_memory_readings_are_the_reserve_and_the_context() -> None:
    with VirtualCuda(1) as vc:
        empty = torch.cuda.device_memory_used()
        x = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        # the 30 MiB block takes a segment of its own (10 MiB or more: its size)
        assert torch.cuda.device_memory_used() - empty == 30 * MiB
        assert empty > 200 * MiB  # the CUDA context's
        lines = torch.cuda.list_gpu_processes().splitlines()
        assert lines[0] == "GPU:0" and str(os.getpid()) in lines[1]
        assert vc.readings.total == 0
        del x


def test_activity_readings_answer_zero_and_are_counted_where_read() -> None:
    with VirtualCuda(1) as vc:
        for name in ACTIVITY_READINGS:
            assert getattr(torch.cuda, name)() == 0
        assert vc.readings.total == len(ACTIVITY_READINGS)
        note = vc.readings.note()
        assert note is not None and "test_cuda_namespace.py" in note


SCRIPT = """
import torch, torch.nn as nn
torch.cuda.set_per_process_memory_fraction({fraction})
print("utilization", torch.cuda.utilization())
m = nn.Linear(2048, 2048).cuda()
opt = torch.optim.Adam(m.parameters(), lr=0.1)
for i in range(3):
    x = torch.randn(2048, 2048, device="cuda")
    m(x).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def _run(tmp_path: Path, fraction: float) -> tuple[ScenarioResult, int]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(fraction=fraction))
    cfg = ScriptConfig(launch=parse_command(["python", str(script)], 1), steps=3)
    result, _ = run_command(cfg, alternatives=False)
    return result.scenarios[0], cfg.capacity_bytes


def test_a_run_beyond_the_scripts_memory_fraction_is_out_of_memory(tmp_path: Path) -> None:
    """The run reserves 96 MiB or so (two 16 MiB matrices with Adam's state, a 16 MiB
    batch, the cuBLAS workspace): within a fraction of 0.01 of 80 GB (810 MB), beyond
    0.0005 (40 MB); the limit is c10's, on the caching allocator's reserve."""
    fits, capacity = _run(tmp_path, 0.01)
    assert fits.status == "ok", fits.message
    reserve = fits.devices[0].peak_reserved_bytes
    assert reserve is not None and 40 * MiB < reserve < 810 * MiB
    assert any("reading(s) of GPU activity" in n and "train.py:4" in n for n in fits.notes)
    over, _ = _run(tmp_path, 0.0005)
    assert over.status == "oom" and over.oom_device == 0
    assert over.allocator_limit_bytes == int(0.0005 * capacity)
    assert fits.allocator_limit_bytes == int(0.01 * capacity)
    assert "set_per_process_memory_fraction(0.0005) at" in over.message
    assert over.oom_bytes == reserve


def test_empty_cache_gives_the_cached_segments_back() -> None:
    with VirtualCuda(2):
        x = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        y = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda:1")
        del x, y
        assert torch.cuda.memory_reserved(0) == torch.cuda.memory_reserved(1) == 30 * MiB
        torch.cuda.empty_cache()  # every device's, as c10's emptyCache
        assert torch.cuda.memory_reserved(0) == torch.cuda.memory_reserved(1) == 0
        assert torch.cuda.max_memory_reserved(0) == 30 * MiB
        snapshot = torch.cuda.memory._snapshot()
        assert snapshot["segments"] == []


EMPTIES = """
import torch
scratch = torch.empty(100 * 2**20, dtype=torch.uint8, device="cuda")
del scratch
{empty}
a = torch.empty(60 * 2**20, dtype=torch.uint8, device="cuda")
b = torch.empty(60 * 2**20, dtype=torch.uint8, device="cuda")
"""


def test_a_runs_reserve_follows_its_empty_cache(tmp_path: Path) -> None:
    kept, released = (peak_reserved(tmp_path, EMPTIES.format(empty=empty))
                      for empty in ("", "torch.cuda.empty_cache()"))
    # kept, the cached 100 MiB segment serves the first 60 MiB (split) and the second needs
    # a segment of its own: 160 MiB; released, the two take 60 MiB each: 120 MiB (the
    # cuBLAS workspaces the same in both)
    assert kept - released == 40 * MiB


SETTINGS = """
import torch
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
x = [torch.empty(12 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(4)]
del x[:2]
y = torch.empty(24 * 2**20, dtype=torch.uint8, device="cuda")
print("settings", torch._C._accelerator_getAllocatorSettings())
print("reserved", torch.cuda.max_memory_reserved())
"""


def test_allocator_settings_set_at_run_time_are_the_simulations(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch.cuda.memory._set_allocator_settings before the first allocation: as the
    environment's. Four 12 MiB blocks, two freed, 24 MiB asked: 72 MiB by default (a segment
    each), 60 MiB expandable (the freed pages serve it; test_allocator works the same)."""
    for source in (SETTINGS.replace('torch.cuda.memory._set_allocator_settings(', 'print('),
                   SETTINGS):
        s = run_script(tmp_path, source)
        assert s.status == "ok", s.message
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("settings")] == [
        "settings ", "settings expandable_segments:True"]
    assert [line for line in out if line.startswith("reserved")] == [
        f"reserved {72 * MiB}", f"reserved {60 * MiB}"]


UNCACHED = """
import torch
x = torch.empty(2**20, device="cuda")
with torch.cuda.memory.caching_allocator_disabled():
    y = torch.empty(2**20, device="cuda")
"""


def test_the_caching_allocator_switched_off_is_said(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, a GPU's allocations bypass the caching allocator (no cache, no statistics),
    which the simulation does not follow: the report says where it was switched off."""
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    monkeypatch.chdir(tmp_path)
    said = [n for n in run_script(tmp_path, UNCACHED).notes
            if "caching allocator switched off" in n]
    assert len(said) == 1
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1 in the script's environment" in said[0]
    assert "caching_allocator_disabled() at train.py:4" in said[0]


def test_the_accelerators_memory_info_is_torch_cudas() -> None:
    """torch.accelerator's get_memory_info answers as torch.cuda.mem_get_info: the free memory
    less the context, not the capacity less the reserve alone."""
    with VirtualCuda(1):
        torch.empty(MiB, device="cuda")
        free, total = torch.cuda.mem_get_info()
        assert free < total - torch.cuda.memory_reserved()  # the context is not free
        for module in (torch.accelerator, getattr(torch.accelerator, "memory", None)):
            if module is not None and hasattr(module, "get_memory_info"):
                assert module.get_memory_info() == (free, total)
