"""Lightning Fabric's ModelParallelStrategy as its tensor-parallel example writes it: a 2x2
mesh (data parallel x tensor parallel), the model built on the meta device
(``init_module(empty_init=True)``), a parallelize function that shards the layers across
the tensor-parallel group and then with FSDP2 across the data-parallel one, Fabric
materialising it on each GPU (``to_empty`` and ``reset_parameters``); AdamW over the sharded
parameters. Run it with ``python fabric_model_parallel.py`` (Fabric starts 4 processes)."""

import lightning as L
import torch
import torch.nn as nn
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


class FeedForward(nn.Module):
    def __init__(self, dim: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def parallelize(model: FeedForward, mesh) -> FeedForward:
    parallelize_module(model, mesh["tensor_parallel"],
                       {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def main() -> None:
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2,
                                     tensor_parallel_size=2)
    fabric = L.Fabric(accelerator="cuda", devices=4, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = FeedForward()
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(4):
        x = torch.randn(8, 256, device=fabric.device)
        fabric.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    fabric.print("trained")


if __name__ == "__main__":
    main()
