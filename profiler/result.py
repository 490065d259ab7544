"""The result model: one saved session object between measuring and reporting.

Every backend writes a :class:`RunResult`; every renderer reads one. It is saved as JSON
with a ``schema_version``; the field names below are a public contract. Bytes are bytes
everywhere (``*_bytes``), seconds are seconds (``*_s``); human units only in renderers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

# Categories of memory, one name each, used by the emulator's breakdown and the reports.
CATEGORIES: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer_state",
    "inputs",
    "activations",
    "outputs",
    "loss",
    "communication",
    "other",
)

STATUS_OK = "ok"
STATUS_OOM = "oom"
STATUS_ERROR = "error"


@dataclass
class TimelinePoint:
    """Memory on one device at one moment of the measured step."""

    t: float  # seconds since the step began (measured) or event index (emulated)
    allocated_bytes: int
    phase: str = ""


@dataclass
class DeviceResult:
    """What one device held during one scenario's measured step."""

    index: int  # cuda index (or virtual device index); DDP: the rank's device
    peak_allocated_bytes: int = 0  # allocator blocks, rounded as the CUDA allocator rounds
    peak_requested_bytes: int = 0  # bytes the tensors asked for, before rounding
    capacity_bytes: int = 0
    # bytes per category at the moment of peak_allocated_bytes (sums to it)
    breakdown_bytes: dict[str, int] = field(default_factory=dict)
    peak_reserved_bytes: int | None = None  # caching-allocator segments (measured or simulated)
    context_bytes: int | None = None  # CUDA context + library workspaces (measured or modelled)
    nvml_peak_used_bytes: int | None = None  # NVML's view (real GPUs only)
    peak_phase: str = ""  # the phase of the step in which the peak happened
    rank: int | None = None  # DDP rank, where the device belongs to one
    node: str | None = None  # host name (DDP across nodes)
    used: bool = True  # False when the scenario put no work on this device
    batch_rows: int = 0  # rows of the batch this device computed
    timeline: list[TimelinePoint] = field(default_factory=list)
    # Library workspaces served by the caching allocator (cuBLAS per handle and stream),
    # included in peak_reserved_bytes (modelled or measured); never in peak_allocated_bytes.
    workspace_bytes: int | None = None
    # context_bytes split by component (cuda_context, cudnn_library, ...), when modelled
    context_breakdown_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total_peak_bytes(self) -> int:
        """Peak the device must hold: reserved (or allocated) plus context and workspaces."""
        base = self.peak_reserved_bytes or self.peak_allocated_bytes
        return base + (self.context_bytes or 0)


@dataclass
class ScenarioResult:
    name: str
    status: str = STATUS_OK  # "ok" | "oom" | "error"
    message: str = ""
    devices: list[DeviceResult] = field(default_factory=list)
    oom_device: int | None = None
    oom_bytes: int | None = None  # bytes the device needed (emulated) or asked for (real OOM)
    loss: float | None = None
    step_time_s: float | None = None  # median over measured steps (real backends)
    step_time_spread_s: float | None = None  # max - min over measured steps
    throughput_samples_per_s: float | None = None
    batch: int = 0
    notes: list[str] = field(default_factory=list)

    def device(self, index: int) -> DeviceResult | None:
        for d in self.devices:
            if d.index == index:
                return d
        return None


@dataclass
class ScenarioComparison:
    primary_excess_bytes: int  # cuda:0 (device_ids[0]) minus the median of the other used devices
    imbalance: float  # max / mean of peak allocated over the used devices
    max_bytes: int
    mean_bytes: float


@dataclass
class Comparison:
    scenarios: dict[str, ScenarioComparison] = field(default_factory=dict)
    verdict: str = ""
    # bytes of cuda:0's peak that a fix removes: {"dp-loss-forward": ..., "ddp": ...}
    savings_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class RunResult:
    backend: str  # "emulated" | "cpu" | "cuda"
    workload: str
    batch: int
    gpus: int
    gpu_memory_bytes: int
    scenarios: list[ScenarioResult] = field(default_factory=list)
    comparison: Comparison = field(default_factory=Comparison)
    schema_version: int = SCHEMA_VERSION
    dpprof_version: str = ""
    created: str = ""  # ISO 8601, UTC
    seed: int = 0
    dtype: str = "float32"
    config: dict[str, Any] = field(default_factory=dict)  # every option the run used
    environment: dict[str, Any] = field(default_factory=dict)
    assumptions: list[str] = field(default_factory=list)  # how the numbers were obtained
    notes: list[str] = field(default_factory=list)

    def scenario(self, name: str) -> ScenarioResult | None:
        for s in self.scenarios:
            if s.name == name:
                return s
        return None

    # ---- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return _from_dict(cls, data)


class ResultFileError(Exception):
    """A file that is missing, not JSON, not a dpprof result, or from a newer dpprof."""


def _from_dict(tp: Any, data: Any) -> Any:
    """Build dataclass ``tp`` from ``data``, ignoring unknown keys (forward compatible)."""
    if not dataclasses.is_dataclass(tp):
        return data
    kwargs: dict[str, Any] = {}
    for name in (f.name for f in dataclasses.fields(tp)):
        if name not in data:
            continue
        value = data[name]
        sub = _NESTED.get((tp.__name__, name))
        if sub is not None and value is not None:
            kind, inner = sub
            if kind == "list":
                value = [_from_dict(inner, v) for v in value]
            elif kind == "dict":
                value = {k: _from_dict(inner, v) for k, v in value.items()}
            else:
                value = _from_dict(inner, value)
        kwargs[name] = value
    return tp(**kwargs)


_NESTED: dict[tuple[str, str], tuple[str, Any]] = {
    ("RunResult", "scenarios"): ("list", ScenarioResult),
    ("RunResult", "comparison"): ("one", Comparison),
    ("Comparison", "scenarios"): ("dict", ScenarioComparison),
    ("ScenarioResult", "devices"): ("list", DeviceResult),
    ("DeviceResult", "timeline"): ("list", TimelinePoint),
}


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Bring an older result up to :data:`SCHEMA_VERSION` (no older schema exists yet)."""
    return data


def load(path: str | Path) -> RunResult:
    """Read a saved result; raise :class:`ResultFileError` with a one-line reason."""
    p = Path(path)
    if not p.exists():
        raise ResultFileError(f"{p}: no such file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultFileError(f"{p}: not JSON ({e})") from e
    if not isinstance(data, dict) or "schema_version" not in data or "scenarios" not in data:
        raise ResultFileError(f"{p}: not a dpprof result (no schema_version/scenarios)")
    version = data["schema_version"]
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ResultFileError(
            f"{p}: schema_version {version} is newer than this dpprof reads "
            f"({SCHEMA_VERSION}); upgrade dpprof (pip install -U dpprof)"
        )
    try:
        return RunResult.from_dict(upgrade(data))
    except (TypeError, ValueError, AttributeError) as e:
        raise ResultFileError(f"{p}: malformed dpprof result ({e})") from e


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p
