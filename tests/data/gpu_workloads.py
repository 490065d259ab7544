"""Workloads for the ``gpu`` tests (loaded by spec in DDP ranks)."""

import torch
from torch import nn

import dpprof


def _mlp_batch(rows: int, device: torch.device):
    return torch.randn(rows, 256, device=device), torch.randint(0, 4096, (rows,), device=device)


def wide() -> dpprof.Workload:
    """A wide output layer: the gathered outputs make cuda:0 heavier under DataParallel."""
    return dpprof.Workload(
        name="wide",
        model=lambda: nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 4096)),
        batch=_mlp_batch,
        loss=nn.functional.cross_entropy,
    )


def _greedy_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if outputs.shape[0] > 64:  # the gathered batch on cuda:0: ask for more than it has
        total = torch.cuda.get_device_properties(outputs.device).total_memory
        _ = torch.empty(total * 2, dtype=torch.uint8, device=outputs.device)
    return nn.functional.cross_entropy(outputs, targets)


def greedy() -> dpprof.Workload:
    """Really runs out of memory on cuda:0 in dp-loss-primary's loss (the gathered 128 rows);
    single (64 rows) fits."""
    return dpprof.Workload(
        name="greedy",
        model=lambda: nn.Sequential(nn.Linear(256, 4096)),
        batch=_mlp_batch,
        loss=_greedy_loss,
    )


class _Careless(nn.Module):
    """Touches cuda:0 from every process: the DDP 'forgot set_device' mistake."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 4096)
        self._keep = torch.zeros(1 << 20, device="cuda:0")  # a context on cuda:0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def careless() -> dpprof.Workload:
    return dpprof.Workload(name="careless", model=_Careless, batch=_mlp_batch,
                           loss=nn.functional.cross_entropy)
