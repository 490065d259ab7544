"""The samples file of ``dpprof watch``: written as the command runs, read back into records.

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
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from dpprof.nvml.sampler import Event, event_to_dict
from dpprof.saved_result import ResultFileError, read_bounded

__all__ = ["MAX_SAMPLES_FILE_BYTES", "SAMPLES_FORMAT", "SamplesWriter", "read_records"]

SAMPLES_FORMAT = 1
FSYNC_EVERY_S = 1.0
MAX_SAMPLES_FILE_BYTES = 2**30  # hours of readings of 8 GPUs at 10 per second


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
