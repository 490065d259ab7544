"""Three more shapes of model for the fidelity checks (loaded by path in the gloo ranks).

* ``tied``: an embedding whose weight is also the output projection (one parameter used
  twice: one gradient, one bucket slot);
* ``structured``: forward takes a dict and a tensor and returns a dict holding a tuple;
* ``buffers``: float and integer buffers, persistent and not, updated in forward (DDP
  broadcasts them before every forward).

No BatchNorm anywhere, so DataParallel on equal shards equals one device on the batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dpprof

V, D = 500, 64


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def tied() -> dpprof.Workload:
    return dpprof.Workload(
        name="tied",
        model=Tied,
        batch=lambda rows, device: (
            torch.randint(0, V, (rows, 16), device=device),
            torch.randint(0, V, (rows, 16), device=device),
        ),
        loss=lambda out, t: F.cross_entropy(out.reshape(-1, V), t.reshape(-1)),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, D)
        self.b = nn.Linear(16, D)
        self.out = nn.Linear(D, 8)
        self.aux = nn.Linear(D, 4)

    def forward(self, parts: dict[str, torch.Tensor], scale: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.a(parts["a"]) + self.b(parts["b"])) * scale
        return {"main": self.out(h), "extra": (self.aux(h), h.mean(dim=1))}


def structured_loss(out: dict[str, Any], targets: tuple[torch.Tensor, torch.Tensor]):  # type: ignore[no-untyped-def]
    main_t, aux_t = targets
    aux, m = out["extra"]
    return F.cross_entropy(out["main"], main_t) + F.l1_loss(aux, aux_t) + 0.1 * m.pow(2).mean()


def structured() -> dpprof.Workload:
    return dpprof.Workload(
        name="structured",
        model=Structured,
        batch=lambda rows, device: (
            ({"a": torch.randn(rows, 32, device=device), "b": torch.randn(rows, 16, device=device)},
             torch.rand(rows, 1, device=device) + 0.5),
            (torch.randint(0, 8, (rows,), device=device), torch.randn(rows, 4, device=device)),
        ),
        loss=structured_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    )


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(48, 96)
        self.fc2 = nn.Linear(96, 10)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 96))
        self.register_buffer("ema", torch.zeros(96))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("table", torch.randn(64, 96), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x)) * self.scale
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
                self.steps += 1
        return self.fc2(h + self.table[0])


def buffers() -> dpprof.Workload:
    return dpprof.Workload(
        name="buffers",
        model=WithBuffers,
        batch=lambda rows, device: (
            torch.randn(rows, 48, device=device),
            torch.randint(0, 10, (rows,), device=device),
        ),
        loss=F.cross_entropy,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
    )


def lm_small() -> dpprof.Workload:
    """The ``lm`` built-in's model and loss (its blocks, embeddings and head) at a size the
    CPU runs in a second in bfloat16 too: the CPU's bf16 matmuls on a machine without
    AVX-512 BF16 are emulated, and lm at its own size took minutes per run there."""
    from dpprof.scenarios.workloads import LMConfig, lm

    return lm(LMConfig(vocab=2048, seq=64, d_model=128, layers=2, heads=4))


def attention_small() -> dpprof.Workload:
    """The ``attention`` built-in's model and loss at a size the CPU runs in a second."""
    from dpprof.scenarios.workloads import AttnConfig, attention

    return attention(AttnConfig(vocab=512, seq=128, d_model=64, layers=2, heads=4),
                     name="attention-small")


def accumulating_step(model: Any, batch: Any, criterion: Any, optimizer: Any) -> torch.Tensor:
    """A loop body of its own: zero_grad after the step, two micro-batches per optimizer
    step, gradients clipped, the outputs deleted before backward."""
    inputs, targets = batch
    total = torch.zeros(())
    for x, y in zip(inputs.chunk(2), targets.chunk(2), strict=True):
        out = model(x)
        loss = criterion(out, y) / 2
        del out
        loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return total


def accumulate() -> dpprof.Workload:
    """The ``tied`` model trained by :func:`accumulating_step`."""
    wl = tied()
    wl.name = "accumulate"
    wl.step = accumulating_step
    return wl


# ---- embedding backward on the sort path -------------------------------------------------

SORT_SEQ, SORT_VOCAB, SORT_WIDTH = 2048, 8192, 16  # 2 rows: 4096 indices, above 3072


class WideEmbedding(nn.Module):
    """A vocabulary wider than the batch's indices and a 1-wide head: the step's peak is
    where the embedding's gradient is made (the head's saved input is gone by then)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(SORT_VOCAB, SORT_WIDTH)
        self.head = nn.Linear(SORT_WIDTH, 1, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def embedding_sorted() -> dpprof.Workload:
    """More than 3072 indices per device: CUDA's embedding backward takes the sort path."""
    return dpprof.Workload(
        name="embedding-sorted",
        model=WideEmbedding,
        batch=lambda rows, device: (
            torch.randint(0, SORT_VOCAB, (rows, SORT_SEQ), device=device),
            torch.zeros(rows, SORT_SEQ, 1, device=device)),
        loss=lambda out, target: (out - target).abs().mean(),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )


def sort_path_bytes_at_peak(rows: int, rounded: bool = False) -> int:
    """What ``embedding_dense_backward_cuda`` holds besides the gradient when it allocates
    its last buffer, ``grad_weight_per_segment`` (Embedding.cu, EmbeddingBackwardKernel.cu;
    int64 indices, float32 gradient): ``sorted_indices`` and ``orig_indices`` (n each),
    ``segment_offsets`` (n), the 0-dim int64 ``num_of_segments`` and
    ``num_of_partial_segments``, ``partials_per_segment`` and its offsets (``min(n,
    vocab)`` each), ``partial_segment_offset`` (``n // 10 + min(n, vocab)``) and
    ``grad_weight_per_segment`` (that many rows of the width, float32). With ``rounded``,
    each as the caching allocator rounds it (512 B)."""
    n = rows * SORT_SEQ
    segments = min(n, SORT_VOCAB)
    partials = n // 10 + segments
    sizes = [8 * n, 8 * n, 8 * n, 8, 8, 8 * segments, 8 * segments, 8 * partials,
             4 * SORT_WIDTH * partials]
    if rounded:
        sizes = [-(-s // 512) * 512 for s in sizes]
    return sum(sizes)
