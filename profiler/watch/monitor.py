"""``dpprof watch -- CMD ARGS...``: run a command, sample every GPU it sees, explain an OOM.

How the command runs
--------------------
- **stdin** is the command's own: it inherits dpprof's file descriptor 0, untouched.
- **stdout / stderr** go through pipes that dpprof copies, byte for byte as they arrive
  (``os.read`` / ``os.write``, no decoding, no buffering of its own), to its own stdout and
  stderr, scanning a bounded copy of each line for CUDA out-of-memory errors
  (:mod:`dpprof.watch.oom_messages`). When dpprof's stdout and stderr are one terminal or one pipe
  (``2>&1``), the command gets a single pipe for both, so their order is kept exactly; else
  the two streams are copied by two threads, and their relative order on a shared
  destination is only as good as the arrival of the bytes. A pipe makes C stdio and Python
  block-buffer; when dpprof's stdout or stderr is a terminal and ``PYTHONUNBUFFERED`` is not
  set, dpprof sets ``PYTHONUNBUFFERED=1`` for the command so that a Python program's output
  appears line by line, as it would on the terminal (the only change to its environment).
  When dpprof's own output is closed (``dpprof watch -- cmd | head``), dpprof closes the
  pipe, and the command gets EPIPE/SIGPIPE on its next write, as it would have.
- **Exit status**: the command's; when a signal ended it, 128 + the signal number (what a
  shell reports). A command that cannot be started: 127 (not found) or 126, as a shell does.
- **Signals** (Linux): the command stays in dpprof's process group, so a terminal's Ctrl-C,
  Ctrl-\\ and Ctrl-Z reach both, as they would reach the command alone; dpprof does not send
  those again. A SIGINT, SIGTERM, SIGHUP or SIGQUIT sent to dpprof alone (``kill PID``,
  a scheduler) is forwarded to the command. dpprof tells the two apart by the signal's origin
  (``si_code`` is ``SI_KERNEL`` for the terminal driver's signals). Escalation, so that a
  command which ignores SIGINT cannot make dpprof hang: if the command is still running
  ``kill_after_s`` (default 10 s) after the first signal, or when a second signal arrives,
  dpprof sends it SIGTERM; after another ``kill_after_s`` or a third signal, SIGKILL to the
  command and every descendant it knows of. dpprof keeps sampling meanwhile, then writes its
  reports.

What is sampled
---------------
Every GPU the command can see (``CUDA_VISIBLE_DEVICES`` resolved by UUID with
:mod:`dpprof.nvml.devices`, never by initialising CUDA in dpprof), or the CUDA indices of
``--gpus``: NVML's used memory of the whole device every ``interval_s``, one reading before
the command starts (the baseline), and the memory of the command's own processes (the child
and its descendants, read from ``/proc`` every 0.5 s) from
``nvmlDeviceGetComputeRunningProcesses``.

The samples file
----------------
Every record is appended to a JSON-lines file as it happens and flushed at once (``fsync``
at most once a second), so a run killed with SIGKILL, or a machine that goes down, leaves a
readable partial timeline; :func:`load_run` (``dpprof report FILE.samples.jsonl``,
``dpprof watch --load FILE``) turns any prefix of it into a report. Records (``kind``):
``watch`` (the header: command, devices, interval), ``spawn``, ``sample``, ``process``,
``stopped`` (from :mod:`dpprof.nvml.sampler`), ``oom``, ``signal``, ``exit``. ``t_s`` is seconds
since the watch began (monotonic clock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import re
import select
import shlex
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dpprof.analysis.answers import post_mortem, watch_ending, watch_verdict
from dpprof.analysis.comparison import compare_scenario
from dpprof.errors import DpprofError, UsageError
from dpprof.nvml.devices import resolve_visible_devices
from dpprof.nvml.libnvml import NvmlBackend
from dpprof.nvml.sampler import Event, NvmlSampler, event_to_dict
from dpprof.result import (
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    Comparison,
    DeviceResult,
    ResultFileError,
    RunResult,
    ScenarioResult,
    TimelinePoint,
    WatchDevice,
    WatchOom,
    WatchResult,
    new_result,
    read_bounded,
)
from dpprof.watch.oom_messages import parse_oom_line

__all__ = [
    "BACKEND",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_KILL_AFTER_S",
    "SamplesWriter",
    "SpawnError",
    "WatchConfig",
    "WatchOutcome",
    "Watcher",
    "build_run",
    "descendants",
    "exit_status",
    "load_run",
    "post_mortem",
    "read_records",
    "select_devices",
]

BACKEND = "nvml-watch"
SAMPLES_FORMAT = 1
DEFAULT_INTERVAL_S = 0.1
DEFAULT_KILL_AFTER_S = 10.0
LINE_LIMIT = 64 * 1024  # bytes of one output line kept for the OOM scan
FSYNC_EVERY_S = 1.0
TEE_JOIN_S = 5.0  # how long to wait for the output pipes after the command ended
PROCESS_SCAN_S = 0.5  # how often the command's process tree is read from /proc
REPORT_POINTS = 4000  # timeline points per GPU in a report (the samples file keeps all)
OOM_WINDOW_S = 1.0  # "peak before the OOM": the readings in this window before the message
SI_KERNEL = 0x80  # siginfo si_code of a signal sent by the kernel (the terminal driver)
MAX_SAMPLES_FILE_BYTES = 2**30  # hours of readings of 8 GPUs at 10 per second

WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_RUNG: dict[int, int] = {signal.SIGINT: 0, signal.SIGHUP: 0, signal.SIGTERM: 1, signal.SIGQUIT: 1}
_LADDER = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
_LINE_END = re.compile(rb"[\r\n]")


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


class ProcessTree:
    """The command's processes: the child and its descendants, read from ``/proc``.

    A descendant whose parent died is re-parented (to init or a subreaper) and would drop out
    of the tree; it stays in :meth:`pids` while it lives, identified by (pid, start time) so a
    reused PID is not mistaken for it.
    """

    def __init__(self, root: int, refresh_s: float = 0.0) -> None:
        self.root = root
        self.refresh_s = refresh_s
        self._known: dict[int, int] = {}
        self._lock = threading.Lock()
        self._cached: set[int] | None = None
        self._scanned_at = 0.0

    def pids(self) -> set[int]:
        """The command's live processes; /proc is read again at most every ``refresh_s``."""
        now = time.monotonic()
        if self._cached is not None and now - self._scanned_at < self.refresh_s:
            return set(self._cached)
        found = self._scan()
        self._cached, self._scanned_at = found, now
        return set(found)

    def _scan(self) -> set[int]:
        children: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        try:
            names = os.listdir("/proc")
        except OSError:
            return {self.root}
        for name in names:
            if not name.isdigit():
                continue
            st = _proc_stat(int(name))
            if st is None:
                continue
            children.setdefault(st[0], []).append(int(name))
            starts[int(name)] = st[1]
        with self._lock:
            stack = [self.root] + [p for p, s in self._known.items() if starts.get(p) == s]
            found: set[int] = set()
            while stack:
                pid = stack.pop()
                if pid in found:
                    continue
                found.add(pid)
                stack.extend(children.get(pid, ()))
            alive = {p for p in found if p in starts}
            for pid in alive:
                self._known[pid] = starts[pid]
            return alive | {self.root}


def descendants(pid: int) -> set[int]:
    """The live descendants of ``pid`` (not ``pid`` itself)."""
    return ProcessTree(pid).pids() - {pid}


def exit_status(returncode: int) -> int:
    """Popen's return code as a shell reports it: a signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --------------------------------------------------------------------------- samples file


class SamplesWriter:
    """Appends JSON lines to the samples file and flushes each at once; thread-safe.

    Sampler events are accepted directly (it is the sampler's sink). A write that fails
    (disk full) stops the writing and is kept in :attr:`error`; the watch goes on.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self._last_sync = time.monotonic()
        self.error: str | None = None
        self.lines = 0

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line)
                self._file.flush()
                self.lines += 1
                now = time.monotonic()
                if now - self._last_sync >= FSYNC_EVERY_S:
                    os.fsync(self._file.fileno())
                    self._last_sync = now
            except OSError as e:
                self.error = f"{self.path}: {e.strerror or e}"
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None

    def __call__(self, event: Event) -> None:
        self.write(event_to_dict(event))

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
            except OSError as e:
                self.error = f"{self.path}: {e.strerror or e}"
            self._file = None


def read_records(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a samples file, and notes on what could not be read.

    A last line cut short (the run was killed while writing it) and unreadable lines are
    skipped and counted, not fatal.
    """
    p = Path(path)
    raw = read_bounded(p, MAX_SAMPLES_FILE_BYTES)  # a regular file, bounded
    records: list[dict[str, Any]] = []
    bad = 0
    lines = raw.split(b"\n")
    cut = lines[-1] != b""  # no newline at the end: the last write was interrupted
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    notes = []
    if bad:
        what = "the last line was cut short" if bad == 1 and cut else f"{bad} lines unreadable"
        notes.append(f"{p.name}: {what}; skipped")
    if not records or records[0].get("kind") != "watch":
        raise ResultFileError(
            f"{p}: not a dpprof watch samples file (no header line); give the "
            "*.samples.jsonl file that dpprof watch wrote"
        )
    return records, notes


# --------------------------------------------------------------------------- devices


def select_devices(
    nvml: NvmlBackend, gpus: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[list[WatchDevice], list[str]]:
    """The GPUs the command will see (by UUID), or the CUDA indices in ``gpus`` ("0,2").

    Raises :class:`UsageError` when ``gpus`` is malformed or names a GPU the command cannot
    see, or when there is no GPU to watch.
    """
    resolved = resolve_visible_devices(nvml, env)
    notes = list(resolved.notes)
    matched = {d.cuda_index: d for d in resolved.devices if d.matched}
    for d in resolved.devices:
        if not d.matched:
            notes.append(f"cuda:{d.cuda_index} not watched: {d.reason}")
    wanted: Sequence[int]
    if gpus is None or not gpus.strip():
        wanted = sorted(matched)
    else:
        try:
            wanted = [int(x) for x in gpus.split(",") if x.strip()]
        except ValueError:
            raise UsageError(
                f"--gpus {gpus!r}: write CUDA indices separated by commas, e.g. --gpus 0,2"
            ) from None
        missing = [i for i in wanted if i not in matched]
        if missing or not wanted or len(set(wanted)) != len(wanted):
            seen = ", ".join(f"cuda:{i}" for i in sorted(matched)) or "none"
            raise UsageError(
                f"--gpus {gpus!r}: the command would see {seen}; give distinct indices "
                "among those"
            )
    if not wanted:
        cvd = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
        why = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
        raise UsageError(f"no GPU to watch: the command would see none{why}")
    devices = []
    for i in wanted:
        d = matched[i]
        assert d.nvml_index is not None
        devices.append(
            WatchDevice(
                cuda_index=i, nvml_index=d.nvml_index, uuid=d.uuid, name=d.name,
                total_bytes=d.total_memory_bytes,
            )
        )
    return devices, notes


# --------------------------------------------------------------------------- output copying


_KEYS = (b"memory", b"ALLOC_FAILED")  # every line parse_oom_line accepts has one of these


def _has_key(data: bytes) -> bool:
    return any(k in data for k in _KEYS)


class OutputScanner:
    """Splits one output stream into lines (``\\n`` or ``\\r``, at most :data:`LINE_LIMIT`
    bytes kept of each) and reports the out-of-memory errors among them.

    A chunk with no key word (``memory``, ``ALLOC_FAILED``) in it, at its edges or in the
    pending partial line is only searched with ``bytes.find`` (memchr speed), so ordinary
    output costs next to nothing; the others are split into lines and parsed.
    """

    def __init__(self, stream: str, on_oom: Callable[[WatchOom], None]) -> None:
        self.stream = stream
        self._on_oom = on_oom
        self._buf = b""
        self._buf_hit = False  # the pending partial line holds a key word
        self._overflow = False

    def feed(self, data: bytes) -> None:
        edge = self._buf[-16:] + data[:16]
        if not self._buf_hit and not _has_key(data) and not _has_key(edge):
            cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
            if cut < 0:
                self._buf = (self._buf + data)[-LINE_LIMIT:]
            else:
                self._buf = data[cut + 1 :][-LINE_LIMIT:]
                self._overflow = False
            return
        parts = _LINE_END.split(self._buf + data)
        self._buf = parts.pop()
        for line in parts:
            if self._overflow:
                self._overflow = False  # the rest of an over-long line: already scanned
                continue
            self._scan(line)
        if len(self._buf) > LINE_LIMIT:
            if not self._overflow:
                self._scan(self._buf[:LINE_LIMIT])
            self._overflow = True
            self._buf = b""
        self._buf_hit = _has_key(self._buf)

    def close(self) -> None:
        if self._buf and not self._overflow:
            self._scan(self._buf)
        self._buf = b""
        self._buf_hit = False

    def _scan(self, line: bytes) -> None:
        if not _has_key(line):
            return
        oom = parse_oom_line(line.decode("utf-8", "replace"), stream=self.stream)
        if oom is not None:
            self._on_oom(oom)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # a non-blocking terminal or pipe: wait until writable
            select.select([], [fd], [])
            continue
        view = view[n:]


def _pump(src: int, dst: int, scanners: Sequence[OutputScanner]) -> None:
    """Copy ``src`` to ``dst`` until EOF; if ``dst`` is gone, close ``src`` (the writer then
    gets EPIPE/SIGPIPE, as it would have writing to ``dst`` itself)."""
    try:
        while True:
            try:
                data = os.read(src, 65536)
            except OSError:
                break
            if not data:
                break
            try:
                _write_all(dst, data)
            except OSError:
                break
            for scanner in scanners:
                scanner.feed(data)
    finally:
        for scanner in scanners:
            scanner.close()
        with contextlib.suppress(OSError):
            os.close(src)


def _same_stream(a: int, b: int) -> bool:
    """Whether fds ``a`` and ``b`` are one terminal or one pipe (e.g. ``2>&1``)."""
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    same = (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
    return same and (os.isatty(a) or stat.S_ISFIFO(sa.st_mode) or stat.S_ISSOCK(sa.st_mode))


# --------------------------------------------------------------------------- the watcher


class SpawnError(DpprofError):
    """The command could not be started; ``exit_code`` is the shell's (127 or 126)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class WatchConfig:
    """What to run and how to watch it."""

    command: list[str]
    samples_path: Path
    interval_s: float = DEFAULT_INTERVAL_S
    kill_after_s: float = DEFAULT_KILL_AFTER_S
    gpus: str | None = None
    process_scan_s: float = PROCESS_SCAN_S  # a process younger than this may be missed


@dataclass
class WatchOutcome:
    """How the watch ended: dpprof's exit status and the result (None if unreadable)."""

    exit_status: int
    run: RunResult | None
    samples_path: Path
    notes: list[str] = field(default_factory=list)


class Watcher:
    """Runs one command under NVML sampling (see the module docstring for the semantics)."""

    def __init__(
        self,
        cfg: WatchConfig,
        nvml: NvmlBackend,
        devices: list[WatchDevice],
        *,
        stdin_fd: int | None = None,
        stdout_fd: int = 1,
        stderr_fd: int = 2,
        env: Mapping[str, str] | None = None,
        notes: Iterable[str] = (),
    ) -> None:
        self.cfg = cfg
        self.stdin_fd = stdin_fd  # None: the command inherits dpprof's stdin
        self.nvml = nvml
        self.devices = devices
        self.stdout_fd = stdout_fd
        self.stderr_fd = stderr_fd
        self.env = dict(os.environ if env is None else env)
        self.notes = list(notes)
        self.proc: subprocess.Popen[bytes] | None = None
        self.tree: ProcessTree | None = None
        self.writer: SamplesWriter | None = None
        self.sampler: NvmlSampler | None = None
        self._rung: int | None = None
        self._deadline: float | None = None
        self._early: list[int] = []
        self._oom_lock = threading.Lock()
        self._oom_texts: set[str] = set()

    # -- helpers -----------------------------------------------------------------------

    def _now(self) -> float:
        assert self.sampler is not None
        return self.sampler.now()

    def _record(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def _pids(self) -> set[int]:
        return self.tree.pids() if self.tree is not None else set()

    def _on_oom(self, oom: WatchOom) -> None:
        with self._oom_lock:
            if oom.text in self._oom_texts:
                return  # the same error printed twice (a log line and the traceback)
            self._oom_texts.add(oom.text)
        oom.t_s = round(self._now(), 6)
        self._record({"kind": "oom", **dataclasses.asdict(oom)})

    def _child_env(self) -> dict[str, str]:
        env = dict(self.env)
        tty = os.isatty(self.stdout_fd) or os.isatty(self.stderr_fd)
        if tty and "PYTHONUNBUFFERED" not in env:
            env["PYTHONUNBUFFERED"] = "1"
            self.notes.append(
                "PYTHONUNBUFFERED=1 was set for the command so that its output reached the "
                "terminal line by line through dpprof's pipes"
            )
        return env

    # -- signals -------------------------------------------------------------------------

    def _send(self, signum: int) -> None:
        assert self.proc is not None
        targets = {self.proc.pid}
        if signum == signal.SIGKILL:
            targets |= self._pids()
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def _on_signal(self, signum: int, from_terminal: bool | None) -> None:
        """A signal for dpprof: pass it on, or escalate (see the module docstring)."""
        name = _signal_name(signum)
        record: dict[str, Any] = {
            "kind": "signal", "t_s": round(self._now(), 6), "signal": name,
            "from_terminal": from_terminal,
        }
        if self._rung is None:
            self._rung = _RUNG.get(signum, 0)
            if from_terminal:
                record["action"] = "not forwarded: the terminal sent it to the command too"
            else:
                self._send(signum)
                record["action"] = "forwarded"
            self._deadline = time.monotonic() + self.cfg.kill_after_s
        else:
            record["action"] = self._escalate()
        self._record(record)

    def _escalate(self) -> str:
        assert self._rung is not None
        self._rung = min(self._rung + 1, len(_LADDER) - 1)
        signum = _LADDER[self._rung]
        self._send(signum)
        last = self._rung == len(_LADDER) - 1
        self._deadline = None if last else time.monotonic() + self.cfg.kill_after_s
        who = "the command and its descendants" if last else "the command"
        return f"escalated: sent {_signal_name(signum)} to {who}"

    def _wait(self) -> int:
        """Wait for the command, handling signals; the watched signals are blocked here."""
        assert self.proc is not None
        for signum in self._early:  # arrived before the mask: origin unknown, forward
            self._on_signal(signum, None)
        while True:
            rc = self.proc.poll()
            if rc is not None:
                return rc
            info = signal.sigtimedwait(WATCHED_SIGNALS, 0.05)
            if info is not None:
                self._on_signal(info.si_signo, info.si_code == SI_KERNEL)
            if self._deadline is not None and time.monotonic() >= self._deadline:
                action = self._escalate()
                self._record({
                    "kind": "signal", "t_s": round(self._now(), 6), "signal": None,
                    "from_terminal": None,
                    "action": f"still running {self.cfg.kill_after_s:g} s later; {action}",
                })

    # -- the run -------------------------------------------------------------------------

    def run(self) -> WatchOutcome:
        cfg = self.cfg
        self.writer = SamplesWriter(cfg.samples_path)
        self.sampler = NvmlSampler(
            self.nvml, [d.nvml_index for d in self.devices], cfg.interval_s,
            pids=self._pids, sink=self.writer, keep_samples=False,
            name="dpprof-watch-sampler",
        )
        self._record({
            "kind": "watch", "format": SAMPLES_FORMAT, "command": list(cfg.command),
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "interval_s": cfg.interval_s, "kill_after_s": cfg.kill_after_s,
            "hostname": socket.gethostname(), "dpprof_version": _version(),
            "driver_version": self.nvml.driver_version(),
            "cuda_visible_devices": self.env.get("CUDA_VISIBLE_DEVICES"),
            "devices": [dataclasses.asdict(d) for d in self.devices],
            "notes": self.notes,
        })
        self.sampler.sample_once()  # the baseline, before the command starts

        previous = {s: signal.signal(s, self._early_handler) for s in WATCHED_SIGNALS}
        mask: set[int] | None = None
        threads: list[threading.Thread] = []
        try:
            self.proc = self._spawn()
            self._record({"kind": "spawn", "t_s": round(self._now(), 6), "pid": self.proc.pid})
            self.tree = ProcessTree(self.proc.pid, refresh_s=self.cfg.process_scan_s)
            # Block the watched signals only now: a child would inherit a blocked mask.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED_SIGNALS)
            self.sampler.start()  # threads started from here on inherit the mask
            threads = self._start_pumps()
            rc = self._wait()
            self._record({
                "kind": "exit", "t_s": round(self._now(), 6), "returncode": rc,
                "exit_status": exit_status(rc),
                "signal": _signal_name(-rc) if rc < 0 else None,
            })
            deadline = time.monotonic() + TEE_JOIN_S
            for t in threads:
                t.join(max(deadline - time.monotonic(), 0.0))
            if any(t.is_alive() for t in threads):
                self.notes.append(
                    "processes started by the command still held its output open "
                    f"{TEE_JOIN_S:g} s after it ended; their later output was not copied"
                )
            self.sampler.stop()
        finally:
            if self.sampler.running:
                self.sampler.stop()
            if mask is not None:
                with contextlib.suppress(OSError):
                    while signal.sigtimedwait(WATCHED_SIGNALS, 0) is not None:
                        pass  # drop signals that arrived after the command ended
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for s, h in previous.items():
                signal.signal(s, h)
            self.writer.close()
        if self.sampler.thread_error:
            self.notes.append(f"the sampler stopped: {self.sampler.thread_error}")
        if self.sampler.sink_error:
            self.notes.append(f"samples file: {self.sampler.sink_error}")
        if self.writer.error:
            self.notes.append(f"samples file: {self.writer.error}")
        status = exit_status(rc)
        try:
            run = load_run(cfg.samples_path, extra_notes=self.notes)
        except ResultFileError as e:
            return WatchOutcome(status, None, cfg.samples_path, [*self.notes, str(e)])
        return WatchOutcome(status, run, cfg.samples_path, self.notes)

    def _early_handler(self, signum: int, frame: object) -> None:
        self._early.append(signum)

    def _spawn(self) -> subprocess.Popen[bytes]:
        merged = _same_stream(self.stdout_fd, self.stderr_fd)
        out_r, out_w = os.pipe()
        err_r, err_w = (out_r, out_w) if merged else os.pipe()
        self._pipes = (out_r, err_r, merged)
        try:
            proc = subprocess.Popen(
                self.cfg.command, stdin=self.stdin_fd, stdout=out_w, stderr=err_w,
                env=self._child_env(), restore_signals=True, close_fds=True,
            )
        except OSError as e:
            for fd in {out_r, out_w, err_r, err_w}:
                os.close(fd)
            if self.writer is not None:
                self.writer.close()
            with contextlib.suppress(OSError):
                self.cfg.samples_path.unlink()
            code = 127 if isinstance(e, FileNotFoundError) else 126
            what = "command not found" if code == 127 else (e.strerror or str(e))
            raise SpawnError(f"{self.cfg.command[0]}: {what}", code) from e
        for fd in {out_w, err_w}:
            os.close(fd)
        return proc

    def _start_pumps(self) -> list[threading.Thread]:
        out_r, err_r, merged = self._pipes
        jobs = [(out_r, self.stdout_fd, "stdout")]
        if not merged:
            jobs.append((err_r, self.stderr_fd, "stderr"))
        threads = []
        for src, dst, name in jobs:
            scanner = OutputScanner("stdout+stderr" if merged else name, self._on_oom)
            t = threading.Thread(
                target=_pump, args=(src, dst, [scanner]), name=f"dpprof-watch-{name}",
                daemon=True,
            )
            t.start()
            threads.append(t)
        return threads


def _version() -> str:
    from dpprof import __version__

    return __version__


# --------------------------------------------------------------------------- the result


def load_run(path: str | Path, extra_notes: Iterable[str] = ()) -> RunResult:
    """A report-ready :class:`RunResult` from a samples file, complete or cut short."""
    records, notes = read_records(path)
    return build_run(records, samples_path=str(path), notes=[*extra_notes, *notes])


def _downsample(points: list[tuple[float, int]], limit: int) -> list[tuple[float, int]]:
    """At most ``limit`` points that keep each bucket's lowest and highest reading (so the
    peak survives), in time order."""
    if len(points) <= limit:
        return points
    buckets = max(limit // 2, 1)
    size = len(points) / buckets
    out: list[tuple[float, int]] = []
    for b in range(buckets):
        chunk = points[int(b * size) : int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(range(len(chunk)), key=lambda i: chunk[i][1])
        hi = max(range(len(chunk)), key=lambda i: chunk[i][1])
        out.extend(chunk[i] for i in sorted({lo, hi}))
    return out


def scenario_name(command: Sequence[str], limit: int = 60) -> str:
    """The command as a shell would show it, shortened to ``limit`` characters."""
    text = shlex.join(command)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def build_run(
    records: list[dict[str, Any]], *, samples_path: str = "", notes: Iterable[str] = ()
) -> RunResult:
    """Turn the records of a samples file into a :class:`RunResult` (pure)."""
    header = records[0]
    notes = list(notes)
    devices = [WatchDevice(**_known(WatchDevice, d)) for d in header.get("devices", [])]
    by_nvml = {d.nvml_index: d for d in devices}
    series: dict[int, list[tuple[float, int]]] = {d.nvml_index: [] for d in devices}
    command_bytes: dict[tuple[int, float], int] = {}
    ooms: list[WatchOom] = []
    signals: list[dict[str, Any]] = []
    spawn_t: float | None = None
    pid: int | None = None
    end: dict[str, Any] | None = None
    last_t = 0.0
    for rec in records[1:]:
        kind = rec.get("kind")
        t = rec.get("t_s")
        if isinstance(t, int | float):
            last_t = max(last_t, float(t))
        try:
            if kind == "sample" and rec["device"] in series:
                series[rec["device"]].append((float(rec["t_s"]), int(rec["used_bytes"])))
            elif kind == "process" and rec.get("used_bytes") is not None:
                key = (int(rec["device"]), float(rec["t_s"]))
                command_bytes[key] = command_bytes.get(key, 0) + int(rec["used_bytes"])
            elif kind == "stopped" and rec["device"] in by_nvml:
                by_nvml[rec["device"]].stopped_reason = str(rec.get("reason"))
            elif kind == "spawn":
                spawn_t, pid = float(rec["t_s"]), int(rec["pid"])
            elif kind == "oom":
                ooms.append(WatchOom(**_known(WatchOom, rec)))
            elif kind == "signal":
                signals.append({k: v for k, v in rec.items() if k != "kind"})
            elif kind == "exit":
                end = rec
        except (KeyError, TypeError, ValueError):
            notes.append(f"a malformed {kind!r} record was skipped")
    for d in devices:
        points = series[d.nvml_index]
        d.samples = len(points)
        if points:
            t_peak, d.peak_used_bytes = max(points, key=lambda p: (p[1], -p[0]))
            d.peak_t_s = t_peak
            before = [p for p in points if spawn_t is None or p[0] <= spawn_t]
            d.baseline_used_bytes = (before[-1] if before else points[0])[1]
        mine = [b for (dev, _), b in command_bytes.items() if dev == d.nvml_index]
        d.command_peak_bytes = max(mine) if mine else None
    cuda_of = {d.nvml_index: d.cuda_index for d in devices}
    for oom in ooms:
        if oom.t_s is None:
            continue
        for nvml_index, points in series.items():
            label = f"cuda:{cuda_of[nvml_index]}"
            prior = [p for p in points if p[0] <= oom.t_s]
            if prior:
                oom.used_at_oom_bytes[label] = prior[-1][1]
                window = [p[1] for p in prior if p[0] >= oom.t_s - OOM_WINDOW_S]
                oom.peak_before_oom_bytes[label] = max(window or [prior[-1][1]])

    for d in devices:
        if d.stopped_reason:
            notes.append(f"cuda:{d.cuda_index}: NVML sampling stopped early: {d.stopped_reason}")
    command = [str(c) for c in header.get("command", [])]
    rc = end.get("returncode") if end else None
    watch = WatchResult(
        command=command, pid=pid, returncode=rc,
        exit_status=end.get("exit_status") if end else None,
        signal=end.get("signal") if end else None, complete=end is not None,
        started=str(header.get("started", "")), duration_s=round(last_t, 6),
        interval_s=float(header.get("interval_s", 0.0)), samples_path=samples_path,
        devices=devices, ooms=ooms, signals=signals,
    )
    name = scenario_name(command)
    if ooms:
        status = STATUS_OOM
    elif rc == 0:
        status = STATUS_OK
    else:
        status = STATUS_ERROR
    results = []
    for d in devices:
        points = _downsample(series[d.nvml_index], REPORT_POINTS)
        results.append(
            DeviceResult(
                index=d.cuda_index, peak_allocated_bytes=d.peak_used_bytes or 0,
                capacity_bytes=d.total_bytes or 0, nvml_peak_used_bytes=d.peak_used_bytes,
                used=d.peak_used_bytes is not None,
                timeline=[TimelinePoint(t=t, allocated_bytes=b) for t, b in points],
            )
        )
    first_oom = ooms[0] if ooms else None
    scenario = ScenarioResult(
        name=name, status=status, message=_ending(watch),
        devices=results, oom_device=first_oom.cuda_index if first_oom else None,
        oom_bytes=first_oom.requested_bytes if first_oom else None,
        notes=[],
    )
    comparison = Comparison()
    sc = compare_scenario(dataclasses.replace(scenario, status=STATUS_OK))
    if sc is not None:
        comparison.scenarios[name] = sc
    # the one answer builder's (dpprof.analysis.answers), stored for the JSON
    watch.post_mortem, watch.next_steps = post_mortem(watch)
    comparison.verdict = watch_verdict(watch, sc.imbalance if sc else None)
    totals = [d.total_bytes for d in devices if d.total_bytes]
    return new_result(  # the watcher's version, time and host, from its samples file
        BACKEND, shlex.join(command), batch=0,
        gpus=max((d.cuda_index for d in devices), default=-1) + 1,
        gpu_memory_bytes=max(totals, default=0), scenarios=[scenario],
        comparison=comparison, dpprof_version=str(header.get("dpprof_version", "")),
        created=watch.started,
        config={
            "command": command, "interval_s": watch.interval_s,
            "kill_after_s": header.get("kill_after_s"),
            "gpus": [d.cuda_index for d in devices],
        },
        environment={
            "hostname": header.get("hostname"), "driver_version": header.get("driver_version"),
            "cuda_visible_devices": header.get("cuda_visible_devices"),
            "gpus": [f"cuda:{d.cuda_index}: {d.name} {d.uuid}" for d in devices],
        },
        assumptions=[
            "Memory is NVML's used memory of each whole GPU (every process, CUDA contexts "
            "included; nvmlDeviceGetMemoryInfo), read every "
            f"{watch.interval_s:g} s: a peak between two readings is missed, so each peak "
            "is a lower bound. In the tables it stands where other backends put the "
            "allocator's peak.",
            "The command's own memory is the sum over its processes (the child and its "
            "descendants) of nvmlDeviceGetComputeRunningProcesses' used memory; in a "
            "container without the host's PID namespace NVML reports other PIDs, and this "
            "stays empty.",
            "'GPU N' in PyTorch's out-of-memory message is a CUDA index of the command; it "
            "is mapped to a GPU through the CUDA_VISIBLE_DEVICES the command started with.",
        ],
        notes=list(dict.fromkeys([*header.get("notes", []), *notes])),
        watch=watch,
    )


def _known(tp: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(tp)}
    return {k: v for k, v in data.items() if k in names}


def _ending(w: WatchResult) -> str:
    return watch_ending(w)
