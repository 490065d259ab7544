"""DistributedDataParallel started by torchrun: one process per GPU."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 100)).cuda(local_rank)
    ddp_model = DDP(model, device_ids=[local_rank])
    data = TensorDataset(torch.randn(512, 64), torch.randint(0, 100, (512,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.cuda(local_rank), y.cuda(local_rank)
            optimizer.zero_grad()
            loss = criterion(ddp_model(x), y)
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            print("epoch", epoch, "loss", loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
