"""DDP with PyTorch's bf16 compression hook (``default_hooks.bf16_compress_hook``), which DDP
accepts only from a CUDA build with NCCL 2.10 or later. Run it with
``torchrun --nproc-per-node 2 ddp_bf16_hook.py``."""

import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
model = DDP(torch.nn.Linear(512, 512).cuda(), device_ids=[rank])
model.register_comm_hook(None, default_hooks.bf16_compress_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    model(torch.randn(64, 512, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}")
dist.destroy_process_group()
