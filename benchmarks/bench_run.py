"""What ``dpprof run`` costs against the script run plainly on the CPU. One command:

    python benchmarks/bench_run.py              # prints, writes benchmarks/results_run.json
    python benchmarks/bench_run.py --repeat 5   # min-max over 5 rounds (default 3)

Cost is CPU time of this process (``time.process_time``), everything in process (the
script through ``runpy``; dpprof through ``run_command``), one warm-up of each first
(imports, first calls), each figure the least of two runs, every ratio measured side by
side in a round; the min-max is over the rounds; torch on one intra-op thread (on shared
cores the spinning of idle threads counts as CPU time). The machine's cores are shared.

1. ``--compute``: ``dpprof run --compute`` of a small training script (an MLP, 20 AdamW steps
   of 64 rows, every step counted: ``--steps 20``, no alternatives) / the same script run
   plainly on the CPU (no GPU: it trains on "cpu"). Goal <= 1.3.
   Beside it, the floor of that design: the same plain run under an empty
   ``TorchDispatchMode`` (every op through Python and back, nothing counted) / the plain
   run. dpprof counts each op of a virtual GPU in such a mode; no goal below this floor
   can be met by a faster mode.
2. Meta mode with the alternatives: ``dpprof run`` of a DataParallel script (the tutorial's
   loop, loss outside forward, 4 GPUs, its DDP and loss-in-forward alternatives: three runs of
   the script) / one plain CPU run of it. Goal <= 1.5.
3. Meta mode, many small ops: an LSTM language model the shape of pytorch/examples'
   ``word_language_model`` (2 layers of 200, 35 steps of 20 rows; three in-place ops a cell
   step) trained 3 steps, then evaluated on 40 batches, on 1 GPU / one plain CPU run of it.
   No goal: it shows what each op through the emulation costs where ops are small.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ratios import record_head, rounds, summary
from torch.utils._python_dispatch import TorchDispatchMode

from dpprof.script.session import ScriptConfig, parse_command, run_command

HERE = Path(__file__).resolve().parent

COMPUTE_SCRIPT = """
import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 10)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()
data = torch.randn(64 * 20, 256)
labels = torch.randint(0, 10, (64 * 20,))
for step in range(20):
    x = data[step * 64:(step + 1) * 64].to(device)
    y = labels[step * 64:(step + 1) * 64].to(device)
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
"""

DP_SCRIPT = """
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 1000))
if torch.cuda.device_count() > 1:
    model = nn.DataParallel(model)
model.to(device)
data = TensorDataset(torch.randn(1024, 256), torch.randint(0, 1000, (1024,)))
loader = DataLoader(data, batch_size=128, shuffle=True)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for inputs, labels in loader:
    inputs, labels = inputs.to(device), labels.to(device)
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = criterion(outputs, labels)
    loss.backward()
    optimizer.step()
"""


LSTM_SCRIPT = """
import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(10000, 200)
        self.rnn = nn.LSTM(200, 200, 2)
        self.decoder = nn.Linear(200, 10000)

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.encoder(x), hidden)
        return self.decoder(out), hidden


model = LM().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
criterion = nn.CrossEntropyLoss()
data = torch.randint(0, 10000, (35 * 43, 20))
for step in range(3):
    x, y = data[step * 35:(step + 1) * 35].to(device), data[step * 35 + 1:(step + 1) * 35 + 1]
    hidden = tuple(torch.zeros(2, 20, 200, device=device) for _ in range(2))
    optimizer.zero_grad()
    out, _ = model(x, hidden)
    criterion(out.view(-1, 10000), y.to(device).view(-1)).backward()
    optimizer.step()
model.eval()
total = 0.0
with torch.no_grad():
    hidden = tuple(torch.zeros(2, 20, 200, device=device) for _ in range(2))
    for step in range(3, 43):
        x = data[(step - 1) * 35:step * 35].to(device)
        out, hidden = model(x, hidden)
        total += out.float().mean().item()
"""


def plain(path: Path) -> Callable[[], object]:
    def go() -> object:
        with contextlib.redirect_stdout(io.StringIO()):
            return runpy.run_path(str(path), run_name="__main__")
    return go


class EmptyMode(TorchDispatchMode):
    """Every op through Python and straight back: what any dispatch mode costs at least."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def under_empty_mode(path: Path) -> Callable[[], object]:
    run = plain(path)

    def go() -> object:
        with EmptyMode():
            return run()
    return go


def dpprof_run(path: Path, steps: int, compute: bool, alternatives: bool,
               gpus: int = 4) -> Callable[[], object]:
    def go() -> object:
        cfg = ScriptConfig(launch=parse_command(["python", str(path)], gpus), gpus=gpus,
                           steps=steps, compute=compute)
        with contextlib.redirect_stdout(io.StringIO()):
            return run_command(cfg, alternatives)
    return go


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds (min-max over them)")
    ap.add_argument("--no-write", action="store_true", help="do not write results_run.json")
    args = ap.parse_args()
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    # one intra-op thread: on shared cores, idle threads' spinning is CPU time of neither
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "train_small.py"
        small.write_text(COMPUTE_SCRIPT)
        dp = Path(tmp) / "train_dp.py"
        dp.write_text(DP_SCRIPT)
        lstm = Path(tmp) / "train_lstm.py"
        lstm.write_text(LSTM_SCRIPT)
        cases = {
            "compute_over_cpu": (plain(small), dpprof_run(small, 20, True, False), 1.3),
            "empty_dispatch_mode_over_cpu": (plain(small), under_empty_mode(small), None),
            "meta_with_alternatives_over_cpu": (plain(dp), dpprof_run(dp, 8, False, True), 1.5),
            "meta_small_ops_over_cpu": (plain(lstm), dpprof_run(lstm, 10, False, False, 1),
                                        None),
        }
        for base, ours, _ in cases.values():  # warm-up: imports, first calls
            base()
            ours()
        raw, secs = rounds({k: (base, ours) for k, (base, ours, _) in cases.items()},
                           args.repeat)
    results: dict[str, Any] = {
        **record_head(),
        "ratios": {k: summary(v, cases[k][2]) for k, v in raw.items()},
        "cpu_s": {k: {"plain": [round(b, 3) for b, _ in v], "dpprof": [round(o, 3) for _, o in v]}
                  for k, v in secs.items()},
    }
    for k, s in results["ratios"].items():
        mark = ("no goal" if s["goal"] is None
                else f"goal {s['goal']}: " + ("met" if s["met"] else "NOT MET"))
        print(f"  {k:<34} {s['median']:.2f}  (min {s['min']:.2f} - max {s['max']:.2f}, "
              f"{len(s['runs'])} rounds; {mark})")
    if not args.no_write:
        (HERE / "results_run.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {HERE / 'results_run.json'}")


if __name__ == "__main__":
    sys.exit(main())
