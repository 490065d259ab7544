"""How long the measured step takes on the target GPUs, predicted from its ops
(:mod:`dpprof.emulator.op_log`) without a GPU.

Each op costs the host (Python, dispatch, autograd, the launch) a fixed time, and its device a
kernel time::

    kernel = max(flops / (peak(dtype) * matmul_efficiency(flops)),
                 bytes / (memory_bandwidth * memory_efficiency)) + kernel_gap

(a roofline; a matmul's efficiency grows with its work, ``flops / (flops + half_flops)``, as
small matmuls cannot fill the GPU, and with its shape, ``1 / (1 + outer_dim_rows (1/M + 1/N)
+ inner_dim_rows / K)``, as a short side leaves BLAS's blocked kernels per-row work that
its few FLOPs do not amortise). The step is then played as CUDA runs it: each host thread
issues its ops in order (an op waits for its thread's previous op), each device runs its
kernels in order (a kernel starts when it is issued and its device is free), a copy between
two GPUs holds both over the interconnect, a copy from the host holds its GPU over PCIe,
DDP's bucket all-reduces run on a stream of their own (ring: ``2 (n-1)/n`` of the bucket
over the link's bandwidth) overlapping the backward, and the optimizer waits for them.

Host threads follow torch: the step's own thread issues everything but the backward, which
the autograd engine runs in one thread per device (so DataParallel's replicas' backwards
issue in parallel, while their forwards, in ``parallel_apply``'s threads, take turns on
the GIL: one host timeline). A phase waits for the threads of the one before it.

Work of the phase :data:`EVALUATION` (a script's validation between two optimizer steps) is
no part of the training step: it is left out of the step and played alone, its time given
beside it (``StepPrediction.evaluation_s``).

The constants of :data:`H200_FIT` are fitted to what an NVIDIA H200 measured
(``tests/data/h200_measured.json``; ``scripts/fit_step_time.py``), and checked on workloads
held out of the fit (README, "How accurate is it?").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from dpprof.emulator.catalog import GpuSpec, peak_rates_of
from dpprof.emulator.op_log import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCAST,
    COLLECTIVES,
    CONV,
    GATHER,
    GATHER_WAIT,
    HOST,
    MATMUL,
    NO_KERNEL,
    NORM,
    REDUCE,
    REDUCE_SCATTER,
    SYNC,
    TRANSFER,
    OpRecord,
)

__all__ = [
    "EVALUATION",
    "H200_FIT",
    "DevicePrediction",
    "DeviceRates",
    "StepPrediction",
    "TimeConstants",
    "matmul_shape_efficiency",
    "predict_step",
    "predict_steps",
    "rates_for",
]


@dataclass(frozen=True)
class DeviceRates:
    """What one device can do at most (datasheet figures, or a micro-benchmark's)."""

    matmul_flops_per_s: dict[str, float]  # dtype ("float32", "tf32", "bfloat16", ...) -> peak
    memory_bytes_per_s: float
    link_bytes_per_s: float  # between two devices, one direction (NVLink, PCIe peer)
    host_link_bytes_per_s: float  # host <-> device, one direction
    interconnect: str = ""  # "nvlink", "pcie", "memory" (the CPU's ranks)
    # the host waits for each kernel (a CPU as the device: no queue between them)
    synchronous: bool = False

    def matmul_peak(self, dtype: str) -> float:
        rates = self.matmul_flops_per_s
        return rates.get(dtype) or rates.get("float32") or min(rates.values())


@dataclass(frozen=True)
class TimeConstants:
    """The fitted part of the model (seconds, FLOPs, fractions of the peak)."""

    matmul_efficiency: float  # of the datasheet peak, for a large matmul
    matmul_half_flops: float  # a matmul of this many FLOPs reaches half that
    memory_efficiency: float  # of the datasheet bandwidth
    conv_efficiency: float  # a convolution's, of the matmul's (cuDNN, few channels)
    norm_passes: float  # a normalisation's bytes are read and written this many times
    kernel_gap_s: float  # device time per launch besides its work
    host_op_s: float  # host time per op that launches a kernel
    host_view_s: float  # host time per op that launches none (views, metadata)
    step_overhead_s: float  # host time per step outside the ops (the Python loop)
    collective_latency_s: float = 10e-6  # per collective (NCCL's launch and handshake)
    link_efficiency: float = 0.8  # of the link's bandwidth a copy or ring reaches
    # A matmul's shape (M x K times K x N): its time grows by outer_dim_rows / M +
    # outer_dim_rows / N + inner_dim_rows / K of a large one's, the per-row work (packing an
    # operand's panels; loading and storing the output's tiles) that a short side does not
    # amortise over many FLOPs, as BLAS's blocked kernels run. 0: by FLOPs alone.
    matmul_outer_dim_rows: float = 0.0
    matmul_inner_dim_rows: float = 0.0


# Fitted by scripts/fit_step_time.py to the H200's mlp, lm, convnet and GPT-2 steps
# (tests/data/h200_measured.json: the kernels' device time per kind of op first, then the step
# time); attention, classifier and ViT held out. Step time, mean |error|: fitted 13.3 %,
# held out 7.5 % (worst 13.8 %); device time: fitted 16.6 %, held out 26.3 %.
# The host's constants are the H200 machine's CPU: another host is faster or slower. The
# matmul's shape terms are left at 0 (by FLOPs alone), as when it was fitted.
H200_FIT = TimeConstants(
    matmul_efficiency=0.686,
    matmul_half_flops=3.74e8,
    memory_efficiency=0.582,
    conv_efficiency=0.134,
    norm_passes=8.32,
    kernel_gap_s=2.75e-6,
    host_op_s=39.6e-6,
    host_view_s=0.0,
    step_overhead_s=412e-6,
)


@dataclass
class DevicePrediction:
    compute_s: float = 0.0
    communication_s: float = 0.0
    waiting_s: float = 0.0
    # of communication_s, the time its collective stream ran beside a kernel of its compute
    # stream (FSDP2's prefetched all-gathers, DDP's all-reduces during the backward)
    overlap_s: float = 0.0

    @property
    def busy_s(self) -> float:
        """The time the GPU ran anything: its streams' union."""
        return self.compute_s + self.communication_s - self.overlap_s


def _overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The time two streams' spans run at once (each stream's spans in order, disjoint)."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            both += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


# the phase of the ops a script runs between two steps with its trained model in eval mode
# and no gradients (its validation): they repeat every N steps or once an epoch, not every
# step, and a measured step they fall in is no longer the training step
EVALUATION = "evaluation"


@dataclass
class StepPrediction:
    step_time_s: float
    host_s: float  # the host threads' busiest timeline (launch-bound when near step_time_s)
    devices: dict[int, DevicePrediction] = field(default_factory=dict)
    ops: int = 0
    kernels: int = 0
    # the EVALUATION phase's ops, left out of the step, played alone: their time (over all
    # the steps played, not a step's mean) and how many there were
    evaluation_s: float = 0.0
    evaluation_ops: int = 0


def matmul_shape_efficiency(gemm: tuple[int, int, int] | tuple[()],
                            k: TimeConstants) -> float:
    """The fraction of a large matmul's rate a product of shape ``gemm`` (M, N, K) reaches
    (1 for an op of no known shape)."""
    if not gemm:
        return 1.0
    m, n, inner = (max(d, 1) for d in gemm)
    return 1.0 / (1.0 + k.matmul_outer_dim_rows * (1 / m + 1 / n)
                  + k.matmul_inner_dim_rows / inner)


def kernel_time_s(op: OpRecord, rates: DeviceRates, k: TimeConstants) -> float:
    """One op's device time (0 for an op that launches no kernel)."""
    if op.kernels == 0:
        return 0.0
    passes = k.norm_passes if op.kind == NORM else 1.0
    memory = passes * op.bytes / (rates.memory_bytes_per_s * k.memory_efficiency)
    work = 0.0
    if op.kind in (MATMUL, CONV) and op.flops:
        efficiency = (k.matmul_efficiency * op.flops / (op.flops + k.matmul_half_flops)
                      * matmul_shape_efficiency(op.gemm, k))
        if op.kind == CONV:
            efficiency *= k.conv_efficiency
        work = op.flops / (rates.matmul_peak(op.dtype) * efficiency)
    return max(work, memory) + k.kernel_gap_s * op.kernels


def _ring_s(op: OpRecord, rates: DeviceRates, k: TimeConstants) -> float:
    """A collective over ``op.world`` ranks on a ring: an all-reduce moves ``2 (n-1)/n`` of
    its buffer over each link, an all-gather or reduce-scatter ``(n-1)/n`` of the unsharded
    buffer (NCCL's ring algorithms)."""
    n = max(op.world, 1)
    moved = (1 if op.kind in (ALL_GATHER, REDUCE_SCATTER) else 2) * (n - 1) / n * op.bytes
    return moved / (rates.link_bytes_per_s * k.link_efficiency) + k.collective_latency_s


def predict_step(records: Sequence[OpRecord], rates: DeviceRates, k: TimeConstants,
                 devices: Sequence[int] = ()) -> StepPrediction:
    """Play the measured step's ops on devices of ``rates`` (see the module's docstring).
    A phase is the word before any "(step N)" its label carries.

    ``devices``: the GPUs to report (each gets a row even if it ran nothing: it waited).
    Ops of the :data:`EVALUATION` phase are left out, and played alone for
    ``evaluation_s``."""
    evaluation = [op for op in records if op[3].startswith(EVALUATION)]
    if evaluation:
        step = _play([op for op in records if not op[3].startswith(EVALUATION)], rates, k,
                     devices)
        alone = _play(evaluation, rates, k, ())
        step.evaluation_s, step.evaluation_ops = alone.step_time_s, len(evaluation)
        return step
    return _play(records, rates, k, devices)


def _play(records: Sequence[OpRecord], rates: DeviceRates, k: TimeConstants,
          devices: Sequence[int]) -> StepPrediction:
    """:func:`predict_step` on ``records``, all of them."""
    host: dict[int, float] = {}  # host timeline -> when it is free
    free: dict[int, float] = {}  # device -> when its compute stream is free
    comm_free: dict[int, float] = {}  # device -> when its collective stream is free
    # device -> when its all-gathers not waited for yet end, oldest first: FSDP2's
    # wait_for_unshard makes the compute stream wait on each, in the order they were issued
    gathered: dict[int, deque[float]] = {}
    # device -> its collective stream's spans, and its compute stream's (the union of the
    # two is the time the device is busy)
    comm_spans: dict[int, list[tuple[float, float]]] = {}
    compute_spans: dict[int, list[tuple[float, float]]] = {}

    def on_compute_stream(d: int, start: float, end: float) -> None:
        spans = compute_spans.setdefault(d, [])
        if spans and start <= spans[-1][1]:  # back to back: one span
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))

    out = {d: DevicePrediction() for d in devices}
    phase = None
    label = None
    kernels = 0
    host_op_s, host_view_s = k.host_op_s, k.host_view_s
    synchronous = rates.synchronous
    # an op's kernel time by its work (kind, dtype, FLOPs, bytes, launches, GEMM; the
    # record from its kind on): a step repeats the same few (its layers, its replicas)
    kernel_times: dict[tuple[object, ...], float] = {}

    def dev(d: int) -> DevicePrediction:
        return out.setdefault(d, DevicePrediction())

    # once per op of the step: kept to plain locals, the prediction's cost
    for op in records:
        (_, device, source, op_label, _, kind, _, _, nbytes, n_kernels, mirrors, _,
         _) = op
        if op_label != label:
            label = op_label
            named = op_label.partition(" (")[0]
            if named != phase:  # a phase starts when the threads of the last one are done
                phase = named
                now = max(host.values(), default=0.0)
                host = {lane: now for lane in host}
        lane = device if phase == "backward" and device != HOST else HOST
        t = host.get(lane)
        if t is None:
            t = max(host.values(), default=0.0)
        if kind == TRANSFER and source != HOST and lane != HOST:
            t = max(t, host.get(source, t))  # the gradient it copies was issued
        cost = host_view_s if kind in (NO_KERNEL, SYNC, GATHER_WAIT) else host_op_s
        targets = (device, *mirrors) if mirrors else (device,)
        # a mirrored replica's op stands for one per replica: in the forward their threads
        # take turns on the GIL (each pays), in the backward each device's thread pays its own
        t += cost * (len(targets) if lane == HOST and kind not in COLLECTIVES else 1)
        host[lane] = t
        if kind == GATHER_WAIT:
            if gathered.get(device):
                free[device] = max(free.get(device, 0.0), gathered[device].popleft())
            continue
        if kind == NO_KERNEL or (device == HOST and kind != TRANSFER):
            continue
        if kind == SYNC:
            host[lane] = max(t, *(free.get(d, 0.0) for d in targets))
            continue
        kernels += n_kernels * len(targets)
        if kind == ALL_GATHER:  # on its own stream, as soon as it is issued (prefetch)
            for d in targets:
                start = max(t, comm_free.get(d, 0.0))
                span = _ring_s(op, rates, k)
                comm_free[d] = start + span
                comm_spans.setdefault(d, []).append((start, start + span))
                gathered.setdefault(d, deque()).append(start + span)
                dev(d).communication_s += span
            continue
        if kind in (ALL_REDUCE, REDUCE_SCATTER):
            for d in targets:
                start = max(free.get(d, 0.0), comm_free.get(d, 0.0))  # its bucket is ready
                span = _ring_s(op, rates, k)
                comm_free[d] = start + span
                comm_spans.setdefault(d, []).append((start, start + span))
                dev(d).communication_s += span
            continue
        if kind in (BROADCAST, REDUCE, GATHER):  # NCCL on the devices' current streams
            span = nbytes / (rates.link_bytes_per_s * k.link_efficiency) \
                + k.collective_latency_s
            start = max(t, *(free.get(d, 0.0) for d in targets))
            for d in targets:
                free[d] = start + span
                on_compute_stream(d, start, start + span)
                dev(d).communication_s += span
            if synchronous:
                host[lane] = start + span
            continue
        if kind == TRANSFER:
            peer = source != HOST and device != HOST
            bw = rates.link_bytes_per_s if peer else rates.host_link_bytes_per_s
            span = nbytes / (bw * k.link_efficiency) + k.kernel_gap_s
            for d, s in zip(targets, (source, *(source for _ in mirrors)), strict=True):
                ends = [x for x in (d, s) if x != HOST]
                start = max(t, *(free.get(x, 0.0) for x in ends))
                for x in ends:
                    free[x] = start + span
                    on_compute_stream(x, start, start + span)
                    dev(x).communication_s += span
                if HOST in (d, s):  # a pageable copy: the host waits for it
                    host[lane] = max(host[lane], start + span)
            continue
        work = op[5:]
        span = kernel_times.get(work, -1.0)
        if span < 0:
            span = kernel_times[work] = kernel_time_s(op, rates, k)
        for d in targets:
            if phase == "optimizer":
                # DDP's finalize_backward: the optimizer reads the all-reduced buckets
                free[d] = max(free.get(d, 0.0), comm_free.get(d, 0.0))
            start = max(t, free.get(d, 0.0))
            free[d] = start + span
            on_compute_stream(d, start, start + span)
            p = out.get(d)
            if p is None:
                p = out[d] = DevicePrediction()
            p.compute_s += span
            if synchronous:
                host[lane] = free[d]
    host_s = max(host.values(), default=0.0) + k.step_overhead_s
    step = max(host_s, *free.values(), *comm_free.values()) if free else host_s
    for d, spans in comm_spans.items():
        out[d].overlap_s = _overlap_s(compute_spans.get(d, []), spans)
    for p in out.values():
        p.waiting_s = max(step - p.busy_s, 0.0)
    return StepPrediction(step, host_s, out, len(records), kernels)


def predict_steps(records: Sequence[OpRecord], step_ends: Sequence[int], rates: DeviceRates,
                  k: TimeConstants, devices: Sequence[int] = ()) -> StepPrediction:
    """The mean step of several measured steps logged one after the other: ``records``
    cut at ``step_ends`` (the index after each step's last op; what follows the last is
    left out), each step played alone (:func:`predict_step`). No ``step_ends``: the
    records are one step. A phase is the word before any "(step N)" the label carries."""
    cuts = [0, *(e for e in step_ends if e > 0)] if step_ends else [0, len(records)]
    steps = [predict_step(records[a:b], rates, k, devices)
             for a, b in pairwise(cuts) if b > a]
    if not steps:
        return predict_step([], rates, k, devices)
    n = len(steps)
    out = StepPrediction(sum(p.step_time_s for p in steps) / n,
                         sum(p.host_s for p in steps) / n,
                         ops=sum(p.ops for p in steps) // n,
                         kernels=sum(p.kernels for p in steps) // n,
                         evaluation_s=sum(p.evaluation_s for p in steps),
                         evaluation_ops=sum(p.evaluation_ops for p in steps))
    for p in steps:
        for d, dev in p.devices.items():
            mean = out.devices.setdefault(d, DevicePrediction())
            mean.compute_s += dev.compute_s / n
            mean.communication_s += dev.communication_s / n
            mean.overlap_s += dev.overlap_s / n
            mean.waiting_s += dev.waiting_s / n
    return out


def rates_for(spec: GpuSpec, interconnect: str = "") -> DeviceRates:
    """``spec``'s datasheet peaks as the model reads them; ``interconnect`` ("nvlink",
    "pcie"; "": NVLink where the board has it) sets the GPU-to-GPU link."""
    peaks = peak_rates_of(spec)
    link = interconnect or ("nvlink" if peaks.nvlink_gbytes_per_s else "pcie")
    if link == "nvlink" and peaks.nvlink_gbytes_per_s is None:
        raise ValueError(f"{spec.name} has no NVLink; use --interconnect pcie")
    gbytes = peaks.nvlink_gbytes_per_s if link == "nvlink" else peaks.pcie_gbytes_per_s
    return DeviceRates(
        matmul_flops_per_s={k: v * 1e12 for k, v in peaks.tflops.items()},
        memory_bytes_per_s=peaks.memory_tbytes_per_s * 1e12,
        link_bytes_per_s=(gbytes or peaks.pcie_gbytes_per_s) * 1e9,
        host_link_bytes_per_s=peaks.pcie_gbytes_per_s * 1e9,
        interconnect=link,
    )
