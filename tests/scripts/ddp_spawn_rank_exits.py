"""DistributedDataParallel under mp.spawn whose last rank ends its process with
os._exit(3) after its first step (as a watchdog or a failed health check does)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    model = DDP(nn.Linear(64, 64).to(rank), device_ids=[rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        optimizer.zero_grad()
        model(torch.randn(16, 64).to(rank)).sum().backward()
        optimizer.step()
        if rank == world_size - 1 and step == 0:
            os._exit(3)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)
