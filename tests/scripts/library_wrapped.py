"""A training loop whose model a library wraps (tests/scripts/wrapper_library.py): DDP
under torchrun, DataParallel under plain ``python``."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from wrapper_library import wrap


def main():
    local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None
    if local_rank is not None:
        dist.init_process_group("nccl")
        torch.cuda.set_device(local_rank)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 100)).cuda()
    wrapped = wrap(model, local_rank)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    for step in range(4):
        x, y = torch.randn(128, 64).cuda(), torch.randint(0, 100, (128,)).cuda()
        optimizer.zero_grad()
        loss = criterion(wrapped(x), y)
        loss.backward()
        optimizer.step()
        if step == 0:
            print("wrapped in", type(wrapped).__name__, "loss", loss.item())
    if local_rank is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
