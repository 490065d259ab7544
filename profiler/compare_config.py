"""``dpprof compare``'s options (:class:`CompareConfig`), declared once, without torch: the
CLI declares its flags and defaults from them; :mod:`dpprof.pipeline` runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpprof.emulator.catalog import DEFAULT_GPU, interconnect_problem, lookup_gpu
from dpprof.errors import UsageError
from dpprof.scenarios.registry import SCENARIOS
from dpprof.scenarios.step_config import StepConfig
from dpprof.scenarios.workload_names import DEFAULT

__all__ = ["BACKENDS", "DEFAULT_EMULATED_GPUS", "CompareConfig"]

DEFAULT_EMULATED_GPUS = 4  # virtual devices when no --gpus is given
BACKENDS = ("auto", "emulated", "cpu", "cuda")


@dataclass
class CompareConfig:
    workload: str = DEFAULT  # built-in name, module.path:function or file.py:function
    # the training step's options (batch, seed, warm-up and measured steps, dtype, autocast,
    # DDP's options), declared once in dpprof.scenarios.step_config, passed to every backend
    step: StepConfig = field(default_factory=StepConfig)
    gpus: int | None = None  # None: every visible GPU (cuda) or 4 virtual ones (emulated)
    gpu_memory_bytes: int = DEFAULT_GPU.total_memory_bytes  # of each (virtual) GPU
    scenarios: tuple[str, ...] = SCENARIOS  # which of the paired scenarios to run
    backend: str = "auto"  # auto: cuda with >= 2 visible GPUs, else emulated
    compute: bool = False  # emulated over CPU tensors (real numbers) instead of meta
    debug: bool = False  # keep tracebacks
    compute_capability: tuple[int, int] = DEFAULT_GPU.compute_capability  # the target GPU's
    extra: dict[str, object] = field(default_factory=dict)
    # ---- answers (dpprof.measure.answer_fields) -------------------------------------------
    fixes: bool = True  # emulate each fix on the workload (what it saves on cuda:0)
    maxbatch: bool = False  # search the largest batch per scenario
    # measure the ladder's rungs (dpprof.measure.ladder); None: where ddp/single is out of
    # memory
    ladder: bool | None = None
    multiple_of: int = 1  # maxbatch granularity
    gpu: str = ""  # catalog name (--gpu a100-80gb): memory and context model
    interconnect: str = ""  # nvlink | pcie (""): the link the predicted step time assumes
    count_reserved: bool = False  # peaks count simulated reserved memory + the context
    equivalence: bool | None = None  # compare the math with single (None: with --compute)
    fail_on_imbalance: float | None = None  # exit 3 above this max/mean
    fail_on_oom: bool = False  # exit 3 on any out-of-memory


    # ---- the cuda backend (real GPUs) ------------------------------------------------------
    devices: tuple[int, ...] | None = None  # --devices 2,3: exactly these CUDA indices
    nvml_interval_s: float = 0.02  # --nvml-interval
    ddp_timeout_s: float = 300.0  # collective timeout / bound on every DDP wait

    def validate(self) -> None:
        problems = self.step.problems()
        if problems:
            raise UsageError(problems[0])
        if self.gpus is not None and self.gpus < 1:
            raise UsageError(f"--gpus must be at least 1, got {self.gpus}")
        if self.gpu_memory_bytes <= 0:
            raise UsageError("--gpu-memory must be larger than zero")
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise UsageError(
                f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}"
            )
        if not self.scenarios:
            raise UsageError(f"--scenarios is empty; choose from {', '.join(SCENARIOS)}")
        if self.backend not in BACKENDS:
            raise UsageError(
                f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}"
            )
        if self.nvml_interval_s <= 0:
            raise UsageError("--nvml-interval must be larger than zero, e.g. 0.02")
        if self.multiple_of < 1:
            raise UsageError(f"--multiple-of must be at least 1, got {self.multiple_of}")
        problem = interconnect_problem(
            self.interconnect, lookup_gpu(self.gpu) if self.gpu else DEFAULT_GPU)
        if problem:
            raise UsageError(problem)
        if self.fail_on_imbalance is not None and self.fail_on_imbalance < 1:
            raise UsageError(
                f"--fail-on-imbalance is a max/mean ratio (>= 1.0), got {self.fail_on_imbalance}"
            )
