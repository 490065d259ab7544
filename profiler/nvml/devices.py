"""Which GPUs a CUDA program sees, and which NVML devices they are.

CUDA and NVML number GPUs differently: NVML's index follows its own enumeration ("no
guarantees of consistency between reboots", NVML API reference, ``nvmlDeviceGetHandleByIndex``;
it is PCI bus order in practice), while a CUDA index counts the devices left after
``CUDA_VISIBLE_DEVICES``, in ``CUDA_DEVICE_ORDER`` order. dpprof therefore identifies a GPU by
its UUID, never by position: :func:`visible_devices` returns, per CUDA index, the NVML index,
UUID, name and memory of that GPU, or the reason it could not be matched.

``CUDA_VISIBLE_DEVICES`` is read as the CUDA driver reads it. Sources: CUDA C++ Programming
Guide, "CUDA Environment Variables"; NVIDIA Multi-Instance GPU User Guide, "CUDA Device
Enumeration"; and, where those are silent, PyTorch's re-implementation of the driver's parser
(``torch/cuda/__init__.py``: ``_parse_visible_devices``, ``_transform_uuid_to_ordinals``,
``_device_count_nvml``), which this module follows rule for rule:

1. Unset: every GPU is visible. Set, even to the empty string: only the listed ones, in the
   order listed (``"2,1"`` makes GPU 2 CUDA device 0). ``""`` means no GPU at all.
2. Entries are separated by commas. The first entry sets the kind of the whole list: it
   starts with ``GPU-`` (UUIDs), ``MIG-`` (MIG devices), or else it is a list of integers.
3. Integers are read like ``strtoul``: surrounding whitespace is skipped and the entry's
   leading number is used, so ``"1gpu2,2ampere"`` means ``1,2``. An entry that is not a
   number, or a negative number, ends the list: ``"0,2,-1,1"`` shows 0 and 2. An index past
   the last GPU also ends the list.
4. UUIDs are written as ``nvidia-smi -L`` prints them (``GPU-8932f937-d72c-4106-c12f-
   20bd9faed9f6``), or abbreviated to any prefix that identifies one GPU (``GPU-8932f937``).
   An entry without the ``GPU-`` prefix, or that matches no GPU or several, ends the list.
5. A device listed twice makes CUDA see no device at all.
6. MIG devices are ``MIG-<uuid>`` (driver R470 and newer) or the legacy
   ``MIG-GPU-<gpu uuid>/<GPU instance id>/<compute instance id>`` (R450, R460). A CUDA process
   enumerates a single MIG device, the first one listed.

Which physical GPU an *integer* means depends on ``CUDA_DEVICE_ORDER``: ``PCI_BUS_ID`` sorts by
PCI bus id; the default ``FASTEST_FIRST`` puts the fastest GPU first and leaves the rest
unspecified (in practice PCI order among identical GPUs). Without a CUDA runtime at hand the
mapping of integers is therefore made through PCI bus ids and marked with a note when it rests
on the FASTEST_FIRST assumption; pass the UUIDs CUDA itself reports (``cuda_uuids``, from
:func:`torch_cuda_uuids`) to make every match exact.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dpprof.nvml.queries import DeviceInfo, NvmlBackend, normalize_pci_bus_id

__all__ = [
    "CudaVisibleDevices",
    "VisibleDevice",
    "VisibleDevices",
    "VisibleEntry",
    "match_torch_uuid",
    "normalize_uuid",
    "nvml_index_for_uuid",
    "parse_cuda_visible_devices",
    "resolve_visible_devices",
    "torch_cuda_uuids",
    "visible_devices",
]

_LEADING_INT = re.compile(r"^\s*([+-]?[0-9]+)")
_UUID_BODY = re.compile(
    r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
)


@dataclass(frozen=True)
class VisibleEntry:
    """One entry of ``CUDA_VISIBLE_DEVICES``.

    ``kind``: ``index`` (``index`` set), ``gpu-uuid`` (``uuid`` is the ``GPU-`` string as
    written, maybe a prefix), ``mig-uuid`` (``uuid`` is the ``MIG-`` string as written) or
    ``mig-legacy`` (``uuid`` is the parent GPU's ``GPU-`` UUID, with the instance ids).
    """

    text: str
    kind: str
    index: int | None = None
    uuid: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True)
class CudaVisibleDevices:
    """``CUDA_VISIBLE_DEVICES`` parsed: the entries CUDA will try to enumerate, in order.

    ``raw`` is None when the variable is unset (every GPU visible). ``notes`` say where and
    why parsing stopped early.
    """

    raw: str | None
    entries: tuple[VisibleEntry, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def all_devices(self) -> bool:
        """True when the variable is unset: CUDA sees every GPU."""
        return self.raw is None

    @property
    def kind(self) -> str:
        """``all``, ``none``, ``index``, ``gpu-uuid`` or ``mig``."""
        if self.raw is None:
            return "all"
        if not self.entries:
            return "none"
        first = self.entries[0].kind
        return "mig" if first.startswith("mig") else first


@dataclass(frozen=True)
class VisibleDevice:
    """The GPU behind one CUDA index.

    ``nvml_index`` is None when it could not be matched (``reason`` says why); for a MIG device
    it is the parent GPU's index, ``uuid`` the MIG UUID and ``mig_index`` the index under which
    NVML reads the MIG device's own memory and processes (the parent's cover every slice).
    ``matched_by``: ``uuid`` (exact), ``uuid-prefix`` (an abbreviated UUID in
    ``CUDA_VISIBLE_DEVICES``), ``pci-bus-order`` (an integer, through CUDA_DEVICE_ORDER and
    PCI bus ids) or None. ``note`` flags a match that
    rests on an assumption.
    """

    cuda_index: int
    nvml_index: int | None
    uuid: str | None
    name: str | None = None
    total_memory_bytes: int | None = None
    pci_bus_id: str | None = None
    mig: bool = False
    matched_by: str | None = None
    reason: str | None = None
    note: str | None = None
    mig_index: int | None = None

    @property
    def sample_index(self) -> int | None:
        """The NVML index whose memory and processes are this CUDA device's: the MIG device's
        own for a MIG device (None when it cannot be addressed), else ``nvml_index``."""
        return self.mig_index if self.mig else self.nvml_index

    @property
    def matched(self) -> bool:
        """Whether this CUDA device was tied to an NVML device."""
        return self.nvml_index is not None


@dataclass(frozen=True)
class VisibleDevices:
    """:func:`resolve_visible_devices`' answer: the devices, the parse, and notes on both."""

    devices: list[VisibleDevice]
    parsed: CudaVisibleDevices
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- parsing


def parse_cuda_visible_devices(value: str | None) -> CudaVisibleDevices:
    """Parse a ``CUDA_VISIBLE_DEVICES`` value by the rules in this module's docstring.

    This is the syntactic part: which entries CUDA will try, in order. Rules that need to
    know the GPUs (an index past the last GPU, an unknown or ambiguous UUID prefix, two
    entries naming the same GPU) are applied by :func:`resolve_visible_devices`.
    """
    if value is None:
        return CudaVisibleDevices(None)
    items = value.split(",")
    if value.startswith("GPU-"):
        return _parse_uuid_list(value, items)
    if value.startswith("MIG-"):
        return _parse_mig_list(value, items)
    entries: list[VisibleEntry] = []
    notes: list[str] = []
    seen: set[int] = set()
    for item in items:
        match = _LEADING_INT.match(item)
        number = int(match.group(1)) if match else -1
        if match is None or number < 0:
            if value.strip():
                notes.append(f"CUDA_VISIBLE_DEVICES stops at {item!r}: not a device index >= 0")
            break
        if number in seen:
            notes.append(f"CUDA_VISIBLE_DEVICES lists device {number} twice: CUDA sees no GPU")
            return CudaVisibleDevices(value, (), tuple(notes))
        seen.add(number)
        entries.append(VisibleEntry(item, "index", index=number))
    return CudaVisibleDevices(value, tuple(entries), tuple(notes))


def _parse_uuid_list(value: str, items: list[str]) -> CudaVisibleDevices:
    entries: list[VisibleEntry] = []
    notes: list[str] = []
    for item in items:
        if not item.startswith("GPU-"):
            notes.append(f"CUDA_VISIBLE_DEVICES stops at {item!r}: not a GPU- UUID")
            break
        if any(e.text == item for e in entries):
            notes.append(f"CUDA_VISIBLE_DEVICES lists {item} twice: CUDA sees no GPU")
            return CudaVisibleDevices(value, (), tuple(notes))
        entries.append(VisibleEntry(item, "gpu-uuid", uuid=item))
    return CudaVisibleDevices(value, tuple(entries), tuple(notes))


def _parse_mig_list(value: str, items: list[str]) -> CudaVisibleDevices:
    entries: list[VisibleEntry] = []
    notes: list[str] = []
    for item in items:
        if not item.startswith("MIG-"):
            notes.append(f"CUDA_VISIBLE_DEVICES stops at {item!r}: not a MIG- device")
            break
        if any(e.text == item for e in entries):
            notes.append(f"CUDA_VISIBLE_DEVICES lists {item} twice: CUDA sees no GPU")
            return CudaVisibleDevices(value, (), tuple(notes))
        body = item[len("MIG-") :]
        if body.startswith("GPU-") and "/" in body:
            parts = body.split("/")
            if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                notes.append(
                    f"CUDA_VISIBLE_DEVICES stops at {item!r}: not MIG-GPU-<uuid>/<gi>/<ci>"
                )
                break
            entries.append(
                VisibleEntry(
                    item,
                    "mig-legacy",
                    uuid=parts[0],
                    gpu_instance_id=int(parts[1]),
                    compute_instance_id=int(parts[2]),
                )
            )
        else:
            entries.append(VisibleEntry(item, "mig-uuid", uuid=item))
    if len(entries) > 1:
        notes.append(
            f"a CUDA process enumerates a single MIG device: only {entries[0].text} is visible, "
            f"{len(entries) - 1} more ignored"
        )
        entries = entries[:1]
    return CudaVisibleDevices(value, tuple(entries), tuple(notes))


# --------------------------------------------------------------------------- UUIDs


def normalize_uuid(uuid: object, *, mig: bool = False) -> str | None:
    """A UUID in NVML's spelling: ``GPU-`` (or ``MIG-``) prefix, lower-case hex.

    Accepts NVML's own form, bytes, and what ``torch.cuda.get_device_properties(i).uuid``
    prints (the 36-character UUID without a prefix). Returns None for anything else.
    """
    if uuid is None:
        return None
    text = uuid.decode("ascii", "replace") if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().rstrip("\x00")
    for prefix in ("GPU-", "MIG-"):
        if text.upper().startswith(prefix) and _UUID_BODY.match(text[4:]):
            return prefix + text[4:].lower()
    if _UUID_BODY.match(text):
        return ("MIG-" if mig else "GPU-") + text.lower()
    return None


def match_torch_uuid(torch_uuid: object, nvml_uuids: Sequence[str | None]) -> str | None:
    """The NVML UUID (``GPU-...`` or ``MIG-...``) that a torch-reported UUID names, if any.

    ``torch.cuda.get_device_properties(i).uuid`` prints without the ``GPU-`` prefix; a MIG
    device reports the MIG UUID's bytes, so both prefixes are tried. Case is ignored.
    """
    wanted = normalize_uuid(torch_uuid)
    if wanted is None:
        return None
    body = wanted[4:]
    for candidate in nvml_uuids:
        norm = normalize_uuid(candidate)
        if norm is not None and norm[4:] == body and (norm[:4] == wanted[:4] or _bare(torch_uuid)):
            return candidate
    return None


def _bare(uuid: object) -> bool:
    text = uuid.decode("ascii", "replace") if isinstance(uuid, bytes) else str(uuid)
    return text.strip()[:4].upper() not in ("GPU-", "MIG-")


def nvml_index_for_uuid(nvml: NvmlBackend, uuid: object) -> int | None:
    """The NVML index of the GPU with this UUID (any spelling :func:`normalize_uuid` reads)."""
    uuids = [nvml.uuid(i) for i in range(nvml.device_count())]
    found = match_torch_uuid(uuid, uuids)
    return None if found is None else uuids.index(found)


def torch_cuda_uuids() -> list[str] | None:
    """The UUID of every CUDA device as the CUDA runtime reports it: 36 hex characters and
    dashes, without a prefix, since the runtime does not say whether it is a GPU (``GPU-``) or
    a MIG device (``MIG-``); :func:`resolve_visible_devices` tries both against NVML.

    None when torch is missing, CUDA is unavailable, or the UUIDs cannot be read. This
    initialises CUDA in the calling process: do not call it in a process that should stay
    off the GPUs (the ``watch`` parent).
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        result = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            uuid = normalize_uuid(getattr(props, "uuid", None))
            if uuid is None:
                return None
            raw = str(getattr(props, "uuid", "")).strip()
            # keep a prefix only where the runtime wrote one; never invent "GPU-"
            result.append(uuid if raw[:4].upper() in ("GPU-", "MIG-") else uuid[4:])
        return result
    except Exception:
        return None


# --------------------------------------------------------------------------- resolution


def visible_devices(
    nvml: NvmlBackend,
    env: Mapping[str, str] | None = None,
    cuda_uuids: Sequence[object] | None = None,
) -> list[VisibleDevice]:
    """Per CUDA index, in order, the NVML device behind it (see :func:`resolve_visible_devices`)."""
    return resolve_visible_devices(nvml, env, cuda_uuids).devices


def resolve_visible_devices(
    nvml: NvmlBackend,
    env: Mapping[str, str] | None = None,
    cuda_uuids: Sequence[object] | None = None,
) -> VisibleDevices:
    """Match each CUDA device to an NVML device by UUID.

    ``env`` defaults to ``os.environ`` (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``).
    ``cuda_uuids``: the UUIDs the CUDA runtime reports per CUDA index (:func:`torch_cuda_uuids`);
    when given they decide, and ``CUDA_VISIBLE_DEVICES`` is not needed. Never raises: what
    cannot be matched carries a ``reason``.
    """
    env = os.environ if env is None else env
    parsed = parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    notes = list(parsed.notes)
    status = nvml.status()
    if cuda_uuids is not None:
        return VisibleDevices(_by_cuda_uuids(nvml, cuda_uuids), parsed, notes)
    if not status.available:
        reason = f"NVML not available: {status.reason}"
        devices = [
            VisibleDevice(
                i,
                None,
                normalize_uuid(e.uuid, mig=e.kind == "mig-uuid") if e.uuid else None,
                reason=reason,
            )
            for i, e in enumerate(parsed.entries)
        ]
        if parsed.all_devices:
            notes.append(f"cannot list the GPUs: {reason}")
        return VisibleDevices(devices, parsed, notes)

    gpus = nvml.devices()
    if parsed.kind == "mig":
        return VisibleDevices(_mig(nvml, gpus, parsed.entries[0], notes), parsed, notes)
    if parsed.kind == "gpu-uuid":
        chosen: list[tuple[DeviceInfo, str, str | None]] = []
        for entry in parsed.entries:
            prefix = entry.uuid or ""
            hits = [g for g in gpus if g.uuid and g.uuid.lower().startswith(prefix.lower())]
            if len(hits) != 1:
                what = "matches no GPU" if not hits else f"matches {len(hits)} GPUs"
                notes.append(f"CUDA_VISIBLE_DEVICES stops at {entry.text!r}: it {what}")
                break
            exact = hits[0].uuid is not None and hits[0].uuid.lower() == prefix.lower()
            chosen.append((hits[0], "uuid" if exact else "uuid-prefix", None))
        return VisibleDevices(_finish(chosen, notes), parsed, notes)

    order, order_note = _cuda_order(gpus, env)
    if parsed.all_devices:
        picked = [(gpus[i], "pci-bus-order", order_note) for i in order]
    else:
        picked = []
        for entry in parsed.entries:
            assert entry.index is not None
            if entry.index >= len(order):
                notes.append(
                    f"CUDA_VISIBLE_DEVICES stops at {entry.text!r}: there are only "
                    f"{len(order)} GPUs"
                )
                break
            picked.append((gpus[order[entry.index]], "pci-bus-order", order_note))
    if any(g.reasons.get("uuid") for g, _, _ in picked):
        notes.append("some GPUs have no readable UUID; they are listed by PCI order only")
    return VisibleDevices(_finish(picked, notes), parsed, notes)


def _finish(
    chosen: list[tuple[DeviceInfo, str, str | None]], notes: list[str]
) -> list[VisibleDevice]:
    indices = [g.index for g, _, _ in chosen]
    if len(set(indices)) != len(indices):
        notes.append("CUDA_VISIBLE_DEVICES names one GPU twice: CUDA sees no GPU")
        return []
    return [
        VisibleDevice(
            cuda_index=i,
            nvml_index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            total_memory_bytes=gpu.total_bytes,
            pci_bus_id=gpu.pci_bus_id,
            matched_by=how,
            reason=None if gpu.uuid else f"UUID unreadable: {gpu.reasons.get('uuid')}",
            note=note,
        )
        for i, (gpu, how, note) in enumerate(chosen)
    ]


def _pci_key(bus_id: str | None) -> tuple[int, int, int, int] | None:
    norm = normalize_pci_bus_id(bus_id)
    if norm is None:
        return None
    try:
        domain, bus, rest = norm.split(":")
        dev, fn = rest.split(".")
        return int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16)
    except ValueError:
        return None


def _cuda_order(gpus: list[DeviceInfo], env: Mapping[str, str]) -> tuple[list[int], str | None]:
    """Positions in ``gpus`` in CUDA's enumeration order, and a note if that is assumed."""
    keys = [_pci_key(g.pci_bus_id) for g in gpus]
    if any(k is None for k in keys):
        return list(range(len(gpus))), (
            "PCI bus ids unreadable: CUDA index assumed equal to NVML index"
        )
    order = sorted(range(len(gpus)), key=lambda i: keys[i] or (0, 0, 0, 0))
    device_order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST").strip().upper()
    if device_order == "PCI_BUS_ID":
        return order, None
    models = {(g.name, g.total_bytes) for g in gpus}
    if len(models) > 1:
        return order, (
            "CUDA_DEVICE_ORDER=FASTEST_FIRST with mixed GPU models: CUDA may put another GPU "
            "first; set CUDA_DEVICE_ORDER=PCI_BUS_ID or match by the UUIDs CUDA reports"
        )
    return order, None


def _mig(
    nvml: NvmlBackend, gpus: list[DeviceInfo], entry: VisibleEntry, notes: list[str]
) -> list[VisibleDevice]:
    for gpu in gpus:
        migs = nvml.mig_devices(gpu.index) or []
        for mig in migs:
            if entry.kind == "mig-uuid":
                hit = mig.uuid.lower() == (entry.uuid or "").lower()
            else:
                hit = (
                    (gpu.uuid or "").lower() == (entry.uuid or "").lower()
                    and mig.gpu_instance_id == entry.gpu_instance_id
                    and mig.compute_instance_id == entry.compute_instance_id
                )
            if hit:
                return [
                    VisibleDevice(
                        cuda_index=0,
                        nvml_index=gpu.index,
                        uuid=mig.uuid,
                        name=f"{gpu.name} MIG {mig.gpu_instance_id}/{mig.compute_instance_id}",
                        total_memory_bytes=mig.total_bytes,
                        pci_bus_id=gpu.pci_bus_id,
                        mig=True,
                        matched_by="uuid",
                        mig_index=mig.index,
                    )
                ]
    notes.append(f"CUDA_VISIBLE_DEVICES stops at {entry.text!r}: no such MIG device")
    return []


def _by_cuda_uuids(nvml: NvmlBackend, cuda_uuids: Sequence[object]) -> list[VisibleDevice]:
    status = nvml.status()
    gpus = nvml.devices() if status.available else []
    migs = [(gpu, mig) for gpu in gpus for mig in (nvml.mig_devices(gpu.index) or [])]
    result = []
    for i, raw in enumerate(cuda_uuids):
        uuid = normalize_uuid(raw)
        if not status.available:
            result.append(
                VisibleDevice(i, None, uuid, reason=f"NVML not available: {status.reason}")
            )
            continue
        if uuid is None:
            result.append(VisibleDevice(i, None, None, reason=f"not a UUID: {raw!r}"))
            continue
        found = match_torch_uuid(raw, [g.uuid for g in gpus])
        if found is not None:
            gpu = next(g for g in gpus if g.uuid == found)
            result.append(
                VisibleDevice(
                    i,
                    gpu.index,
                    gpu.uuid,
                    gpu.name,
                    gpu.total_bytes,
                    gpu.pci_bus_id,
                    matched_by="uuid",
                )
            )
            continue
        found = match_torch_uuid(raw, [m.uuid for _, m in migs])
        if found is not None:
            gpu, mig = next((g, m) for g, m in migs if m.uuid == found)
            result.append(
                VisibleDevice(
                    i,
                    gpu.index,
                    mig.uuid,
                    f"{gpu.name} MIG {mig.gpu_instance_id}/{mig.compute_instance_id}",
                    mig.total_bytes,
                    gpu.pci_bus_id,
                    mig=True,
                    matched_by="uuid",
                    mig_index=mig.index,
                )
            )
            continue
        result.append(
            VisibleDevice(
                i, None, uuid, reason=f"no NVML device has UUID {uuid} (NVML sees {len(gpus)})"
            )
        )
    return result
