"""``dpprof watch -- CMD ARGS...``: run a command, sample every GPU it sees, explain an OOM.

How the command runs
--------------------
- **stdin** is the command's own: it inherits dpprof's file descriptor 0, untouched.
- **stdout / stderr** go through pipes that dpprof copies, byte for byte as they arrive
  (``os.read`` / ``os.write``, no decoding, no buffering of its own), to its own stdout and
  stderr, scanning a bounded copy of each line for CUDA out-of-memory errors
  (:mod:`dpprof.backends.oom_messages`). When dpprof's stdout and stderr are one terminal or
  one pipe (``2>&1``), the command gets a single pipe for both, so their order is kept
  exactly; else
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

The samples file (:mod:`dpprof.watch.samples`) records everything as it happens; the result
is built from it (:mod:`dpprof.watch.analysis`), the command's output copied and scanned by
:mod:`dpprof.watch.output`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpprof.errors import DpprofError, UsageError
from dpprof.nvml.devices import resolve_visible_devices
from dpprof.nvml.queries import NvmlBackend
from dpprof.nvml.sampler import NvmlSampler
from dpprof.result import RunResult, WatchDevice, WatchOom
from dpprof.saved_result import ResultFileError
from dpprof.version import __version__
from dpprof.watch.analysis import load_run
from dpprof.watch.output import OutputScanner, pump, same_stream
from dpprof.watch.samples import SAMPLES_FORMAT, SamplesWriter

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DEFAULT_KILL_AFTER_S",
    "SpawnError",
    "WatchConfig",
    "WatchOutcome",
    "Watcher",
    "descendants",
    "exit_status",
    "select_devices",
]

DEFAULT_INTERVAL_S = 0.1
DEFAULT_KILL_AFTER_S = 10.0
TEE_JOIN_S = 5.0  # how long to wait for the output pipes after the command ended
PROCESS_SCAN_S = 0.5  # how often the command's process tree is read from /proc
SI_KERNEL = 0x80  # siginfo si_code of a signal sent by the kernel (the terminal driver)

WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_RUNG: dict[int, int] = {signal.SIGINT: 0, signal.SIGHUP: 0, signal.SIGTERM: 1, signal.SIGQUIT: 1}
_LADDER = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


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
        self._record({"kind": "oom", **dataclasses.asdict(
            dataclasses.replace(oom, t_s=round(self._now(), 6)))})

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
            # a signal number outside the mask is no signal of ours (sigtimedwait has
            # returned garbage, 67,765,952, on a loaded CI machine): nothing to pass on
            if info is not None and info.si_signo in WATCHED_SIGNALS:
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
        merged = same_stream(self.stdout_fd, self.stderr_fd)
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
                target=pump, args=(src, dst, [scanner]), name=f"dpprof-watch-{name}",
                daemon=True,
            )
            t.start()
            threads.append(t)
        return threads


def _version() -> str:
    return __version__
