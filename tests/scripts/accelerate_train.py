"""A classifier trained the way accelerate's examples train (``examples/nlp_example.py``,
``cv_example.py``): ``Accelerator`` prepares the model, optimizer, loaders and scheduler,
``accelerator.backward``, ``gather_for_metrics`` in evaluation, ``save_state`` every
``--checkpointing_steps`` into ``--output_dir``; started by ``accelerate launch``."""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    train = TensorDataset(torch.randn(2048, 128, generator=g),
                          torch.randint(0, 10, (2048,), generator=g))
    valid = TensorDataset(torch.randn(256, 128, generator=g),
                          torch.randint(0, 10, (256,), generator=g))
    return (DataLoader(train, batch_size=batch_size, shuffle=True),
            DataLoader(valid, batch_size=batch_size))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpointing_steps", type=int, default=2)
    parser.add_argument("--output_dir", default=".")
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    set_seed(42)
    train, valid = loaders(args.batch_size)
    model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, epochs=args.epochs,
                                                    steps_per_epoch=len(train))
    model, optimizer, train, valid, scheduler = accelerator.prepare(
        model, optimizer, train, valid, scheduler)
    accelerator.print(f"{accelerator.num_processes} processes, {type(model).__name__}, "
                      f"{len(train)} steps an epoch")
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train:
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
        model.eval()
        correct = total = 0
        for x, y in valid:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, y = accelerator.gather_for_metrics((predictions, y))
            correct += (predictions == y).sum().item()
            total += y.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f}")
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)


if __name__ == "__main__":
    main()
