"""DistributedDataParallel started with torch.multiprocessing.spawn."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def train(rank, world_size):
    setup(rank, world_size)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 100)).to(rank)
    ddp_model = DDP(model, device_ids=[rank])
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    for _ in range(5):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(32, 64).to(rank))
        labels = torch.randint(0, 100, (32,)).to(rank)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)
