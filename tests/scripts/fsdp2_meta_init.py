"""FSDP2 the way pytorch/examples' distributed/FSDP2 example writes it: the model built on
the meta device, ``fully_shard`` on each block and then the root, ``to_empty`` on the GPU
and ``reset_parameters`` (DTensor's random init), Adam and gradient clipping over the
sharded parameters, and at the end a full checkpoint (``full_tensor()`` gathered, moved to
the CPU) saved by rank 0 under a new numbered folder. Run it with
``torchrun --nproc-per-node 4 fsdp2_meta_init.py``."""

import os
import time

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return x + self.proj(self.norm(x))

    def reset_parameters(self):
        self.norm.reset_parameters()
        self.proj.reset_parameters()


class Net(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)

    def reset_parameters(self):
        self.embed.reset_parameters()
        self.out.reset_parameters()


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{rank}")
    torch.accelerator.device_index(rank)
    torch.distributed.init_process_group(backend="nccl", device_id=device)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net(vocab=512, dim=256, layers=4)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    model.reset_parameters()
    for layer in model.layers:
        layer.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(4):
        x = torch.randint(0, 512, (8, 16), device=device)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()

    full = {name: p.full_tensor().cpu() for name, p in model.state_dict().items()}
    if torch.distributed.get_rank() == 0:
        folder = f"checkpoints/{int(time.time() * 1000)}"
        os.makedirs(folder, exist_ok=True)
        torch.save(full, f"{folder}/model_state_dict.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
