"""What a first run on real GPUs would hit, over fakes that behave like those machines: the
allocator's process-wide peaks, NVML's 0-byte entries for peers, MIG devices (their own
handles, NoPermission on the parent), containers that list host PIDs, a driver that refuses
one query, OOM formats outside the caching allocator, DataParallel's re-raised errors."""

from __future__ import annotations

import datetime as dt
import os
import types
from pathlib import Path
from typing import Any

import fake_cuda
import pytest
import torch
import torch.distributed as dist
from fake_cuda import AllocatorOps, AllocatorStats, CpuOps
from fake_nvml import FakeDevice, FakeMig, FakeNvml, mig_parent
from test_cuda_backend import UA, UB
from test_nvml import err, memory_struct, scripted_pynvml
from torch import nn

import dpprof
from dpprof.backends import cuda_run
from dpprof.backends.cuda import run_local_scenario
from dpprof.backends.cuda_ddp import measure_ddp_rank
from dpprof.backends.cuda_measure import CudaRunConfig, Measured
from dpprof.backends.cuda_oom import is_oom
from dpprof.nvml.devices import resolve_visible_devices, torch_cuda_uuids
from dpprof.nvml.libnvml import RealNvml
from dpprof.pipeline import CompareConfig, run_compare
from dpprof.result import DeviceResult
from dpprof.scenarios.step import StepConfig

GiB = 2**30
MIG = "MIG-dddd4444-1111-2222-3333-444444444444"


def _cfg(devices: tuple[int, ...] = (0, 1)) -> CudaRunConfig:
    return CudaRunConfig(devices=list(devices), nvml_interval_s=0.001,
                         step=StepConfig(batch=8, warmup=1, steps=2))


def _tiny() -> dpprof.Workload:
    return dpprof.Workload(
        name="tiny", model=lambda: nn.Linear(8, 4),
        batch=lambda rows, device: (torch.randn(rows, 8), torch.randint(0, 4, (rows,))),
        loss=nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=dt.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _touching(stats: AllocatorStats, nbytes: int, oom: bool = False) -> dpprof.Workload:
    """A model whose forward holds ``nbytes`` on device 0 for a moment; ``oom``: then the
    allocator fails, in the first (warm-up) step."""

    class Touch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stats.touch(0, nbytes)
            if oom:
                raise torch.cuda.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                    "capacity of 79.15 GiB of which 1.00 GiB is free.")
            return self.lin(x)

    return dpprof.Workload(
        name="touch", model=Touch,
        batch=lambda rows, device: (torch.randn(rows, 8), torch.randint(0, 4, (rows,))),
        loss=nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


# ---- the allocator's peaks -----------------------------------------------------------------


def test_an_oom_in_warm_up_reports_its_own_peak_not_the_previous_scenarios() -> None:
    stats = AllocatorStats()  # one process: every scenario reads the same counters
    big = run_local_scenario("single", _touching(stats, 5 * GiB), _cfg(),
                             ops=AllocatorOps([0, 1], stats))
    assert big.status == "ok" and big.devices[0].peak_allocated_bytes == 5 * GiB
    small = run_local_scenario("single", _touching(stats, 1 * GiB, oom=True), _cfg(),
                               ops=AllocatorOps([0, 1], stats))
    assert small.status == "oom" and small.oom_phase == "forward"
    assert small.devices[0].peak_allocated_bytes == 1 * GiB


# ---- NVML as real machines answer ----------------------------------------------------------


def test_peer_access_entries_of_0_bytes_are_not_stray_contexts(one_rank_group: None) -> None:
    me = os.getpid()
    # NVLink / P2P: NVML lists every DDP rank on every peer's GPU with 0 bytes
    nvml = FakeNvml([
        FakeDevice(uuid=UA, used=2 * GiB, processes=[(me, 1 * GiB), (me + 1, 0)]),
        FakeDevice(uuid=UB, used=2 * GiB, processes=[(me, 0), (me + 1, 1 * GiB)]),
    ])
    out = measure_ddp_rank(_tiny(), _cfg(devices=(0,)), rank=0, world=1, local_device=0,
                           ops=CpuOps([0]), nvml=nvml, cuda_uuids=[UA, UB])
    assert out.status == "ok", out.message
    assert out.stray_contexts == []
    assert not any("set_device" in n for n in out.notes)
    # DataParallel over cuda:1 (--devices 1): this process mapped cuda:0 only as a peer
    dp = FakeNvml([FakeDevice(uuid=UA, processes=[(me, 0)]),
                   FakeDevice(uuid=UB, processes=[(me, GiB)])])
    r = run_local_scenario("single", _tiny(), _cfg(devices=(1,)), ops=CpuOps([1]), nvml=dp,
                           cuda_uuids=[UA, UB])
    assert r.status == "ok" and r.stray_contexts == ()


def test_torch_cuda_uuids_does_not_call_a_mig_device_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the CUDA runtime reports a MIG device's own UUID, without a prefix
    props = types.SimpleNamespace(uuid=MIG[4:], name="NVIDIA A100 MIG 1g.10gb")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    uuids = torch_cuda_uuids()
    nvml = FakeNvml([mig_parent(UA, FakeMig(MIG, 1, 0))])
    (dev,) = resolve_visible_devices(nvml, {}, uuids).devices
    assert dev.mig and dev.uuid == MIG and dev.nvml_index == 0 and dev.sample_index is not None


def test_a_mig_device_is_sampled_through_its_own_handle_not_the_parent() -> None:
    me = os.getpid()
    nvml = FakeNvml([mig_parent(UA, FakeMig(MIG, 1, 0, used=[3 * GiB, 4 * GiB],
                                            processes=[(me, 2 * GiB)]))])
    r = run_local_scenario("single", _tiny(), _cfg(devices=(0,)), ops=CpuOps([0]), nvml=nvml,
                           cuda_uuids=[MIG[4:]])
    assert r.status == "ok", r.message
    d = r.devices[0]
    assert d.uuid == MIG and d.nvml_index == 0, d.nvml_reason
    assert d.nvml_peak_used_bytes == 4 * GiB and d.process_used_bytes == {str(me): 2 * GiB}
    assert nvml.calls("memory", 0) == 0  # the parent (NoPermission for non-root) untouched


def test_nvml_memory_v2_stays_on_when_one_gpu_refuses_it() -> None:
    import pynvml

    def memory(handle: int, version: int | None = None) -> Any:
        if handle == 100:  # a MIG-enabled parent, read without root: v1 and v2 alike
            raise err(pynvml.NVML_ERROR_NO_PERMISSION)
        if version is None:
            return memory_struct(total=100, free=30, used=70)  # v1 counts the driver's reserve
        return memory_struct(total=100, free=30, used=60, reserved=10)

    nvml = RealNvml(scripted_pynvml(nvmlDeviceGetMemoryInfo=memory))
    assert nvml.memory(0) is None and "Permission" in (nvml.reason("memory", 0) or "")
    mem = nvml.memory(1)
    assert mem is not None and (mem.used, mem.reserved) == (60, 10)
    nvml.shutdown()


def test_real_nvml_reads_a_mig_device_through_its_own_handle() -> None:
    import pynvml

    def memory(handle: int, version: int | None = None) -> Any:
        if handle == 100:
            raise err(pynvml.NVML_ERROR_NO_PERMISSION)
        if handle == 500:
            return memory_struct(total=10 * GiB, free=7 * GiB, used=3 * GiB, reserved=0)
        return memory_struct(total=80 * GiB, free=70 * GiB, used=10 * GiB, reserved=0)

    def mig_handle(parent: int, slot: int) -> int:
        if parent != 100 or slot != 0:
            raise err(pynvml.NVML_ERROR_NOT_FOUND)
        return 500

    module = scripted_pynvml(
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetMigMode=lambda h: (1, 1) if h == 100 else (0, 0),
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
        nvmlDeviceGetUUID=lambda h: (MIG if h == 500 else f"GPU-0000000{h - 100}-aaaa-bbbb-"
                                     "cccc-dddddddddddd").encode(),
        nvmlDeviceGetGpuInstanceId=lambda h: 1, nvmlDeviceGetComputeInstanceId=lambda h: 0,
    )
    nvml = RealNvml(module)
    (mig,) = nvml.mig_devices(0) or []
    assert mig.uuid == MIG and mig.index is not None
    mem = nvml.memory(mig.index)
    assert mem is not None and mem.used == 3 * GiB
    fresh = RealNvml(module)  # a new process: the handle is asked for by its index
    assert (fresh.memory(mig.index) or mem).total == 10 * GiB
    nvml.shutdown()
    fresh.shutdown()


def test_a_container_that_lists_host_pids_is_said_so_and_the_sampler_notes_arrive() -> None:
    # without the host PID namespace NVML lists host PIDs: this process never appears
    nvml = FakeNvml([FakeDevice(uuid=UA, used=3 * GiB, processes=[(3_512_771, 2 * GiB)])])
    r = run_local_scenario("single", _tiny(), _cfg(devices=(0,)), ops=CpuOps([0]), nvml=nvml,
                           cuda_uuids=[UA])
    assert r.status == "ok" and r.devices[0].process_used_bytes == {}
    assert any("PID namespace" in n for n in r.notes), r.notes
    assert "NVML on cuda:0: utilization: Not Supported" in r.notes  # a sampler note
    # where NVML does list this process, nothing is said
    me = os.getpid()
    seen = FakeNvml([FakeDevice(uuid=UA, used=3 * GiB, util=[5],
                                processes=[(3_512_771, GiB), (me, GiB)])])
    r = run_local_scenario("single", _tiny(), _cfg(devices=(0,)), ops=CpuOps([0]), nvml=seen,
                           cuda_uuids=[UA])
    assert r.notes == () and r.devices[0].process_used_bytes == {str(me): GiB}


# ---- the order of the scenarios ------------------------------------------------------------


def test_ddp_ranks_run_before_this_process_touches_the_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    real_local = cuda_run.run_local_scenario

    def local(name: str, *a: Any, **kw: Any) -> Any:
        order.append(name)
        return real_local(name, *a, **kw)

    def spawn(job: Any, world: int) -> list[Measured]:
        order.append("ddp")
        return [Measured(rank=r, devices=[DeviceResult(index=r, rank=r)],
                         step_times_s=[0.1, 0.1], loss=1.0) for r in range(world)]

    monkeypatch.setattr(cuda_run, "run_local_scenario", local)
    monkeypatch.setattr(cuda_run, "spawn_ddp", spawn)
    fake_cuda.install(monkeypatch, gpus=2, children=False)
    run = run_compare(CompareConfig(workload="mlp", gpus=2, fixes=False,
                                    step=StepConfig(batch=8, warmup=1, steps=2)))
    assert run is not None and order[0] == "ddp"
    assert [s.name for s in run.scenarios] == list(dpprof.SCENARIOS)  # reported in order


# ---- what counts as out of memory, and its one line ------------------------------------------


def test_is_oom_knows_every_format_the_watch_parser_knows() -> None:
    assert is_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be "
                               "asynchronously reported at some other API call"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_oom(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda "
                               "error, NCCL version 2.21.5\nCuda failure 'out of memory'"))
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))


def _replica_error(exc_type: type[BaseException], original: str) -> BaseException:
    """What DataParallel's parallel_apply re-raises (torch/_utils.py ExceptionWrapper)."""
    return exc_type(
        "Caught OutOfMemoryError in replica 0 on device 0.\nOriginal Traceback (most recent "
        "call last):\n  File \"torch/nn/parallel/parallel_apply.py\", line 97, in _worker\n"
        f"    output = module(*input, **kwargs)\n{original}\n")


def test_an_error_re_raised_by_data_parallel_threads_is_one_line() -> None:
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 "
           "has a total capacity of 23.65 GiB of which 3.06 MiB is free.")
    for exc, want in (
        (_replica_error(torch.cuda.OutOfMemoryError, oom),
         "out of memory on cuda:0 asking for 20.0 MiB during forward"),
        (_replica_error(RuntimeError, "KeyError: 'labels'"), "KeyError: 'labels'"),
    ):
        wl = _tiny()

        def forward(self: Any, x: torch.Tensor, exc: BaseException = exc) -> torch.Tensor:
            raise exc

        wl.model = type("Raises", (nn.Module,), {
            "__init__": lambda self: (nn.Module.__init__(self), setattr(
                self, "lin", nn.Linear(8, 4)))[0], "forward": forward})
        r = run_local_scenario("dp-loss-primary", wl, _cfg(), ops=CpuOps([0, 1]))
        assert "\n" not in r.message and want in r.message, r.message
