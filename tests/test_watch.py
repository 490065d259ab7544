"""``dpprof watch``: real child processes under a fake NVML (tests/watch_fakes.py).

The watcher runs in this process with its stdout/stderr pointed at files, so the passthrough
can be compared byte for byte; the CLI tests at the end run ``dpprof`` itself (no NVML here,
a pty for the terminal's Ctrl-C, a SIGKILL of dpprof mid-run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fake_cuda
import pytest
import watch_fakes
from fake_nvml import FakeNvml
from typer.testing import CliRunner

from dpprof.answers.post_mortem import post_mortem
from dpprof.cli.app import app
from dpprof.reports import html as html_report
from dpprof.reports import json as json_report
from dpprof.reports import terminal
from dpprof.result import RunResult
from dpprof.watch.analysis import REPORT_POINTS, build_run, load_run
from dpprof.watch.monitor import WatchConfig, Watcher, WatchOutcome, select_devices
from dpprof.watch.samples import read_records

GIB = 2**30
MIB = 2**20
PY = sys.executable

OOM_MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, "
    "this process has 78.08 GiB memory in use. Of the allocated memory 75.50 GiB is "
    "allocated by PyTorch, and 1.12 GiB is reserved by PyTorch but unallocated. If reserved "
    "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
    "True to avoid fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

# Python for a watched command: wait (bounded) until the watcher's samples file, whose
# records are flushed one by one as they happen, holds what the test needs. ``path``: the
# file; ``done(records)``: the condition. No fixed time window: under load it waits longer.
WAIT_FOR_RECORDS = """
import json, os, sys, time
def wait_for_records(path, done, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                records = [json.loads(line) for line in f if line.endswith("\\n")]
        except FileNotFoundError:
            records = []
        if done(records):
            return records
        time.sleep(0.01)
    sys.stderr.write(f"the watcher's records never met the condition in {timeout} s\\n")
    sys.exit(99)
"""


def oom_script(samples: Path) -> str:
    """A training script that dies as PyTorch does: a traceback ending in the allocator's
    message, exit status 1. It starts a grandchild first (a process of the command too) and
    fails once the watcher has read both GPUs full (the fake's last readings: 78 and 40 GiB)
    and has seen the child and the grandchild on cuda:0 in one reading."""
    return WAIT_FOR_RECORDS + f"""
import subprocess
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("epoch 1 step 1 loss 2.3", flush=True)
def full(records):
    last = {{r["device"]: r["used_bytes"] for r in records if r["kind"] == "sample"}}
    on_0 = {{}}
    for r in records:
        if r["kind"] == "process" and r["device"] == 0:
            on_0.setdefault(r["t_s"], set()).add(r["pid"])
    both = any({{os.getpid(), helper.pid}} <= pids for pids in on_0.values())
    return last.get(0) == 78 * 2**30 and last.get(1) == 40 * 2**30 and both
wait_for_records({str(samples)!r}, full)
sys.stderr.write('Traceback (most recent call last):\\n  File "train.py", line 41, in <module>\\n'
                 '    loss.backward()\\n')
sys.stderr.write({OOM_MESSAGE!r} + "\\n")
sys.stderr.flush()
helper.kill()
sys.exit(1)
"""


def samples_of(tmp_path: Path) -> Path:
    """Where :func:`run_watch` has the watcher write its records."""
    return tmp_path / "run.samples.jsonl"


def run_watch(
    tmp_path: Path,
    script: str,
    nvml: FakeNvml | None = None,
    *,
    interval_s: float = 0.02,
    kill_after_s: float = 10.0,
    stdin: bytes | None = None,
    during: callable | None = None,  # type: ignore[valid-type]
) -> tuple[WatchOutcome, bytes, bytes]:
    """Run ``python -c script`` under the watcher; return the outcome, stdout, stderr."""
    nvml = nvml or watch_fakes.two_gpus()
    devices, notes = select_devices(nvml, None, env={})
    out_path, err_path = tmp_path / "out.bin", tmp_path / "err.bin"
    out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    in_fd = None
    if stdin is not None:
        (tmp_path / "in.bin").write_bytes(stdin)
        in_fd = os.open(tmp_path / "in.bin", os.O_RDONLY)
    cfg = WatchConfig(
        command=[PY, "-c", script], samples_path=samples_of(tmp_path),
        interval_s=interval_s, kill_after_s=kill_after_s, process_scan_s=0.05,
    )
    watcher = Watcher(
        cfg, nvml, devices, stdin_fd=in_fd, stdout_fd=out_fd, stderr_fd=err_fd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, notes=notes,
    )
    helper = None
    if during is not None:
        helper = threading.Thread(target=during, args=(out_path,), daemon=True)
        helper.start()
    try:
        outcome = watcher.run()
    finally:
        for fd in (out_fd, err_fd, in_fd):
            if fd is not None:
                os.close(fd)
    if helper is not None:
        helper.join(10)
    return outcome, out_path.read_bytes(), err_path.read_bytes()


def wait_for(path: Path, needle: bytes, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_bytes():
            return
        time.sleep(0.02)
    raise AssertionError(f"{needle!r} never appeared in {path}")


# --------------------------------------------------------------------------- real children


def test_oom_script_status_passthrough_and_post_mortem(tmp_path: Path) -> None:
    outcome, out, err = run_watch(tmp_path, oom_script(samples_of(tmp_path)))
    assert outcome.exit_status == 1
    assert out == b"epoch 1 step 1 loss 2.3\n"
    assert err.endswith(OOM_MESSAGE.encode() + b"\n")
    assert err.startswith(b"Traceback (most recent call last):\n")

    run = outcome.run
    assert run is not None and run.watch is not None
    w = run.watch
    assert (w.returncode, w.exit_status, w.complete) == (1, 1, True)
    assert run.backend == "nvml-watch" and run.scenarios[0].status == "oom"
    [oom] = w.ooms
    assert (oom.cuda_index, oom.requested_bytes, oom.stream) == (0, 2 * GIB, "stderr")
    # how full each GPU was: the fake had filled cuda:0 to 78 GiB, cuda:1 to 40 GiB
    assert oom.used_at_oom_bytes == {"cuda:0": 78 * GIB, "cuda:1": 40 * GIB}
    assert [d.peak_used_bytes for d in w.devices] == [78 * GIB, 40 * GIB]
    assert [d.baseline_used_bytes for d in w.devices] == [GIB + 8 * GIB, GIB + 4 * GIB]
    # the command's own memory: the child and its grandchild (600 MiB each on cuda:0), not
    # PID 1, which the fake lists too
    assert w.devices[0].command_peak_bytes == 2 * 600 * MIB
    assert w.devices[1].command_peak_bytes == 2 * 300 * MIB
    text = " ".join(w.post_mortem)
    assert "ran out of memory on cuda:0" in text and "tried to allocate 2.00 GiB" in text
    assert "cuda:0 78.0 GiB (98%), cuda:1 40.0 GiB (50%)" in text
    assert "more than the median of the other GPUs" in text
    steps = " ".join(w.next_steps)
    assert "dpprof.ModelWithLoss" in steps
    assert "dpprof compare --workload" in steps and "--gpus 2 --gpu-memory 80GiB" in steps
    # every renderer shows it; JSON round-trips
    again = RunResult.from_dict(json.loads(json_report.render(run)))
    assert again.watch == w
    page = html_report.render(run)
    assert "id='post-mortem'" in page and "timeline-watch" in page
    assert "ModelWithLoss" in page


def test_binary_output_and_exit_code(tmp_path: Path) -> None:
    script = """
import os, sys
data = bytes(range(256)) * 4096 + b"no newline at the end\\r"
sys.stdout.buffer.write(data); sys.stdout.flush()
sys.stderr.buffer.write(b"\\xff\\xfe not utf-8 \\x00\\n"); sys.stderr.flush()
sys.exit(3)
"""
    outcome, out, err = run_watch(tmp_path, script)
    assert outcome.exit_status == 3
    assert out == bytes(range(256)) * 4096 + b"no newline at the end\r"
    assert err == b"\xff\xfe not utf-8 \x00\n"
    assert outcome.run is not None and outcome.run.scenarios[0].status == "error"
    assert outcome.run.watch is not None and not outcome.run.watch.ooms


def test_stdin_passes_through(tmp_path: Path) -> None:
    payload = b"line one\n\x00\x01binary\xff\nlast"
    script = "import sys; d = sys.stdin.buffer.read(); sys.stdout.buffer.write(d[::-1])"
    outcome, out, _ = run_watch(tmp_path, script, stdin=payload)
    assert outcome.exit_status == 0
    assert out == payload[::-1]
    assert outcome.run is not None and outcome.run.scenarios[0].status == "ok"


def test_command_killed_by_sigkill(tmp_path: Path) -> None:
    script = WAIT_FOR_RECORDS + f"""
import signal
print('x', flush=True)
wait_for_records({str(samples_of(tmp_path))!r},  # three readings of each GPU, then die
                 lambda rs: min(sum(r["kind"] == "sample" and r["device"] == d for r in rs)
                                for d in (0, 1)) >= 3)
os.kill(os.getpid(), signal.SIGKILL)
"""
    outcome, out, _ = run_watch(tmp_path, script)
    assert outcome.exit_status == 128 + 9
    assert out == b"x\n"
    run = outcome.run
    assert run is not None and run.watch is not None
    assert (run.watch.signal, run.watch.returncode) == ("SIGKILL", -9)
    assert "killed by SIGKILL" in run.scenarios[0].message
    assert run.watch.devices[0].samples >= 3  # the timeline up to the kill


def wait_for_count(path: Path, needle: str, count: int, timeout: float = 60.0) -> None:
    """Until ``path`` holds ``needle`` ``count`` times (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text(errors="replace").count(needle) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"{needle!r} never appeared {count} times in {path}")


def _send_to_main(signum: int, times: int = 1) -> callable:  # type: ignore[valid-type]
    """Once the command has printed "ready", send ``signum`` to dpprof ``times`` times, each after
    the watcher has handled the one before (its record is in the samples file)."""
    main = threading.main_thread().ident
    assert main is not None

    def during(out_path: Path) -> None:
        # the whole line: unbuffered, print writes "ready" and its newline apart, and a
        # signal between the two ends the command before the newline is written
        wait_for(out_path, b"ready\n")
        samples = out_path.with_name("run.samples.jsonl")
        for i in range(times):
            signal.pthread_kill(main, signum)  # sent to dpprof alone, not from a terminal
            wait_for_count(samples, '"kind":"signal"', i + 1)

    return during


IGNORES_SIGINT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("ready", flush=True)
for _ in range(600):
    time.sleep(0.05)
sys.exit(0)
"""


def test_sigint_ignored_escalates_to_sigterm_after_the_grace_time(tmp_path: Path) -> None:
    t0 = time.monotonic()
    outcome, _, _ = run_watch(
        tmp_path, IGNORES_SIGINT, kill_after_s=0.5, during=_send_to_main(signal.SIGINT)
    )
    assert time.monotonic() - t0 < 15
    assert outcome.exit_status == 128 + signal.SIGTERM
    w = outcome.run.watch if outcome.run else None
    assert w is not None
    first, second = w.signals
    assert (first["signal"], first["from_terminal"], first["action"]) == (
        "SIGINT", False, "forwarded"
    )
    assert second["action"].startswith("still running 0.5 s later; escalated: sent SIGTERM")


def test_second_sigint_escalates_at_once_and_sigkill_ends_it(tmp_path: Path) -> None:
    script = IGNORES_SIGINT.replace(
        "signal.signal(signal.SIGINT, signal.SIG_IGN)",
        "signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
    )
    t0 = time.monotonic()
    outcome, _, _ = run_watch(
        tmp_path, script, kill_after_s=60, during=_send_to_main(signal.SIGINT, times=3)
    )
    assert time.monotonic() - t0 < 15  # not 60 s: the second and third signals escalate
    assert outcome.exit_status == 128 + signal.SIGKILL
    w = outcome.run.watch if outcome.run else None
    assert w is not None
    actions = [s["action"] for s in w.signals]
    assert actions == [
        "forwarded",
        "escalated: sent SIGTERM to the command",
        "escalated: sent SIGKILL to the command and its descendants",
    ]


def test_sigterm_is_forwarded(tmp_path: Path) -> None:
    script = """
import signal, sys, time
def bye(*_):
    print("got SIGTERM", flush=True); sys.exit(7)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
time.sleep(30)
"""
    before = signal.getsignal(signal.SIGINT)
    outcome, out, _ = run_watch(tmp_path, script, during=_send_to_main(signal.SIGTERM))
    assert outcome.exit_status == 7
    assert out == b"ready\ngot SIGTERM\n"
    # the handlers this process had are back (pytest-xdist's worker may have been given
    # others by a test before this one)
    assert signal.getsignal(signal.SIGINT) is before
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_command_not_found(tmp_path: Path) -> None:
    nvml = watch_fakes.two_gpus()
    devices, _ = select_devices(nvml, None, env={})
    cfg = WatchConfig(["/no/such/program"], tmp_path / "x.samples.jsonl")
    from dpprof.watch.monitor import SpawnError

    with pytest.raises(SpawnError) as e:
        Watcher(cfg, nvml, devices).run()
    assert e.value.exit_code == 127
    assert not cfg.samples_path.exists()


# --------------------------------------------------------------------------- pure parts


def test_select_devices_follows_cuda_visible_devices_and_gpus() -> None:
    nvml = watch_fakes.three_gpus()
    devices, _ = select_devices(nvml, None, env={"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [(d.cuda_index, d.nvml_index) for d in devices] == [(0, 2), (1, 0)]
    devices, _ = select_devices(nvml, "0,2", env={})
    assert [(d.cuda_index, d.nvml_index) for d in devices] == [(0, 0), (2, 2)]
    from dpprof.errors import UsageError

    for bad in ("5", "a,b", "0,0"):
        with pytest.raises(UsageError):
            select_devices(nvml, bad, env={})
    with pytest.raises(UsageError, match="no GPU to watch"):
        select_devices(nvml, None, env={"CUDA_VISIBLE_DEVICES": ""})


def _records(n: int = 10) -> list[dict]:
    header = {
        "kind": "watch", "format": 1, "command": ["python", "train.py"], "interval_s": 0.1,
        "devices": [
            {"cuda_index": 0, "nvml_index": 1, "uuid": "GPU-1", "total_bytes": 80 * GIB},
            {"cuda_index": 1, "nvml_index": 0, "uuid": "GPU-0", "total_bytes": 80 * GIB},
        ],
    }
    recs: list[dict] = [header]
    for i in range(n):
        t = 0.1 * i
        recs.append({"kind": "sample", "t_s": t, "device": 1, "used_bytes": (10 + 5 * i) * GIB})
        recs.append({"kind": "sample", "t_s": t, "device": 0, "used_bytes": (10 + 2 * i) * GIB})
        if i == 0:
            recs.append({"kind": "spawn", "t_s": 0.05, "pid": 42})
    return recs


def test_build_run_from_a_cut_short_file(tmp_path: Path) -> None:
    path = tmp_path / "r.samples.jsonl"
    recs = _records()
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind":"sam')
    _, notes = read_records(path)
    assert notes == ["r.samples.jsonl: the last line was cut short; skipped"]
    run = load_run(path)
    w = run.watch
    assert w is not None and not w.complete and w.returncode is None
    assert [d.peak_used_bytes for d in w.devices] == [55 * GIB, 28 * GIB]  # by UUID order
    assert [d.baseline_used_bytes for d in w.devices] == [10 * GIB, 10 * GIB]
    assert "without the command's end" in run.scenarios[0].message
    assert run.comparison.scenarios[run.scenarios[0].name].primary_excess_bytes == 27 * GIB
    assert "Peak used memory: cuda:0 55.0 GiB, cuda:1 28.0 GiB" in run.comparison.verdict
    html_report.render(run)  # renders without an exit record
    with pytest.raises(Exception, match="not a dpprof watch samples file"):
        (tmp_path / "x.jsonl").write_text('{"kind":"sample"}\n')
        read_records(tmp_path / "x.jsonl")


def test_oom_moment_and_balanced_post_mortem() -> None:
    recs = _records()
    recs.append({
        "kind": "oom", "t_s": 0.45, "stream": "stderr", "text": OOM_MESSAGE,
        "format": "caching-allocator", "cuda_index": 1, "requested_bytes": 2 * GIB,
        "total_bytes": 80 * GIB, "free_bytes": GIB,
    })
    recs.append({"kind": "exit", "t_s": 1.0, "returncode": 1, "exit_status": 1})
    run = build_run(recs)
    w = run.watch
    assert w is not None and w.complete
    [oom] = w.ooms
    # the last readings at or before 0.45 s are those of 0.4 s (i = 4)
    assert oom.used_at_oom_bytes == {"cuda:0": 30 * GIB, "cuda:1": 18 * GIB}
    assert oom.peak_before_oom_bytes == {"cuda:0": 30 * GIB, "cuda:1": 18 * GIB}
    text = " ".join(w.post_mortem)
    # cuda:1 OOMed while it held less than cuda:0: not the primary-GPU imbalance
    assert "ran out of memory on cuda:1" in text
    # 12 GiB less than cuda:0 is not "about equally full" (the old threshold said so)
    assert "cuda:1 held 12.0 GiB less than the median of the other GPUs" in text
    assert "rose between two readings" in text  # NVML saw 18 GiB, PyTorch 79 GiB in use
    assert not any("ModelWithLoss" in s for s in w.next_steps)
    assert any("single-GPU floor" in s for s in w.next_steps)
    assert run.scenarios[0].oom_device == 1 and run.scenarios[0].oom_bytes == 2 * GIB


def test_post_mortem_is_empty_without_oom_and_flags_a_remapped_gpu() -> None:
    recs = [*_records(), {"kind": "exit", "t_s": 1.0, "returncode": 0, "exit_status": 0}]
    assert build_run(recs).watch.post_mortem == ()  # type: ignore[union-attr]
    w = build_run(recs).watch
    assert w is not None
    from dpprof.result import WatchOom

    w = dataclasses.replace(w, ooms=(WatchOom(
        0.5, "stderr", "x", "caching-allocator", cuda_index=0, requested_bytes=GIB,
        total_bytes=24 * GIB, free_bytes=0),))
    lines, _ = post_mortem(w)
    assert any("set CUDA_VISIBLE_DEVICES itself" in line for line in lines)


def test_long_runs_are_downsampled_but_keep_the_peak() -> None:
    recs = _records(1)
    spike = 3 * REPORT_POINTS + 7
    for i in range(10 * REPORT_POINTS):
        used = 79 * GIB if i == spike else (20 + i % 3) * GIB
        recs.append({"kind": "sample", "t_s": 1 + i * 0.1, "device": 1, "used_bytes": used})
    run = build_run(recs)
    timeline = run.scenarios[0].devices[0].timeline
    assert len(timeline) <= REPORT_POINTS
    assert max(p.allocated_bytes for p in timeline) == 79 * GIB
    assert [p.t for p in timeline] == sorted(p.t for p in timeline)


def test_terminal_rendering_of_a_watch() -> None:
    recs = [*_records(), {"kind": "exit", "t_s": 1.0, "returncode": 0, "exit_status": 0}]
    from rich.console import Console

    console = Console(width=160, record=True)
    recs[0]["command"] = ["python", "train.py", "--ids", "[bold]x[/bold]"]
    console.print(terminal.render(build_run(recs)))
    text = console.export_text()
    assert "cuda:0" in text and "55.0 GiB" in text and "exited with status 0" in text
    assert "[bold]x[/bold]" in text  # the command as typed, not rich markup


# --------------------------------------------------------------------------- the CLI


def test_cli_without_nvml_says_so_and_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    watch_fakes.install(monkeypatch, watch_fakes.unavailable())
    marker = tmp_path / "ran"
    result = CliRunner().invoke(
        app, ["watch", "--", PY, "-c", f"open({str(marker)!r}, 'w')"],
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "NVML is not available" in lines[0]
    assert "the command was not run" in lines[0]
    assert not marker.exists()


def _dpprof(*args: str) -> list[str]:
    """``dpprof watch ARGS`` as a command; run it with :data:`TWO_GPUS` as its environment."""
    return [PY, "-m", "dpprof", "watch", *args]


#: two fake GPUs (watch_fakes.two_gpus) in the dpprof process, through tests/fakehost
TWO_GPUS = fake_cuda.fakehost_env(nvml="two_gpus")


def test_cli_end_to_end_one_line_before_and_after(tmp_path: Path) -> None:
    script = "import sys; sys.stdout.write(sys.stdin.read().upper()); sys.exit(4)"
    proc = subprocess.run(
        _dpprof("-o", str(tmp_path / "r.html"), "-o", str(tmp_path / "r.json"), "--",
                PY, "-c", script),
        input=b"hello\n", capture_output=True, timeout=120, cwd=tmp_path, env=TWO_GPUS,
    )
    assert proc.returncode == 4
    assert proc.stdout == b"HELLO\n"
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("dpprof: watching cuda:0, cuda:1 every 0.1 s; samples: ")
    assert lines[1].startswith("dpprof: command exited with status 4; peak cuda:0 ")
    assert (tmp_path / "r.html").exists() and (tmp_path / "r.samples.jsonl").exists()
    run = RunResult.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert run.watch is not None and run.watch.exit_status == 4


def test_cli_killed_mid_run_leaves_a_readable_timeline(tmp_path: Path) -> None:
    samples = tmp_path / "r.samples.jsonl"
    proc = subprocess.Popen(
        _dpprof("--interval", "0.02", "-o", str(tmp_path / "r.json"), "--", PY, "-c",
                "import time; time.sleep(60)"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path, env=TWO_GPUS,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if samples.exists() and samples.read_text().count('"kind":"sample"') >= 30:
                break
            time.sleep(0.05)
        proc.kill()  # SIGKILL: no report, no exit record
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    records, _ = read_records(samples)
    spawn = next(r for r in records if r["kind"] == "spawn")
    os.kill(spawn["pid"], signal.SIGKILL)  # the orphaned command
    run = load_run(samples)
    assert run.watch is not None and not run.watch.complete
    assert all(d.samples >= 15 for d in run.watch.devices)
    assert run.watch.devices[0].peak_used_bytes == 78 * GIB
    result = CliRunner().invoke(app, ["report", str(samples), "-o", str(tmp_path / "p.html")])
    assert result.exit_code == 0, result.output
    assert "samples end at" in (tmp_path / "p.html").read_text()


def test_cli_ctrl_c_in_a_terminal_reaches_the_command_once(tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to dpprof and the command (one process group): dpprof must
    not send it a second time."""
    log = tmp_path / "signals.log"
    script = WAIT_FOR_RECORDS + f"""
import signal
got = []
def on_int(*_):
    got.append(1)
    with open({str(log)!r}, "a") as f:
        f.write("INT\\n")
signal.signal(signal.SIGINT, on_int)
print("ready", flush=True)
# the terminal's SIGINT has reached this process, and dpprof has recorded what it did with
# its own copy (after passing it on, had it done so: a second one would be here by now)
wait_for_records({str(tmp_path / "r.samples.jsonl")!r},
                 lambda rs: got and any(r["kind"] == "signal" for r in rs))
with open({str(log)!r}) as f:
    sys.exit(10 + len(f.read().splitlines()))
"""
    pid, master = pty.fork()
    if pid == 0:  # the child: session leader on the pty, dpprof in the foreground
        os.chdir(tmp_path)
        os.execve(PY, _dpprof("-o", str(tmp_path / "r.json"), "--", PY, "-c", script),
                  TWO_GPUS)
    buf = b""
    try:
        deadline = time.monotonic() + 60
        while b"ready" not in buf and time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                buf += os.read(master, 4096)
        assert b"ready" in buf, buf
        os.write(master, b"\x03")  # Ctrl-C, through the terminal driver
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(master)
    assert os.waitstatus_to_exitcode(status) == 11, buf  # exactly one SIGINT
    assert log.read_text() == "INT\n"
    run = RunResult.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert run.watch is not None
    [sig] = run.watch.signals
    assert sig["from_terminal"] is True and sig["action"].startswith("not forwarded")


def test_closed_output_reaches_the_command_as_sigpipe(tmp_path: Path) -> None:
    """`dpprof watch -- yes | head -1`: when dpprof's stdout is gone, the command gets
    SIGPIPE on its next write, as it would writing there itself."""
    nvml = watch_fakes.two_gpus()
    devices, _ = select_devices(nvml, None, env={})
    r, w = os.pipe()
    os.close(r)  # the reader (head) has exited
    err_fd = os.open(tmp_path / "err.bin", os.O_WRONLY | os.O_CREAT)
    cfg = WatchConfig(["yes"], tmp_path / "y.samples.jsonl", interval_s=0.02)
    try:
        t0 = time.monotonic()
        outcome = Watcher(cfg, nvml, devices, stdout_fd=w, stderr_fd=err_fd).run()
    finally:
        os.close(w)
        os.close(err_fd)
    assert outcome.exit_status == 128 + signal.SIGPIPE
    assert time.monotonic() - t0 < 10


def test_cli_load_turns_a_samples_file_into_reports(tmp_path: Path) -> None:
    samples = tmp_path / "old.samples.jsonl"
    recs = [*_records(), {"kind": "exit", "t_s": 1.0, "returncode": 0, "exit_status": 0}]
    samples.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "again.json"
    result = CliRunner().invoke(app, ["watch", "--load", str(samples), "-o", str(out)])
    assert result.exit_code == 0, result.output
    run = RunResult.from_dict(json.loads(out.read_text()))
    assert run.watch is not None and run.watch.devices[0].peak_used_bytes == 55 * GIB
    bad = CliRunner().invoke(app, ["watch", "--load", str(tmp_path / "missing.jsonl")])
    assert bad.exit_code == 1 and "missing.jsonl" in bad.output


def test_stdout_and_stderr_to_one_pipe_keep_their_order(tmp_path: Path) -> None:
    """`dpprof watch -- cmd 2>&1 | less`: one pipe for both streams, order kept exactly."""
    script = """
import sys
for i in range(300):
    sys.stdout.write(f"o{i} "); sys.stdout.flush()
    sys.stderr.write(f"e{i} "); sys.stderr.flush()
"""
    nvml = watch_fakes.two_gpus()
    devices, _ = select_devices(nvml, None, env={})
    r, w = os.pipe()
    cfg = WatchConfig([PY, "-c", script], tmp_path / "o.samples.jsonl", interval_s=0.05)
    try:
        outcome = Watcher(cfg, nvml, devices, stdout_fd=w, stderr_fd=w).run()
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    assert outcome.exit_status == 0
    assert data.decode() == "".join(f"o{i} e{i} " for i in range(300))


def test_a_gpu_lost_mid_run_is_noted() -> None:
    recs = [*_records(), {"kind": "stopped", "t_s": 0.95, "device": 0, "reason": "GPU is lost"}]
    run = build_run(recs)
    assert run.watch is not None and run.watch.devices[1].stopped_reason == "GPU is lost"
    assert "cuda:1: NVML sampling stopped early: GPU is lost" in run.notes


def _scan_chunks(chunks: list[bytes]) -> list:
    from dpprof.watch.output import OutputScanner

    found: list = []
    scanner = OutputScanner("stderr", found.append)
    for chunk in chunks:
        scanner.feed(chunk)
    scanner.close()
    return found


def test_scanner_finds_a_message_split_anywhere() -> None:
    text = (b"x" * 100 + b"\nstep 3\r" + b"Traceback\n" + OOM_MESSAGE.encode() + b"\nbye\n")
    for cut in range(1, len(text), 7):
        for cut2 in (cut + 1, cut + 50, len(text)):
            found = _scan_chunks([text[:cut], text[cut:cut2], text[cut2:]])
            assert len(found) == 1, (cut, cut2)
            assert found[0].requested_bytes == 2 * GIB
    # without a final newline, at the end of the stream
    assert len(_scan_chunks([OOM_MESSAGE.encode()[:50], OOM_MESSAGE.encode()[50:]])) == 1


def test_scanner_is_bounded_and_ignores_ordinary_output() -> None:
    from dpprof.watch.output import LINE_LIMIT

    huge = b"y" * (5 * LINE_LIMIT)  # one endless line, then the OOM on the next one
    found = _scan_chunks([huge[i : i + 4096] for i in range(0, len(huge), 4096)]
                         + [b"\n" + OOM_MESSAGE.encode() + b"\n"])
    assert len(found) == 1
    assert _scan_chunks([b"loss 0.1 memory 3 GiB\n" * 1000, b"\r100%|####|\r"]) == []


@pytest.mark.slow  # imports torch in the child: 3-8 s
def test_a_real_torch_out_of_memory_error(tmp_path: Path) -> None:
    """torch's own exception class, raised and printed by Python, with the allocator's text."""
    message = OOM_MESSAGE.split(": ", 1)[1]
    script = WAIT_FOR_RECORDS + f"""
import torch
wait_for_records({str(samples_of(tmp_path))!r},  # the GPUs read before the error
                 lambda rs: {{r["device"] for r in rs if r["kind"] == "sample"}} == {{0, 1}})
raise torch.OutOfMemoryError({message!r})
"""
    outcome, _, err = run_watch(tmp_path, script)
    assert outcome.exit_status == 1
    assert err.decode().endswith(OOM_MESSAGE + "\n")
    w = outcome.run.watch if outcome.run else None
    assert w is not None
    [oom] = w.ooms
    assert oom.exception == "torch.OutOfMemoryError"
    assert (oom.cuda_index, oom.requested_bytes) == (0, 2 * GIB)
    assert w.post_mortem and w.post_mortem[0].startswith("PyTorch ran out of memory on cuda:0")


def test_an_oom_on_a_heavy_non_primary_gpu_is_not_blamed_on_dataparallel() -> None:
    recs = _records()
    # cuda:1 (NVML 0) made the heaviest by far
    recs = [
        {**r, "used_bytes": 70 * GIB} if r.get("kind") == "sample" and r["device"] == 0 else r
        for r in recs
    ]
    recs.append({
        "kind": "oom", "t_s": 0.95, "stream": "stderr", "text": OOM_MESSAGE,
        "format": "caching-allocator", "cuda_index": 1, "requested_bytes": GIB,
        "total_bytes": 80 * GIB, "free_bytes": GIB,
    })
    w = build_run(recs).watch
    assert w is not None
    text = " ".join(w.post_mortem)
    assert "it is not the first GPU (cuda:0)" in text
    assert not any("ModelWithLoss" in s for s in w.next_steps)
