#!/usr/bin/env bash
# gpu_check.sh: the first run of dpprof's real-GPU path, on a machine with ONE CUDA GPU.
#
#   cd <dpprof checkout> && OUT=/some/dir bash scripts/gpu_check.sh
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh   # the plumbing only, on a CPU box, over the
#                                               # tests' fakes (tests/fakehost)
#   GPU_CHECK_STEPS="env dpprof_check" bash scripts/gpu_check.sh   # only these steps
#                                               # (the summary always runs)
#
# Needs: the project installed as its own install step does it (pip install -e '.[test]',
# which brings a CUDA build of torch from PyPI), an NVIDIA driver, no internet. Python is
# $PYTHON (default: python, else python3). Everything it writes goes under $OUT (default
# ./gpu-check-out): every command's stdout/stderr, every JSON/HTML report, samples files,
# checks.json (the Python checks), summary.txt / summary.json (PASS / FAIL / INFO per
# expectation) and steps.tsv (exit code and seconds per step). Budget: about 6 minutes on
# one H100; each step has its own timeout, cut so that nothing runs past $HARD_S (default
# 450) seconds; a step that would get under 20 s is skipped (steps.tsv says so); the summary
# always runs.
#
# Steps (in order of importance):
#  0 preflight       versions, nvidia-smi -L / -q -d MEMORY, torch.cuda.is_available()
#  1 env             dpprof env, dpprof env --markdown; dpprof check -o check.json (the
#                    figures a user attaches to a bug report)
#  2 checks          gpu_checks.py: UUID match CUDA<->NVML (MIG), NVML v1/v2 memory, whether
#                    NVML lists this PID (containers), NVML call latency, allocator semantics
#                    (cuBLAS workspace, side-stream peaks), dp-loss-primary / dp-loss-forward /
#                    single through run_local_scenario on cuda:0, a real OOM as a result and the
#                    memory coming back, an OOM in warm-up not reporting the previous
#                    scenario's peak, the real OOM message parsed, DDP (NCCL, world 1)
#                    spawned ok and with an OOM (no hang), the NVML sampler's cost on step time
#  3 compare         dpprof compare --backend cuda --gpus 1 (all four scenarios, fixes on)
#  4 compare_oom     dpprof compare --backend cuda --devices 0, an OOM only under DDP,
#                    --fail-on-oom (expect exit 3, dp ok / ddp oom / single ok, no hang)
#  5 watch_real      dpprof watch -- python tiny_train.py (real GPU)
#  6 watch_oom       dpprof watch -- python tiny_oom.py (a real OOM message, post-mortem)
#  7 run_emulated    dpprof watch -- dpprof run --gpus 1 -- python tiny_train.py (the same
#                    script emulated; the watch shows whether emulation touched the GPU)
#  8 emu_leak        dpprof compare --backend emulated with the GPU visible and hidden
#                    (CUDA_VISIBLE_DEVICES=): the numbers must be identical
#  9 bench           benchmarks/emulator_vs_gpu.py --gpus 1 --workloads mlp
# 10 pytest_gpu      pytest -m gpu (one GPU runs all but the gpus2 ones: recorded)
# 11 pytest_cpu      the CPU suite's device-facing files on this CUDA build
# 12 summary         summary.py over everything above
set -uo pipefail

START=$(date +%s)
HARD_S=${HARD_S:-450}   # no step runs past this many seconds from the start (summary excepted)
REPO=${REPO:-$(git rev-parse --show-toplevel 2>/dev/null || pwd)}
cd "$REPO" || { echo "gpu_check: cannot cd to $REPO" >&2; exit 2; }
if ! grep -q '^name = "dpprof"' pyproject.toml 2>/dev/null; then
  echo "gpu_check: run me from the dpprof checkout (or set REPO=...)" >&2
  exit 2
fi
OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$OUT/work
mkdir -p "$WORK"
PY=${PYTHON:-$(command -v python || command -v python3)}
export OUT WORK REPO PYTHONUNBUFFERED=1 COLUMNS=160
DRY=${GPU_CHECK_DRY:-0}
PYTHONPATH_ORIG=${PYTHONPATH:-}
if [ "$DRY" = 1 ]; then
  # Plumbing test on a machine without a GPU: the tests' own fakes (tests/fakehost) stand in
  # for one GPU and for NVML in every dpprof process; the real-GPU checks then fail, as they
  # must, but every command line, file name and the summary are exercised.
  export DPPROF_FAKEHOST="gpus=1,nvml=two_gpus"
  export PYTHONPATH="$REPO/tests/fakehost${PYTHONPATH:+:$PYTHONPATH}"
fi
DP=("$PY" -m dpprof)
printf 'step\trc\tseconds\tnote\n' > "$OUT/steps.tsv"

elapsed() { echo $(( $(date +%s) - START )); }

# step NAME TIMEOUT_S CMD...: run CMD with a timeout (cut to what is left of $HARD_S; skipped
# when under 20 s are left), stdout/stderr to $OUT/NAME.{out,err}, rc and seconds to steps.tsv
step() {
  local name=$1 limit=$2
  shift 2
  local t0 rc left
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    printf '%s\tskipped\t0\tnot in GPU_CHECK_STEPS\n' "$name" >> "$OUT/steps.tsv"
    return 0
  fi
  left=$(( HARD_S - $(elapsed) ))
  if [ "$left" -lt 20 ]; then
    printf '%s\tskipped\t0\tbudget of %ss spent\n' "$name" "$HARD_S" >> "$OUT/steps.tsv"
    echo "== $name: skipped (budget spent)" >&2
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$(date +%s)
  echo "== [$(elapsed)s] $name: $*" >&2
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  rc=$?
  local note=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note="TIMEOUT after ${limit}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$note" >> "$OUT/steps.tsv"
  echo "   rc=$rc ($(( $(date +%s) - t0 ))s) $note" >&2
  return 0
}

# ----------------------------------------------------------------------------- helper files

cat > "$WORK/oom_workloads.py" <<'EOF'
"""Workloads that really run out of memory (loaded by spec, also in DDP ranks)."""
import torch
import torch.distributed as dist
from torch import nn

import dpprof


def _batch(rows, device):
    return torch.randn(rows, 256, device=device), torch.randint(0, 4096, (rows,), device=device)


def _ask_too_much(outputs):
    total = torch.cuda.get_device_properties(outputs.device).total_memory
    return torch.empty(total * 2, dtype=torch.uint8, device=outputs.device)


def _loss_over_64_rows(outputs, targets):
    if outputs.shape[0] > 64:
        _ask_too_much(outputs)
    return nn.functional.cross_entropy(outputs, targets)


def _loss_under_ddp(outputs, targets):
    if dist.is_available() and dist.is_initialized() and outputs.is_cuda:
        _ask_too_much(outputs)
    return nn.functional.cross_entropy(outputs, targets)


def greedy_all():
    """OOM in the loss whenever the loss sees more than 64 rows."""
    return dpprof.Workload(name="greedy_all", model=lambda: nn.Sequential(nn.Linear(256, 4096)),
                           batch=_batch, loss=_loss_over_64_rows)


def greedy_ddp():
    """OOM in the loss only inside a DDP rank (dp and single fit)."""
    return dpprof.Workload(name="greedy_ddp", model=lambda: nn.Sequential(nn.Linear(256, 4096)),
                           batch=_batch, loss=_loss_under_ddp)


def big():
    """About 134 M parameters (AdamW): a peak of about 2.2 GB, far above greedy_all's."""
    return dpprof.Workload(
        name="big",
        model=lambda: nn.Sequential(nn.Linear(4096, 16384), nn.ReLU(), nn.Linear(16384, 4096)),
        batch=lambda rows, device: (torch.randn(rows, 4096, device=device),
                                    torch.randn(rows, 4096, device=device)),
        loss=nn.functional.mse_loss)
EOF

cat > "$WORK/tiny_train.py" <<'EOF'
"""A tiny DataParallel training script: real on the GPU, or emulated under `dpprof run`."""
import json
import os
import sys
import time

import torch
from torch import nn


def main() -> int:
    steps = int(os.environ.get("TINY_STEPS", "8"))
    batch = int(os.environ.get("TINY_BATCH", "256"))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                          nn.Linear(4096, 1024)).to(dev)
    model = nn.DataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    loss = None
    for _ in range(steps):
        x = torch.randn(batch, 1024).to(dev)
        y = torch.randn(batch, 1024).to(dev)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        time.sleep(0.05)  # a few NVML readings per step under dpprof watch
    n = torch.cuda.device_count()
    report = {
        "gpus": n,
        "max_memory_allocated": [torch.cuda.max_memory_allocated(i) for i in range(n)],
        "max_memory_reserved": [torch.cuda.max_memory_reserved(i) for i in range(n)],
        "loss": float(loss) if loss is not None else None,
    }
    path = os.environ.get("TINY_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f)
    print("tiny_train:", json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
EOF

cat > "$WORK/tiny_oom.py" <<'EOF'
"""Hold 1 GiB for a moment, then ask cuda:0 for twice its memory: a real OOM message."""
import time

import torch

keep = torch.empty(2**30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
time.sleep(0.6)
total = torch.cuda.get_device_properties(0).total_memory
x = torch.empty(2 * total, dtype=torch.uint8, device="cuda:0")
EOF

cat > "$WORK/gpu_checks.py" <<'EOF'
"""One-GPU checks of dpprof's real-GPU path; results in $OUT/checks.json (see gpu_check.sh)."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

OUT = Path(os.environ["OUT"])
WORK = Path(os.environ["WORK"])
REPO = Path(os.environ["REPO"])
RESULTS: list[dict] = []
GiB = 2**30


def record(name: str, ok: bool | None, **detail: object) -> None:
    RESULTS.append({"check": name, "ok": ok, **detail})
    tag = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    print(f"[{tag}] {name}: {json.dumps(detail, default=str)[:1500]}", flush=True)
    (OUT / "checks.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def check(fn):
    def run() -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except BaseException as e:  # one failing check must not stop the others
            record(fn.__name__, False, error=f"{type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc()[-4000:])
            if isinstance(e, KeyboardInterrupt):
                raise
        print(f"    ({fn.__name__}: {time.perf_counter() - t0:.1f} s)", flush=True)
    run.__name__ = fn.__name__
    return run


def main() -> int:
    import torch
    from torch import nn

    # imported first: a dry run (no GPU) still shows a name that moved
    from dpprof.backends.cuda import run_local_scenario
    from dpprof.backends.cuda_ddp import DdpJob, ddp_scenario, spawn_ddp
    from dpprof.backends.cuda_measure import CudaRunConfig
    from dpprof.backends.cuda_oom import find_oom, is_oom
    from dpprof.nvml import libnvml
    from dpprof.nvml.devices import resolve_visible_devices, torch_cuda_uuids
    from dpprof.nvml.sampler import NvmlSampler
    from dpprof.scenarios.step import StepConfig
    from dpprof.scenarios.workloads import load_workload

    if not torch.cuda.is_available():
        record("cuda_available", False, torch=torch.__version__, cuda=torch.version.cuda,
               hint="a CPU build of torch, or no driver: nothing below can run")
        return 1

    wide = f"{REPO}/tests/data/gpu_workloads.py:wide"
    oomw = f"{WORK}/oom_workloads.py"
    nv = libnvml.default_nvml()
    state: dict[str, object] = {"nvml0": 0, "nvml_all": []}

    def cfg(batch: int, warmup: int = 1, steps: int = 3, interval: float = 0.02):
        return CudaRunConfig(devices=[0], nvml_interval_s=interval,
                             step=StepConfig(batch=batch, warmup=warmup, steps=steps))

    def asdict(x: object) -> object:
        try:
            return dataclasses.asdict(x)  # type: ignore[arg-type]
        except Exception:
            return repr(x)

    @check
    def versions() -> None:
        import pynvml
        p = torch.cuda.get_device_properties(0)
        st = nv.status()
        migs = []
        if st.available:
            for i in range(nv.device_count()):
                m = nv.mig_devices(i)
                migs.append([x.uuid for x in m] if m else m)
        try:
            nccl = torch.cuda.nccl.version()
        except Exception as e:
            nccl = f"{type(e).__name__}: {e}"
        record("versions", None, torch=torch.__version__, cuda=torch.version.cuda, nccl=nccl,
               device=p.name, capability=f"{p.major}.{p.minor}", total_memory=p.total_memory,
               cuda_gpus=torch.cuda.device_count(), nvml=st.available, nvml_reason=st.reason,
               nvml_gpus=nv.device_count(), driver=nv.driver_version(),
               pynvml=getattr(pynvml, "__version__", "?"), mig_devices=migs,
               cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
               torch_uuid_str=str(p.uuid), python=sys.version.split()[0],
               allocator=torch.cuda.get_allocator_backend())

    @check
    def uuid_match() -> None:
        uuids = torch_cuda_uuids()
        raw = [str(torch.cuda.get_device_properties(i).uuid)
               for i in range(torch.cuda.device_count())]
        found = resolve_visible_devices(nv, None, uuids)
        bare = resolve_visible_devices(nv, None, raw)
        rows = [dict(cuda=d.cuda_index, nvml=d.nvml_index, uuid=d.uuid, mig=d.mig,
                     reason=d.reason) for d in found.devices]
        if found.devices and found.devices[0].nvml_index is not None:
            state["nvml0"] = found.devices[0].nvml_index
        state["nvml_all"] = sorted({d.nvml_index for d in found.devices
                                    if d.nvml_index is not None})
        ok = bool(found.devices) and all(d.nvml_index is not None for d in found.devices)
        record("uuid_match", ok, torch_cuda_uuids=uuids, raw_torch_uuids=raw,
               nvml_uuids=[nv.uuid(i) for i in range(nv.device_count())], matched=rows,
               matched_from_bare_uuids=[(d.cuda_index, d.nvml_index, d.mig)
                                        for d in bare.devices],
               notes=found.notes,
               meaning="FAIL: a CUDA device is not matched to NVML; with MIG, the "
                       "runtime's UUID is not the MIG device's")

    @check
    def nvml_memory_v1_v2() -> None:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(int(state["nvml0"]))
        v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        detail: dict[str, object] = dict(v1_total=v1.total, v1_free=v1.free, v1_used=v1.used)
        try:
            v2 = pynvml.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
            detail.update(v2_total=v2.total, v2_free=v2.free, v2_used=v2.used,
                          v2_reserved=v2.reserved,
                          v2_total_eq_free_used_reserved=v2.total == v2.free + v2.used
                          + v2.reserved,
                          v1_used_minus_v2_used=v1.used - v2.used)
        except Exception as e:
            detail["v2_error"] = f"{type(e).__name__}: {e}"
        mem = nv.memory(int(state["nvml0"]))
        detail["dpprof_memory"] = asdict(mem)
        detail["dpprof_uses_v2"] = mem is not None and mem.reserved is not None
        record("nvml_memory_v1_v2", None, **detail)

    @check
    def nvml_sees_this_pid() -> None:
        keep = torch.ones(1 << 20, device="cuda:0")
        torch.cuda.synchronize()
        time.sleep(0.2)
        procs = nv.processes(int(state["nvml0"]))
        mine = [p for p in procs or [] if p.pid == os.getpid()]
        record("nvml_sees_this_pid", bool(mine), pid=os.getpid(),
               processes=[(p.pid, p.used_bytes) for p in procs or []],
               reason=nv.reason("processes", int(state["nvml0"])),
               meaning="FAIL: NVML lists PIDs of another PID namespace (a container): "
                       "process_used_bytes, stray-context detection and watch's "
                       "command_peak_bytes are blind here")
        del keep

    @check
    def nvml_latency() -> None:
        i = int(state["nvml0"])
        n = 200
        res: dict[str, object] = {}
        for name, fn in (("memory", lambda: nv.memory(i)),
                         ("utilization", lambda: nv.utilization(i)),
                         ("processes", lambda: nv.processes(i))):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            res[f"{name}_ms"] = round((time.perf_counter() - t0) / n * 1e3, 4)
        devs = list(state["nvml_all"]) or [i]  # type: ignore[arg-type]
        s = NvmlSampler(nv, devs, 0.02, pids=[os.getpid()])
        t0 = time.perf_counter()
        for _ in range(50):
            s.sample_once()
        res["sample_once_ms"] = round((time.perf_counter() - t0) / 50 * 1e3, 4)
        res["devices_sampled"] = len(devs)
        res["sampler_notes"] = s.notes
        record("nvml_latency", None, **res)

    @check
    def allocator_semantics() -> None:
        d = 0
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        a0 = torch.cuda.memory_allocated(d)
        side = torch.cuda.Stream(d)
        with torch.cuda.stream(side):
            m = torch.randn(512, 512, device=d)
            r = m @ m
        torch.cuda.synchronize()
        del m, r
        a_ws = torch.cuda.memory_allocated(d) - a0  # the (handle, side stream) workspace
        torch._C._cuda_clearCublasWorkspaces()
        a_cleared = torch.cuda.memory_allocated(d) - a0
        torch.cuda.reset_peak_memory_stats(d)
        base = torch.cuda.memory_allocated(d)
        with torch.cuda.stream(side):
            t = torch.empty(64 << 20, dtype=torch.uint8, device=d)
            del t
        torch.cuda.synchronize()
        side_peak = torch.cuda.max_memory_allocated(d) - base
        record("allocator_semantics", side_peak >= (64 << 20) and a_cleared <= 0,
               cublas_workspace_bytes=a_ws, after_clear_bytes=a_cleared,
               side_stream_peak_bytes=side_peak)

    @check
    def scenarios_one_gpu() -> None:
        wl = load_workload(wide)
        ok = True
        out: dict[str, object] = {}
        full = {}
        for name in ("dp-loss-primary", "dp-loss-forward", "single"):
            t0 = time.perf_counter()
            r = run_local_scenario(name, wl, cfg(256))
            d = r.devices[0]
            problems = []
            if r.status != "ok":
                problems.append(f"status {r.status}: {r.message}")
            if not d.allocator_stats or d.peak_allocated_bytes <= 0:
                problems.append("no allocator peak")
            if d.peak_reserved_bytes is None or d.peak_reserved_bytes < d.peak_allocated_bytes:
                problems.append("reserved < allocated")
            if not {"inputs", "forward", "backward"} <= set(d.phase_peak_allocated_bytes):
                problems.append(f"phases {sorted(d.phase_peak_allocated_bytes)}")
            if not (d.uuid or "").startswith(("GPU-", "MIG-")):
                problems.append(f"uuid {d.uuid!r}")
            if not d.nvml_peak_used_bytes or not d.timeline:
                problems.append(f"nvml: {d.nvml_reason}")
            if d.nvml_unexplained_bytes is None:
                problems.append("nvml_unexplained_bytes None")
            if len(r.step_times_s) != 3 or not r.event_step_time_s:
                problems.append(f"timing {r.step_times_s} / {r.event_step_time_s}")
            if r.stray_contexts:
                problems.append(f"stray contexts {r.stray_contexts}")
            ok = ok and not problems
            out[name] = dict(
                seconds=round(time.perf_counter() - t0, 2), status=r.status,
                peak_allocated=d.peak_allocated_bytes, peak_reserved=d.peak_reserved_bytes,
                phases=d.phase_peak_allocated_bytes, nvml_peak=d.nvml_peak_used_bytes,
                nvml_baseline=d.nvml_baseline_used_bytes,
                nvml_unexplained=d.nvml_unexplained_bytes, timeline_points=len(d.timeline),
                step_time_s=r.step_time_s, event_step_time_s=r.event_step_time_s,
                step_times_s=r.step_times_s, util_mean=d.gpu_utilization_mean_percent,
                process_used=d.process_used_bytes, nvml_reason=d.nvml_reason, notes=r.notes,
                problems=problems)
            full[name] = asdict(r)
        (OUT / "checks_scenarios.json").write_text(json.dumps(full, indent=1, default=str))
        record("scenarios_one_gpu", ok, **out)

    @check
    def real_oom_dp() -> None:
        wl = load_workload(f"{oomw}:greedy_all")
        torch.ones(8, 8, device="cuda:0") @ torch.ones(8, 8, device="cuda:0")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(0)
        t0 = time.perf_counter()
        r = run_local_scenario("dp-loss-primary", wl, cfg(128, steps=2))
        seconds = time.perf_counter() - t0
        after = torch.cuda.memory_allocated(0)
        reserved_after = torch.cuda.memory_reserved(0)
        total = torch.cuda.get_device_properties(0).total_memory
        s = run_local_scenario("single", wl, cfg(64, steps=2))
        ok = (r.status == "oom" and r.oom_device == 0 and r.oom_phase == "loss"
              and bool(r.oom_bytes) and abs((r.oom_bytes or 0) - 2 * total) < 0.01 * total
              and after <= before and s.status == "ok")
        record("real_oom_dp", ok, status=r.status, message=r.message, oom_device=r.oom_device,
               oom_phase=r.oom_phase, oom_bytes=r.oom_bytes, expected_bytes=2 * total,
               allocated_before=before, allocated_after=after, reserved_after=reserved_after,
               seconds=round(seconds, 2), single_status=s.status, single_message=s.message)

    @check
    def stale_peak_after_oom_in_warmup() -> None:
        # A scenario that runs out of memory in a warm-up step reports the allocator's peak
        # since the last reset_peak_memory_stats: nothing resets it between scenarios, so the
        # previous scenario's peak comes back as this one's (cuda_measure.py: MeasuringLoop
        # resets at its start and at the first measured step; record_failure reads
        # peaks_now()).
        r_big = run_local_scenario("single", load_workload(f"{oomw}:big"), cfg(64, steps=2))
        big_peak = r_big.devices[0].peak_allocated_bytes
        r = run_local_scenario("dp-loss-primary", load_workload(f"{oomw}:greedy_all"),
                               cfg(128, steps=2))
        d = r.devices[0]
        ok = r.status == "oom" and r_big.status == "ok" and d.peak_allocated_bytes < 0.5 * big_peak
        record("stale_peak_after_oom_in_warmup", ok, big_status=r_big.status,
               big_peak_allocated=big_peak, big_peak_reserved=r_big.devices[0].peak_reserved_bytes,
               oom_status=r.status, oom_phase=r.oom_phase,
               oom_scenario_peak_allocated=d.peak_allocated_bytes,
               oom_scenario_peak_reserved=d.peak_reserved_bytes,
               meaning="FAIL: the OOM scenario reports the previous scenario's peak")

    @check
    def parse_real_oom() -> None:
        msg, err = "", None
        try:
            torch.empty(2**50, dtype=torch.uint8, device="cuda:0")
        except Exception as e:
            msg, err = str(e), e
        info = find_oom(msg)
        ok = (err is not None and is_oom(err) and info is not None and info.cuda_index == 0
              and info.requested_bytes == 2**50)
        record("parse_real_oom", ok, type=type(err).__name__, message=msg[:600],
               device=info.cuda_index if info else None,
               bytes=info.requested_bytes if info else None)

    @check
    def ddp_world1_ok() -> None:
        c = cfg(256)
        job = DdpJob(workload=wide, cfg=c, backend="nccl", device="cuda", timeout_s=90)
        t0 = time.perf_counter()
        outcomes = spawn_ddp(job, 1)
        seconds = time.perf_counter() - t0
        s = ddp_scenario(outcomes, c, 1)
        d = s.devices[0] if s.devices else None
        ok = (s.status == "ok" and d is not None and d.cuda_index == 0 and d.rank == 0
              and not s.stray_contexts and bool(d.nvml_peak_used_bytes) and d.allocator_stats)
        record("ddp_world1_ok", ok, seconds=round(seconds, 1), status=s.status,
               message=s.message, device=asdict(d) if d else None,
               stray_contexts=s.stray_contexts, notes=s.notes,
               step_time_s=s.step_time_s, event_step_time_s=s.event_step_time_s)

    @check
    def ddp_world1_oom_no_hang() -> None:
        c = cfg(128, steps=2)
        job = DdpJob(workload=f"{oomw}:greedy_ddp", cfg=c, backend="nccl", device="cuda",
                     timeout_s=60)
        t0 = time.perf_counter()
        outcomes = spawn_ddp(job, 1)
        seconds = time.perf_counter() - t0
        s = ddp_scenario(outcomes, c, 1)
        ok = s.status == "oom" and s.oom_phase == "loss" and seconds < 60
        record("ddp_world1_oom_no_hang", ok, seconds=round(seconds, 1), status=s.status,
               message=s.message, oom_phase=s.oom_phase, oom_device=s.oom_device,
               oom_bytes=s.oom_bytes, notes=s.notes)

    @check
    def sampler_overhead() -> None:
        import torch.nn.functional as F
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 4096)).cuda()
        x = torch.randn(256, 256, device="cuda")
        y = torch.randint(0, 4096, (256,), device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def run(n: int = 300) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n

        run(30)
        devs = list(state["nvml_all"]) or [int(state["nvml0"])]  # type: ignore[arg-type]
        res: dict[str, list[float]] = {"off": [], "on_20ms": [], "on_5ms": []}
        for _ in range(3):
            res["off"].append(run())
            with NvmlSampler(nv, devs, 0.02, pids=[os.getpid()]):
                res["on_20ms"].append(run())
            with NvmlSampler(nv, devs, 0.005, pids=[os.getpid()]):
                res["on_5ms"].append(run())
        med = {k: statistics.median(v) for k, v in res.items()}
        record("sampler_overhead", None,
               step_ms={k: round(v * 1e3, 4) for k, v in med.items()},
               slowdown_20ms_pct=round(100 * (med["on_20ms"] / med["off"] - 1), 2),
               slowdown_5ms_pct=round(100 * (med["on_5ms"] / med["off"] - 1), 2),
               devices_sampled=len(devs))

    for fn in (versions, uuid_match, nvml_memory_v1_v2, nvml_sees_this_pid, nvml_latency,
               allocator_semantics, scenarios_one_gpu, real_oom_dp,
               stale_peak_after_oom_in_warmup, parse_real_oom,
               ddp_world1_ok, ddp_world1_oom_no_hang, sampler_overhead):
        fn()
    failed = [r["check"] for r in RESULTS if r["ok"] is False]
    print(f"checks: {len(RESULTS)} run, failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
EOF

cat > "$WORK/summary.py" <<'EOF'
"""Read every output of gpu_check.sh and say, per expectation, PASS / FAIL / INFO."""
from __future__ import annotations

import json
import os
from pathlib import Path

OUT = Path(os.environ["OUT"])
rows: list[dict] = []


def say(name: str, ok: bool | None, detail: object = "") -> None:
    rows.append({"check": name, "ok": ok, "detail": detail})


def load(name: str):
    p = OUT / name
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except Exception as e:  # noqa: BLE001
        return {"__error__": f"{type(e).__name__}: {e}"}


checks = {r["check"]: r for r in (load("checks.json") or []) if isinstance(r, dict)}
# False: NVML lists PIDs of another namespace (a container): per-process figures are blind
pid_visible = (checks.get("nvml_sees_this_pid") or {}).get("ok")

steps = {}
for line in (OUT / "steps.tsv").read_text().splitlines()[1:]:
    parts = line.split("\t")
    steps[parts[0]] = parts[1:]
for name, (rc, secs, *note) in steps.items():
    if rc == "skipped":
        say(f"step {name}", None, f"skipped: {note}")
    elif name not in ("compare_oom", "watch_oom", "pytest_gpu", "checks", "pytest_cpu"):
        say(f"step {name}", rc == "0", f"rc={rc} in {secs}s {' '.join(note)}")
    else:
        say(f"step {name}", None, f"rc={rc} in {secs}s {' '.join(note)}")

env_md = (OUT / "env_md.out").read_text() if (OUT / "env_md.out").exists() else ""
say("env lists a GPU- or MIG- UUID", "GPU-" in env_md or "MIG-" in env_md, env_md[:400])

for r in checks.values():
    say(f"checks.{r['check']}", r["ok"], {k: v for k, v in r.items()
                                          if k not in ("check", "ok", "traceback")})

c = load("compare_cuda.json")
if isinstance(c, dict) and "scenarios" in c:
    by = {s["name"]: s for s in c["scenarios"]}
    say("compare: backend cuda, 1 GPU", c.get("backend") == "cuda" and c.get("gpus") == 1,
        {"backend": c.get("backend"), "gpus": c.get("gpus")})
    say("compare: every scenario ok", all(s["status"] == "ok" for s in by.values()),
        {n: (s["status"], s["message"][:200]) for n, s in by.items()})
    for n, s in by.items():
        for d in s["devices"]:
            if not d.get("used"):
                continue
            say(f"compare {n} dev{d['index']}: allocator + NVML + timing",
                bool(d.get("allocator_stats")) and (d.get("peak_reserved_bytes") or 0)
                >= d["peak_allocated_bytes"] > 0 and bool(d.get("nvml_peak_used_bytes"))
                and bool(d.get("timeline")) and bool(s.get("event_step_time_s"))
                and len(s.get("step_times_s") or []) == 3,
                {k: d.get(k) for k in ("peak_allocated_bytes", "peak_reserved_bytes",
                                       "nvml_peak_used_bytes", "nvml_unexplained_bytes",
                                       "nvml_reason", "uuid", "cuda_index", "rank",
                                       "process_used_bytes")}
                | {"event_step_time_s": s.get("event_step_time_s"),
                   "step_time_s": s.get("step_time_s")})
    if "ddp" in by:
        say("compare ddp: no stray context (set_device first)",
            by["ddp"].get("stray_contexts") == [], by["ddp"].get("stray_contexts"))
    say("compare: environment has nccl_version and gpus",
        bool(c.get("environment", {}).get("nccl_version"))
        and bool(c.get("environment", {}).get("gpus")),
        {k: c.get("environment", {}).get(k) for k in ("nccl_version", "driver_version",
                                                      "torch_cuda_version")})
else:
    say("compare_cuda.json", False, c)

o = load("compare_oom.json")
rc = steps.get("compare_oom", ["?"])[0]
if isinstance(o, dict) and "scenarios" in o:
    by = {s["name"]: s for s in o["scenarios"]}
    got = {n: s["status"] for n, s in by.items()}
    say("compare_oom: dp ok, ddp oom (in loss), single ok, exit 3",
        got == {"dp-loss-primary": "ok", "ddp": "oom", "single": "ok"}
        and by["ddp"].get("oom_phase") == "loss" and rc == "3",
        {"statuses": got, "ddp_message": by.get("ddp", {}).get("message"),
         "ddp_oom_phase": by.get("ddp", {}).get("oom_phase"), "rc": rc,
         "seconds": steps.get("compare_oom", ["?", "?"])[1]})
else:
    say("compare_oom.json", False, {"rc": rc, "json": o})

real = load("tiny_real.json")
w = load("watch_real.json")
if isinstance(w, dict) and w.get("watch"):
    d0 = (w["watch"].get("devices") or [{}])[0]
    say("watch_real: a timeline with a peak", bool(d0.get("peak_used_bytes"))
        and (d0.get("samples") or 0) > 3 and w["watch"].get("exit_status") == 0,
        {k: d0.get(k) for k in ("peak_used_bytes", "baseline_used_bytes",
                                "command_peak_bytes", "samples", "stopped_reason")})
    say("watch_real: the command's own memory (NVML per-process, same PID namespace)",
        (d0.get("command_peak_bytes") is not None) if pid_visible is not False else None,
        {"command_peak_bytes": d0.get("command_peak_bytes"), "nvml_sees_pids": pid_visible})
    if real:
        say("watch_real vs the script's own allocator peak", None,
            {"nvml_peak": d0.get("peak_used_bytes"),
             "nvml_command_peak": d0.get("command_peak_bytes"),
             "torch_max_allocated": real["max_memory_allocated"],
             "torch_max_reserved": real["max_memory_reserved"]})
else:
    say("watch_real.json", False, w)

wo = load("watch_oom.json")
if isinstance(wo, dict) and wo.get("watch"):
    oo = (wo["watch"].get("ooms") or [{}])[0]
    dev = (wo["watch"].get("devices") or [{}])[0]
    total = dev.get("total_bytes") or 0
    say("watch_oom: GPU 0 named, size read, post-mortem written, exit 1",
        oo.get("cuda_index") == 0 and bool(oo.get("requested_bytes"))
        and bool(wo["watch"].get("post_mortem")) and wo["watch"].get("exit_status") == 1,
        {"oom": {k: oo.get(k) for k in ("cuda_index", "requested_bytes", "total_bytes",
                                        "free_bytes", "format", "exception")},
         "nvml_total": total, "post_mortem": wo["watch"].get("post_mortem")})
else:
    say("watch_oom.json", False, wo)

run = load("run_tiny.json")
if isinstance(run, dict) and run.get("scenarios"):
    s0 = run["scenarios"][0]
    d0 = s0["devices"][0] if s0.get("devices") else {}
    # as max_memory_allocated counts: the tensors and the cuBLAS workspaces
    emu = (d0["peak_allocated_bytes"] + (d0.get("workspace_bytes") or 0)) if d0 else None
    meas = real["max_memory_allocated"][0] if real else None
    say("dpprof run (emulated) vs the real run of the same script", None,
        {"scenario": s0["name"], "status": s0["status"], "emulated_peak_allocated": emu,
         "real_max_memory_allocated": meas,
         "ratio": (emu / meas) if emu and meas else None,
         "emulated_reserved": s0["devices"][0].get("peak_reserved_bytes")
         if s0.get("devices") else None,
         "real_max_memory_reserved": real["max_memory_reserved"][0] if real else None})
else:
    say("run_tiny.json", False, run)

wr = load("watch_run_emulated.json")
if isinstance(wr, dict) and wr.get("watch"):
    d0 = (wr["watch"].get("devices") or [{}])[0]
    say("emulation (dpprof run) never touched the real GPU",
        (not d0.get("command_peak_bytes")) if pid_visible else None,
        {"command_peak_bytes": d0.get("command_peak_bytes"),
         "peak_used": d0.get("peak_used_bytes"), "baseline": d0.get("baseline_used_bytes")})
we = load("watch_emu_compare.json")
if isinstance(we, dict) and we.get("watch"):
    d0 = (we["watch"].get("devices") or [{}])[0]
    say("emulation (compare --backend emulated) never touched the real GPU",
        (not d0.get("command_peak_bytes")) if pid_visible else None,
        {"command_peak_bytes": d0.get("command_peak_bytes")})

a, b = load("emu_visible.json"), load("emu_hidden.json")
if isinstance(a, dict) and isinstance(b, dict) and "scenarios" in a and "scenarios" in b:
    def peaks(r):
        return {s["name"]: [(d["peak_allocated_bytes"], d.get("peak_reserved_bytes"))
                            for d in s["devices"]] for s in r["scenarios"]}
    say("emulated numbers identical with the GPU visible and hidden", peaks(a) == peaks(b),
        {"visible": peaks(a), "hidden": peaks(b)})
else:
    say("emu_visible/emu_hidden", False, {"visible": bool(a), "hidden": bool(b)})

bench = OUT / "emulator_vs_gpu.jsonl"
if bench.exists():
    for line in bench.read_text().splitlines()[-3:]:
        rec = json.loads(line)
        say(f"bench {rec['workload']}", None, [
            {k: r.get(k) for k in ("scenario", "device", "status", "allocated_error",
                                   "reserved_error", "total_error")} for r in rec["rows"]])

k = load("check.json")
if isinstance(k, dict) and "rows" in k:
    say("dpprof check: every scenario ok", all(r["status"] == ["ok", "ok"] for r in k["rows"]),
        {r["scenario"]: r["messages"] for r in k["rows"]})
    say("dpprof check: every CUDA device matched to NVML",
        all(d.get("matched") for d in k.get("devices", [])), k.get("devices"))
    say("dpprof check: per-process NVML works", (k.get("per_process_nvml") or {}).get("works"),
        k.get("per_process_nvml"))
    say("dpprof check: figures", None, {key: k.get(key) for key in (
        "gpu", "context", "cublas_workspace", "sampler", "rows", "notes")})
elif steps.get("dpprof_check", ["skipped"])[0] != "skipped":
    say("check.json", False, k)

for name in ("pytest_gpu", "pytest_cpu"):
    p = OUT / f"{name}.out"
    if p.exists():
        tail = [x for x in p.read_text().splitlines() if x.strip()][-12:]
        say(name, None, tail)

(OUT / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
with (OUT / "summary.txt").open("w") as f:
    for r in rows:
        tag = "INFO" if r["ok"] is None else ("PASS" if r["ok"] else "FAIL")
        line = f"[{tag}] {r['check']}: {json.dumps(r['detail'], default=str)[:900]}"
        f.write(line + "\n")
        print(line)
fails = [r["check"] for r in rows if r["ok"] is False]
print(f"\n{len(rows)} expectations, {len(fails)} FAIL: {fails}")
EOF

# ----------------------------------------------------------------------------- 0 preflight

{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  repo: $REPO  commit: $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,mig.mode.current,driver_version --format=csv 2>&1
  nvidia-smi -q -d MEMORY 2>&1 | head -40
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1
  env | grep -E '^(CUDA_|NCCL_|TORCH_NCCL|PYTORCH_)' 2>&1
} > "$OUT/preflight_smi.txt" 2>&1
step preflight 120 "$PY" -c '
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
ok = torch.cuda.is_available()
print("cuda available", ok, "devices", torch.cuda.device_count() if ok else 0)
if ok:
    p = torch.cuda.get_device_properties(0)
    print("cuda:0", p.name, p.total_memory, str(p.uuid), "nccl", torch.cuda.nccl.version())
import dpprof, pynvml
print("dpprof", dpprof.__version__, "pynvml", getattr(pynvml, "__version__", "?"))
sys.exit(0 if ok else 3)'
if [ "$DRY" != 1 ] && ! grep -q "cuda available True" "$OUT/preflight.out"; then
  echo "gpu_check: torch sees no CUDA GPU (see $OUT/preflight.out/err); stopping" >&2
  exit 3
fi

# ----------------------------------------------------------------------------- 1 env

step env 90 "${DP[@]}" env
step env_md 90 "${DP[@]}" env --markdown
CHECK_ARGS=()
# the dry run's CPU stand-in is slow: a few rows and steps show the plumbing
[ "$DRY" = 1 ] && CHECK_ARGS=(-b 4 --steps 1 --sampler-steps 2 -s single,dp-loss-primary)
step dpprof_check 240 "${DP[@]}" check "${CHECK_ARGS[@]}" -o "$OUT/check.json"

# ----------------------------------------------------------------------------- 2 checks

step checks 240 "$PY" "$WORK/gpu_checks.py"

# ----------------------------------------------------------------------------- 3-4 compare

step compare 200 "${DP[@]}" compare --backend cuda --gpus 1 -w mlp -b 64 --warmup 1 --steps 3 \
  --ddp-timeout 90 --debug -o "$OUT/compare_cuda.json" -o "$OUT/compare_cuda.html" \
  -o "$OUT/compare_cuda.md"
step compare_oom 150 "${DP[@]}" compare --backend cuda --devices 0 \
  -w "$WORK/oom_workloads.py:greedy_ddp" -s dp-loss-primary,ddp,single -b 64 --warmup 1 \
  --steps 2 --ddp-timeout 60 --no-fixes --fail-on-oom --debug -o "$OUT/compare_oom.json"

# ----------------------------------------------------------------------------- 5-7 watch, run

step watch_real 90 env TINY_REPORT="$OUT/tiny_real.json" "${DP[@]}" watch --interval 0.02 \
  -o "$OUT/watch_real.json" -o "$OUT/watch_real.html" -- "$PY" "$WORK/tiny_train.py"
step watch_oom 90 "${DP[@]}" watch --interval 0.02 -o "$OUT/watch_oom.json" \
  -o "$OUT/watch_oom.html" -- "$PY" "$WORK/tiny_oom.py"
step run_emulated 150 "${DP[@]}" watch --interval 0.05 -o "$OUT/watch_run_emulated.json" -- \
  "$PY" -m dpprof run --gpus 1 --gpu h100-80gb --steps 3 -o "$OUT/run_tiny.json" \
  -o "$OUT/run_tiny.html" -- "$PY" "$WORK/tiny_train.py"

# ----------------------------------------------------------------------------- 8 emulation leak

step emu_visible 120 "${DP[@]}" watch --interval 0.05 -o "$OUT/watch_emu_compare.json" -- \
  "$PY" -m dpprof compare --backend emulated -w mlp -b 64 --gpus 2 -q -o "$OUT/emu_visible.json"
step emu_hidden 120 env CUDA_VISIBLE_DEVICES= "${DP[@]}" compare --backend emulated -w mlp \
  -b 64 --gpus 2 -q -o "$OUT/emu_hidden.json"

# ----------------------------------------------------------------------------- 9 benchmark

BENCH_REC=benchmarks/emulator_vs_gpu.jsonl
lines_before=0
[ -f "$BENCH_REC" ] && lines_before=$(wc -l < "$BENCH_REC")
step bench 200 "$PY" benchmarks/emulator_vs_gpu.py --gpus 1 --workloads mlp --batch 16
if [ -f "$BENCH_REC" ]; then
  tail -n +"$((lines_before + 1))" "$BENCH_REC" > "$OUT/emulator_vs_gpu.jsonl"
fi

# ----------------------------------------------------------------------------- 10-11 pytest

# (the tests install their own fakes: none of the dry run's is passed on)
PYT=(env -u DPPROF_FAKEHOST PYTHONPATH="$PYTHONPATH_ORIG" "$PY" -m pytest)
step pytest_gpu 120 "${PYT[@]}" -m gpu -ra -q -p no:cacheprovider tests/test_gpu.py
step pytest_cpu 150 "${PYT[@]}" -q -ra -p no:cacheprovider \
  -m "not slow and not browser and not gpu" tests/test_cuda_backend.py tests/test_nvml.py \
  tests/test_devices.py tests/test_sampler.py tests/test_env.py tests/test_emulator_vs_gpu.py

# ----------------------------------------------------------------------------- 12 summary

# what the steps left in the working tree (dpprof's default report folder) goes with the rest
[ -d dpprof-reports ] && cp -r dpprof-reports "$OUT/" 2>/dev/null
timeout 60 "$PY" "$WORK/summary.py" > "$OUT/summary.out" 2> "$OUT/summary.err"
cat "$OUT/summary.out"
echo "gpu_check: done in $(elapsed)s; everything is in $OUT" >&2
