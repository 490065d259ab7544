"""bf16 autocast the way Hugging Face's Llama meets it: a rotary embedding that forces
float32 through ``maybe_autocast`` (it asks ``torch.is_autocast_enabled`` first), and
blocks under non-reentrant checkpointing, whose recompute in backward (outside the
script's autocast region) enters the autocast state checkpoint recorded in forward."""

import contextlib

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

BATCH, SEQ, DIM = 8, 1024, 256


def maybe_autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
    # transformers.utils.generic.maybe_autocast: a region only where autocast is already
    # on or asked for
    if torch.is_autocast_enabled(device_type) or enabled:
        return torch.autocast(device_type, dtype=dtype, enabled=enabled,
                              cache_enabled=cache_enabled)
    return contextlib.nullcontext()


class RotaryEmbedding(nn.Module):
    """In the style of Hugging Face's LlamaRotaryEmbedding.forward around maybe_autocast."""

    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        positions = position_ids[:, None, :].float()
        with maybe_autocast(device_type=x.device.type, enabled=False):  # force float32
            freqs = (inv_freq.float() @ positions.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x, cos):
        return x + self.down(torch.relu(self.up(x * cos)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = RotaryEmbedding(DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        positions = torch.arange(SEQ, device=x.device)[None].expand(x.shape[0], -1)
        cos, _sin = self.rotary(x, positions)
        for block in self.blocks:
            x = checkpoint(block, x, cos, use_reentrant=False)
        return x


model = Model().cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(4):
    x = torch.randn(BATCH, SEQ, DIM, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
