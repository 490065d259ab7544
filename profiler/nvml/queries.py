"""The NVML queries dpprof needs, and what they answer: the seam every part of dpprof asks
the NVIDIA driver through.

:class:`NvmlBackend` is a small interface with two implementations: :class:`RealNvml`
(:mod:`dpprof.nvml.libnvml`, over ``pynvml``) and the tests' ``FakeNvml``
(``tests/fake_nvml.py``, not shipped), driven by recorded values: a real implementation of
the interface, not a patched module. An implementation provides :meth:`NvmlBackend.status`
and the ``_query_*`` primitives, which return a value or raise :class:`NvmlQueryError`; the
public methods here never raise.

Failure model (the style of nvitop's ``nvitop/api/libnvml.py``): nothing here raises to the
caller.

- NVML as a whole can be unavailable: ``pynvml`` cannot be imported, the driver library
  ``libnvidia-ml.so.1`` is missing (``NVMLError_LibraryNotFound``), the driver is not loaded,
  permission is denied. :meth:`NvmlBackend.status` then returns
  ``NvmlStatus(available=False, reason=..., hint=...)``, :meth:`NvmlBackend.device_count` is 0
  and every query returns ``None``.
- A single query can fail (``NotSupported`` on a consumer board, ``NoPermission`` in a
  container, ``GPU is lost``): that query returns ``None`` and :meth:`NvmlBackend.reason` says
  why.

The values (:class:`MemoryInfo`, :class:`ProcessMemory`, :class:`PeerLink`...) are what
the NVML API reference's calls return, as :mod:`dpprof.nvml.libnvml` reads them.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

#: NVML's "value not available" marker for unsigned long long fields (``usedGpuMemory``).
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

# nvmlGpuP2PCapsIndex_t (nvml.h). Written out here because pynvml 12/13 define
# NVML_P2P_CAPS_INDEX_READ with a trailing comma, which makes it the tuple (0,).
P2P_CAPS_READ = 0
P2P_CAPS_WRITE = 1
P2P_CAPS_NVLINK = 2
P2P_CAPS_ATOMICS = 3


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
MIG_SLOTS = 64  # nvmlDeviceGetMaxMigDeviceCount is 7 on every MIG GPU so far


def mig_device_index(parent: int, slot: int) -> int:
    """The index that names MIG device ``slot`` of GPU ``parent`` in the per-device queries.

    On a MIG-enabled GPU the parent's memory and process queries answer for every slice
    (or, for a user without root, fail with NoPermission): what a CUDA process on one MIG
    device uses is only readable through that MIG device's own handle.
    """
    return MIG_INDEX_BASE + parent * MIG_SLOTS + slot


def split_mig_index(index: int) -> tuple[int, int] | None:
    """``(parent, slot)`` of an index made by :func:`mig_device_index`; None for a GPU's."""
    if index < MIG_INDEX_BASE:
        return None
    return divmod(index - MIG_INDEX_BASE, MIG_SLOTS)


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
    text = nvml_text(bus_id)
    if not text:
        return None
    try:
        domain_bus, dev_fn = text.rsplit(":", 1)
        domain, bus = domain_bus.split(":") if ":" in domain_bus else ("0", domain_bus)
        dev, fn = dev_fn.split(".") if "." in dev_fn else (dev_fn, "0")
        return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(dev, 16):02X}.{int(fn, 16):X}"
    except (ValueError, IndexError):
        return text.upper()


def nvml_text(value: Any) -> str | None:
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
