"""NVML over ``pynvml``: the only module in the project that imports it.

Everything dpprof asks the NVIDIA driver goes through the interface of
:mod:`dpprof.nvml.queries` (:class:`~dpprof.nvml.queries.NvmlBackend`: the queries, what
they answer, and its failure model: nothing raises to the caller). Here is its
implementation over the driver, :class:`RealNvml`, and the process-wide one
(:func:`default_nvml`, which the tests replace with their fake).

:class:`RealNvml` runs over ``pynvml`` (the ``nvidia-ml-py`` package). NVML is initialised
lazily on the first query (``nvmlInit``), shut down at interpreter exit (``atexit``), and the
initialisation, the handle cache and the reason book are guarded by a lock, so the sampler
thread and the main thread may share one instance (NVML calls themselves are thread-safe,
per the NVML API reference, "Multi-threading"). Where NVML cannot start (``pynvml`` not
importable, no driver library, the driver not loaded, permission denied), its status (and
:func:`nvml_status`) says why and what to do.

Semantics follow the NVML API reference (docs.nvidia.com/deploy/nvml-api):

- ``nvmlDeviceGetMemoryInfo``: total, free and used bytes of the device's framebuffer. With a
  driver that has ``nvmlDeviceGetMemoryInfo_v2`` (R510+), the v2 structure is read: its ``used``
  excludes the memory the driver reserves (``reserved``), as ``nvidia-smi`` shows it; older
  drivers fall back to v1, whose ``used`` includes it.
- ``nvmlDeviceGetUtilizationRates``: percent of time over the past sample period (between 1/6 s
  and 1 s, product dependent) during which a kernel ran / device memory was read or written.
- ``nvmlDeviceGetComputeRunningProcesses`` (``_v3``, falling back to ``_v2`` and the
  unversioned call on older drivers): ``usedGpuMemory`` is ``None`` or
  ``NVML_VALUE_NOT_AVAILABLE`` (2**64 - 1) when the driver cannot tell (Windows WDDM, or a
  container without access to the host PID namespace); both become ``None``.
- ``nvmlDeviceGetP2PStatus`` / ``nvmlDeviceGetTopologyCommonAncestor`` /
  ``nvmlDeviceGetNvLinkState`` + ``nvmlDeviceGetNvLinkRemotePciInfo``: peer access and the
  path between two GPUs, labelled as ``nvidia-smi topo -m`` labels them.
- Strings (UUID, name, driver version, PCI bus id) are ``bytes`` in older ``pynvml`` releases
  and ``str`` in newer ones; both are accepted.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from dpprof.nvml.queries import (
    MIG_SLOTS,
    NVML_VALUE_NOT_AVAILABLE,
    MemoryInfo,
    MigDevice,
    NvmlBackend,
    NvmlQueryError,
    NvmlStatus,
    ProcessMemory,
    Utilization,
    mig_device_index,
    normalize_pci_bus_id,
    nvml_text,
    split_mig_index,
)

T = TypeVar("T")

HINT_NO_GPU = (
    "install the NVIDIA driver, or run on a machine with NVIDIA GPUs; without NVML dpprof "
    "still runs its emulated backend"
)
HINT_NO_BINDINGS = "install the NVML Python bindings: pip install nvidia-ml-py"
HINT_PERMISSION = (
    "run as a user allowed to query the GPUs (in a container: expose the devices, e.g. "
    "docker run --gpus all)"
)
HINT_DRIVER_MISMATCH = (
    "the NVIDIA kernel module and the user-space driver differ: reboot or reinstall"
)

# nvmlGpuP2PStatus_t (nvml.h)
_P2P_STATUS = {
    0: "ok",
    1: "chipset not supported",
    2: "GPU not supported",
    3: "IOH topology not supported",
    4: "disabled by regkey",
    5: "not supported",
    6: "unknown",
}

# nvmlGpuTopologyLevel_t (nvml.h) -> the labels of `nvidia-smi topo -m`:
# PIX = at most one PCIe bridge, PXB = several PCIe bridges, PHB = a PCIe host bridge,
# NODE = host bridges within one NUMA node, SYS = across NUMA nodes (SMP interconnect).
_TOPOLOGY_LEVEL = {
    0: "BOARD",  # NVML_TOPOLOGY_INTERNAL: both GPUs on one board
    10: "PIX",  # NVML_TOPOLOGY_SINGLE
    20: "PXB",  # NVML_TOPOLOGY_MULTIPLE
    30: "PHB",  # NVML_TOPOLOGY_HOSTBRIDGE
    40: "NODE",  # NVML_TOPOLOGY_NODE (alias NVML_TOPOLOGY_CPU)
    50: "SYS",  # NVML_TOPOLOGY_SYSTEM
}

# nvmlReturn_t codes (nvml.h), used when the pynvml module lacks a constant.
_ERR = {
    "UNINITIALIZED": 1,
    "INVALID_ARGUMENT": 2,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "NOT_FOUND": 6,
    "DRIVER_NOT_LOADED": 9,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "GPU_IS_LOST": 15,
    "LIB_RM_VERSION_MISMATCH": 18,
}



# --------------------------------------------------------------------------- pynvml


class RealNvml(NvmlBackend):
    """:class:`NvmlBackend` over ``pynvml``.

    ``module`` replaces the ``pynvml`` module (anything with the same functions, constants and
    ``NVMLError``); by default ``pynvml`` is imported on first use. Nothing happens in the
    constructor: the import and ``nvmlInit`` run on the first query, once, under a lock; on
    success ``nvmlShutdown`` is registered with :mod:`atexit`.
    """

    def __init__(self, module: Any = None) -> None:
        super().__init__()
        self._module_override = module
        self._nv: Any = None
        self._lock = threading.RLock()
        self._status: NvmlStatus | None = None
        self._initialized = False
        self._handles: dict[int, Any] = {}
        self._process_fn: Callable[[Any], Any] | None = None
        self._memory_v2: dict[int, bool] = {}  # per device: whether the v2 query works

    # -- lifecycle ---------------------------------------------------------------------

    def status(self) -> NvmlStatus:
        """Import ``pynvml`` and run ``nvmlInit`` on first call; the outcome is kept."""
        status = self._status
        if status is not None:
            return status
        with self._lock:
            if self._status is None:
                self._status = self._init()
            return self._status

    def _init(self) -> NvmlStatus:
        if self._module_override is not None:
            nv = self._module_override
        else:
            try:
                nv = importlib.import_module("pynvml")
            except Exception as exc:  # ImportError, or a broken install
                return NvmlStatus(
                    False,
                    f"the NVML Python bindings (module pynvml) cannot be imported: {exc}",
                    HINT_NO_BINDINGS,
                )
        self._nv = nv
        try:
            nv.nvmlInit()
        except Exception as exc:
            error = self._translate(exc)
            return NvmlStatus(False, f"nvmlInit failed: {error.reason}", _hint_for(error))
        self._initialized = True
        atexit.register(self.shutdown)
        return NvmlStatus(True, "NVML initialised", "")

    def shutdown(self) -> None:
        """``nvmlShutdown`` if this instance initialised NVML; the next query re-initialises."""
        with self._lock:
            if self._initialized:
                self._initialized = False
                # At exit, with the driver gone, there is nothing left to do on failure.
                with contextlib.suppress(Exception):
                    self._nv.nvmlShutdown()
                atexit.unregister(self.shutdown)
            self._handles.clear()
            self._process_fn = None
            self._memory_v2 = {}
            self._status = None

    # -- error translation ---------------------------------------------------------------

    def _code(self, name: str) -> int:
        value = getattr(self._nv, f"NVML_ERROR_{name}", _ERR[name])
        return value if isinstance(value, int) else _ERR[name]

    def _translate(self, exc: BaseException) -> NvmlQueryError:
        """A pynvml exception as :class:`NvmlQueryError` (kind from the NVML return code)."""
        if isinstance(exc, NvmlQueryError):
            return exc
        mismatch = getattr(self._nv, "NVMLLibraryMismatchError", None)
        if isinstance(mismatch, type) and isinstance(exc, mismatch):
            return NvmlQueryError(f"not supported by the installed driver ({exc})", "not_supported")
        code = getattr(exc, "value", None)
        if not isinstance(code, int):
            if isinstance(exc, OSError):
                return NvmlQueryError(f"cannot load the NVML library: {exc}", "not_available")
            return NvmlQueryError(f"{type(exc).__name__}: {exc}", "error")
        try:
            text = str(exc)
        except Exception:
            text = f"NVML error {code}"
        kinds = {
            "NOT_SUPPORTED": "not_supported",
            "FUNCTION_NOT_FOUND": "not_supported",
            "NO_PERMISSION": "no_permission",
            "LIBRARY_NOT_FOUND": "not_available",
            "DRIVER_NOT_LOADED": "not_available",
            "LIB_RM_VERSION_MISMATCH": "not_available",
            "UNINITIALIZED": "not_available",
            "NOT_FOUND": "not_found",
            "GPU_IS_LOST": "gpu_lost",
            "INVALID_ARGUMENT": "invalid_argument",
        }
        for name, kind in kinds.items():
            if code == self._code(name):
                if name == "LIBRARY_NOT_FOUND":
                    library = "nvml.dll" if sys.platform.startswith("win") else "libnvidia-ml.so.1"
                    text = f"{text}: {library} cannot be loaded, so no NVIDIA driver is installed"
                return NvmlQueryError(text, kind)
        return NvmlQueryError(f"{text} (NVML error {code})", "error")

    def _nvml(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self._nv, fn_name, None)
        if fn is None:
            raise NvmlQueryError(f"{fn_name} is missing from this pynvml", "not_supported")
        try:
            return fn(*args)
        except Exception as exc:
            raise self._translate(exc) from exc

    def _handle(self, index: int) -> Any:
        with self._lock:
            handle = self._handles.get(index)
            if handle is None:
                mig = split_mig_index(index)
                if mig is None:
                    handle = self._nvml("nvmlDeviceGetHandleByIndex", index)
                else:
                    handle = self._nvml("nvmlDeviceGetMigDeviceHandleByIndex",
                                        self._handle(mig[0]), mig[1])
                self._handles[index] = handle
            return handle

    # -- queries -----------------------------------------------------------------------

    def _query_device_count(self) -> int:
        return int(self._nvml("nvmlDeviceGetCount"))

    def _query_uuid(self, index: int) -> str:
        return nvml_text(self._nvml("nvmlDeviceGetUUID", self._handle(index))) or ""

    def _query_name(self, index: int) -> str:
        return nvml_text(self._nvml("nvmlDeviceGetName", self._handle(index))) or ""

    def _query_memory(self, index: int) -> MemoryInfo:
        handle = self._handle(index)
        version = getattr(self._nv, "nvmlMemory_v2", None)
        if version is not None and self._memory_v2.get(index) is not False:
            try:
                mem = self._nvml("nvmlDeviceGetMemoryInfo", handle, version)
            except (NvmlQueryError, TypeError) as exc:
                # Only "this query does not exist here" switches this device to v1: no
                # nvmlDeviceGetMemoryInfo_v2 in the driver (pre-R510), a version mismatch, a
                # pynvml without the version argument. Anything else (NoPermission on a MIG
                # parent, a lost GPU) is this reading's failure: v1 would fail alike, and
                # switching would change what "used" means on every GPU (v1 counts the
                # driver's reserve, v2 does not).
                if isinstance(exc, NvmlQueryError) and exc.kind != "not_supported":
                    raise
                with self._lock:
                    self._memory_v2[index] = False
            else:
                with self._lock:
                    self._memory_v2[index] = True
                return MemoryInfo(int(mem.total), int(mem.free), int(mem.used), int(mem.reserved))
        mem = self._nvml("nvmlDeviceGetMemoryInfo", handle)
        return MemoryInfo(int(mem.total), int(mem.free), int(mem.used))

    def _query_utilization(self, index: int) -> Utilization:
        util = self._nvml("nvmlDeviceGetUtilizationRates", self._handle(index))
        return Utilization(int(util.gpu), int(util.memory))

    def _query_processes(self, index: int) -> list[ProcessMemory]:
        handle = self._handle(index)
        names = (
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetComputeRunningProcesses",
        )
        if self._process_fn is not None:
            procs = self._process_fn(handle)
        else:
            last: NvmlQueryError | None = None
            for fn_name in names:
                if getattr(self._nv, fn_name, None) is None:
                    continue
                try:
                    procs = self._nvml(fn_name, handle)
                except NvmlQueryError as exc:
                    if exc.kind != "not_supported":
                        raise
                    last = exc
                    continue
                self._process_fn = getattr(self._nv, fn_name)
                break
            else:
                raise last or NvmlQueryError("no process query in this pynvml", "not_supported")
        result = []
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            if used is not None and int(used) >= NVML_VALUE_NOT_AVAILABLE:
                used = None
            result.append(ProcessMemory(int(proc.pid), None if used is None else int(used)))
        return result

    def _query_driver_version(self) -> str:
        return nvml_text(self._nvml("nvmlSystemGetDriverVersion")) or ""

    def _query_cuda_driver_version(self) -> int:
        try:
            return int(self._nvml("nvmlSystemGetCudaDriverVersion"))
        except NvmlQueryError as exc:
            if exc.kind != "not_supported":
                raise
            return int(self._nvml("nvmlSystemGetCudaDriverVersion_v2"))

    def _query_pci_bus_id(self, index: int) -> str:
        info = self._nvml("nvmlDeviceGetPciInfo", self._handle(index))
        bus_id = (nvml_text(getattr(info, "busId", None))
                  or nvml_text(getattr(info, "busIdLegacy", None)))
        if not bus_id:
            raise NvmlQueryError("the driver returned no PCI bus id", "not_supported")
        return bus_id

    def _query_compute_capability(self, index: int) -> tuple[int, int]:
        major, minor = self._nvml("nvmlDeviceGetCudaComputeCapability", self._handle(index))
        return int(major), int(minor)

    def _query_p2p(self, a: int, b: int, caps: int) -> str:
        code = int(self._nvml("nvmlDeviceGetP2PStatus", self._handle(a), self._handle(b), caps))
        return _P2P_STATUS.get(code, f"status {code}")

    def _query_topology(self, a: int, b: int) -> str:
        level = int(
            self._nvml("nvmlDeviceGetTopologyCommonAncestor", self._handle(a), self._handle(b))
        )
        return _TOPOLOGY_LEVEL.get(level, f"level {level}")

    def _query_nvlinks(self, a: int, b: int) -> int:
        handle = self._handle(a)
        peer = normalize_pci_bus_id(self._query_pci_bus_id(b))
        max_links = getattr(self._nv, "NVML_NVLINK_MAX_LINKS", 18)
        count = 0
        answered = False
        for link in range(int(max_links)):
            try:
                active = self._nvml("nvmlDeviceGetNvLinkState", handle, link)
            except NvmlQueryError as exc:
                if exc.kind in ("invalid_argument", "not_supported", "not_found"):
                    if link == 0 and exc.kind == "not_supported":
                        raise  # no NVLink on this device at all
                    continue
                raise
            answered = True
            if not active:
                continue
            if self._nvlink_to_switch(handle, link):
                count += 1  # an NVSwitch reaches every GPU on the fabric
                continue
            remote = self._nvml("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            remote_id = nvml_text(getattr(remote, "busId", None)) or nvml_text(
                getattr(remote, "busIdLegacy", None)
            )
            if normalize_pci_bus_id(remote_id) == peer:
                count += 1
        if not answered:
            raise NvmlQueryError("no NVLink state could be read", "not_supported")
        return count

    def _nvlink_to_switch(self, handle: Any, link: int) -> bool:
        """Whether the far end of ``link`` is an NVSwitch (NVML_NVLINK_DEVICE_TYPE_SWITCH)."""
        switch = getattr(self._nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        try:
            kind = self._nvml("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        except NvmlQueryError:
            return False  # an older driver: fall back to comparing PCI bus ids
        return bool(kind == switch)

    def _query_mig_devices(self, index: int) -> list[MigDevice]:
        handle = self._handle(index)
        try:
            current, _pending = self._nvml("nvmlDeviceGetMigMode", handle)
        except NvmlQueryError as exc:
            if exc.kind == "not_supported":
                return []  # a GPU without MIG
            raise
        if not current:
            return []
        result = []
        for slot in range(int(self._nvml("nvmlDeviceGetMaxMigDeviceCount", handle))):
            try:
                mig = self._nvml("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except NvmlQueryError as exc:
                if exc.kind in ("not_found", "invalid_argument"):
                    continue  # an empty slot
                raise
            uuid = nvml_text(self._nvml("nvmlDeviceGetUUID", mig)) or ""
            gi = _optional(partial(self._nvml, "nvmlDeviceGetGpuInstanceId", mig))
            ci = _optional(partial(self._nvml, "nvmlDeviceGetComputeInstanceId", mig))
            mem = _optional(partial(self._nvml, "nvmlDeviceGetMemoryInfo", mig))
            if slot < MIG_SLOTS:
                with self._lock:
                    self._handles[mig_device_index(index, slot)] = mig
            result.append(
                MigDevice(
                    parent_index=index,
                    uuid=uuid,
                    gpu_instance_id=None if gi is None else int(gi),
                    compute_instance_id=None if ci is None else int(ci),
                    total_bytes=None if mem is None else int(mem.total),
                    index=mig_device_index(index, slot) if slot < MIG_SLOTS else None,
                )
            )
        return result


def _optional(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except NvmlQueryError:
        return None


def _hint_for(error: NvmlQueryError) -> str:
    if error.kind == "no_permission":
        return HINT_PERMISSION
    if "mismatch" in error.reason.lower():
        return HINT_DRIVER_MISMATCH
    return HINT_NO_GPU


_default_lock = threading.Lock()
_default: RealNvml | None = None


def default_nvml() -> NvmlBackend:
    """The process-wide :class:`RealNvml` (created on first call; NVML still starts lazily).

    Every part of dpprof gets its NVML backend here, looked up at call time
    (``libnvml.default_nvml()``): the tests install their fake by replacing this function.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = RealNvml()
        return _default


def nvml_status(nvml: NvmlBackend | None = None) -> NvmlStatus:
    """Whether NVML works here (the default backend unless one is given); never raises."""
    try:
        return (nvml or default_nvml()).status()
    except Exception as exc:  # pragma: no cover - status() itself does not raise
        return NvmlStatus(False, f"{type(exc).__name__}: {exc}", HINT_NO_GPU)
