"""torch's profilers and GEMM tuner on virtual GPUs (:func:`install`): what a CPU build
refuses or floods the output with, where the script profiles its CUDA work.

* ``torch.profiler.profile(activities=[..., ProfilerActivity.CUDA])`` and
  ``torch.autograd.profiler.profile(use_device="cuda")``: torch turns CUDA profiling off
  where ``torch.cuda.is_available()`` is false; on virtual GPUs it is true, and the CPU
  build's profiler then printed a C++ stack trace ("Failed to record CUDA event") for every
  op. Nothing runs on a GPU to time: the CUDA activity is left out and the CPU side
  profiled, as torch does without a GPU.
* ``torch.autograd.profiler.emit_nvtx()`` and ``torch.cuda.profiler``'s ``start``, ``stop``
  and ``profile`` (nsys's ranges and capture range): nothing to range, they do nothing.
* ``torch.cuda.tunable`` (TunableOp): its settings are kept and read back; no GEMM is tuned
  (the tuning's own buffers are not played).

Each is counted by the line that asked (:class:`Profiled`) for the report's note.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dpprof.emulator.call_sites import caller_site, relative_site
from dpprof.emulator.patcher import Patch

__all__ = ["Profiled", "TunableSettings", "install"]


@dataclass
class Profiled:
    """Where the script asked for GPU profiling or tuning that virtual GPUs leave out, by
    kind (``"CUDA activity"``) and line."""

    sites: dict[str, int] = field(default_factory=dict)

    def add(self, what: str) -> None:
        key = f"{what} at {relative_site(caller_site((contextlib.__file__,)))}"
        self.sites[key] = self.sites.get(key, 0) + 1

    def note(self) -> str | None:
        if not self.sites:
            return None
        where = "; ".join(list(self.sites)[:3])
        return (f"GPU profiling left out ({where}): nothing runs on a virtual GPU to time or "
                "tune; the profilers record the CPU side, TunableOp keeps its settings")


class TunableSettings:
    """``torch.cuda.tunable``'s functions over settings kept as its C++ side keeps them
    (defaults from ``aten/src/ATen/cuda/tunable/Tunable.cpp``: 30 ms and 100 iterations of
    tuning, the ``tunableop_results.csv`` file), with torch's signatures."""

    def __init__(self, profiled: Profiled) -> None:
        self._profiled = profiled
        self.enabled = False
        self.tuning = True
        self.untuned = False
        self.duration = 30
        self.iterations = 100
        self.filename = "tunableop_results.csv"
        self.rotating = 0

    def enable(self, val: bool = True) -> None:
        if val:
            self._profiled.add("torch.cuda.tunable")
        self.enabled = bool(val)

    def is_enabled(self) -> bool:
        return self.enabled

    def tuning_enable(self, val: bool = True) -> None:
        self.tuning = bool(val)

    def tuning_is_enabled(self) -> bool:
        return self.tuning

    def record_untuned_enable(self, val: bool = True) -> None:
        self.untuned = bool(val)

    def record_untuned_is_enabled(self) -> bool:
        return self.untuned

    def set_max_tuning_duration(self, duration: int) -> None:
        self.duration = int(duration)

    def get_max_tuning_duration(self) -> int:
        return self.duration

    def set_max_tuning_iterations(self, iterations: int) -> None:
        self.iterations = int(iterations)

    def get_max_tuning_iterations(self) -> int:
        return self.iterations

    def set_filename(self, filename: str, insert_device_ordinal: bool = False) -> None:
        self.filename = str(filename)

    def get_filename(self) -> str:
        return self.filename

    def set_rotating_buffer_size(self, buffer_size: int) -> None:
        self.rotating = int(buffer_size)

    def get_rotating_buffer_size(self) -> int:
        return self.rotating

    def get_results(self) -> tuple[Any, ...]:
        return ()  # nothing was tuned

    def get_validators(self) -> tuple[Any, ...]:
        return ()

    def read_file(self, filename: str | None = None) -> bool:
        return False

    def set_numerical_check_tolerances(self, enable: bool, atol: float = 1e-5,
                                       rtol: float = 1e-5) -> None:
        return None

    def tune_gemm_in_file(self, filename: str) -> None:
        self._profiled.add("torch.cuda.tunable")

    def mgpu_tune_gemm_in_file(self, filename_pattern: str, num_gpus: int) -> None:
        self._profiled.add("torch.cuda.tunable")


def install(p: Patch, profiled: Profiled) -> None:
    """Patch the profilers and ``torch.cuda.tunable`` for virtual GPUs."""
    import torch.autograd.profiler as autograd_profiler
    import torch.cuda.profiler as cuda_profiler
    import torch.profiler.profiler as kineto

    kineto_init = kineto._KinetoProfile.__init__

    def kineto_profile_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kineto_init(self, *args, **kwargs)
        if torch.profiler.ProfilerActivity.CUDA in self.activities:
            profiled.add("CUDA activity")
            self.activities.discard(torch.profiler.ProfilerActivity.CUDA)
            if self.use_device == "cuda":
                self.use_device = None

    autograd_init = autograd_profiler.profile.__init__

    def autograd_profile_init(self: Any, *args: Any, **kwargs: Any) -> None:
        # torch's own rule for a machine without CUDA turns CUDA profiling off (its warning
        # that CUDA is not available is not the user's case here: the note says why)
        cuda = torch.cuda
        available = cuda.is_available
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "CUDA is not available, disabling CUDA")
            cuda.is_available = lambda: False  # type: ignore[method-assign]
            try:
                autograd_init(self, *args, **kwargs)
            finally:
                cuda.is_available = available  # type: ignore[method-assign]
        if kwargs.get("use_cuda") or kwargs.get("use_device") == "cuda":
            profiled.add("CUDA activity")

    p(kineto._KinetoProfile, "__init__", kineto_profile_init)
    p(autograd_profiler.profile, "__init__", autograd_profile_init)

    def counted(what: str) -> Callable[..., contextlib.AbstractContextManager[None]]:
        @contextlib.contextmanager
        def block(*args: Any, **kwargs: Any) -> Iterator[None]:
            profiled.add(what)
            yield
        return block

    p(autograd_profiler, "emit_nvtx", counted("NVTX ranges"))
    p(cuda_profiler, "start", lambda: profiled.add("torch.cuda.profiler"))
    p(cuda_profiler, "stop", lambda: None)
    p(cuda_profiler, "profile", counted("torch.cuda.profiler"))

    import torch.cuda.tunable as tunable

    settings = TunableSettings(profiled)
    for name in tunable.__all__:
        if hasattr(settings, name):
            p(tunable, name, getattr(settings, name))
