"""NVML access for dpprof: the only module in the project that imports ``pynvml``.

Everything dpprof asks the NVIDIA driver goes through :class:`NvmlBackend`, a small interface
with two implementations:

- :class:`RealNvml` over ``pynvml`` (the ``nvidia-ml-py`` package). NVML is initialised lazily
  on the first query (``nvmlInit``), shut down at interpreter exit (``atexit``), and the
  initialisation, the handle cache and the reason book are guarded by a lock, so the sampler
  thread and the main thread may share one instance (NVML calls themselves are thread-safe,
  per the NVML API reference, "Multi-threading").
- the tests' ``FakeNvml`` (``tests/fake_nvml.py``, not shipped), driven by recorded values: a
  real implementation of the interface, not a patched module.

Failure model (the style of nvitop's ``nvitop/api/libnvml.py``): nothing here raises to the
caller.

- NVML as a whole can be unavailable: ``pynvml`` cannot be imported, the driver library
  ``libnvidia-ml.so.1`` is missing (``NVMLError_LibraryNotFound``), the driver is not loaded,
  permission is denied. :meth:`NvmlBackend.status` (and :func:`nvml_status`) then returns
  ``NvmlStatus(available=False, reason=..., hint=...)``, :meth:`NvmlBackend.device_count` is 0
  and every query returns ``None``.
- A single query can fail (``NotSupported`` on a consumer board, ``NoPermission`` in a
  container, ``GPU is lost``): that query returns ``None`` and :meth:`NvmlBackend.reason` says
  why.

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
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

__all__ = [
    "MIG_INDEX_BASE",
    "NVML_VALUE_NOT_AVAILABLE",
    "DeviceInfo",
    "MemoryInfo",
    "MigDevice",
    "NvmlBackend",
    "NvmlQueryError",
    "NvmlStatus",
    "PeerLink",
    "ProcessMemory",
    "RealNvml",
    "Utilization",
    "cuda_version_string",
    "default_nvml",
    "mig_device_index",
    "normalize_pci_bus_id",
    "nvml_status",
    "split_mig_index",
]

T = TypeVar("T")

#: NVML's "value not available" marker for unsigned long long fields (``usedGpuMemory``).
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

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

# nvmlGpuP2PCapsIndex_t (nvml.h). Written out here because pynvml 12/13 define
# NVML_P2P_CAPS_INDEX_READ with a trailing comma, which makes it the tuple (0,).
P2P_CAPS_READ = 0
P2P_CAPS_WRITE = 1
P2P_CAPS_NVLINK = 2
P2P_CAPS_ATOMICS = 3

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


# --------------------------------------------------------------------------- value types


@dataclass(frozen=True)
class NvmlStatus:
    """Whether NVML can be used; when not, why (``reason``) and what to do (``hint``)."""

    available: bool
    reason: str = ""
    hint: str = ""


@dataclass(frozen=True)
class MemoryInfo:
    """``nvmlDeviceGetMemoryInfo``: bytes. ``reserved`` only from the v2 query, else None."""

    total: int
    free: int
    used: int
    reserved: int | None = None


@dataclass(frozen=True)
class Utilization:
    """``nvmlDeviceGetUtilizationRates``: percent busy over the driver's last sample period."""

    gpu: int
    memory: int


@dataclass(frozen=True)
class ProcessMemory:
    """One compute process on a device; ``used_bytes`` None when the driver cannot tell."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class MigDevice:
    """A MIG device (GPU instance / compute instance) of a physical GPU."""

    parent_index: int
    uuid: str
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    total_bytes: int | None = None
    # the index under which memory(), processes() and utilization() read this MIG device
    # itself (see mig_device_index); None where the backend cannot address it
    index: int | None = None


#: NVML indices from here up address MIG devices (:func:`mig_device_index`), not GPUs.
MIG_INDEX_BASE = 1 << 16
_MIG_SLOTS = 64  # nvmlDeviceGetMaxMigDeviceCount is 7 on every MIG GPU so far


def mig_device_index(parent: int, slot: int) -> int:
    """The index that names MIG device ``slot`` of GPU ``parent`` in the per-device queries.

    On a MIG-enabled GPU the parent's memory and process queries answer for every slice
    (or, for a user without root, fail with NoPermission): what a CUDA process on one MIG
    device uses is only readable through that MIG device's own handle.
    """
    return MIG_INDEX_BASE + parent * _MIG_SLOTS + slot


def split_mig_index(index: int) -> tuple[int, int] | None:
    """``(parent, slot)`` of an index made by :func:`mig_device_index`; None for a GPU's."""
    if index < MIG_INDEX_BASE:
        return None
    return divmod(index - MIG_INDEX_BASE, _MIG_SLOTS)


@dataclass(frozen=True)
class DeviceInfo:
    """Static facts about one NVML device; a field is None where it could not be read."""

    index: int
    uuid: str | None
    name: str | None
    total_bytes: int | None
    pci_bus_id: str | None
    reasons: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerLink:
    """How two GPUs reach each other. Fields are None where NVML cannot tell.

    ``read``/``write``/``nvlink_p2p``: the ``nvmlDeviceGetP2PStatus`` result for that capability
    ("ok", "not supported", "chipset not supported", ...). ``topology``: the common ancestor
    as ``nvidia-smi topo -m`` labels it (PIX, PXB, PHB, NODE, SYS, BOARD). ``nvlinks``: the
    number of active NVLinks from ``a`` whose remote end is ``b`` (direct links only: behind
    an NVSwitch, every link to a switch counts, as ``nvidia-smi topo -m`` counts them: NV12
    between any two A100s of an HGX board). A plain ``NV`` label means NVLink P2P is reported
    but the links could not be counted.
    """

    a: int
    b: int
    read: str | None = None
    write: str | None = None
    nvlink_p2p: str | None = None
    topology: str | None = None
    nvlinks: int | None = None

    @property
    def p2p_read(self) -> bool | None:
        """True when peer reads are supported, None when unknown."""
        return None if self.read is None else self.read == "ok"

    @property
    def p2p_write(self) -> bool | None:
        """True when peer writes are supported, None when unknown."""
        return None if self.write is None else self.write == "ok"

    @property
    def label(self) -> str:
        """The cell of ``nvidia-smi topo -m``: ``NV4``, ``PIX``, ... or ``N/A``."""
        if self.nvlinks:
            return f"NV{self.nvlinks}"
        if self.nvlink_p2p == "ok":
            return "NV"
        return self.topology or "N/A"


class NvmlQueryError(Exception):
    """A failed NVML query, with a reason for humans and a ``kind`` for code.

    Kinds: ``not_supported``, ``no_permission``, ``not_available`` (NVML itself unusable),
    ``not_found``, ``gpu_lost``, ``invalid_argument``, ``error``.
    """

    def __init__(self, reason: str, kind: str = "error") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


def cuda_version_string(version: int | None) -> str | None:
    """``nvmlSystemGetCudaDriverVersion``'s integer (1000 * major + 10 * minor) as 'major.minor'."""
    if version is None or version <= 0:
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def normalize_pci_bus_id(bus_id: str | bytes | None) -> str | None:
    """'00000000:3B:00.0' and '0000:3b:00.0' -> '00000000:3B:00.0' (NVML's long form)."""
    text = _text(bus_id)
    if not text:
        return None
    try:
        domain_bus, dev_fn = text.rsplit(":", 1)
        domain, bus = domain_bus.split(":") if ":" in domain_bus else ("0", domain_bus)
        dev, fn = dev_fn.split(".") if "." in dev_fn else (dev_fn, "0")
        return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(dev, 16):02X}.{int(fn, 16):X}"
    except (ValueError, IndexError):
        return text.upper()


def _text(value: Any) -> str | None:
    """NVML strings arrive as bytes (old pynvml) or str (new pynvml)."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "replace")
    return str(value).rstrip("\x00").strip()


# --------------------------------------------------------------------------- the interface


class NvmlBackend(ABC):
    """The NVML queries dpprof needs. Public methods never raise.

    Implementations provide :meth:`status` and the ``_query_*`` primitives, which return a
    value or raise :class:`NvmlQueryError`; the public methods turn a failure into ``None`` and
    remember why (see :meth:`reason`). Device indices are NVML indices (PCI bus order), not
    CUDA indices: map between them by UUID with :mod:`dpprof.nvml.devices`.
    """

    def __init__(self) -> None:
        self._reasons: dict[tuple[str, tuple[int, ...]], str] = {}
        self._reasons_lock = threading.Lock()

    # -- to implement ------------------------------------------------------------------

    @abstractmethod
    def status(self) -> NvmlStatus:
        """Whether NVML is usable; initialises it on first call (lazily)."""

    @abstractmethod
    def _query_device_count(self) -> int: ...

    @abstractmethod
    def _query_uuid(self, index: int) -> str: ...

    @abstractmethod
    def _query_name(self, index: int) -> str: ...

    @abstractmethod
    def _query_memory(self, index: int) -> MemoryInfo: ...

    @abstractmethod
    def _query_utilization(self, index: int) -> Utilization: ...

    @abstractmethod
    def _query_processes(self, index: int) -> list[ProcessMemory]: ...

    @abstractmethod
    def _query_driver_version(self) -> str: ...

    @abstractmethod
    def _query_cuda_driver_version(self) -> int: ...

    @abstractmethod
    def _query_pci_bus_id(self, index: int) -> str: ...

    @abstractmethod
    def _query_compute_capability(self, index: int) -> tuple[int, int]: ...

    @abstractmethod
    def _query_p2p(self, a: int, b: int, caps: int) -> str: ...

    @abstractmethod
    def _query_topology(self, a: int, b: int) -> str: ...

    @abstractmethod
    def _query_nvlinks(self, a: int, b: int) -> int: ...

    @abstractmethod
    def _query_mig_devices(self, index: int) -> list[MigDevice]: ...

    # -- public API ----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Shorthand for ``status().available``."""
        return self.status().available

    def reason(self, query: str, *args: int) -> str | None:
        """Why the last ``query(*args)`` returned None (e.g. ``reason("memory", 0)``)."""
        with self._reasons_lock:
            return self._reasons.get((query, tuple(args)))

    def device_count(self) -> int:
        """Number of GPUs NVML sees (all of them, regardless of CUDA_VISIBLE_DEVICES); 0 if none."""
        count = self._call("device_count", (), self._query_device_count)
        return count or 0

    def uuid(self, index: int) -> str | None:
        """The device UUID, ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
        return self._call("uuid", (index,), self._query_uuid, index)

    def name(self, index: int) -> str | None:
        """The product name, e.g. ``NVIDIA A100-SXM4-80GB``."""
        return self._call("name", (index,), self._query_name, index)

    def memory(self, index: int) -> MemoryInfo | None:
        """Total, free and used framebuffer bytes."""
        return self._call("memory", (index,), self._query_memory, index)

    def utilization(self, index: int) -> Utilization | None:
        """GPU and memory-controller utilisation in percent."""
        return self._call("utilization", (index,), self._query_utilization, index)

    def processes(self, index: int) -> list[ProcessMemory] | None:
        """Compute processes running on the device, with their used memory when known."""
        return self._call("processes", (index,), self._query_processes, index)

    def driver_version(self) -> str | None:
        """The driver version string, e.g. ``550.54.15``."""
        return self._call("driver_version", (), self._query_driver_version)

    def cuda_driver_version(self) -> int | None:
        """The CUDA version the driver supports, as NVML encodes it (12040 for 12.4)."""
        return self._call("cuda_driver_version", (), self._query_cuda_driver_version)

    def pci_bus_id(self, index: int) -> str | None:
        """The PCI bus id, ``domain:bus:device.function`` (``00000000:3B:00.0``)."""
        value = self._call("pci_bus_id", (index,), self._query_pci_bus_id, index)
        return normalize_pci_bus_id(value) if value else value

    def compute_capability(self, index: int) -> tuple[int, int] | None:
        """``nvmlDeviceGetCudaComputeCapability``: (major, minor)."""
        return self._call("compute_capability", (index,), self._query_compute_capability, index)

    def mig_devices(self, index: int) -> list[MigDevice] | None:
        """The MIG devices of a GPU; [] when MIG is off, None when it cannot be read."""
        return self._call("mig_devices", (index,), self._query_mig_devices, index)

    def p2p(self, a: int, b: int) -> PeerLink | None:
        """Peer access and the path from GPU ``a`` to GPU ``b``; None if NVML is unavailable.

        Each field of the result is read separately, so a ``NotSupported`` for one (say
        NVLink on a PCIe board) leaves the others intact.
        """
        if not self.status().available:
            self._remember(("p2p", (a, b)), self.status().reason)
            return None
        return PeerLink(
            a=a,
            b=b,
            read=self._call("p2p_read", (a, b), self._query_p2p, a, b, P2P_CAPS_READ),
            write=self._call("p2p_write", (a, b), self._query_p2p, a, b, P2P_CAPS_WRITE),
            nvlink_p2p=self._call("p2p_nvlink", (a, b), self._query_p2p, a, b, P2P_CAPS_NVLINK),
            topology=self._call("topology", (a, b), self._query_topology, a, b),
            nvlinks=self._call("nvlinks", (a, b), self._query_nvlinks, a, b),
        )

    def device_info(self, index: int) -> DeviceInfo:
        """UUID, name, total memory and PCI bus id of one device, with reasons for gaps."""
        mem = self.memory(index)
        uuid, name, bus = self.uuid(index), self.name(index), self.pci_bus_id(index)
        total = mem.total if mem else None
        fields = {"uuid": uuid, "name": name, "total_bytes": total, "pci_bus_id": bus}
        query_of = {"total_bytes": "memory"}
        reasons = {
            key: self.reason(query_of.get(key, key), index) or "not available"
            for key, value in fields.items()
            if value is None
        }
        return DeviceInfo(index, uuid, name, total, bus, reasons)

    def devices(self) -> list[DeviceInfo]:
        """:meth:`device_info` for every NVML device."""
        return [self.device_info(i) for i in range(self.device_count())]

    # -- plumbing ----------------------------------------------------------------------

    def _remember(self, key: tuple[str, tuple[int, ...]], reason: str | None) -> None:
        with self._reasons_lock:
            if reason is None:
                self._reasons.pop(key, None)
            else:
                self._reasons[key] = reason

    def _call(
        self, query: str, args: tuple[int, ...], fn: Callable[..., T], *fn_args: Any
    ) -> T | None:
        key = (query, args)
        status = self.status()
        if not status.available:
            self._remember(key, f"NVML not available: {status.reason}")
            return None
        try:
            value = fn(*fn_args)
        except NvmlQueryError as exc:
            self._remember(key, exc.reason)
            return None
        except Exception as exc:  # a query must never take the caller down
            self._remember(key, f"{type(exc).__name__}: {exc}")
            return None
        self._remember(key, None)
        return value


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
        return _text(self._nvml("nvmlDeviceGetUUID", self._handle(index))) or ""

    def _query_name(self, index: int) -> str:
        return _text(self._nvml("nvmlDeviceGetName", self._handle(index))) or ""

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
        return _text(self._nvml("nvmlSystemGetDriverVersion")) or ""

    def _query_cuda_driver_version(self) -> int:
        try:
            return int(self._nvml("nvmlSystemGetCudaDriverVersion"))
        except NvmlQueryError as exc:
            if exc.kind != "not_supported":
                raise
            return int(self._nvml("nvmlSystemGetCudaDriverVersion_v2"))

    def _query_pci_bus_id(self, index: int) -> str:
        info = self._nvml("nvmlDeviceGetPciInfo", self._handle(index))
        bus_id = _text(getattr(info, "busId", None)) or _text(getattr(info, "busIdLegacy", None))
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
            remote_id = _text(getattr(remote, "busId", None)) or _text(
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
            uuid = _text(self._nvml("nvmlDeviceGetUUID", mig)) or ""
            gi = _optional(partial(self._nvml, "nvmlDeviceGetGpuInstanceId", mig))
            ci = _optional(partial(self._nvml, "nvmlDeviceGetComputeInstanceId", mig))
            mem = _optional(partial(self._nvml, "nvmlDeviceGetMemoryInfo", mig))
            if slot < _MIG_SLOTS:
                with self._lock:
                    self._handles[mig_device_index(index, slot)] = mig
            result.append(
                MigDevice(
                    parent_index=index,
                    uuid=uuid,
                    gpu_instance_id=None if gi is None else int(gi),
                    compute_instance_id=None if ci is None else int(ci),
                    total_bytes=None if mem is None else int(mem.total),
                    index=mig_device_index(index, slot) if slot < _MIG_SLOTS else None,
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
