"""torch.distributed.pipelining as its documentation writes it: a model cut into stages, one
per rank, run by GPipe over micro-batches. With ``objects``: no pipeline, rank 0 sends a
config to the last rank with send_object_list, which receives it (recv_object_list)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)

if sys.argv[1:] == ["objects"]:
    weights = torch.randn(1024, 1024, device=device)  # on its GPU before the exchange
    got = [{"lr": 0.1}] if rank == 0 else [None]
    if rank == 0:
        dist.send_object_list(got, dst=world - 1)
    elif rank == world - 1:
        dist.recv_object_list(got, src=0)
    print("config", got[0])
    sys.exit(0)

d, batch, chunks = 256, 32, 4
part = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).to(device)
stage = PipelineStage(part, rank, world, device)
schedule = ScheduleGPipe(stage, n_microbatches=chunks, loss_fn=nn.MSELoss())
opt = torch.optim.AdamW(part.parameters(), lr=1e-3)
for _ in range(4):
    opt.zero_grad()
    x, y = torch.randn(batch, d, device=device), torch.randn(batch, d, device=device)
    if world == 1:  # the one stage is the first and the last
        schedule.step(x, target=y)
    elif rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    opt.step()
dist.destroy_process_group()
