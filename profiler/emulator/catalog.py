"""The catalog of common GPUs, and the target GPU a run is emulated on or predicted for.

Memory figures
--------------
``GpuSpec.total_memory_bytes`` is what ``torch.cuda.get_device_properties(i).total_memory``
reports (``cudaDeviceProp.totalGlobalMem``), which is also the "total capacity" in PyTorch's
out-of-memory message. It is below the marketed size ("80 GB" is 80e9 B, or a round number of
GiB) and below NVML's total (``nvidia-smi``), because the driver keeps some memory for itself
(0.35 to 0.75 GiB on the boards below; it varies with the driver version and with ECC).
Each entry says where its figure comes from (``memory_source``):

- where an out-of-memory message for that GPU was found in a public issue, its "total
  capacity" (two decimals of GiB, so +-5 MiB; drivers move it by up to ~0.1 GiB) is used;
- otherwise (``estimated=True``) NVML's total minus 0.5 GiB, the typical gap seen on the
  boards that have both figures.

``nvml_total_bytes`` is NVML's total: from Modal's published ``nvidia-smi`` table
(modal-labs/modal-client PR 2797, thundergolfer.com/blog/nvidia-gpu-memory-capacity) where
it lists the GPU, otherwise the value ``nvidia-smi`` commonly shows for the board.

The target GPU
--------------
:class:`TargetGpu` is the one description of the GPU a run is for: a catalog model and the
memory of each GPU (the model's unless given). :data:`DEFAULT_GPU` is the default everywhere:
the catalog's A100 80GB, with the memory CUDA reports for it (79.25 GiB), not the 80 GiB on
the box.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DEFAULT_GPU",
    "GPUS",
    "GpuSpec",
    "TargetGpu",
    "compute_capability_of",
    "known_gpus",
    "lookup_gpu",
]

_MiB = 1024 * 1024


def _gib(x: float) -> int:
    """GiB with two decimals (as PyTorch prints them) to bytes, rounded to whole MiB."""
    return round(x * 1024) * _MiB


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Bytes are bytes."""

    key: str  # the catalog name, e.g. "a100-80gb"
    name: str  # the device name as CUDA reports it
    total_memory_bytes: int  # torch.cuda.get_device_properties().total_memory
    nvml_total_bytes: int  # nvidia-smi / NVML total
    marketed_gb: int  # the number on the box ("80 GB")
    compute_capability: tuple[int, int]
    generation: str  # architecture name
    memory_source: str  # where total_memory_bytes comes from
    estimated: bool = False  # True: total_memory_bytes estimated from NVML's total
    aliases: tuple[str, ...] = ()

    @property
    def driver_reserved_bytes(self) -> int:
        """NVML's total minus what CUDA reports: memory the driver keeps."""
        return self.nvml_total_bytes - self.total_memory_bytes


_EST = "estimated: NVML total minus 0.5 GiB (typical driver reservation on comparable boards)"

GPUS: dict[str, GpuSpec] = {
    s.key: s
    for s in (
        GpuSpec(
            "a100-80gb",
            "NVIDIA A100-SXM4-80GB",
            _gib(79.25),
            81920 * _MiB,
            80,
            (8, 0),
            "Ampere",
            "OOM message '79.25 GiB total capacity' (levihsu/OOTDiffusion issue 235); "
            "A800-80GB shows 79.33 GiB on other drivers",
            aliases=("a100-sxm4-80gb", "a100-pcie-80gb", "a100-80g", "a100 80gb"),
        ),
        GpuSpec(
            "a100-40gb",
            "NVIDIA A100-SXM4-40GB",
            _gib(39.50),
            40960 * _MiB,
            40,
            (8, 0),
            "Ampere",
            "OOM message 'total capacity of 39.50 GiB' on one A100 40GB (TianheWu/CoSeR issue 10)",
            aliases=("a100-sxm4-40gb", "a100-pcie-40gb", "a100-40g"),
        ),
        GpuSpec(
            "h100-80gb",
            "NVIDIA H100 80GB HBM3",
            _gib(79.11),
            81559 * _MiB,
            80,
            (9, 0),
            "Hopper",
            "OOM message 'total capacity of 79.11 GiB' on H100 (vllm-project/vllm issue 27508)",
            aliases=("h100", "h100-sxm", "h100-sxm5-80gb", "h100-80gb-hbm3", "h100-pcie"),
        ),
        GpuSpec(
            "h200",
            "NVIDIA H200",
            _gib(139.90),
            143771 * _MiB,
            141,
            (9, 0),
            "Hopper",
            _EST,
            estimated=True,
            aliases=("h200-141gb", "h200-sxm", "h200-nvl"),
        ),
        GpuSpec(
            "v100-16gb",
            "Tesla V100-SXM2-16GB",
            _gib(15.75),
            16160 * _MiB,
            16,
            (7, 0),
            "Volta",
            "OOM message '15.75 GiB total capacity' on a 16 GB card (Morizeyao/GPT2-Chinese "
            "issue 215); NVML 16160 MiB",
            aliases=("v100-sxm2-16gb", "v100-pcie-16gb"),
        ),
        GpuSpec(
            "v100-32gb",
            "Tesla V100-SXM2-32GB",
            _gib(31.74),
            32510 * _MiB,
            32,
            (7, 0),
            "Volta",
            "OOM message '31.74 GiB total capacity' on 8x V100 (haotian-liu/LLaVA issue 812)",
            aliases=("v100-sxm2-32gb", "v100-pcie-32gb", "v100s", "v100s-32gb"),
        ),
        GpuSpec(
            "a10g",
            "NVIDIA A10G",
            _gib(21.99),
            23028 * _MiB,
            24,
            (8, 6),
            "Ampere",
            "OOM message 'total capacity of 21.99 GiB' on an A10 (zai-org/CogVLM issue 236); "
            "A10 and A10G both show 23028 MiB in NVML",
            aliases=("a10", "a10-24gb", "a10g-24gb"),
        ),
        GpuSpec(
            "l4",
            "NVIDIA L4",
            _gib(21.99),
            23034 * _MiB,
            24,
            (8, 9),
            "Ada Lovelace",
            _EST,
            estimated=True,
            aliases=("l4-24gb",),
        ),
        GpuSpec(
            "t4",
            "Tesla T4",
            _gib(14.58),
            15360 * _MiB,
            16,
            (7, 5),
            "Turing",
            "OOM message 'total capacity of 14.58 GiB' on T4, driver 535.183 "
            "(mbzuai-oryx/GeoPixel issue 5); older drivers showed 14.75 GiB",
            aliases=("tesla-t4", "t4-16gb"),
        ),
        GpuSpec(
            "rtx-3090",
            "NVIDIA GeForce RTX 3090",
            _gib(23.70),
            24576 * _MiB,
            24,
            (8, 6),
            "Ampere",
            "OOM message '23.70 GiB total capacity' on RTX 3090 (GaoLii/DSP issue 10, "
            "xiaoxiangAQ/GAS-Net issue 7)",
            aliases=("3090", "rtx3090", "geforce-rtx-3090"),
        ),
        GpuSpec(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090",
            _gib(23.64),
            24564 * _MiB,
            24,
            (8, 9),
            "Ada Lovelace",
            "OOM message 'total capacty of 23.64 GiB' on RTX 4090 (3DTopia/Phidias-Diffusion "
            "issue 8); older drivers showed 23.65-23.68 GiB",
            aliases=("4090", "rtx4090", "geforce-rtx-4090"),
        ),
        GpuSpec(
            "a6000",
            "NVIDIA RTX A6000",
            _gib(47.49),
            49140 * _MiB,
            48,
            (8, 6),
            "Ampere",
            _EST,
            estimated=True,
            aliases=("rtx-a6000", "rtxa6000", "a6000-48gb"),
        ),
        GpuSpec(
            "l40s",
            "NVIDIA L40S",
            _gib(44.53),
            46068 * _MiB,
            48,
            (8, 9),
            "Ada Lovelace",
            "OOM message 'total capacity of 44.53 GiB' on L40S (Wan-Video/Wan2.1 issue 205)",
            aliases=("l40s-48gb",),
        ),
    )
}


def _norm(name: str) -> str:
    s = name.strip().lower()
    s = re.sub(r"^(nvidia|tesla|geforce)[\s_-]+", "", s)
    s = re.sub(r"^(tesla|geforce)[\s_-]+", "", s)
    return re.sub(r"[\s_]+", "-", s)


_INDEX: dict[str, str] = {}
for _spec in GPUS.values():
    for _n in (_spec.key, _spec.name, *_spec.aliases):
        _INDEX.setdefault(_norm(_n), _spec.key)


def known_gpus() -> list[str]:
    """The catalog's names, sorted."""
    return sorted(GPUS)


def lookup_gpu(name: str) -> GpuSpec:
    """The :class:`GpuSpec` for a catalog name, an alias or a CUDA device name.

    Case, spaces and underscores do not matter; ``"NVIDIA A100-SXM4-80GB"``, ``"a100_80gb"``
    and ``"A100-80GB"`` all find ``a100-80gb``. Raises ``KeyError`` naming the known GPUs.
    """
    key = _INDEX.get(_norm(str(name)))
    if key is None:
        raise KeyError(
            f"unknown GPU {name!r}; known GPUs: {', '.join(known_gpus())} "
            "(or give the memory instead, e.g. --gpu-memory 80GiB)"
        )
    return GPUS[key]



def compute_capability_of(spec_or_cc: GpuSpec | tuple[int, int] | str) -> tuple[int, int]:
    """A compute capability from a spec, a (major, minor) pair, "8.6", "sm_90" or a name."""
    if isinstance(spec_or_cc, GpuSpec):
        return spec_or_cc.compute_capability
    if isinstance(spec_or_cc, str):
        text = spec_or_cc.strip().lower()
        m = re.fullmatch(r"(\d+)\.(\d+)", text) or re.fullmatch(r"sm_?(\d+)(\d)", text)
        if m:
            return int(m.group(1)), int(m.group(2))
        return lookup_gpu(spec_or_cc).compute_capability
    major, minor = spec_or_cc
    return int(major), int(minor)



DEFAULT_GPU = GPUS["a100-80gb"]  # what every command emulates or predicts for by default


@dataclass(frozen=True)
class TargetGpu:
    """The GPU a run is for: a catalog model (its name, generation and kernels), the memory
    of each GPU and the compute capability the kernels are chosen for; the last two are the
    model's unless the user gave others (``--gpu-memory``, ``--compute-capability``)."""

    spec: GpuSpec = DEFAULT_GPU
    memory_bytes: int = DEFAULT_GPU.total_memory_bytes
    compute_capability: tuple[int, int] = DEFAULT_GPU.compute_capability
    named: bool = False  # the model was asked for by name (--gpu), not the default

    @classmethod
    def of(cls, spec: GpuSpec | None = None, memory_bytes: int | None = None,
           compute_capability: tuple[int, int] | None = None) -> TargetGpu:
        """The target: ``spec`` (default :data:`DEFAULT_GPU`) with its memory and compute
        capability unless others are given."""
        model = spec or DEFAULT_GPU
        return cls(model, memory_bytes or model.total_memory_bytes,
                   compute_capability or model.compute_capability, named=spec is not None)


# ---- peak rates, for the step-time model (dpprof.emulator.step_time) --------------------


@dataclass(frozen=True)
class PeakRates:
    """A GPU's datasheet peaks: dense (no sparsity) matmul rates per dtype, memory bandwidth,
    and its links, each one direction: the GPU-to-GPU link of a typical multi-GPU server of
    that board (NVLink where it has one, else PCIe peer to peer) and PCIe to the host."""

    tflops: dict[str, float]  # "float32" (no tensor cores), "tf32", "bfloat16", "float16"
    memory_tbytes_per_s: float
    nvlink_gbytes_per_s: float | None  # per direction, all links of one GPU; None: none
    pcie_gbytes_per_s: float  # per direction
    source: str


def _t(fp32: float, tf32: float | None, bf16: float | None, fp16: float) -> dict[str, float]:
    rates = {"float32": fp32, "float16": fp16}
    if tf32 is not None:
        rates["tf32"] = tf32
    if bf16 is not None:
        rates["bfloat16"] = bf16
    return rates


_PCIE3, _PCIE4, _PCIE5 = 16.0, 32.0, 64.0  # GB/s per direction, x16
PEAK_RATES: dict[str, PeakRates] = {
    "a100-80gb": PeakRates(_t(19.5, 156, 312, 312), 2.039, 300, _PCIE4,
                           "NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s; NVLink 600 GB/s"),
    "a100-40gb": PeakRates(_t(19.5, 156, 312, 312), 1.555, 300, _PCIE4,
                           "NVIDIA A100 datasheet (SXM4 40GB): 1,555 GB/s; NVLink 600 GB/s"),
    "h100-80gb": PeakRates(_t(67, 494.7, 989.4, 989.4), 3.35, 450, _PCIE5,
                           "NVIDIA H100 datasheet (SXM): 3.35 TB/s; NVLink 900 GB/s"),
    "h200": PeakRates(_t(67, 494.7, 989.4, 989.4), 4.8, 450, _PCIE5,
                      "NVIDIA H200 datasheet (SXM): 4.8 TB/s; NVLink 900 GB/s"),
    "v100-16gb": PeakRates(_t(15.7, None, None, 125), 0.9, 150, _PCIE3,
                           "NVIDIA V100 datasheet (SXM2): 900 GB/s; NVLink 300 GB/s"),
    "v100-32gb": PeakRates(_t(15.7, None, None, 125), 0.9, 150, _PCIE3,
                           "NVIDIA V100 datasheet (SXM2): 900 GB/s; NVLink 300 GB/s"),
    "a10g": PeakRates(_t(31.2, 62.5, 125, 125), 0.6, None, _PCIE4,
                      "NVIDIA A10 datasheet (A10G: AWS's variant of it): 600 GB/s"),
    "l4": PeakRates(_t(30.3, 60, 121, 121), 0.3, None, _PCIE4,
                    "NVIDIA L4 datasheet: 300 GB/s (tensor figures halved: listed with "
                    "sparsity)"),
    "t4": PeakRates(_t(8.1, None, None, 65), 0.32, None, _PCIE3,
                    "NVIDIA T4 datasheet: 320 GB/s"),
    "rtx-3090": PeakRates(_t(35.6, 35.6, 71, 71), 0.936, None, _PCIE4,
                          "NVIDIA Ampere GA102 whitepaper (RTX 3090): 936 GB/s"),
    "rtx-4090": PeakRates(_t(82.6, 82.6, 165.2, 165.2), 1.008, None, _PCIE4,
                          "NVIDIA Ada Lovelace whitepaper (RTX 4090): 1,008 GB/s"),
    "a6000": PeakRates(_t(38.7, 77.4, 154.8, 154.8), 0.768, 56.25, _PCIE4,
                       "NVIDIA RTX A6000 datasheet: 768 GB/s; NVLink bridge 112.5 GB/s"),
    "l40s": PeakRates(_t(91.6, 183, 362, 362), 0.864, None, _PCIE4,
                      "NVIDIA L40S datasheet: 864 GB/s (tensor figures halved: listed with "
                      "sparsity)"),
}

INTERCONNECTS = ("nvlink", "pcie")


def interconnect_problem(interconnect: str, spec: GpuSpec) -> str:
    """What is wrong with ``--interconnect`` for ``spec`` ("" where nothing is): a link
    that is none of :data:`INTERCONNECTS`, or NVLink on a board that has none."""
    if interconnect not in ("", *INTERCONNECTS):
        return (f"--interconnect {interconnect}: unknown link; choose from "
                f"{', '.join(INTERCONNECTS)}")
    if interconnect == "nvlink" and not peak_rates_of(spec).nvlink_gbytes_per_s:
        return (f"--interconnect nvlink: the {spec.name} has no NVLink; give "
                "--interconnect pcie or leave it out")
    return ""


def peak_rates_of(spec: GpuSpec) -> PeakRates:
    """The datasheet peaks of ``spec`` (every catalog GPU has them)."""
    return PEAK_RATES[spec.key]
