"""A workload that writes down what each backend's code path actually built and fed it.

Every forward call appends one JSON line to ``$DPPROF_SEED_RECORD/<pid>.jsonl``: the
process's DDP rank (None outside a process group), the call's number, a hash of the
inputs it got and, on its first call, a hash of its parameters (the initial weights: no
optimizer step has run yet). Used by ``tests/test_seed_rule.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import dpprof

FEATURES, CLASSES = 16, 4


def digest(tensors: list[torch.Tensor]) -> str:
    """A hash of the values (read as Python floats, so any device or mode can give them)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(repr(t.detach().double().flatten().tolist()).encode())
    return h.hexdigest()[:16]


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.5),
                                 nn.Linear(32, CLASSES))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = os.environ.get("DPPROF_SEED_RECORD")
        if out:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
            line = {"rank": rank, "call": self.calls, "rows": x.shape[0],
                    "inputs": digest([x])}
            if self.calls == 0:
                line["params"] = digest(list(self.parameters()))
            with (Path(out) / f"{os.getpid()}.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
        self.calls += 1
        return self.net(x)


def workload() -> dpprof.Workload:
    return dpprof.Workload(
        name="seed-recorder",
        model=Recorder,
        batch=lambda rows, device: (torch.randn(rows, FEATURES, device=device),
                                    torch.randint(0, CLASSES, (rows,), device=device)),
        loss=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
