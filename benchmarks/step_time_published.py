"""Check 2 of the step-time model: published DataParallel and DDP step times.

Source: Hugging Face, "Efficient Training on Multiple GPUs", section "DataParallel vs
DistributedDataParallel" (huggingface/transformers, docs/source/en/perf_train_gpu_many.md):
GPT-2 small (``openai-community/gpt2``, 124M parameters) fine-tuned by ``run_clm.py`` on
wikitext-2 (blocks of 1024 tokens), ``--per_device_train_batch_size 4 --max_steps 200``, fp32,
on 2x TITAN RTX 24GB joined by 2 NVLinks; torch 1.8-to-be, CUDA 11.0, transformers 4.3.
``train_runtime`` for 200 steps: DataParallel 110.5948 s, DDP with NVLink 101.9003 s, DDP
without it (``NCCL_P2P_DISABLE=1``) 131.4367 s.

The model here: the same GPT-2 (``GPT2Config()``, transformers' defaults = GPT-2 small),
8 rows of 1024 tokens a step (4 per GPU), the labels in the batch (the loss inside the model,
as the Trainer runs it), AdamW, emulated as dpprof's ``dp-loss-primary`` (DataParallel(model):
the Trainer wraps the model so on 2 GPUs) and ``ddp``, predicted on the TITAN RTX's
datasheet peaks (16.3 TFLOPS fp32, 672 GB/s; NVLink bridge 100 GB/s, 50 each way; without
it, PCIe 3.0 x16, 16 GB/s each way, which NCCL's shared-memory path crosses twice).

    python benchmarks/step_time_published.py    # prints the table, writes its JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "step_time_published.json"
STEPS = 200
PUBLISHED_S = {"dp-loss-primary nvlink": 110.5948, "ddp nvlink": 101.9003,
               "ddp pcie": 131.4367}
SOURCE = ("huggingface/transformers docs/source/en/perf_train_gpu_many.md, "
          "'DataParallel vs DistributedDataParallel'")


def gpt2_small() -> Any:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from torchvision_shim import import_torchvision

    import_torchvision()  # transformers imports it; its C ops do not load over the CPU torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import dpprof

    config = GPT2Config()  # GPT-2 small: 12 layers, 768 wide, 1024 positions, 50257 tokens

    def batch(rows: int, device: torch.device) -> tuple[dict[str, torch.Tensor], None]:
        ids = torch.randint(0, config.vocab_size, (rows, config.n_positions), device=device)
        return {"input_ids": ids, "labels": ids.clone()}, None

    return dpprof.Workload(
        name="gpt2-small", model=lambda: GPT2LMHeadModel(config), batch=batch,
        loss=lambda out, _: out.loss.mean(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=5e-5))


def titan_rtx(link: str) -> Any:
    from dpprof.emulator.step_time import DeviceRates

    pcie = 16e9
    return DeviceRates(
        matmul_flops_per_s={"float32": 16.3e12, "float16": 130e12},
        memory_bytes_per_s=672e9,
        link_bytes_per_s=50e9 if link == "nvlink" else pcie / 2,
        host_link_bytes_per_s=pcie, interconnect=link)


def main() -> None:
    from dpprof.backends.emulated import EmulationConfig, run_scenario
    from dpprof.emulator.step_time import H200_FIT, predict_step
    from dpprof.scenarios.step import StepConfig

    wl = gpt2_small()
    rows = []
    for key, published in PUBLISHED_S.items():
        scenario, link = key.split()
        trace: dict[str, Any] = {}
        cfg = EmulationConfig(gpus=2, gpu_memory_bytes=24 << 30, step=StepConfig(batch=8),
                              compute_capability=(7, 5))
        result = run_scenario(scenario, wl, cfg, trace=trace)
        if result.status == "error":
            raise RuntimeError(result.message)
        pred = predict_step(trace["rt"].op_log.records, titan_rtx(link), H200_FIT,
                            [0, 1]).step_time_s
        measured = published / STEPS
        rows.append({"scenario": scenario, "interconnect": link, "published_step_s": measured,
                     "predicted_step_s": pred, "error": pred / measured - 1})
        print(f"{scenario:16} {link:7} published {measured * 1e3:7.1f} ms a step, predicted "
              f"{pred * 1e3:7.1f} ms: {pred / measured - 1:+.1%}", flush=True)
    OUT.write_text(json.dumps({"source": SOURCE, "gpu": "2x NVIDIA TITAN RTX",
                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
