"""The NVML layer: RealNvml without a driver, RealNvml over a scripted pynvml, FakeNvml."""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from fake_nvml import FakeDevice, FakeLink, FakeNvml

from dpprof.nvml.libnvml import HINT_PERMISSION, RealNvml, nvml_status
from dpprof.nvml.queries import (
    NVML_VALUE_NOT_AVAILABLE,
    NvmlQueryError,
    PeerLink,
    ProcessMemory,
    cuda_version_string,
    normalize_pci_bus_id,
)

REPO = Path(__file__).resolve().parents[1]


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def err(code: int) -> pynvml.NVMLError:
    """The exception pynvml itself raises for an NVML return code.

    The test builds pynvml's genuine exception objects (no driver needed for that) so that
    RealNvml's translation is checked against the real classes, not against imitations.
    """
    return pynvml.NVMLError(code)


# --------------------------------------------------------------------------- no driver here


@pytest.mark.skipif(_driver_present(), reason="an NVIDIA driver is installed on this machine")
def test_real_nvml_without_driver_is_unavailable_not_a_crash() -> None:
    nvml = RealNvml()
    status = nvml.status()
    assert status.available is False
    assert "Library Not Found" in status.reason
    assert "libnvidia-ml.so.1" in status.reason
    assert "NVIDIA driver" in status.hint
    assert nvml.device_count() == 0
    assert nvml.uuid(0) is None
    assert nvml.memory(0) is None
    assert nvml.p2p(0, 1) is None
    assert nvml.driver_version() is None
    reason = nvml.reason("memory", 0)
    assert reason is not None and reason.startswith("NVML not available")
    assert nvml_status(nvml) == status
    assert nvml_status().available is False  # the process-wide default backend


def test_only_nvml_module_imports_pynvml() -> None:
    pattern = re.compile(r"^\s*(import\s+pynvml|from\s+pynvml\s+import)", re.M)
    offenders = []
    for folder in ("profiler", "scenarios", "reports"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if pattern.search(text) or 'import_module("pynvml")' in text:
                offenders.append(path.relative_to(REPO).as_posix())
    assert offenders == ["profiler/nvml/libnvml.py"]


# --------------------------------------------------------------------------- a scripted pynvml


def memory_struct(total: int, free: int, used: int, reserved: int | None = None) -> Any:
    """What pynvml's nvmlDeviceGetMemoryInfo returns: its ctypes structure (v2 with
    ``reserved``), so a field dpprof reads by a wrong name fails here."""
    if reserved is None:
        return pynvml.c_nvmlMemory_t(total=total, free=free, used=used)
    return pynvml.c_nvmlMemory_v2_t(version=pynvml.nvmlMemory_v2, total=total,
                                    reserved=reserved, free=free, used=used)


def process_info(pid: int, used: int | None, converted: bool = True) -> Any:
    """One entry of pynvml's nvmlDeviceGetComputeRunningProcesses_v2: its friendly object
    made from the ctypes structure; NVML's "not available" becomes None as pynvml does it
    (``converted=False``: an older pynvml that left the raw value)."""
    raw = NVML_VALUE_NOT_AVAILABLE if used is None else used
    obj = pynvml.nvmlStructToFriendlyObject(
        pynvml.c_nvmlProcessInfo_v2_t(pid=pid, usedGpuMemory=raw))
    if converted and obj.usedGpuMemory == NVML_VALUE_NOT_AVAILABLE:
        obj.usedGpuMemory = None
    return obj


def pci_info(bus_id: str) -> Any:
    """What pynvml's nvmlDeviceGetPciInfo returns: its ctypes structure."""
    return pynvml.nvmlPciInfo_t(busId=bus_id.encode())


def scripted_pynvml(**overrides: Any) -> SimpleNamespace:
    """An object shaped like the pynvml module, with two GPUs, raising pynvml's own errors."""
    calls: dict[str, int] = {}

    def count(name: str) -> None:
        calls[name] = calls.get(name, 0) + 1

    def init() -> None:
        count("init")

    def shutdown() -> None:
        count("shutdown")

    def memory(handle: int, version: int | None = None) -> Any:
        if version is not None:  # a driver before R510: no nvmlDeviceGetMemoryInfo_v2
            raise err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if handle == 101:
            raise err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return memory_struct(total=80 * 2**30, free=70 * 2**30, used=10 * 2**30)

    def procs_v3(handle: int) -> Any:
        raise err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def procs_v2(handle: int) -> Any:
        count("procs_v2")
        return [
            process_info(11, 5 * 2**20),
            process_info(12, None),
            process_info(13, None, converted=False),
        ]

    def p2p(a: int, b: int, caps: Any) -> int:
        assert isinstance(caps, int)  # not pynvml's NVML_P2P_CAPS_INDEX_READ tuple
        return {0: 0, 1: 0, 2: 5}[caps]

    def nvlink_state(handle: int, link: int) -> int:
        raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def utilization(handle: int) -> Any:
        raise err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    module = SimpleNamespace(
        calls=calls,
        NVMLError=pynvml.NVMLError,
        NVMLLibraryMismatchError=pynvml.NVMLLibraryMismatchError,
        nvmlMemory_v2=pynvml.nvmlMemory_v2,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: 100 + i,
        nvmlDeviceGetUUID=lambda h: f"GPU-0000000{h - 100}-aaaa-bbbb-cccc-dddddddddddd".encode(),
        nvmlDeviceGetName=lambda h: b"NVIDIA A100-SXM4-80GB",
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetUtilizationRates=utilization,
        nvmlDeviceGetComputeRunningProcesses_v3=procs_v3,
        nvmlDeviceGetComputeRunningProcesses_v2=procs_v2,
        nvmlSystemGetDriverVersion=lambda: b"470.82.01",
        nvmlSystemGetCudaDriverVersion=lambda: 11040,
        nvmlDeviceGetPciInfo=lambda h: pci_info(f"00000000:{h - 60:02X}:00.0"),
        nvmlDeviceGetCudaComputeCapability=lambda h: (8, 0),
        nvmlDeviceGetP2PStatus=lambda a, b, caps: p2p(a, b, caps),
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 20,
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlDeviceGetMigMode=lambda h: (_ for _ in ()).throw(err(pynvml.NVML_ERROR_NOT_SUPPORTED)),
    )
    for key, value in overrides.items():
        setattr(module, key, value)
    return module


def test_real_nvml_is_lazy_and_initialises_once_across_threads() -> None:
    module = scripted_pynvml()
    nvml = RealNvml(module)
    assert module.calls.get("init", 0) == 0  # nothing happens in the constructor
    threads = [threading.Thread(target=nvml.device_count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert module.calls["init"] == 1
    assert nvml.status().available
    nvml.shutdown()
    assert module.calls["shutdown"] == 1
    assert nvml.device_count() == 2  # re-initialises after an explicit shutdown
    assert module.calls["init"] == 2
    nvml.shutdown()


def test_real_nvml_reads_and_converts_values() -> None:
    nvml = RealNvml(scripted_pynvml())
    assert nvml.device_count() == 2
    assert nvml.uuid(1) == "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"  # bytes -> str
    assert nvml.name(0) == "NVIDIA A100-SXM4-80GB"
    mem = nvml.memory(0)  # v2 missing in this "driver": falls back to v1
    assert mem is not None and (mem.total, mem.used, mem.reserved) == (80 * 2**30, 10 * 2**30, None)
    assert nvml.driver_version() == "470.82.01"
    assert cuda_version_string(nvml.cuda_driver_version()) == "11.4"
    assert nvml.pci_bus_id(0) == "00000000:28:00.0"
    assert nvml.compute_capability(0) == (8, 0)
    assert nvml.mig_devices(0) == []  # NotSupported for MIG mode means: not a MIG GPU
    procs = nvml.processes(0)
    assert procs is not None
    assert [(p.pid, p.used_bytes) for p in procs] == [(11, 5 * 2**20), (12, None), (13, None)]
    nvml.shutdown()


def test_real_nvml_per_query_failures_become_none_with_reason() -> None:
    nvml = RealNvml(scripted_pynvml())
    assert nvml.utilization(0) is None
    assert nvml.reason("utilization", 0) == "Not Supported"
    assert nvml.memory(1) is None  # GPU lost on the second device only
    assert "GPU is lost" in (nvml.reason("memory", 1) or "")
    assert nvml.memory(0) is not None
    assert nvml.reason("memory", 0) is None
    link = nvml.p2p(0, 1)
    assert link == PeerLink(0, 1, "ok", "ok", "not supported", "PXB", None)
    assert link.label == "PXB"
    assert nvml.reason("nvlinks", 0, 1) == "Not Supported"
    info = nvml.device_info(1)
    assert info.uuid is not None and info.total_bytes is None
    assert "GPU is lost" in info.reasons["total_bytes"]
    nvml.shutdown()


def test_real_nvml_memory_v2_is_used_when_the_driver_has_it() -> None:
    def memory(handle: int, version: int | None = None) -> Any:
        if version is None:
            raise AssertionError("v1 must not be asked when v2 works")
        return memory_struct(total=100, free=40, used=50, reserved=10)

    nvml = RealNvml(scripted_pynvml(nvmlDeviceGetMemoryInfo=memory))
    mem = nvml.memory(0)
    assert mem is not None and (mem.total, mem.free, mem.used, mem.reserved) == (100, 40, 50, 10)
    nvml.shutdown()


def test_real_nvml_unversioned_process_query_mismatch_is_not_supported() -> None:
    def mismatch(handle: int) -> Any:
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called")

    module = scripted_pynvml(nvmlDeviceGetComputeRunningProcesses=mismatch)
    del module.nvmlDeviceGetComputeRunningProcesses_v3
    del module.nvmlDeviceGetComputeRunningProcesses_v2
    nvml = RealNvml(module)
    assert nvml.processes(0) is None
    assert "not supported by the installed driver" in (nvml.reason("processes", 0) or "")
    nvml.shutdown()


@pytest.mark.parametrize(
    ("code", "text", "hint"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "Library Not Found", "NVIDIA driver"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded", "NVIDIA driver"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions", HINT_PERMISSION),
    ],
)
def test_real_nvml_init_failures_degrade_with_reason_and_hint(
    code: int, text: str, hint: str
) -> None:
    def init() -> None:
        raise err(code)

    nvml = RealNvml(scripted_pynvml(nvmlInit=init))
    status = nvml.status()
    assert status.available is False
    assert text in status.reason
    assert hint in status.hint
    assert nvml.device_count() == 0
    assert nvml.name(0) is None
    assert text in (nvml.reason("name", 0) or "")


def test_real_nvml_init_failing_with_an_os_error_degrades() -> None:
    def init() -> None:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    status = RealNvml(scripted_pynvml(nvmlInit=init)).status()
    assert status.available is False
    assert "cannot open shared object file" in status.reason


def test_normalize_pci_bus_id_and_cuda_version_string() -> None:
    assert normalize_pci_bus_id("0000:3b:00.0") == "00000000:3B:00.0"
    assert normalize_pci_bus_id(b"00000000:3B:00.0\x00") == "00000000:3B:00.0"
    assert normalize_pci_bus_id("") is None
    assert cuda_version_string(12040) == "12.4"
    assert cuda_version_string(11080) == "11.8"
    assert cuda_version_string(None) is None


# --------------------------------------------------------------------------- the fake


def test_fake_nvml_replays_recorded_readings_in_order() -> None:
    fake = FakeNvml([FakeDevice("GPU-a", total_bytes=1000, used=[100, 300, 200])])
    used = [fake.memory(0).used for _ in range(5)]  # type: ignore[union-attr]
    assert used == [100, 300, 200, 200, 200]  # the last reading repeats
    assert fake.memory(0).free == 800  # type: ignore[union-attr]
    assert fake.calls("memory", 0) == 6


def test_fake_nvml_callable_readings_and_failures() -> None:
    fake = FakeNvml(
        [
            FakeDevice("GPU-a", used=lambda n: 10 * n),
            FakeDevice("GPU-b", used=[5, NvmlQueryError("GPU is lost", "gpu_lost")]),
            FakeDevice("GPU-c", used=[None]),
            FakeDevice("GPU-d", fail={"name": "Insufficient Permissions"}),
        ]
    )
    assert [fake.memory(0).used for _ in range(3)] == [0, 10, 20]  # type: ignore[union-attr]
    assert fake.memory(1).used == 5  # type: ignore[union-attr]
    assert fake.memory(1) is None
    assert fake.reason("memory", 1) == "GPU is lost"
    assert fake.memory(2) is None
    assert fake.reason("memory", 2) == "Not Supported"
    assert fake.name(3) is None
    assert fake.reason("name", 3) == "Insufficient Permissions"
    assert fake.uuid(3) == "GPU-d"
    assert fake.memory(7) is None  # no such device
    assert "no device 7" in (fake.reason("memory", 7) or "")


def test_fake_nvml_unavailable_behaves_like_no_driver() -> None:
    fake = FakeNvml.unavailable("NVML Shared Library Not Found")
    assert not fake.available
    assert fake.device_count() == 0
    assert fake.memory(0) is None
    assert fake.reason("memory", 0) == "NVML not available: NVML Shared Library Not Found"
    assert fake.devices() == []


def test_fake_nvml_processes_and_links() -> None:
    fake = FakeNvml(
        [
            FakeDevice("GPU-a", processes=[(1, 10), (2, None), (3, NVML_VALUE_NOT_AVAILABLE)]),
            FakeDevice("GPU-b"),
            FakeDevice("GPU-c"),
        ],
        links={(0, 1): FakeLink(nvlinks=4), (1, 2): FakeLink(topology="SYS", read="not supported")},
    )
    assert fake.processes(0) == [
        ProcessMemory(1, 10),
        ProcessMemory(2, None),
        ProcessMemory(3, None),
    ]
    ab = fake.p2p(1, 0)  # looked up in both orders
    assert ab is not None and ab.label == "NV4" and ab.p2p_read is True
    bc = fake.p2p(1, 2)
    assert bc is not None and bc.label == "SYS" and bc.p2p_read is False
    ac = fake.p2p(0, 2)  # not recorded: every field unknown
    assert ac is not None and ac.label == "N/A" and ac.p2p_read is None


def test_peer_link_label_follows_nvidia_smi_topo() -> None:
    assert PeerLink(0, 1, nvlinks=12).label == "NV12"
    assert PeerLink(0, 1, nvlink_p2p="ok", nvlinks=0, topology="SYS").label == "NV"  # NVSwitch
    assert PeerLink(0, 1, nvlink_p2p="not supported", topology="PIX").label == "PIX"
    assert PeerLink(0, 1).label == "N/A"


def test_real_nvml_counts_nvlinks_to_the_peer_and_through_switches() -> None:
    # device 0 (handle 100): links 0-1 go to device 1 (bus 0x29), link 2 to another bus,
    # link 3 to an NVSwitch, link 4 is down, links past 4 do not exist on this GPU
    def state(handle: int, link: int) -> int:
        if link > 4:
            raise err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 0 if link == 4 else 1

    def remote_type(handle: int, link: int) -> int:
        return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if link == 3 else 0

    def remote_pci(handle: int, link: int) -> Any:
        bus = "0000:29:00.0" if link < 2 else "0000:77:00.0"
        return pci_info(bus)

    module = scripted_pynvml(
        nvmlDeviceGetNvLinkState=state,
        nvmlDeviceGetNvLinkRemoteDeviceType=remote_type,
        nvmlDeviceGetNvLinkRemotePciInfo=remote_pci,
    )
    nvml = RealNvml(module)
    link = nvml.p2p(0, 1)
    assert link is not None
    assert link.nvlinks == 3
    assert link.label == "NV3"
    nvml.shutdown()
