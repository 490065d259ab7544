"""Copying a watched command's output to dpprof's own, byte for byte, and scanning each line
for CUDA out-of-memory errors (:mod:`dpprof.backends.oom_messages`) on the way."""

from __future__ import annotations

import contextlib
import os
import re
import select
import stat
from collections.abc import Callable, Sequence

from dpprof.backends.oom_messages import parse_oom_line
from dpprof.result import WatchOom

__all__ = ["LINE_LIMIT", "OutputScanner", "pump", "same_stream"]

LINE_LIMIT = 64 * 1024  # bytes of one output line kept for the OOM scan
_LINE_END = re.compile(rb"[\r\n]")


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


def pump(src: int, dst: int, scanners: Sequence[OutputScanner]) -> None:
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


def same_stream(a: int, b: int) -> bool:
    """Whether fds ``a`` and ``b`` are one terminal or one pipe (e.g. ``2>&1``)."""
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    same = (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
    return same and (os.isatty(a) or stat.S_ISFIFO(sa.st_mode) or stat.S_ISSOCK(sa.st_mode))
