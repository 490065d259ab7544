"""Small workloads for the cuda backend's CPU tests (loaded by spec in spawned/torchrun ranks).

``oom_over``: raises ``torch.cuda.OutOfMemoryError`` inside forward, where the caching
allocator would raise it, when a forward sees more rows than ``DPPROF_TEST_OOM_ROWS``
(the full DataParallel batch does, a DDP shard or ``single`` does not), or on the rank named
by ``DPPROF_TEST_OOM_RANK``. The message is the allocator's, word for word.
"""

import os

import torch
from torch import nn

import dpprof

OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.50 GiB. GPU {gpu} has a total capacity of "
    "79.15 GiB of which 1.02 GiB is free. Of the allocated memory 76.10 GiB is allocated by "
    "PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated."
)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = int(os.environ.get("DPPROF_TEST_OOM_ROWS", "1000000"))
        rank = os.environ.get("DPPROF_TEST_OOM_RANK")
        if x.shape[0] > rows or (rank is not None and rank == os.environ.get("RANK")):
            raise torch.cuda.OutOfMemoryError(OOM_MESSAGE.format(gpu=os.environ.get("RANK", 0)))
        return self.lin(x)


def tiny() -> dpprof.Workload:
    return dpprof.Workload(
        name="tiny",
        model=Tiny,
        batch=lambda rows, device: (
            torch.randn(rows, 8, device=device),
            torch.randint(0, 4, (rows,), device=device),
        ),
        loss=nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )
