"""The result model: one saved session object between measuring and reporting.

Every backend writes a :class:`RunResult`; every renderer reads one. It is saved as JSON
with a ``schema_version`` (:mod:`dpprof.saved_result` reads and writes the file); the field
names below are a public contract. A result is built whole by the code that measures it,
and frozen: what is derived from it (the comparison, the verdict, the answer) is computed
by :func:`dpprof.answers.answer.settled`, which returns a new result. Bytes are bytes
everywhere (``*_bytes``), seconds are seconds (``*_s``); human units only in renderers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from annotated_types import Ge, Le, MaxLen, Predicate

from dpprof.environment import collect_environment
from dpprof.version import __version__

SCHEMA_VERSION = 1

# ---- what a result may hold (checked on load, see :func:`load`) --------------------------
# The field types below carry their ranges (annotated_types: pydantic checks them on load,
# plain dataclasses ignore them): a renderer never receives a value the model does not allow.
MAX_BYTES = 2**60  # 1 EiB: any sum of a few of them stays exact in a float's range
MAX_DEVICES = 1024  # devices (GPUs, ranks) of one scenario; a result's `gpus`
MAX_SCENARIOS = 64
MAX_ALL_DEVICES = 4 * MAX_DEVICES  # over every scenario (the terminal's table is gpus x these)
MAX_POINTS = 2_000_000  # timeline points of one device
MAX_ITEMS = 100_000  # any other list or mapping
MAX_TEXT = 1_000_000  # characters of one string (a traceback, a note)
MAX_RESULT_FILE_BYTES = 64 * 2**20  # `dpprof report` reads regular files up to 64 MiB
Bytes = Annotated[int, Ge(0), Le(MAX_BYTES)]
SignedBytes = Annotated[int, Ge(-MAX_BYTES), Le(MAX_BYTES)]
Index = Annotated[int, Ge(0), Le(MAX_DEVICES)]  # a device, rank or node number; a GPU count
Count = Annotated[int, Ge(0), Le(2**53)]
Int = Annotated[int, Ge(-(2**63)), Le(2**64 - 1)]
Float = float  # finite: every dataclass here refuses NaN and infinities (see _adapter)
Text = Annotated[str, MaxLen(MAX_TEXT)]
TextList = Annotated[tuple[Text, ...], MaxLen(MAX_ITEMS)]
BytesMap = Annotated[dict[Text, SignedBytes], MaxLen(MAX_ITEMS)]
FloatMap = Annotated[dict[Text, Float], MaxLen(MAX_ITEMS)]


def _is_status(value: str) -> bool:
    return value in (STATUS_OK, STATUS_OOM, STATUS_ERROR)


Status = Annotated[str, Predicate(_is_status)]  # "ok" | "oom" | "error"

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


@dataclass(frozen=True)
class TimelinePoint:
    """Memory on one device at one moment of the measured step."""

    t: Float  # seconds since the step began (measured) or event index (emulated)
    allocated_bytes: Bytes
    phase: Text = ""
    used_bytes: Bytes | None = None  # NVML's "used" at this moment (real GPUs only)


@dataclass(frozen=True)
class DeviceResult:
    """What one device held during one scenario's measured step."""

    index: Index  # cuda index (or virtual device index); DDP: the rank's device
    peak_allocated_bytes: Bytes = 0  # allocator blocks, rounded as the CUDA allocator rounds
    peak_requested_bytes: Bytes = 0  # bytes the tensors asked for, before rounding
    capacity_bytes: Bytes = 0
    # bytes per category at the moment of peak_allocated_bytes (sums to it)
    breakdown_bytes: BytesMap = field(default_factory=dict)
    peak_reserved_bytes: Bytes | None = None  # caching-allocator segments (measured or simulated)
    context_bytes: Bytes | None = None  # CUDA context + library workspaces (measured or modelled)
    nvml_peak_used_bytes: Bytes | None = None  # NVML's view (real GPUs only)
    peak_phase: Text = ""  # the phase of the step in which the peak happened
    rank: Index | None = None  # DDP rank, where the device belongs to one
    node: Text | None = None  # host name (DDP across nodes)
    used: bool = True  # False when the scenario put no work on this device
    batch_rows: Count = 0  # rows of the batch this device computed
    timeline: Annotated[tuple[TimelinePoint, ...], MaxLen(MAX_POINTS)] = ()
    # ---- real GPUs (cuda backend); None where not measured -------------------------------
    cuda_index: Index | None = None  # the physical CUDA index (index is the position/rank)
    uuid: Text | None = None  # GPU-... (or MIG-...), as NVML and nvidia-smi -L print it
    nvml_index: Index | None = None  # matched by UUID, never by position
    nvml_reason: Text | None = None  # why NVML's view is missing, when it is
    nvml_unexplained_bytes: SignedBytes | None = None  # NVML peak used minus peak reserved
    nvml_baseline_used_bytes: Bytes | None = None  # NVML used at the first sample
    gpu_utilization_mean_percent: Float | None = None  # NVML, over the scenario
    gpu_utilization_max_percent: Int | None = None
    process_used_bytes: BytesMap = field(default_factory=dict)  # pid -> NVML peak
    phase_peak_allocated_bytes: BytesMap = field(default_factory=dict)  # first measured
    phase_peak_reserved_bytes: BytesMap = field(default_factory=dict)  # step, per phase
    allocator_stats: bool = False  # peak_* came from torch.cuda's allocator statistics
    node_rank: Index | None = None  # torchrun GROUP_RANK (the node's number)
    local_rank: Index | None = None  # torchrun LOCAL_RANK
    # Library workspaces served by the caching allocator (cuBLAS per handle and stream,
    # cuBLASLt's), included in peak_reserved_bytes. Emulated, peak_allocated_bytes holds the
    # tensors only (torch.cuda.max_memory_allocated on the GPU adds these bytes); measured on
    # a GPU, the allocator counted them in both.
    workspace_bytes: Bytes | None = None
    # context_bytes split by component (cuda_context, cudnn_library, ...), when modelled
    context_breakdown_bytes: BytesMap = field(default_factory=dict)
    # ---- transients (emulated): the peaks above are the worst case a real run reaches,
    # counting a warm-up's short-lived blocks that a later step no longer has; these say
    # which (kind -> bytes alive at peak_allocated_bytes, e.g. "ddp_unreaped_buckets": DDP's
    # first buckets, kept by NCCL's works until its watchdog reaps them) and what the peaks
    # are once they are gone (None: no such block at the peak, the steady state is the peak)
    transient_bytes: BytesMap = field(default_factory=dict)
    steady_peak_allocated_bytes: Bytes | None = None
    steady_peak_reserved_bytes: Bytes | None = None
    # ---- time, predicted (dpprof.emulator.step_time): the measured step's seconds on this
    # GPU by what it did: "compute" (kernels), "communication" (copies, collectives) and
    # "waiting" (the rest of the step: idle while other GPUs or the host work); they add
    # up to the scenario's predicted_step_time_s. Empty where not predicted.
    predicted_busy_s: FloatMap = field(default_factory=dict)

    @property
    def gpu_allocated_bytes(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` reads: measured, the peak itself; emulated,
        the tensors' peak and the workspaces the caching allocator serves beside them."""
        extra = 0 if self.allocator_stats else (self.workspace_bytes or 0)
        return self.peak_allocated_bytes + extra

    @property
    def total_peak_bytes(self) -> int:
        """Peak the device must hold: reserved (or allocated) plus context and workspaces."""
        base = self.peak_reserved_bytes or self.peak_allocated_bytes
        return base + (self.context_bytes or 0)


@dataclass(frozen=True)
class ScenarioResult:
    name: Text
    status: Status = STATUS_OK  # "ok" | "oom" | "error"
    message: Text = ""
    devices: Annotated[tuple[DeviceResult, ...], MaxLen(MAX_DEVICES)] = ()
    oom_device: Index | None = None
    oom_bytes: Bytes | None = None  # bytes the device needed (emulated) or asked for (real OOM)
    # the caching allocator's limit the script set (set_per_process_memory_fraction; beyond
    # it, oom_bytes is the reserve needed), None: the GPU's memory
    allocator_limit_bytes: Bytes | None = None
    loss: Float | None = None
    step_time_s: Float | None = None  # median over measured steps (real backends)
    step_time_spread_s: Float | None = None  # max - min over measured steps
    throughput_samples_per_s: Float | None = None
    batch: Count = 0
    notes: TextList = ()
    # ---- real GPUs (cuda backend) ----------------------------------------------------------
    oom_phase: Text | None = None  # the phase in which the OOM was raised
    # wall clock, each measured step
    step_times_s: Annotated[tuple[Float, ...], MaxLen(MAX_ITEMS)] = ()
    event_step_time_s: Float | None = None  # median of CUDA-event step times
    traceback: Text | None = None  # of an error (or of an OOM with --debug); DDP: the rank's
    # a process's CUDA context on a GPU it should not touch: {rank, pid, cuda_index, used_bytes}
    stray_contexts: Annotated[tuple[dict[str, Any], ...], MaxLen(MAX_ITEMS)] = ()
    max_batch: Count | None = None  # largest global batch that fits (where computed)
    # ---- time, predicted without a GPU (dpprof.emulator.step_time) ------------------------
    predicted_step_time_s: Float | None = None  # one training step on the target GPUs
    predicted_samples_per_s: Float | None = None  # the global batch over that
    predicted_host_s: Float | None = None  # the host's share: near the step, launch-bound
    # host memory a rank's model keeps (FSDP2's CPU offload: its parameter shards, their
    # gradients and the optimizer state in host RAM, emulated): parameters, gradients,
    # optimizer_state, and pinned (the page-locked part of them), bytes per rank
    host_bytes: BytesMap = field(default_factory=dict)

    def device(self, index: int) -> DeviceResult | None:
        for d in self.devices:
            if d.index == index:
                return d
        return None


@dataclass(frozen=True)
class ScenarioComparison:
    # cuda:0 (device_ids[0]) minus the median of the other used devices
    primary_excess_bytes: SignedBytes
    imbalance: Float  # max / mean of peak allocated over the used devices
    max_bytes: Bytes
    mean_bytes: Float


@dataclass(frozen=True)
class Comparison:
    scenarios: Annotated[dict[Text, ScenarioComparison], MaxLen(MAX_ITEMS)] = field(
        default_factory=dict)
    verdict: Text = ""
    # bytes of cuda:0's peak that a fix removes: {"dp-loss-forward": ..., "ddp": ...}
    savings_bytes: BytesMap = field(default_factory=dict)


@dataclass(frozen=True)
class Attribution:
    """cuda:0's excess over the median other device, in bytes per cause at cuda:0's peak.

    ``causes_bytes`` adds up exactly to ``excess_bytes`` (see :mod:`dpprof.answers.attribution`).
    """

    scenario: Text
    excess_bytes: SignedBytes  # == ScenarioComparison.primary_excess_bytes
    reference: Text = ""  # e.g. "cuda:2", or "mean of cuda:1 and cuda:2"
    causes_bytes: BytesMap = field(default_factory=dict)
    answer: Text = ""  # one sentence: what dominates and what fixes it


@dataclass(frozen=True)
class Fix:
    """What one change buys on the user's workload (see :mod:`dpprof.measure.fix_savings`)."""

    name: Text  # loss-in-forward | ddp | gradient-as-bucket-view | output-device | balanced-split
    title: Text
    primary_peak_bytes: Bytes | None = None  # cuda:0's peak with the fix
    max_peak_bytes: Bytes | None = None  # the heaviest device's peak with the fix
    saves_bytes: SignedBytes | None = None  # on cuda:0, against dp-loss-primary's cuda:0
    # on the heaviest GPU, against dp-loss-primary's heaviest: > 0 makes it a recommendation
    heaviest_saves_bytes: SignedBytes | None = None
    detail: Text = ""
    code: Text = ""  # the minimal change to a typical training loop
    # balanced-split: rows per GPU
    chunk_sizes: Annotated[tuple[Count, ...], MaxLen(MAX_DEVICES)] = ()
    # what the fix's fullest GPU needs as the out-of-memory check counts it (reserved +
    # context where emulated or measured, else allocated); None in results saved before
    # every fix had one
    need_bytes: Bytes | None = None
    # the scenario the savings are measured against ("" in older results: dp-loss-primary)
    baseline: Text = ""
    # one step with the fix, predicted (dpprof.emulator.step_time), where its own run was
    # emulated beside the scenarios (a ladder's rung, a variant of a scenario); None else
    predicted_step_time_s: Float | None = None
    change: Text = ""  # what making it takes, where not its kind's ("": the kind's cost)


@dataclass(frozen=True)
class FixAnswer:
    """The answer's reading of one fix against the scenario the user ran
    (:mod:`dpprof.answers.answer`): what it saves there, what it needs, whether it fits,
    what it costs, in one sentence each renderer shows as it is."""

    fix: Text  # Fix.name
    title: Text
    baseline: Text  # the scenario it is measured against
    heaviest_saves_bytes: SignedBytes  # the baseline's heaviest GPU minus the fix's
    primary_saves_bytes: SignedBytes | None = None  # the same on cuda:0
    max_peak_bytes: Bytes | None = None  # the fix's heaviest GPU (allocated)
    need_bytes: Bytes | None = None  # its fullest GPU, as the out-of-memory check counts
    fits: bool | None = None  # None: its need is not known
    spare_bytes: SignedBytes | None = None  # capacity minus need
    cost_rank: Count = 0  # the policy's order (dpprof.fixes.policy): lower is cheaper
    cost: Text = ""  # what the change costs, in words
    # what it adds to a step's time, predicted; None until the time model fills it
    step_time_cost_s: Float | None = None
    why: Text = ""  # the sentence every format shows beside it


@dataclass(frozen=True)
class PassedOver:
    """A change cheaper than the recommended one, and why it is not the answer."""

    fix: Text
    title: Text
    reason: Text


@dataclass(frozen=True)
class Recommendation:
    """The one answer of a result, computed once (:func:`dpprof.answers.answer.settled`)
    and shown by every format: the verdict, the change recommended (or none), why, what it
    needs and whether it fits, and why each cheaper change was passed over."""

    verdict: Text
    verdict_oom: Text = ""  # the verdict's out-of-memory clause, as it stands in it
    setup: Text = ""  # data-parallel | distributed | split-model | one-gpu | watch | ...
    baseline: Text | None = None  # the scenario the fixes are measured against
    fix: Text | None = None  # the recommended change's Fix.name; None: nothing to change
    title: Text = ""  # its title
    why: Text = ""  # why it (or nothing) is the answer
    need_bytes: Bytes | None = None  # what its fullest GPU needs
    fits: bool | None = None
    margin_bytes: Bytes | None = None  # the spare the policy asks of a fit
    passed_over: Annotated[tuple[PassedOver, ...], MaxLen(MAX_ITEMS)] = ()
    fixes: Annotated[tuple[FixAnswer, ...], MaxLen(MAX_ITEMS)] = ()
    # scenario -> why its cuda:0 is heavier (the DataParallel scenarios it applies to)
    why_heavier: Annotated[dict[Text, Text], MaxLen(MAX_ITEMS)] = field(default_factory=dict)


@dataclass(frozen=True)
class MaxBatchEntry:
    """The largest global batch one scenario fits (see :mod:`dpprof.measure.maxbatch_search`)."""

    scenario: Text
    max_batch: Count | None = None  # None: not even the smallest step fits
    limit_device: Index | None = None  # the device that runs out first at max_batch + step
    needed_bytes: Bytes | None = None  # that device's total (reserved + context) at max_batch
    next_needed_bytes: Bytes | None = None  # ... at max_batch + step (over capacity)
    capped: bool = False  # the search stopped at its upper bound, not at the memory
    emulations: Count = 0  # emulated steps the search ran
    message: Text = ""
    errored: bool = False  # the step raised (not out of memory): nothing was measured


@dataclass(frozen=True)
class MaxBatch:
    capacity_bytes: Bytes
    gpu: Text = ""  # catalog name, or "" when --gpu-memory was given
    multiple_of: Count = 1
    counts: Text = ""  # what "fits" counts: e.g. "peak reserved + CUDA context"
    entries: Annotated[tuple[MaxBatchEntry, ...], MaxLen(MAX_ITEMS)] = ()


@dataclass(frozen=True)
class EquivalenceEntry:
    scenario: Text
    loss: Float | None = None
    loss_diff: Float | None = None  # |loss - single's on the full batch|
    grad_max_diff: Float | None = None  # largest |gradient difference| over all parameters
    param_max_diff: Float | None = None  # largest |parameter difference| after the step
    equivalent: bool | None = None  # within tolerance


@dataclass(frozen=True)
class EquivalenceFinding:
    kind: Text  # uneven-mean | batchnorm | dropout | sum-reduction
    scenario: Text = ""  # "" when it concerns the workload as a whole
    effect: Float = 0.0  # size of the effect (see message for its unit)
    message: Text = ""


@dataclass(frozen=True)
class Equivalence:
    """Do the paired scenarios compute the same thing as ``single`` on the full batch?"""

    backend: Text = ""
    batch: Count = 0
    tolerance: Float = 0.0
    reference_loss: Float | None = None
    entries: Annotated[tuple[EquivalenceEntry, ...], MaxLen(MAX_ITEMS)] = ()
    findings: Annotated[tuple[EquivalenceFinding, ...], MaxLen(MAX_ITEMS)] = ()
    largest_diff: Float = 0.0  # the largest difference of any scenario (loss, grads, params)


@dataclass(frozen=True)
class ScriptWrite:
    """What a script under ``dpprof run`` wrote, made or removed (into its run's overlay)."""

    run: Text  # "as-written", or the alternative's or rung's run that wrote it
    path: Text  # relative to the working directory where inside it, else absolute
    kind: Text  # "file" | "folder" | "link" | "removed"
    size_bytes: Bytes = 0
    # holds values of emulated tensors, as far as dpprof can tell: a stand-in checkpoint, or
    # written after the run read a value from a virtual GPU (a stand-in)
    emulated_values: bool = False
    replaced: bool = False  # a file of the user's stands at that path (and stays as it was)


@dataclass(frozen=True)
class SealCheck:
    """How ``dpprof run`` kept the script's writes out of the user's files, and its check
    after every run that they are as they were."""

    lines: TextList = ()  # "python", "kernel" | "audit hook"
    checked_entries: Count = 0  # files and folders compared after each run
    checked_all: bool = True  # False: more than the check's limit; the shallowest compared
    changed: TextList = ()  # "path: changed after the as-written run"
    subprocesses: TextList = ()  # commands the script started
    ended_processes: TextList = ()  # commands still running as their run ended, ended then
    omitted_writes: Count = 0  # writes left out of ``RunResult.writes`` (too many to list)
    kept_in: Text | None = None  # --keep-writes DIR


@dataclass(frozen=True)
class RunResult:
    backend: Text  # "emulated" | "cpu" | "cuda"
    workload: Text
    batch: Count
    gpus: Index
    gpu_memory_bytes: Bytes
    scenarios: Annotated[tuple[ScenarioResult, ...], MaxLen(MAX_SCENARIOS)] = ()
    comparison: Comparison = field(default_factory=Comparison)
    schema_version: Int = SCHEMA_VERSION
    dpprof_version: Text = ""
    created: Text = ""  # ISO 8601, UTC
    seed: Int = 0
    dtype: Text = "float32"
    # every option the run used
    config: Annotated[dict[Text, Any], MaxLen(MAX_ITEMS)] = field(
        default_factory=dict)
    environment: Annotated[dict[Text, Any], MaxLen(MAX_ITEMS)] = field(default_factory=dict)
    assumptions: TextList = ()  # how the numbers were obtained
    notes: TextList = ()
    watch: WatchResult | None = None  # `dpprof watch -- CMD` runs only (backend "nvml-watch")
    # ---- answers: all optional, so that results saved before they existed still load ----
    # per DP scenario
    attribution: Annotated[dict[Text, Attribution], MaxLen(MAX_ITEMS)] = field(
        default_factory=dict)
    fixes: Annotated[tuple[Fix, ...], MaxLen(MAX_ITEMS)] = ()
    maxbatch: MaxBatch | None = None
    equivalence: Equivalence | None = None
    fail_reasons: TextList = ()  # --fail-on-* checks that failed
    # "SIGINT" | "SIGTERM": cut short; ``scenarios`` holds those measured before (partial)
    interrupted: Text | None = None
    # the one answer (dpprof.answers.answer.settled); None in results saved before it
    recommended: Recommendation | None = None
    # `dpprof run`: what the script wrote (into its runs' overlays), and the seal's check
    writes: Annotated[tuple[ScriptWrite, ...], MaxLen(MAX_ITEMS)] = ()
    seal: SealCheck | None = None

    def scenario(self, name: str) -> ScenarioResult | None:
        for s in self.scenarios:
            if s.name == name:
                return s
        return None

    # ---- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """Strict JSON: a NaN or an infinity (a diverged loss) is written as null."""
        return json.dumps(json_safe(self.to_dict()), indent=1, sort_keys=False,
                          allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        return _from_dict(cls, data)


def new_result(backend: str, workload: str, *, batch: int, gpus: int, gpu_memory_bytes: int,
               config: dict[str, Any], environment: dict[str, Any] | None = None,
               created: str | None = None, dpprof_version: str | None = None,
               **fields: Any) -> RunResult:
    """The one way every command starts its result (compare, run, maxbatch, watch): the
    version of dpprof that made it, when (UTC, ISO 8601, to the second), the environment
    (``dpprof env``'s block as ``backend`` sees it, :func:`environment_block`) and every
    option it ran with (``config``); ``fields``: the rest of :class:`RunResult`'s.

    ``environment``, ``created`` and ``dpprof_version`` are given where the result records
    another process's (``dpprof watch``: what its samples file says)."""
    import datetime

    return RunResult(
        backend=backend, workload=workload, batch=batch, gpus=gpus,
        gpu_memory_bytes=gpu_memory_bytes,
        dpprof_version=__version__ if dpprof_version is None else dpprof_version,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if created is None else created,
        config=config,
        environment=environment_block(backend) if environment is None else environment,
        **fields,
    )


def environment_block(backend: str) -> dict[str, Any]:
    """The ``dpprof env`` block (:func:`dpprof.environment.collect_environment`); never
    raises."""
    try:
        return collect_environment(use_cuda=backend == "cuda")
    except Exception as e:  # pragma: no cover - collect_environment does not raise
        return {"environment_error": f"{type(e).__name__}: {e}"}


@dataclass(frozen=True)
class WatchDevice:
    """One GPU watched by ``dpprof watch``: NVML's used memory of the whole device."""

    cuda_index: Index  # as the command saw it (through CUDA_VISIBLE_DEVICES)
    nvml_index: Index
    uuid: Text | None = None
    name: Text | None = None
    total_bytes: Bytes | None = None
    peak_used_bytes: Bytes | None = None  # highest NVML reading (a lower bound of the true peak)
    peak_t_s: Float | None = None  # seconds since dpprof started watching
    baseline_used_bytes: Bytes | None = None  # first reading, before the command started
    command_peak_bytes: Bytes | None = None  # the command's own processes, summed per reading
    samples: Count = 0
    stopped_reason: Text | None = None  # why sampling of this GPU ended early


@dataclass(frozen=True)
class WatchOom:
    """A CUDA out-of-memory error found in the command's output."""

    t_s: Float | None  # when dpprof read the line (seconds since watching began)
    stream: Text  # "stdout" | "stderr"
    text: Text  # the message as printed (truncated to 1000 characters)
    format: Text  # "caching-allocator" (PyTorch >= 2.1), "caching-allocator-1.x", "cuda-error"
    cuda_index: Index | None = None  # "GPU N" of the message: a CUDA index of the command
    requested_bytes: Bytes | None = None  # "Tried to allocate" (rounded as PyTorch prints it)
    total_bytes: Bytes | None = None  # "total capacity"
    free_bytes: Bytes | None = None  # "of which ... is free" / "... free"
    allocated_by_pytorch_bytes: Bytes | None = None
    reserved_unallocated_bytes: Bytes | None = None
    exception: Text | None = None  # e.g. torch.OutOfMemoryError
    # per watched GPU ("cuda:N"): the last NVML reading at or before t_s, the highest before
    used_at_oom_bytes: BytesMap = field(default_factory=dict)
    peak_before_oom_bytes: BytesMap = field(default_factory=dict)


@dataclass(frozen=True)
class WatchResult:
    """What ``dpprof watch -- CMD`` saw: the command, how it ended, each GPU, any OOM."""

    command: TextList
    pid: Count | None = None
    returncode: Int | None = None  # Popen's: negative for a signal; None: end not recorded
    exit_status: Int | None = None  # what a shell reports: returncode, or 128 + signal
    signal: Text | None = None  # the signal that ended the command, e.g. "SIGKILL"
    complete: bool = True  # False: the samples file ends before the command did
    started: Text = ""  # ISO 8601, UTC
    duration_s: Float | None = None  # of the watch, from the first reading to the last record
    interval_s: Float = 0.0
    samples_path: Text = ""
    devices: Annotated[tuple[WatchDevice, ...], MaxLen(MAX_DEVICES)] = ()
    ooms: Annotated[tuple[WatchOom, ...], MaxLen(MAX_ITEMS)] = ()
    # what dpprof received/sent
    signals: Annotated[tuple[dict[str, Any], ...], MaxLen(MAX_ITEMS)] = ()
    post_mortem: TextList = ()  # sentences, for every renderer
    next_steps: TextList = ()  # dpprof checks to run next


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN and infinity replaced by None: what strict JSON (and a
    browser's ``JSON.parse``) can read."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


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
                value = tuple(_from_dict(inner, v) for v in value)
            elif kind == "dict":
                value = {k: _from_dict(inner, v) for k, v in value.items()}
            else:
                value = _from_dict(inner, value)
        elif isinstance(value, list):  # every sequence a result holds is a tuple
            value = tuple(value)
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
    ("RunResult", "recommended"): ("one", Recommendation),
    ("Recommendation", "passed_over"): ("list", PassedOver),
    ("Recommendation", "fixes"): ("list", FixAnswer),
    ("RunResult", "writes"): ("list", ScriptWrite),
    ("RunResult", "seal"): ("one", SealCheck),
}


_NESTED[("RunResult", "watch")] = ("one", WatchResult)
_NESTED[("WatchResult", "devices")] = ("list", WatchDevice)
_NESTED[("WatchResult", "ooms")] = ("list", WatchOom)
