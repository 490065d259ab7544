"""DistributedDataParallel under torchrun where rank 0 alone keeps an exponential moving
average of the model on its GPU (and saves it at the end), as timm's and many recipes'
ModelEmaV2 under `if rank == 0` does; the other ranks only train."""

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
    ema = None
    if dist.get_rank() == 0:
        ema = copy.deepcopy(model).requires_grad_(False)
    ddp = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(5):
        x = torch.randn(32, 256, device="cuda")
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()
        if ema is not None:
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.mul_(0.99).add_(p, alpha=0.01)
    if ema is not None:
        torch.save(ema.state_dict(), "ema.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
