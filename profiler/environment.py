"""The environment block of a run and of ``dpprof env``: versions, GPUs, driver, topology.

:func:`collect_environment` gathers what a maintainer asks for first in a GPU memory bug
report, as a JSON-ready dict (sizes in bytes). Each part is read on its own: a part that
cannot be read is ``None`` and ``env["reasons"][key]`` says why, so the function works (and is
tested) on a machine with neither a GPU nor an NVIDIA driver. :func:`environment_markdown`
renders it for a GitHub issue, :func:`environment_rows` for a terminal table.

Keys: ``dpprof_version``, ``python_version``, ``python_implementation``, ``platform``,
``hostname``, ``torch_version``, ``torch_cuda_version`` (``torch.version.cuda``; None on a CPU
build), ``cudnn_version`` (``torch.backends.cudnn.version()``, an integer as cuDNN encodes it),
``nccl_version`` (``torch.cuda.nccl.version()`` as "major.minor.patch"),
``cuda_visible_devices`` and ``cuda_device_order`` (None when unset), ``cuda_available``,
``cuda_device_count``, ``nvml`` (``{"available", "reason", "hint"}``), ``driver_version``,
``cuda_driver_version`` (the CUDA version the driver supports, "12.4"), ``gpus`` (one dict per
CUDA device, in CUDA index order), ``topology`` (links between the visible GPUs, or None),
``notes`` and ``reasons``.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Callable, Mapping
from typing import Any

from dpprof.nvml import libnvml
from dpprof.nvml.devices import resolve_visible_devices, torch_cuda_uuids
from dpprof.nvml.queries import NvmlBackend, cuda_version_string
from dpprof.units import fmt_bytes
from dpprof.version import __version__

__all__ = ["collect_environment", "environment_markdown", "environment_rows"]

# (key, label) of the scalar facts, in display order.
_FIELDS: tuple[tuple[str, str], ...] = (
    ("dpprof_version", "dpprof"),
    ("python_version", "Python"),
    ("platform", "Platform"),
    ("hostname", "Host"),
    ("torch_version", "PyTorch"),
    ("torch_cuda_version", "PyTorch built with CUDA"),
    ("cudnn_version", "cuDNN"),
    ("nccl_version", "NCCL"),
    ("cuda_available", "CUDA available"),
    ("cuda_device_count", "CUDA devices"),
    ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"),
    ("cuda_device_order", "CUDA_DEVICE_ORDER"),
    ("driver_version", "NVIDIA driver"),
    ("cuda_driver_version", "CUDA supported by the driver"),
)
_UNSET_OK = {"cuda_visible_devices", "cuda_device_order"}


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def collect_environment(
    nvml: NvmlBackend | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    use_cuda: bool = True,
) -> dict[str, Any]:
    """Collect the environment; never raises.

    ``nvml`` defaults to the process-wide :class:`~dpprof.nvml.libnvml.RealNvml`. ``environ``
    defaults
    to ``os.environ``. ``use_cuda=False`` keeps torch from initialising CUDA (GPU facts then
    come from NVML alone).
    """
    environ = os.environ if environ is None else environ
    facts = _Facts()
    notes: list[str] = []
    _put_host(facts, environ)
    torch_mod = _put_torch(facts)
    backend = nvml if nvml is not None else libnvml.default_nvml()
    nvml_ok = _put_driver(facts, backend)
    _put_gpus(facts, backend if nvml_ok else None, environ,
              torch_mod if use_cuda and facts.env.get("cuda_available") else None, notes)
    _put_topology(facts, backend if nvml_ok else None)
    env, reasons = facts.env, facts.reasons
    env["notes"] = notes
    env["reasons"] = reasons
    return env


class _Facts:
    """The environment being collected: each fact, and why each one missing is missing."""

    def __init__(self) -> None:
        self.env: dict[str, Any] = {}
        self.reasons: dict[str, str] = {}

    def put(self, key: str, fn: Callable[[], Any], none_reason: str | None = None) -> Any:
        """``fn()`` stored under ``key``; None, with the reason, where it raised (or gave
        None and ``none_reason`` says why)."""
        try:
            value = fn()
        except Exception as exc:
            value = None
            self.reasons[key] = _describe(exc)
        else:
            if value is None and none_reason:
                self.reasons[key] = none_reason
        self.env[key] = value
        return value


def _put_host(facts: _Facts, environ: Mapping[str, str]) -> None:
    """dpprof's and Python's versions, the platform, the host and the CUDA variables."""
    put, env = facts.put, facts.env
    put("dpprof_version", _dpprof_version)
    put("python_version", lambda: platform.python_version())
    put("python_implementation", lambda: platform.python_implementation())
    put("platform", lambda: platform.platform())
    put("hostname", lambda: socket.gethostname())
    env["cuda_visible_devices"] = environ.get("CUDA_VISIBLE_DEVICES")
    env["cuda_device_order"] = environ.get("CUDA_DEVICE_ORDER")


def _put_torch(facts: _Facts) -> Any:
    """torch's version and what it was built with, and the CUDA devices it sees; the torch
    module, or None where it cannot be imported."""
    put, env, reasons = facts.put, facts.env, facts.reasons
    torch = put("torch_version", lambda: _import_torch().__version__)
    torch_mod = _import_torch_quietly() if torch is not None else None
    if torch_mod is None:
        for key in ("torch_cuda_version", "cudnn_version", "nccl_version", "cuda_available"):
            env[key] = None
            reasons[key] = reasons.get("torch_version", "torch is not importable")
        env["cuda_device_count"] = None
        reasons["cuda_device_count"] = reasons["cuda_available"]
    else:
        put("torch_cuda_version", lambda: torch_mod.version.cuda, "a CPU-only build of torch")
        put("cudnn_version", lambda: torch_mod.backends.cudnn.version(), "cuDNN not available")
        put("nccl_version", lambda: _nccl_version(torch_mod), "NCCL not available")
        available = put("cuda_available", lambda: bool(torch_mod.cuda.is_available()))
        put(
            "cuda_device_count",
            lambda: int(torch_mod.cuda.device_count()) if available else 0,
        )
    return torch_mod


def _put_driver(facts: _Facts, backend: NvmlBackend) -> bool:
    """NVML's status and the driver's versions; whether NVML is available."""
    put, env, reasons = facts.put, facts.env, facts.reasons
    try:
        status = backend.status()
        env["nvml"] = {"available": status.available, "reason": status.reason, "hint": status.hint}
    except Exception as exc:  # a broken backend must not break the report
        status = None
        env["nvml"] = {"available": False, "reason": _describe(exc), "hint": ""}
    nvml_ok = bool(status and status.available)
    if nvml_ok:
        put("driver_version", backend.driver_version)
        if env["driver_version"] is None:
            reasons["driver_version"] = backend.reason("driver_version") or "not available"
        put("cuda_driver_version", lambda: cuda_version_string(backend.cuda_driver_version()))
        if env["cuda_driver_version"] is None:
            reasons["cuda_driver_version"] = (
                backend.reason("cuda_driver_version") or "not available"
            )
    else:
        why = f"NVML not available: {env['nvml']['reason']}"
        env["driver_version"] = env["cuda_driver_version"] = None
        reasons["driver_version"] = reasons["cuda_driver_version"] = why
    return nvml_ok


def _put_gpus(facts: _Facts, nvml: NvmlBackend | None, environ: Mapping[str, str],
              torch_mod: Any, notes: list[str]) -> None:
    """One dict per CUDA device (``nvml``: None where NVML is not available; ``torch_mod``:
    None where torch may not initialise CUDA)."""
    env, reasons = facts.env, facts.reasons
    try:
        env["gpus"] = _gpus(nvml, environ, torch_mod, notes)
    except Exception as exc:
        env["gpus"] = []
        reasons["gpus"] = _describe(exc)
    if not env["gpus"] and "gpus" not in reasons:
        reasons["gpus"] = (
            "no GPU visible"
            if nvml is not None
            else f"NVML not available: {env['nvml']['reason']}; torch sees no CUDA device"
        )


def _put_topology(facts: _Facts, nvml: NvmlBackend | None) -> None:
    """The links between the visible GPUs (``nvml``: None where NVML is not available)."""
    env, reasons = facts.env, facts.reasons
    env["topology"] = None
    if nvml is not None:
        try:
            env["topology"] = _topology(nvml, env["gpus"])
        except Exception as exc:
            reasons["topology"] = _describe(exc)
        if env["topology"] is None and "topology" not in reasons:
            reasons["topology"] = "fewer than two GPUs matched to NVML devices"
    else:
        reasons["topology"] = f"NVML not available: {env['nvml']['reason']}"


def _dpprof_version() -> str:
    return __version__


def _import_torch() -> Any:
    import torch

    return torch


def _import_torch_quietly() -> Any:
    try:
        return _import_torch()
    except Exception:
        return None


def _nccl_version(torch: Any) -> str | None:
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    if isinstance(version, tuple | list):
        return ".".join(str(v) for v in version)
    if isinstance(version, int):  # torch < 1.11: 2708 -> 2.7.8; NCCL >= 2.9: 21903 -> 2.19.3
        if version >= 10000:
            return f"{version // 10000}.{(version % 10000) // 100}.{version % 100}"
        return f"{version // 1000}.{(version % 1000) // 100}.{version % 100}"
    return str(version)


def _gpus(
    nvml: NvmlBackend | None,
    environ: Mapping[str, str],
    torch: Any,
    notes: list[str],
) -> list[dict[str, Any]]:
    """One dict per CUDA device: from torch when CUDA is up, else from NVML."""
    gpus: list[dict[str, Any]] = []
    if torch is not None:
        uuids = torch_cuda_uuids()
        matched = (
            resolve_visible_devices(nvml, environ, uuids).devices
            if nvml is not None and uuids is not None
            else []
        )
        for i in range(torch.cuda.device_count()):
            gpu: dict[str, Any] = {"cuda_index": i, "reasons": {}}
            try:
                props = torch.cuda.get_device_properties(i)
                gpu["name"] = str(props.name)
                gpu["total_memory_bytes"] = int(props.total_memory)
                gpu["compute_capability"] = f"{props.major}.{props.minor}"
                gpu["uuid"] = uuids[i] if uuids and i < len(uuids) else None
                known = matched[i].uuid if i < len(matched) else None
                if known:  # NVML's spelling, with the GPU- or MIG- prefix the runtime omits
                    gpu["uuid"] = known
            except Exception as exc:
                for key in ("name", "total_memory_bytes", "compute_capability", "uuid"):
                    gpu.setdefault(key, None)
                    gpu["reasons"][key] = _describe(exc)
            if gpu.get("uuid") is None:
                gpu["reasons"].setdefault("uuid", "torch reports no UUID")
            dev = matched[i] if i < len(matched) else None
            gpu["nvml_index"] = dev.nvml_index if dev else None
            gpu["pci_bus_id"] = dev.pci_bus_id if dev else None
            if dev is None or dev.nvml_index is None:
                why = (dev.reason if dev else None) or (
                    "NVML not available" if nvml is None else "not matched to an NVML device"
                )
                gpu["reasons"]["nvml_index"] = gpu["reasons"]["pci_bus_id"] = why
            gpus.append(gpu)
        return gpus
    if nvml is None:
        return gpus
    found = resolve_visible_devices(nvml, environ)
    notes.extend(found.notes)
    for dev in found.devices:
        gpu = {
            "cuda_index": dev.cuda_index,
            "name": dev.name,
            "total_memory_bytes": dev.total_memory_bytes,
            "uuid": dev.uuid,
            "compute_capability": None,
            "nvml_index": dev.nvml_index,
            "pci_bus_id": dev.pci_bus_id,
            "reasons": {},
        }
        if dev.nvml_index is not None:
            cc = nvml.compute_capability(dev.nvml_index)
            if cc is not None:
                gpu["compute_capability"] = f"{cc[0]}.{cc[1]}"
            else:
                gpu["reasons"]["compute_capability"] = (
                    nvml.reason("compute_capability", dev.nvml_index) or "not available"
                )
        if dev.note:
            notes.append(f"cuda:{dev.cuda_index}: {dev.note}")
        for key in ("name", "total_memory_bytes", "uuid", "nvml_index", "pci_bus_id"):
            if gpu[key] is None:
                gpu["reasons"][key] = dev.reason or "not available"
        gpus.append(gpu)
    return gpus


def _topology(nvml: NvmlBackend, gpus: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Links between every pair of visible GPUs, as ``nvidia-smi topo -m`` labels them."""
    nodes = [(g["cuda_index"], g["nvml_index"]) for g in gpus if g.get("nvml_index") is not None]
    if len(nodes) < 2:
        return None
    matrix: list[list[str]] = []
    links: list[dict[str, Any]] = []
    for ca, a in nodes:
        row = []
        for cb, b in nodes:
            if a == b:
                row.append("X")
                continue
            link = nvml.p2p(a, b)
            row.append(link.label if link else "N/A")
            if link is not None and ca < cb:
                links.append(
                    {
                        "a": ca,
                        "b": cb,
                        "label": link.label,
                        "topology": link.topology,
                        "nvlinks": link.nvlinks,
                        "p2p_read": link.read,
                        "p2p_write": link.write,
                        "p2p_nvlink": link.nvlink_p2p,
                    }
                )
        matrix.append(row)
    return {"devices": [c for c, _ in nodes], "matrix": matrix, "links": links}


# --------------------------------------------------------------------------- rendering


def _reason(env: Mapping[str, Any], key: str) -> str | None:
    reason = (env.get("reasons") or {}).get(key)
    if reason and reason.startswith("NVML not available"):
        return "NVML not available"  # the NVML line gives the full reason once
    return reason


def _show(env: Mapping[str, Any], key: str) -> str:
    value = env.get(key)
    if value is None:
        reason = _reason(env, key)
        if reason:
            return f"n/a ({reason})"
        return "unset" if key in _UNSET_OK else "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key == "cuda_visible_devices" and value == "":
        return '"" (no GPU)'
    return str(value)


def _nvml_text(env: Mapping[str, Any]) -> str:
    nvml = env.get("nvml") or {}
    if nvml.get("available"):
        return "available"
    text = f"not available: {nvml.get('reason') or 'unknown reason'}"
    if nvml.get("hint"):
        text += f" ({nvml['hint']})"
    return text


def _gpu_cell(gpu: Mapping[str, Any], key: str) -> str:
    value = gpu.get(key)
    if value is None:
        return "n/a"
    if key == "total_memory_bytes":
        return str(fmt_bytes(value))
    return str(value)


def environment_rows(env: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs for a terminal table: the facts, NVML, one row per GPU, links."""
    rows = [(label, _show(env, key)) for key, label in _FIELDS]
    rows.append(("NVML", _nvml_text(env)))
    for gpu in env.get("gpus") or []:
        parts = [
            _gpu_cell(gpu, "name"),
            _gpu_cell(gpu, "total_memory_bytes"),
            f"cc {_gpu_cell(gpu, 'compute_capability')}",
            _gpu_cell(gpu, "uuid"),
        ]
        if gpu.get("nvml_index") is not None:
            parts.append(f"NVML {gpu['nvml_index']}")
        rows.append((f"cuda:{gpu.get('cuda_index')}", " · ".join(parts)))
    if not env.get("gpus"):
        rows.append(("GPUs", f"none ({_reason(env, 'gpus') or 'no GPU visible'})"))
    topology = env.get("topology")
    if topology:
        for link in topology.get("links", []):
            p2p = link.get("p2p_read") or "n/a"
            rows.append((f"cuda:{link['a']} ↔ cuda:{link['b']}", f"{link['label']}, P2P {p2p}"))
    for note in env.get("notes") or []:
        rows.append(("note", str(note)))
    return rows


def _md(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def environment_markdown(env: Mapping[str, Any], heading: str | None = "Environment") -> str:
    """A Markdown block for a GitHub issue: a GPU table, the topology and a key/value list."""
    lines: list[str] = []
    if heading:
        lines += [f"### {heading}", ""]
    gpus = env.get("gpus") or []
    if gpus:
        lines += [
            "| CUDA | GPU | memory | compute capability | UUID | NVML index | PCI bus id |",
            "| ---: | --- | ---: | :---: | --- | ---: | --- |",
        ]
        for gpu in gpus:
            cells = [
                str(gpu.get("cuda_index")),
                _gpu_cell(gpu, "name"),
                _gpu_cell(gpu, "total_memory_bytes"),
                _gpu_cell(gpu, "compute_capability"),
                f"`{gpu['uuid']}`" if gpu.get("uuid") else "n/a",
                _gpu_cell(gpu, "nvml_index"),
                _gpu_cell(gpu, "pci_bus_id"),
            ]
            lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
        lines.append("")
    else:
        lines += [f"GPUs: none ({_md(_reason(env, 'gpus') or 'no GPU visible')}).", ""]
    topology = env.get("topology")
    if topology and topology.get("matrix"):
        names = [f"cuda:{d}" for d in topology["devices"]]
        lines += [
            "GPU links (`nvidia-smi topo -m` labels: NV# = NVLinks, PIX/PXB/PHB/NODE/SYS = PCIe):",
            "",
            "| | " + " | ".join(names) + " |",
            "| --- |" + " :---: |" * len(names),
        ]
        for name, row in zip(names, topology["matrix"], strict=False):
            lines.append(f"| {name} | " + " | ".join(_md(c) for c in row) + " |")
        lines.append("")
    for key, label in _FIELDS:
        lines.append(f"- **{label}**: {_md(_show(env, key))}")
    lines.append(f"- **NVML**: {_md(_nvml_text(env))}")
    for note in env.get("notes") or []:
        lines.append(f"- note: {_md(note)}")
    return "\n".join(lines) + "\n"
