"""What ``dpprof check`` measured on a real GPU, kept for later emulations of that GPU model.

The emulator's CUDA context and cuBLAS workspace sizes are cited figures
(:mod:`dpprof.emulator.context`); the driver, the CUDA version and the GPU model move them.
``dpprof check --save-calibration`` measures both on the user's own GPU and writes them here,
one small JSON file per compute capability (the GPU generation, which is what the
emulation targets: ``--gpu`` / ``--compute-capability``). From then on every emulation for
that compute capability uses the measured figures, and its report says so.

The folder is ``$DPPROF_CALIBRATION_DIR``, else ``$XDG_CACHE_HOME/dpprof/calibration``, else
``~/.cache/dpprof/calibration``. A file that does not read as a calibration is ignored.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_DIR = "DPPROF_CALIBRATION_DIR"


@dataclass(frozen=True)
class Calibration:
    """One GPU's measured context and cuBLAS workspace."""

    gpu_name: str  # torch.cuda.get_device_name, as measured
    compute_capability: tuple[int, int]
    cuda_context_bytes: int  # NVML's used memory of the process minus memory_reserved
    cublas_workspace_bytes: int  # memory_allocated's growth at a first matmul on a stream
    torch_version: str
    measured: str  # ISO time

    def note(self, path: Path) -> str:
        return (f"the CUDA context ({self.cuda_context_bytes:,} B) and the cuBLAS workspace "
                f"({self.cublas_workspace_bytes:,} B) as dpprof check measured them on "
                f"{self.gpu_name} (torch {self.torch_version}, {self.measured}), the "
                f"calibration in {path}")


def calibration_dir() -> Path:
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dpprof" / "calibration"


def path_for(compute_capability: tuple[int, int]) -> Path:
    major, minor = compute_capability
    return calibration_dir() / f"sm_{major}{minor}.json"


def save(cal: Calibration) -> Path:
    path = path_for(cal.compute_capability)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cal), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def measured_now(gpu_name: str, compute_capability: tuple[int, int], context_bytes: int,
                 workspace_bytes: int, torch_version: str) -> Calibration:
    return Calibration(gpu_name, tuple(compute_capability), context_bytes,  # type: ignore[arg-type]
                       workspace_bytes, torch_version,
                       _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))


def load(compute_capability: tuple[int, int]) -> tuple[Calibration, Path] | None:
    """The calibration saved for this compute capability, and its file; None if none (or
    the file does not read as one)."""
    path = path_for(compute_capability)
    try:
        data = json.loads(path.read_text())
        cal = Calibration(
            gpu_name=str(data["gpu_name"]),
            compute_capability=(int(data["compute_capability"][0]),
                                int(data["compute_capability"][1])),
            cuda_context_bytes=int(data["cuda_context_bytes"]),
            cublas_workspace_bytes=int(data["cublas_workspace_bytes"]),
            torch_version=str(data["torch_version"]), measured=str(data["measured"]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    if (cal.compute_capability != tuple(compute_capability) or cal.cuda_context_bytes < 0
            or cal.cublas_workspace_bytes <= 0):
        return None
    return cal, path
