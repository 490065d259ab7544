"""Run a comparison: pick the backend, run every scenario, build the :class:`RunResult`."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from dataclasses import asdict

from dpprof.answers.answer import partial_sentence, settled
from dpprof.backends.cpu import run_ddp_gloo
from dpprof.backends.cuda_ddp import torchrun_info
from dpprof.backends.cuda_host import host
from dpprof.backends.cuda_predicted import measured_gpu, predict_beside_measured
from dpprof.backends.cuda_run import cuda_compare, torchrun_compare
from dpprof.backends.emulated import (
    ASSUMPTIONS,
    Alongside,
    EmulationConfig,
    context_model,
    model_devices,
    probe_model,
    run_scenario,
)
from dpprof.compare_config import DEFAULT_EMULATED_GPUS, CompareConfig
from dpprof.emulator.context import gpu_model_notes
from dpprof.errors import Interrupted, UsageError
from dpprof.measure.answer_fields import add_answers, gpu_spec
from dpprof.measure.fix_savings import alongside
from dpprof.measure.maxbatch_search import COUNTS
from dpprof.result import RunResult, ScenarioResult, new_result
from dpprof.scenarios.measured_loop import loop_description
from dpprof.scenarios.registry import scenario
from dpprof.scenarios.workloads import Workload, load_workload

Progress = Callable[[str, int, int], None]  # (scenario, index, total)


def visible_cuda_gpus() -> int:
    """The CUDA GPUs the cuda backend's host sees (:func:`dpprof.backends.cuda_host.host`)."""
    return host().visible_gpus()


def resolve_backend(requested: str) -> str:
    """``auto``: cuda with at least two visible GPUs (one under torchrun), else emulated.

    ``cuda`` without a GPU is a :class:`UsageError`.
    """
    if requested == "cuda" and visible_cuda_gpus() == 0:
        raise UsageError(
            "--backend cuda: no CUDA GPU visible (torch.cuda.is_available() is False; check "
            "the driver, CUDA_VISIBLE_DEVICES and that torch is a CUDA build); use --backend "
            "emulated"
        )
    if requested == "auto":
        need = 1 if torchrun_info() is not None else 2
        return "cuda" if visible_cuda_gpus() >= need else "emulated"
    return requested


def emulation_config(cfg: CompareConfig, backend: str, gpus: int) -> EmulationConfig:
    """The emulator's part of ``cfg``, as it is: the scenarios of the emulated and cpu
    backends, and the predictions (fixes, largest batch) of every backend."""
    return EmulationConfig(
        gpus=gpus, gpu_memory_bytes=cfg.gpu_memory_bytes, step=cfg.step.resolved(backend),
        compute=cfg.compute or backend == "cpu", debug=cfg.debug,
        compute_capability=tuple(cfg.compute_capability),  # type: ignore[arg-type]
        count_reserved=cfg.count_reserved or cfg.maxbatch or bool(cfg.gpu),
        gpu=cfg.gpu, interconnect=cfg.interconnect,
    )


def run_compare(
    cfg: CompareConfig, progress: Progress | None = None, workload: Workload | None = None
) -> RunResult | None:
    """One comparison, the same pipeline for every backend: the spec, the backend's
    scenarios, the comparison, the answers (attribution, fixes, largest batch, equivalence,
    the CI checks); the reports render the result.

    Under torchrun (the cuda backend's ``ddp``), ranks other than 0 return None. The cuda
    backend's DDP ranks are separate processes: they load the workload from ``cfg.workload``
    (a spec), not from the ``workload`` object given here.
    """
    cfg.validate()
    wl = workload or load_workload(cfg.workload)
    wl = cfg.step.workload(wl)  # --dtype
    backend = resolve_backend(cfg.backend)
    run = new_result(
        backend, wl.name, batch=cfg.step.batch, gpus=cfg.gpus or DEFAULT_EMULATED_GPUS,
        gpu_memory_bytes=cfg.gpu_memory_bytes, config=option_record(cfg, wl, backend),
        seed=cfg.step.seed, dtype=str(wl.dtype).removeprefix("torch."),
    )
    ecfg = emulation_config(cfg, backend, run.gpus)
    besides: Alongside | None = None  # what the scenarios measure for the fixes
    not_applicable: tuple[str, ...] = ()  # scenarios the workload's model rules out
    if backend == "cuda":
        try:
            measured = _cuda(cfg, wl, run, progress)
        except (KeyboardInterrupt, Interrupted) as e:
            raise _interrupted(e, run) from None
        if measured is None:
            return None
        # the emulator predicts the fixes and the largest batch for the GPUs measured
        ecfg = dataclasses.replace(ecfg, gpus=measured.gpus, compute=False,
                                   gpu_memory_bytes=measured.gpu_memory_bytes)
        run = measured
        # and the step each scenario measured, predicted beside it
        run = predict_beside_measured(run, wl, ecfg, measured_gpu(
            cfg.gpu, list(run.config.get("devices") or [0])))
    else:
        besides = alongside(cfg.step.batch, run.gpus) if cfg.fixes else None
        run, not_applicable = _emulated_run(cfg, wl, run, ecfg)
        scenarios: list[ScenarioResult] = []  # those measured, kept if interrupted
        try:
            _emulate(cfg, wl, run.backend, ecfg, progress, besides, not_applicable, scenarios)
        except (KeyboardInterrupt, Interrupted) as e:
            raise _interrupted(e, dataclasses.replace(run, scenarios=tuple(scenarios))) from None
        run = dataclasses.replace(run, scenarios=tuple(scenarios))
    if progress:
        progress("", len(cfg.scenarios), len(cfg.scenarios))
    ran = tuple(s for s in cfg.scenarios if s not in not_applicable)
    return add_answers(
        run, wl, ecfg, fixes=cfg.fixes and not not_applicable, maxbatch=cfg.maxbatch,
        multiple_of=cfg.multiple_of, gpu=gpu_spec(cfg.gpu),
        equivalence=cfg.compute if cfg.equivalence is None else cfg.equivalence,
        scenarios=ran, fail_on_imbalance=cfg.fail_on_imbalance,
        fail_on_oom=cfg.fail_on_oom, progress=progress, alongside=besides,
        ladder=cfg.ladder,
    )


def option_record(cfg: CompareConfig, wl: Workload, backend: str) -> dict[str, object]:
    """One flat record of every option (the result's ``config``): the step's options and
    DDP's under their own (torch's) names, then the rest, then ``extra``; the GPUs, warm-up
    and compute capability as resolved, the workload's description and shapes."""
    step = {k: v for k, v in asdict(cfg.step).items() if k != "ddp"}
    rest = {k: v for k, v in asdict(cfg).items() if k not in ("extra", "step")}
    out = {"workload": cfg.workload} | step | rest | asdict(cfg.step.ddp) | dict(cfg.extra)
    out["gpus"] = cfg.gpus or DEFAULT_EMULATED_GPUS
    out["warmup_steps"] = cfg.step.warmup_steps(backend)
    out["compute_capability"] = list(cfg.compute_capability)  # JSON has no tuples
    out["scenarios"] = list(cfg.scenarios)
    out["workload_description"] = wl.description
    out["workload_shapes"] = dict(wl.shapes)
    return out


def _emulated_run(cfg: CompareConfig, wl: Workload, run: RunResult, ecfg: EmulationConfig
                  ) -> tuple[RunResult, tuple[str, ...]]:
    """The emulated and cpu backends' ``run`` before its scenarios: how its numbers are
    obtained (``assumptions``), its loop (``config``), and the scenarios that do not apply to
    the workload's model (said in a note, not run)."""
    ctx = context_model(ecfg, probe_model(wl, ecfg.gpus))
    assumptions = list(ASSUMPTIONS)
    if ecfg.count_reserved and cfg.compute:  # meta emulation models reserved + context itself
        assumptions.append(
            f"Out of memory when {COUNTS} ({ctx.outside_allocator_bytes} B per GPU, "
            f"{ctx.workspace_bytes} B of workspaces) exceeds the GPU's memory.")
    if cfg.step.dtype not in (None, "float32"):
        assumptions.append(
            f"--dtype {cfg.step.dtype}: parameters, gradients, optimizer state and floating "
            "inputs in that dtype (pure low precision: no float32 master weights)")
    if cfg.step.amp:
        assumptions.append(
            f"--amp {cfg.step.amp}: forward and loss under autocast, re-enacted from autocast's "
            "CUDA op lists (linear, matmul, conv, SDPA in the low dtype; softmax, losses, "
            "norms in float32); each weight cast once per forward (autocast's cache) and kept "
            "while autograd saves it; parameters, gradients and optimizer state float32 "
            "(the master weights); no GradScaler")
    if cfg.compute:
        assumptions[0] = (
            "Emulated over CPU tensors (real numbers): the training step runs on virtual "
            "devices; no GPU was used."
        )
    if run.backend == "cpu":
        assumptions = cpu_backend_assumptions(cfg)
    loop = loop_description(ecfg.step.warmup_steps(run.backend) + 1)
    assumptions.insert(1, "Measured: " + loop + ".")
    if run.backend == "emulated":
        assumptions += gpu_model_notes(ctx)
        assumptions.append(
            "Kernels as the target GPU (compute capability {}.{}) picks them: "
            "scaled_dot_product_attention as flash / memory-efficient / math by "
            "sdp_utils' rules, dropout as the fused native_dropout (bool mask)".format(
                *ecfg.compute_capability))
    spans = model_devices(wl, ecfg.gpus)
    not_applicable = tuple(s for s in cfg.scenarios
                           if scenario(s).model_on_one_gpu) if len(spans) > 1 else ()
    notes = run.notes
    if not_applicable:
        gpus = ", ".join(f"cuda:{i}" for i in spans)
        notes += (
            f"{', '.join(not_applicable)}: not applicable: the model places its layers on "
            f"{len(spans)} GPUs itself ({gpus}); DataParallel replicates a model that lives "
            f"on one GPU (device_ids[0]), and DDP with one process per GPU would need "
            f"{len(spans)} GPUs per rank; single shows this model's share of each GPU",)
    return dataclasses.replace(run, assumptions=tuple(assumptions), notes=notes,
                               config={**run.config, "loop": loop}), not_applicable


def _emulate(cfg: CompareConfig, wl: Workload, backend: str, ecfg: EmulationConfig,
             progress: Progress | None, besides: Alongside | None,
             not_applicable: tuple[str, ...], scenarios: list[ScenarioResult]) -> None:
    """The emulated and cpu backends' scenarios, appended to ``scenarios`` as each ends:
    every scenario on virtual devices (cpu: over CPU tensors, and ``ddp`` as gloo
    processes), with the same options; each also measures what ``besides`` asks of it (over
    meta tensors)."""
    for i, name in enumerate(cfg.scenarios):
        if progress:
            progress(name, i, len(cfg.scenarios))
        if name in not_applicable:
            continue
        if backend == "cpu" and scenario(name).one_process_per_gpu:
            scenarios.append(run_ddp_gloo(cfg.workload, ecfg, cfg.ddp_timeout_s))
        else:
            scenarios.append(run_scenario(name, wl, ecfg, alongside=besides))


def _interrupted(e: BaseException, run: RunResult) -> Interrupted:
    """SIGINT/SIGTERM during the scenarios: carry what was measured (the CLI writes it)."""
    signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
    return Interrupted(signum, partial=run if run.scenarios else None)


def mark_partial(run: RunResult, signum: int) -> RunResult:
    """An interrupted run as a result: its comparison over the scenarios measured, marked
    partial (``interrupted``, the verdict and a note say so in every format)."""
    run = dataclasses.replace(run, interrupted=signal.Signals(signum).name)
    note = partial_sentence(run)
    try:  # its verdict begins with partial_sentence
        return dataclasses.replace(settled(run), notes=(*run.notes, note))
    except Exception:  # what was measured is still worth keeping
        return dataclasses.replace(
            run, comparison=dataclasses.replace(run.comparison, verdict=note),
            notes=(*run.notes, note))


def _cuda(
    cfg: CompareConfig, wl: Workload, run: RunResult, progress: Progress | None
) -> RunResult | None:
    info = torchrun_info()
    if info is not None:
        if not all(scenario(s).one_process_per_gpu for s in cfg.scenarios):
            raise UsageError(
                "under torchrun only the ddp scenario runs (one process per GPU): add "
                "--scenarios ddp; run the DataParallel scenarios without torchrun"
            )
        return torchrun_compare(run, cfg, info)
    return cuda_compare(run, cfg, wl, visible_cuda_gpus(), progress)


def cpu_backend_assumptions(cfg: CompareConfig) -> list[str]:
    return [
        "cpu backend: real computation on the CPU. DataParallel scenarios and single run on "
        "virtual devices over CPU tensors (the emulator with real numbers); ddp runs as real "
        "torch.distributed processes over gloo, one per simulated GPU, measured with "
        "torch.profiler's allocation records.",
        "CPU kernels allocate some scratch that CUDA kernels do not (mse_loss's elementwise "
        "buffer, mkldnn convolution and CPU norm scratch, 0-dim wrapped scalars); the ddp "
        "figures include it, the emulated ones do not.",
        "No GPU effects: no caching-allocator reserve, CUDA context or library workspaces.",
    ]
