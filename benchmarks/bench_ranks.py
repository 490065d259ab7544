"""What running the other ranks costs ``dpprof run`` of a torchrun script. One command:

    python benchmarks/bench_ranks.py              # prints, writes benchmarks/results_ranks.json
    python benchmarks/bench_ranks.py --repeat 5   # min-max over 5 rounds (default 3)

A small DDP script under ``torchrun --nproc-per-node 4`` (an MLP, a DistributedSampler,
AdamW; 3 steps, meta tensors, sealed, no ladder), in process through ``run_command``:
``--ranks last`` (the default: rank 0 and rank 3, two runs of the script) and
``--ranks all`` (four runs) against ``--ranks none`` (rank 0 alone standing for every rank:
what ``dpprof run`` did before it ran the other ranks). CPU time of this process, torch on
one intra-op thread, each figure the least of two runs, side by side in a round, min-max
over the rounds (``ratios.py``); one warm-up of each first. No goal: a rank costs one run of
the script, so ``last`` is expected near 2x and ``all`` near 4x; the figure says what the
default's second rank costs a user.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ratios import record_head, rounds, summary

from dpprof.script.session import ScriptConfig, parse_command, run_command

HERE = Path(__file__).resolve().parent

DDP_SCRIPT = """
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group("nccl")
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 100)).cuda(local_rank)
ddp = DDP(model, device_ids=[local_rank])
data = TensorDataset(torch.randn(512, 64), torch.randint(0, 100, (512,)))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=32, sampler=sampler)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
for x, y in loader:
    x, y = x.cuda(local_rank), y.cuda(local_rank)
    optimizer.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    optimizer.step()
dist.destroy_process_group()
"""


def dpprof_run(path: Path, ranks: str) -> Callable[[], object]:
    def go() -> object:
        launch = parse_command(["torchrun", "--nproc-per-node", "4", str(path)], 4)
        cfg = ScriptConfig(launch=launch, gpus=4, steps=3, ladder=False, ranks=ranks)
        with contextlib.redirect_stdout(io.StringIO()):
            result, _ = run_command(cfg)
        assert result.config["ranks"]["run"] == {"none": [0], "last": [0, 3],
                                                 "all": [0, 1, 2, 3]}[ranks]
        return result
    return go


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds (min-max over them)")
    ap.add_argument("--no-write", action="store_true", help="do not write results_ranks.json")
    args = ap.parse_args()
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train_ddp.py"
        script.write_text(DDP_SCRIPT)
        alone = dpprof_run(script, "none")
        cases = {"last_over_rank0_alone": (alone, dpprof_run(script, "last")),
                 "all_over_rank0_alone": (alone, dpprof_run(script, "all"))}
        for base, ours in cases.values():  # warm-up: imports, first calls
            base()
            ours()
        raw, secs = rounds(cases, args.repeat)
    results: dict[str, Any] = {
        **record_head(),
        "ratios": {k: summary(v, None) for k, v in raw.items()},
        "cpu_s": {k: {"rank0_alone": [round(b, 3) for b, _ in v],
                      "dpprof": [round(o, 3) for _, o in v]} for k, v in secs.items()},
    }
    for k, s in results["ratios"].items():
        cpu = results["cpu_s"][k]
        print(f"  {k:<24} {s['median']:.2f}  (min {s['min']:.2f} - max {s['max']:.2f}, "
              f"{len(s['runs'])} rounds; CPU s: {min(cpu['rank0_alone']):.2f} -> "
              f"{min(cpu['dpprof']):.2f})")
    if not args.no_write:
        (HERE / "results_ranks.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {HERE / 'results_ranks.json'}")


if __name__ == "__main__":
    sys.exit(main())
