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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpprof.errors import DpprofError

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
    used_bytes: int | None = None  # NVML's "used" at this moment (real GPUs only)


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
    # ---- real GPUs (cuda backend); None where not measured -------------------------------
    cuda_index: int | None = None  # the physical CUDA index (index is the position/rank)
    uuid: str | None = None  # GPU-... (or MIG-...), as NVML and nvidia-smi -L print it
    nvml_index: int | None = None  # matched by UUID, never by position
    nvml_reason: str | None = None  # why NVML's view is missing, when it is
    nvml_unexplained_bytes: int | None = None  # NVML peak used minus peak reserved
    nvml_baseline_used_bytes: int | None = None  # NVML used at the first sample
    gpu_utilization_mean_percent: float | None = None  # NVML, over the scenario
    gpu_utilization_max_percent: int | None = None
    process_used_bytes: dict[str, int] = field(default_factory=dict)  # pid -> NVML peak
    phase_peak_allocated_bytes: dict[str, int] = field(default_factory=dict)  # first measured
    phase_peak_reserved_bytes: dict[str, int] = field(default_factory=dict)  # step, per phase
    allocator_stats: bool = False  # peak_* came from torch.cuda's allocator statistics
    node_rank: int | None = None  # torchrun GROUP_RANK (the node's number)
    local_rank: int | None = None  # torchrun LOCAL_RANK
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
    # ---- real GPUs (cuda backend) ----------------------------------------------------------
    oom_phase: str | None = None  # the phase in which the OOM was raised
    step_times_s: list[float] = field(default_factory=list)  # wall clock, each measured step
    event_step_time_s: float | None = None  # median of CUDA-event step times
    traceback: str | None = None  # of an error (or of an OOM with --debug); DDP: the rank's
    # a process's CUDA context on a GPU it should not touch: {rank, pid, cuda_index, used_bytes}
    stray_contexts: list[dict[str, Any]] = field(default_factory=list)
    max_batch: int | None = None  # largest global batch that fits (where computed)

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
class Attribution:
    """cuda:0's excess over the median other device, in bytes per cause at cuda:0's peak.

    ``causes_bytes`` adds up exactly to ``excess_bytes`` (see :mod:`dpprof.analysis.attribution`).
    """

    scenario: str
    excess_bytes: int  # == ScenarioComparison.primary_excess_bytes
    reference: str = ""  # e.g. "cuda:2", or "mean of cuda:1 and cuda:2"
    causes_bytes: dict[str, int] = field(default_factory=dict)
    answer: str = ""  # one sentence: what dominates and what fixes it


@dataclass
class Fix:
    """What one change buys on the user's workload (see :mod:`dpprof.analysis.fixes`)."""

    name: str  # loss-in-forward | ddp | gradient-as-bucket-view | output-device | balanced-split
    title: str
    primary_peak_bytes: int | None = None  # cuda:0's peak with the fix
    max_peak_bytes: int | None = None  # the heaviest device's peak with the fix
    saves_bytes: int | None = None  # on cuda:0, against dp-loss-primary's cuda:0
    detail: str = ""
    code: str = ""  # the minimal change to a typical training loop
    chunk_sizes: list[int] = field(default_factory=list)  # balanced-split: rows per GPU


@dataclass
class MaxBatchEntry:
    """The largest global batch one scenario fits (see :mod:`dpprof.analysis.maxbatch`)."""

    scenario: str
    max_batch: int | None = None  # None: not even the smallest step fits
    limit_device: int | None = None  # the device that runs out first at max_batch + step
    needed_bytes: int | None = None  # that device's total (reserved + context) at max_batch
    next_needed_bytes: int | None = None  # ... at max_batch + step (over capacity)
    capped: bool = False  # the search stopped at its upper bound, not at the memory
    emulations: int = 0  # emulated steps the search ran
    message: str = ""
    errored: bool = False  # the step raised (not out of memory): nothing was measured


@dataclass
class MaxBatch:
    capacity_bytes: int
    gpu: str = ""  # catalog name, or "" when --gpu-memory was given
    multiple_of: int = 1
    counts: str = ""  # what "fits" counts: e.g. "peak reserved + CUDA context"
    entries: list[MaxBatchEntry] = field(default_factory=list)


@dataclass
class EquivalenceEntry:
    scenario: str
    loss: float | None = None
    loss_diff: float | None = None  # |loss - single's on the full batch|
    grad_max_diff: float | None = None  # largest |gradient difference| over all parameters
    param_max_diff: float | None = None  # largest |parameter difference| after the step
    equivalent: bool | None = None  # within tolerance


@dataclass
class EquivalenceFinding:
    kind: str  # uneven-mean | batchnorm | dropout | sum-reduction
    scenario: str = ""  # "" when it concerns the workload as a whole
    effect: float = 0.0  # size of the effect (see message for its unit)
    message: str = ""


@dataclass
class Equivalence:
    """Do the paired scenarios compute the same thing as ``single`` on the full batch?"""

    backend: str = ""
    batch: int = 0
    tolerance: float = 0.0
    reference_loss: float | None = None
    entries: list[EquivalenceEntry] = field(default_factory=list)
    findings: list[EquivalenceFinding] = field(default_factory=list)
    largest_diff: float = 0.0  # the largest difference of any scenario (loss, grads, params)


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
    watch: WatchResult | None = None  # `dpprof watch -- CMD` runs only (backend "nvml-watch")
    # ---- answers (issue 6): all optional, absent from older results -----------------------
    attribution: dict[str, Attribution] = field(default_factory=dict)  # per DP scenario
    fixes: list[Fix] = field(default_factory=list)
    maxbatch: MaxBatch | None = None
    equivalence: Equivalence | None = None
    fail_reasons: list[str] = field(default_factory=list)  # --fail-on-* checks that failed
    # "SIGINT" | "SIGTERM": cut short; ``scenarios`` holds those measured before (partial)
    interrupted: str | None = None

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


@dataclass
class WatchDevice:
    """One GPU watched by ``dpprof watch``: NVML's used memory of the whole device."""

    cuda_index: int  # as the command saw it (through CUDA_VISIBLE_DEVICES)
    nvml_index: int
    uuid: str | None = None
    name: str | None = None
    total_bytes: int | None = None
    peak_used_bytes: int | None = None  # highest NVML reading (a lower bound of the true peak)
    peak_t_s: float | None = None  # seconds since dpprof started watching
    baseline_used_bytes: int | None = None  # first reading, before the command started
    command_peak_bytes: int | None = None  # the command's own processes, summed per reading
    samples: int = 0
    stopped_reason: str | None = None  # why sampling of this GPU ended early


@dataclass
class WatchOom:
    """A CUDA out-of-memory error found in the command's output."""

    t_s: float | None  # when dpprof read the line (seconds since watching began)
    stream: str  # "stdout" | "stderr"
    text: str  # the message as printed (truncated to 1000 characters)
    format: str  # "caching-allocator" (PyTorch >= 2.1), "caching-allocator-1.x", "cuda-error"
    cuda_index: int | None = None  # "GPU N" of the message: a CUDA index of the command
    requested_bytes: int | None = None  # "Tried to allocate" (rounded as PyTorch prints it)
    total_bytes: int | None = None  # "total capacity"
    free_bytes: int | None = None  # "of which ... is free" / "... free"
    allocated_by_pytorch_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    exception: str | None = None  # e.g. torch.OutOfMemoryError
    # per watched GPU ("cuda:N"): the last NVML reading at or before t_s, and the highest in
    # the second before it
    used_at_oom_bytes: dict[str, int] = field(default_factory=dict)
    peak_before_oom_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class WatchResult:
    """What ``dpprof watch -- CMD`` saw: the command, how it ended, each GPU, any OOM."""

    command: list[str]
    pid: int | None = None
    returncode: int | None = None  # Popen's: negative for a signal; None: end not recorded
    exit_status: int | None = None  # what a shell reports: returncode, or 128 + signal
    signal: str | None = None  # the signal that ended the command, e.g. "SIGKILL"
    complete: bool = True  # False: the samples file ends before the command did
    started: str = ""  # ISO 8601, UTC
    duration_s: float | None = None  # of the watch, from the first reading to the last record
    interval_s: float = 0.0
    samples_path: str = ""
    devices: list[WatchDevice] = field(default_factory=list)
    ooms: list[WatchOom] = field(default_factory=list)
    signals: list[dict[str, Any]] = field(default_factory=list)  # what dpprof received/sent
    post_mortem: list[str] = field(default_factory=list)  # sentences, for every renderer
    next_steps: list[str] = field(default_factory=list)  # dpprof checks to run next


class ResultFileError(DpprofError):
    """A file that is missing, not JSON, not a dpprof result, or from a newer dpprof: exit 1."""


def _from_dict(tp: Any, data: Any) -> Any:
    """Build dataclass ``tp`` from ``data``, ignoring unknown keys (forward compatible)."""
    if not dataclasses.is_dataclass(tp):
        return data
    kwargs: dict[str, Any] = {}
    for name in (f.name for f in dataclasses.fields(tp)):
        if name not in data:
            continue
        value = data[name]
        sub = _NESTED.get((getattr(tp, "__name__", ""), name))
        if sub is not None and value is not None:
            kind, inner = sub
            if kind == "list":
                value = [_from_dict(inner, v) for v in value]
            elif kind == "dict":
                value = {k: _from_dict(inner, v) for k, v in value.items()}
            else:
                value = _from_dict(inner, value)
        kwargs[name] = value
    return tp(**kwargs)  # type: ignore[operator]


_NESTED: dict[tuple[str, str], tuple[str, Any]] = {
    ("RunResult", "scenarios"): ("list", ScenarioResult),
    ("RunResult", "comparison"): ("one", Comparison),
    ("Comparison", "scenarios"): ("dict", ScenarioComparison),
    ("ScenarioResult", "devices"): ("list", DeviceResult),
    ("DeviceResult", "timeline"): ("list", TimelinePoint),
    ("RunResult", "attribution"): ("dict", Attribution),
    ("RunResult", "fixes"): ("list", Fix),
    ("RunResult", "maxbatch"): ("one", MaxBatch),
    ("MaxBatch", "entries"): ("list", MaxBatchEntry),
    ("RunResult", "equivalence"): ("one", Equivalence),
    ("Equivalence", "entries"): ("list", EquivalenceEntry),
    ("Equivalence", "findings"): ("list", EquivalenceFinding),
}


_NESTED[("RunResult", "watch")] = ("one", WatchResult)
_NESTED[("WatchResult", "devices")] = ("list", WatchDevice)
_NESTED[("WatchResult", "ooms")] = ("list", WatchOom)
# Upgrades from each older schema version to the next: ``_UPGRADES[v]`` turns a version-v
# dict into a version-(v + 1) dict. Version 1 is the first, so there is none yet; when the
# schema changes, bump SCHEMA_VERSION and register the step from the previous version here.
Upgrade = Callable[[dict[str, Any]], dict[str, Any]]
_UPGRADES: dict[int, Upgrade] = {}
FIRST_SCHEMA_VERSION = 1


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Bring a result of an older ``schema_version`` up to :data:`SCHEMA_VERSION`, step by step.

    Raises ValueError when a step is missing (a version this dpprof never wrote).
    """
    version = data.get("schema_version", SCHEMA_VERSION)
    while version < SCHEMA_VERSION:
        step = _UPGRADES.get(version)
        if step is None:
            raise ValueError(f"schema_version {version} is not one this dpprof can read")
        data = step(dict(data))
        version += 1
        data["schema_version"] = version
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
    except OSError as e:
        raise ResultFileError(f"{p}: cannot read it ({e.strerror or e})") from e
    if not isinstance(data, dict) or "schema_version" not in data or "scenarios" not in data:
        raise ResultFileError(f"{p}: not a dpprof result (no schema_version/scenarios)")
    version = data["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < FIRST_SCHEMA_VERSION:
        raise ResultFileError(
            f"{p}: not a dpprof result (schema_version {version!r} is not one dpprof wrote)"
        )
    if version > SCHEMA_VERSION:
        raise ResultFileError(
            f"{p}: schema_version {version} is newer than this dpprof reads "
            f"({SCHEMA_VERSION}); upgrade dpprof (pip install -U dpprof)"
        )
    try:
        data = upgrade(data)
    except ValueError as e:
        raise ResultFileError(f"{p}: {e}") from e
    try:
        return RunResult.from_dict(data)
    except (TypeError, ValueError, AttributeError, KeyError) as e:
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
