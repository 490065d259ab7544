"""A Llama-shaped decoder, built from a config (no weights): the benchmark's large model.

``llama70b()`` is Llama-3-70B's shape: 80 layers, d 8192, grouped-query attention with 64
query and 8 key/value heads (head 128), SwiGLU MLP 28672, vocabulary 128256, seq 4096,
RMSNorm, rotary embeddings, untied output projection, bfloat16. Usable as a workload:

    dpprof compare --workload benchmarks/llama_shape.py:llama70b --batch 8 --gpus 8
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpprof.scenarios.workloads import Workload, lm_loss


@dataclass(frozen=True)
class LlamaShape:
    layers: int = 80
    d_model: int = 8192
    heads: int = 64
    kv_heads: int = 8
    ffn: int = 28672
    vocab: int = 128256
    seq: int = 4096
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def parameter_count(self) -> int:
        """Parameters from the shapes alone (embedding, output projection, per layer: q, k,
        v, o, gate, up, down and two norms; the final norm)."""
        d, kv = self.d_model, self.kv_heads * self.head_dim
        per_layer = d * d + 2 * d * kv + d * d + 3 * d * self.ffn + 2 * d
        return 2 * self.vocab * d + self.layers * per_layer + d


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LlamaShape) -> None:
        super().__init__()
        self.c = c
        hd = c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.heads * hd, bias=False)
        self.k_proj = nn.Linear(c.d_model, c.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.d_model, c.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.heads * hd, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, s, _ = x.shape
        hd = c.head_dim
        q = self.q_proj(x).view(b, s, c.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.kv_heads, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = c.heads // c.kv_heads  # repeat_kv: expand then reshape (a copy)
        k = k[:, :, None].expand(b, c.kv_heads, rep, s, hd).reshape(b, c.heads, s, hd)
        v = v[:, :, None].expand(b, c.kv_heads, rep, s, hd).reshape(b, c.heads, s, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, c.d_model))


class Mlp(nn.Module):
    def __init__(self, c: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.ffn, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: LlamaShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.d_model)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.d_model)
        self.mlp = Mlp(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, c: LlamaShape) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.d_model)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        c = self.c
        s = idx.shape[1]
        pos = torch.arange(s, device=idx.device, dtype=torch.float32)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=idx.device,
                                                    dtype=torch.float32) / c.head_dim))
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed_tokens(idx)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def llama(c: LlamaShape, name: str) -> Workload:
    return Workload(
        name=name,
        description=(f"Llama-shaped decoder, {c.layers} layers, d={c.d_model}, GQA "
                     f"{c.heads}/{c.kv_heads} heads, MLP {c.ffn}, vocab {c.vocab}, seq {c.seq}"),
        model=lambda: Llama(c),
        batch=lambda rows, device: (
            torch.randint(0, c.vocab, (rows, c.seq), device=device),
            torch.randint(0, c.vocab, (rows, c.seq), device=device),
        ),
        loss=lm_loss,
        dtype=torch.bfloat16,
        shapes={"seq": c.seq, "vocab": c.vocab, "d_model": c.d_model, "layers": c.layers,
                "heads": c.heads},
    )


LLAMA_70B = LlamaShape()


def llama70b() -> Workload:
    return llama(LLAMA_70B, "llama-70b-shape")
