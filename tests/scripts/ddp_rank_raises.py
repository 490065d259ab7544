"""DistributedDataParallel under torchrun whose rank 1 fails in its second step (a shard of
the data it alone reads is bad); rank 0 runs on."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def check_shard(rank: int, step: int) -> None:
    if rank == 1 and step == 1:
        raise ValueError(f"corrupt shard on rank {rank} at step {step}")


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    model = DDP(nn.Linear(64, 64).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        check_shard(dist.get_rank(), step)
        x = torch.randn(16, 64, device=local_rank)
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
