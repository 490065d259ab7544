"""A plain PyTorch loop scaled with Lightning Fabric: ``Fabric(strategy="ddp", devices=4)``
and ``fabric.launch()`` from a plain ``python``, Fabric starting the other ranks itself
(``--strategy ddp_spawn`` / ``ddp_notebook``: ``fabric.launch(train)``, the ranks spawned
or forked); ``fabric.setup`` wraps the model and optimizer, ``fabric.setup_dataloaders``
shards the data, ``fabric.backward`` and ``fabric.save`` a checkpoint every few steps
(``--out``)."""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(rows: int, features: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(rows, 1, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--out", default="fabric_out")
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cuda", devices=args.devices, strategy=args.strategy)
    if "spawn" in args.strategy or "notebook" in args.strategy:
        fabric.launch(train, args)
    else:
        fabric.launch()
        train(fabric, args)


def train(fabric: L.Fabric, args: argparse.Namespace) -> None:
    fabric.seed_everything(1234)

    model = nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(
        DataLoader(regression_data(2048, 32), batch_size=args.batch_size, shuffle=True))

    step = 0
    model.train()
    while step < args.steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step == 1:
                fabric.print(f"rows per rank: {x.shape[0]}, world size: {fabric.world_size}")
            if step % 4 == 0:
                fabric.save(os.path.join(args.out, f"step-{step}.ckpt"),
                            {"model": model, "optimizer": optimizer, "step": step})
            if step >= args.steps:
                break
    fabric.print("done after", step, "steps")


if __name__ == "__main__":
    main()
