"""A saved result: the JSON file a command writes and ``dpprof report`` reads back.

Reading is strict (:func:`load`): a regular file of bounded size, strict JSON, a
``schema_version`` this dpprof reads (older ones upgraded step by step, :func:`upgrade`),
and every field validated against the result model (:mod:`dpprof.result`) by pydantic,
the first bad field named. Writing goes through a temporary file and a rename
(:func:`write_atomic`).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpprof.errors import DpprofError, removed_if_quit
from dpprof.result import (
    MAX_ALL_DEVICES,
    MAX_RESULT_FILE_BYTES,
    SCHEMA_VERSION,
    Attribution,
    Comparison,
    DeviceResult,
    Equivalence,
    EquivalenceEntry,
    EquivalenceFinding,
    Fix,
    FixAnswer,
    MaxBatch,
    MaxBatchEntry,
    PassedOver,
    Recommendation,
    RunResult,
    ScenarioComparison,
    ScenarioResult,
    ScriptWrite,
    SealCheck,
    TimelinePoint,
    WatchDevice,
    WatchOom,
    WatchResult,
)

__all__ = [
    "FIRST_SCHEMA_VERSION", "ResultFileError", "load", "read_bounded", "upgrade", "validate",
    "write_atomic",
]


class ResultFileError(DpprofError):
    """A file that is missing, not JSON, not a dpprof result, or from a newer dpprof: exit 1."""


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
    """Read a saved result; raise :class:`ResultFileError` with a one-line reason.

    Only a regular file of at most :data:`MAX_RESULT_FILE_BYTES` is read (not ``/dev/zero``,
    a FIFO or a directory). The JSON must be strict (no ``NaN``/``Infinity``), and the result
    is validated against this module's model by pydantic (types in strict mode, the ranges
    the field types carry, lengths, finite floats): the first field that fails is named.
    """
    data = _read_json(Path(path))
    return validate(data, str(path))


def read_bounded(p: Path, limit: int = MAX_RESULT_FILE_BYTES) -> bytes:
    """The bytes of ``p``, a regular file of at most ``limit`` bytes (never ``/dev/zero``, a
    FIFO or a directory); :class:`ResultFileError` in one line otherwise."""
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ResultFileError(f"{p}: no such file") from None
    except OSError as e:
        raise ResultFileError(f"{p}: cannot read it ({e.strerror or e})") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise ResultFileError(f"{p}: cannot read it ({kind}); give a file written by dpprof")
    if st.st_size > limit:
        raise ResultFileError(f"{p}: {st.st_size} bytes, more than a dpprof result holds "
                              f"(at most {limit // 2**20} MiB)")
    try:
        with open(p, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise ResultFileError(f"{p}: cannot read it ({e.strerror or e})") from e
    if len(raw) > limit:
        raise ResultFileError(f"{p}: more than {limit // 2**20} MiB")
    return raw


def _read_json(p: Path) -> dict[str, Any]:
    raw = read_bounded(p)
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultFileError(f"{p}: not JSON ({e})") from e
    except ValueError as e:  # NaN/Infinity, or an integer too long to read
        raise ResultFileError(f"{p}: not strict JSON ({e})") from e
    except RecursionError:
        raise ResultFileError(f"{p}: not a dpprof result (nested too deeply)") from None
    if not isinstance(data, dict) or "schema_version" not in data or "scenarios" not in data:
        raise ResultFileError(f"{p}: not a dpprof result (no schema_version/scenarios)")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def validate(data: dict[str, Any], where: str = "result") -> RunResult:
    """A :class:`RunResult` from a saved result's dict (any schema version this dpprof
    reads), validated against the model; :class:`ResultFileError` names the first bad field."""
    version = data.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < FIRST_SCHEMA_VERSION:
        raise ResultFileError(
            f"{where}: not a dpprof result (schema_version {version!r:.40} is not one dpprof "
            "wrote)"
        )
    if version > SCHEMA_VERSION:
        raise ResultFileError(
            f"{where}: schema_version {version} is newer than this dpprof reads "
            f"({SCHEMA_VERSION}); upgrade dpprof (pip install -U dpprof)"
        )
    try:
        data = upgrade(data)
    except ValueError as e:
        raise ResultFileError(f"{where}: {e}") from e
    import pydantic

    try:
        text = json.dumps(data, allow_nan=False)
        run: RunResult = _adapter().validate_json(text, strict=True)
    except pydantic.ValidationError as e:
        raise ResultFileError(f"{where}: {_first_error(e)}") from None
    except (ValueError, RecursionError) as e:  # not representable as strict JSON
        raise ResultFileError(f"{where}: malformed dpprof result ({e})") from None
    devices = sum(len(s.devices) for s in run.scenarios)
    if devices > MAX_ALL_DEVICES:
        raise ResultFileError(f"{where}: field scenarios: {devices} devices in all, more "
                              f"than {MAX_ALL_DEVICES}")
    return run


_ADAPTER: Any = None


def _adapter() -> Any:
    """pydantic's validator of :class:`RunResult`, built once (strict, finite floats)."""
    global _ADAPTER
    if _ADAPTER is None:
        import pydantic

        config = {"strict": True, "allow_inf_nan": False}
        for cls in (TimelinePoint, DeviceResult, ScenarioResult, ScenarioComparison,
                    Comparison, Attribution, Fix, MaxBatchEntry, MaxBatch, EquivalenceEntry,
                    EquivalenceFinding, Equivalence, RunResult, WatchDevice, WatchOom,
                    WatchResult, FixAnswer, PassedOver, Recommendation, ScriptWrite,
                    SealCheck):
            setattr(cls, "__pydantic_config__", config)  # noqa: B010 (a stdlib dataclass)
        _ADAPTER = pydantic.TypeAdapter(RunResult)
    return _ADAPTER


def _first_error(e: Any) -> str:
    err = e.errors(include_url=False)[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {json.dumps(got)[:60]})"
    more = f"; {e.error_count() - 1} more" if e.error_count() > 1 else ""
    return f"malformed dpprof result: field {loc or '(top level)'}: {err['msg']}{shown}{more}"


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with removed_if_quit(tmp):
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
