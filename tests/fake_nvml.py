"""A fake NVML for the tests: :class:`FakeNvml` implements dpprof's :class:`NvmlBackend`
interface from recorded values (devices as :class:`FakeDevice` dataclasses and a sequence or
callable of used-memory readings per device). It lives here, not in the package: production
code does not ship it (issue 10).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dpprof.nvml.libnvml import HINT_NO_GPU
from dpprof.nvml.queries import (
    NVML_VALUE_NOT_AVAILABLE,
    P2P_CAPS_NVLINK,
    P2P_CAPS_READ,
    MemoryInfo,
    MigDevice,
    NvmlBackend,
    NvmlQueryError,
    NvmlStatus,
    ProcessMemory,
    Utilization,
    mig_device_index,
    split_mig_index,
)

T = TypeVar("T")



Reading = int | None | BaseException
Readings = int | Sequence[Reading] | Callable[[int], Reading]


@dataclass
class FakeMig:
    """A MIG device of a :class:`FakeDevice`, read through its own handle (its index is
    :func:`mig_device_index` of the parent and its slot): ``used``, ``processes`` and ``fail``
    as for :class:`FakeDevice`; utilisation is not supported on MIG devices, as on real ones."""

    uuid: str
    gpu_instance_id: int = 0
    compute_instance_id: int = 0
    total_bytes: int = 10 * 2**30
    used: Readings = 0
    processes: Sequence[tuple[int, int | None]] | Callable[[int], Any] = ()
    util: Readings | None = None
    fail: Mapping[str, str | NvmlQueryError] = field(default_factory=dict)


def denied(what: str = "Insufficient Permissions") -> NvmlQueryError:
    """NVML_ERROR_NO_PERMISSION, as :class:`RealNvml` translates it: what a user without root
    gets for the memory and processes of a MIG-enabled GPU, or in a locked-down container."""
    return NvmlQueryError(what, "no_permission")


def mig_parent(uuid: str, *migs: FakeMig, **kw: Any) -> FakeDevice:
    """A MIG-enabled GPU as a user without root sees it: its own memory and process queries
    fail with NoPermission (they would span every slice), its MIG devices answer."""
    fail: dict[str, str | NvmlQueryError] = {"memory": denied(), "processes": denied(),
                                              "utilization": "Not Supported"}
    return FakeDevice(uuid=uuid, mig=migs, fail=fail, **kw)


@dataclass
class FakeDevice:
    """A recorded GPU for :class:`FakeNvml`.

    ``used``: the used-memory readings, one per :meth:`NvmlBackend.memory` call: an int (always
    that), a sequence (consumed in order; the last one repeats), or a callable taking the call
    number (0, 1, ...). A reading that is an exception is raised (an :class:`NvmlQueryError`
    fails that query with its reason; anything else too, as an unexpected error); ``None``
    makes the query fail as "Not Supported". ``util`` works the same way for the GPU
    utilisation percent (None: not supported). ``processes``: (pid, used bytes or None) pairs,
    or a callable of the call number returning them. As on a real machine, NVML lists a
    process that maps this GPU's memory through peer access (NVLink, P2P) with 0 bytes, and
    in a container without the host PID namespace it lists host PIDs: record them so.
    ``fail``: query name -> reason, to make any query (``"name"``, ``"uuid"``,
    ``"pci_bus_id"``, ...) fail with ``not_supported``, or -> an :class:`NvmlQueryError`
    (e.g. :func:`denied`) raised as it is.
    ``mig``: the MIG devices of this GPU. Note that :meth:`NvmlBackend.device_info` (and so
    :func:`dpprof.nvml.devices.visible_devices`) reads memory too, taking one reading.
    """

    uuid: str
    name: str = "NVIDIA Fake GPU"
    total_bytes: int = 80 * 2**30
    used: Readings = 0
    util: Readings | None = None
    processes: Sequence[tuple[int, int | None]] | Callable[[int], Any] = ()
    pci_bus_id: str | None = None
    compute_capability: tuple[int, int] | None = (9, 0)
    mig: Sequence[FakeMig] = ()
    fail: Mapping[str, str | NvmlQueryError] = field(default_factory=dict)


@dataclass(frozen=True)
class FakeLink:
    """The recorded path between two fake GPUs (see :class:`PeerLink` for the meanings)."""

    topology: str | None = "NODE"
    nvlinks: int | None = 0
    read: str | None = "ok"
    write: str | None = "ok"
    nvlink_p2p: str | None = None


class FakeNvml(NvmlBackend):
    """:class:`NvmlBackend` over recorded values; NVML indices are positions in ``devices``.

    ``links`` maps (a, b) index pairs to :class:`FakeLink` (looked up in both orders; a
    missing pair fails as not supported). ``available=False`` makes the whole backend
    unavailable with ``reason``/``hint``, as :class:`RealNvml` is on a machine without a driver.
    """

    def __init__(
        self,
        devices: Sequence[FakeDevice] = (),
        *,
        driver_version: str | None = "550.54.15",
        cuda_driver_version: int | None = 12040,
        links: Mapping[tuple[int, int], FakeLink] | None = None,
        available: bool = True,
        reason: str = "",
        hint: str = "",
    ) -> None:
        super().__init__()
        self.fake_devices = list(devices)
        self._driver = driver_version
        self._cuda = cuda_driver_version
        self._links = dict(links or {})
        self._status = (
            NvmlStatus(True, "fake NVML", "")
            if available
            else NvmlStatus(False, reason or "fake NVML marked unavailable", hint or HINT_NO_GPU)
        )
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, int], int] = {}

    @classmethod
    def unavailable(cls, reason: str, hint: str = HINT_NO_GPU) -> FakeNvml:
        """A fake without NVML (what a machine without a driver looks like)."""
        return cls((), available=False, reason=reason, hint=hint)

    def status(self) -> NvmlStatus:
        """Fixed at construction."""
        return self._status

    def calls(self, query: str, index: int) -> int:
        """How many times ``query`` ran for device ``index`` (for tests)."""
        with self._lock:
            return self._calls.get((query, index), 0)

    # -- helpers -------------------------------------------------------------------------

    def _device(self, index: int, query: str) -> FakeDevice:
        if not 0 <= index < len(self.fake_devices):
            raise NvmlQueryError(f"Invalid Argument (no device {index})", "invalid_argument")
        device = self.fake_devices[index]
        self._fail(device.fail, query)
        return device

    @staticmethod
    def _fail(fail: Mapping[str, str | NvmlQueryError], query: str) -> None:
        why = fail.get(query)
        if isinstance(why, NvmlQueryError):
            raise why
        if why is not None:
            raise NvmlQueryError(why, "not_supported")

    def _target(self, index: int, query: str) -> FakeDevice | FakeMig:
        """The GPU, or the MIG device a :func:`mig_device_index` names."""
        mig = split_mig_index(index)
        if mig is None:
            return self._device(index, query)
        parent, slot = mig
        if not 0 <= parent < len(self.fake_devices) or slot >= len(
                self.fake_devices[parent].mig):
            raise NvmlQueryError(f"Not Found (no MIG device {index})", "not_found")
        target = self.fake_devices[parent].mig[slot]
        self._fail(target.fail, query)
        return target

    def _next(self, query: str, index: int) -> int:
        with self._lock:
            n = self._calls.get((query, index), 0)
            self._calls[(query, index)] = n + 1
            return n

    @staticmethod
    def _read(readings: Readings, n: int) -> int:
        if callable(readings):
            value = readings(n)
        elif isinstance(readings, int):
            value = readings
        else:
            if not readings:
                raise NvmlQueryError("no recorded readings", "not_supported")
            value = readings[min(n, len(readings) - 1)]
        if isinstance(value, BaseException):
            raise value
        if value is None:
            raise NvmlQueryError("Not Supported", "not_supported")
        return int(value)

    # -- queries -------------------------------------------------------------------------

    def _query_device_count(self) -> int:
        return len(self.fake_devices)

    def _query_uuid(self, index: int) -> str:
        return self._device(index, "uuid").uuid

    def _query_name(self, index: int) -> str:
        return self._device(index, "name").name

    def _query_memory(self, index: int) -> MemoryInfo:
        device = self._target(index, "memory")
        used = self._read(device.used, self._next("memory", index))
        return MemoryInfo(device.total_bytes, max(device.total_bytes - used, 0), used)

    def _query_utilization(self, index: int) -> Utilization:
        device = self._target(index, "utilization")
        if device.util is None:
            raise NvmlQueryError("Not Supported", "not_supported")
        gpu = self._read(device.util, self._next("utilization", index))
        return Utilization(gpu, 0)

    def _query_processes(self, index: int) -> list[ProcessMemory]:
        device = self._target(index, "processes")
        n = self._next("processes", index)
        procs = device.processes(n) if callable(device.processes) else device.processes
        if isinstance(procs, BaseException):
            raise procs
        return [
            ProcessMemory(
                int(pid),
                None if used is None or used >= NVML_VALUE_NOT_AVAILABLE else int(used),
            )
            for pid, used in procs
        ]

    def _query_driver_version(self) -> str:
        if self._driver is None:
            raise NvmlQueryError("Not Supported", "not_supported")
        return self._driver

    def _query_cuda_driver_version(self) -> int:
        if self._cuda is None:
            raise NvmlQueryError("Not Supported", "not_supported")
        return self._cuda

    def _query_pci_bus_id(self, index: int) -> str:
        device = self._device(index, "pci_bus_id")
        return device.pci_bus_id or f"00000000:{0x10 + index:02X}:00.0"

    def _query_compute_capability(self, index: int) -> tuple[int, int]:
        device = self._device(index, "compute_capability")
        if device.compute_capability is None:
            raise NvmlQueryError("Not Supported", "not_supported")
        return device.compute_capability

    def _link(self, a: int, b: int) -> FakeLink:
        self._device(a, "p2p")
        self._device(b, "p2p")
        link = self._links.get((a, b)) or self._links.get((b, a))
        if link is None:
            raise NvmlQueryError("Not Supported", "not_supported")
        return link

    @staticmethod
    def _field(value: T | None) -> T:
        if value is None:
            raise NvmlQueryError("Not Supported", "not_supported")
        return value

    def _query_p2p(self, a: int, b: int, caps: int) -> str:
        link = self._link(a, b)
        if caps == P2P_CAPS_NVLINK:
            return self._field(link.nvlink_p2p or ("ok" if link.nvlinks else "not supported"))
        return self._field(link.read if caps == P2P_CAPS_READ else link.write)

    def _query_topology(self, a: int, b: int) -> str:
        return self._field(self._link(a, b).topology)

    def _query_nvlinks(self, a: int, b: int) -> int:
        return self._field(self._link(a, b).nvlinks)

    def _query_mig_devices(self, index: int) -> list[MigDevice]:
        device = self._device(index, "mig_devices")
        return [
            MigDevice(index, m.uuid, m.gpu_instance_id, m.compute_instance_id, m.total_bytes,
                      mig_device_index(index, slot))
            for slot, m in enumerate(device.mig)
        ]
