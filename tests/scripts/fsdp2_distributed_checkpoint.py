"""FSDP2 with a distributed checkpoint, the way PyTorch's DCP recipe writes it: an
``AppState`` (``Stateful``) holding the model and optimizer, saved with
``torch.distributed.checkpoint.save`` beside a plain value (the epoch), then loaded back into a
fresh state and checked. ``python fsdp2_distributed_checkpoint.py missing`` loads a checkpoint
that was never saved (which fails, as on a GPU). Run it with
``torchrun --nproc-per-node 2 fsdp2_distributed_checkpoint.py``."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard


class AppState(Stateful):
    # no __dict__: what it holds is reached through its state_dict(), as DCP reaches it
    __slots__ = ("model", "optimizer", "loaded")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loaded = 0

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "steps_done": 4}

    def load_state_dict(self, state_dict):
        if state_dict["steps_done"] != 4:
            raise SystemExit(f"steps_done read back as {state_dict['steps_done']}")
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.loaded += 1


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(4):
        model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = "checkpoints/step-4"
    if sys.argv[1:] != ["missing"]:
        dcp.save({"app": AppState(model, optimizer), "epoch": 3}, checkpoint_id=folder)
    state = {"app": AppState(model, optimizer), "epoch": 0}
    dcp.load(state, checkpoint_id=folder)
    if state["epoch"] != 3 or state["app"].loaded != 1:
        raise SystemExit(f"read back epoch {state['epoch']}, loaded {state['app'].loaded}")
    print(f"rank {rank} resumed at epoch {state['epoch']}; "
          f"max memory allocated {torch.cuda.max_memory_allocated()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
