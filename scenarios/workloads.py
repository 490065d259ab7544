"""Workloads: the user's training step, given as data.

A :class:`Workload` says how to build the model, make a batch, compute the loss and build
the optimizer. dpprof runs it under every scenario. Built-ins: ``lm`` (the default),
``mlp``, ``convnet``, ``classifier``. Your own: ``--workload my_pkg.train:workload`` or
``--workload path/to/file.py:workload``, where ``workload()`` returns a :class:`Workload`::

    import torch
    from torch import nn
    import dpprof

    def workload() -> dpprof.Workload:
        return dpprof.Workload(
            name="my-mlp",
            model=lambda: nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)),
            batch=lambda rows, device: (
                torch.randn(rows, 1024, device=device),
                torch.randint(0, 10, (rows,), device=device),
            ),
            loss=nn.functional.cross_entropy,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        )
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from dpprof.errors import WorkloadError
from dpprof.scenarios.measured_loop import UserStep
from dpprof.scenarios.workload_names import BUILTIN_WORKLOADS


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4)


@dataclass
class Workload:
    """A training step as data: what dpprof runs under every scenario.

    ``model()`` builds the model (on the CPU, as usual; dpprof places it). ``batch(rows,
    device)`` returns ``(inputs, targets)`` with ``rows`` rows along dim 0; ``inputs`` is a
    tensor or a tuple of the model's positional arguments. ``loss(outputs, targets)``
    returns a scalar; it may be an ``nn.Module`` with parameters (they are trained too).
    ``optimizer(params)`` builds the optimizer over the model's and the loss's parameters.

    ``step(model, batch, criterion, optimizer)``, if given, is your loop body, run by every
    scenario in place of the tutorial's (zero_grad placement, gradient accumulation,
    ``clip_grad_norm_``, autocast, ``del`` habits): ``batch`` is ``(inputs, targets)`` on
    the device, ``model`` the scenario's wrapper (DataParallel, DDP or the bare model),
    ``criterion`` the workload's ``loss``. Return the loss: it lives until the next step
    returns, as ``loss = step(...)`` in a loop would. Under ``dp-loss-forward`` the call
    ``model(...)`` is deferred to ``criterion(outputs, targets)``, which runs
    ``DataParallel(ModelWithLoss(model, criterion))``, so use the outputs only through the
    criterion.
    """

    model: Callable[[], nn.Module]
    batch: Callable[[int, torch.device], tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = _adamw
    name: str = "custom"
    dtype: torch.dtype = torch.float32  # parameters and floating inputs are cast to it
    description: str = ""
    # Shapes that analysis uses to explain numbers (e.g. {"seq": 256, "vocab": 32000}).
    shapes: dict[str, int] = field(default_factory=dict)
    # Your loop body: step(model, batch, criterion, optimizer) -> loss; None: the tutorial's.
    step: UserStep | None = None

    def validate(self) -> None:
        """Raise :class:`WorkloadError` naming the first malformed field."""
        for name in ("model", "batch", "loss", "optimizer"):
            if not callable(getattr(self, name, None)):
                raise WorkloadError(
                    f"workload {self.name!r}: '{name}' must be callable, got "
                    f"{type(getattr(self, name, None)).__name__}; see the Workload example "
                    "in the README"
                )
        if self.step is not None and not callable(self.step):
            raise WorkloadError(
                f"workload {self.name!r}: 'step' must be a function step(model, batch, "
                f"criterion, optimizer), got {type(self.step).__name__}")
        if not isinstance(self.dtype, torch.dtype):
            raise WorkloadError(f"workload {self.name!r}: dtype must be a torch.dtype")


# ---- built-ins ---------------------------------------------------------------------------


@dataclass
class LMConfig:
    vocab: int = 32000  # a 32k vocabulary: gathered logits are batch x seq x vocab floats
    seq: int = 256  # tokens per row
    d_model: int = 512  # width of the residual stream
    layers: int = 4  # transformer blocks
    heads: int = 8  # attention heads (d_model / heads per head)
    ff_mult: int = 4  # MLP hidden = ff_mult * d_model
    dropout: float = 0.1  # on attention weights and residual branches
    tie_embeddings: bool = False  # the output projection shares the token embedding


class _Block(nn.Module):
    """A pre-norm transformer block; attention written out (softmax(q k^T) v, masked)."""

    needs_mask = True  # the written-out attention masks with a causal buffer

    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, c.ff_mult * c.d_model)
        self.out = nn.Linear(c.ff_mult * c.d_model, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        if self.needs_mask:
            mask = torch.ones(c.seq, c.seq, dtype=torch.bool).triu(1)
            self.register_buffer("causal", mask, persistent=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q.shape[2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        causal: torch.Tensor = self.causal  # type: ignore[assignment]
        att = att.masked_fill(causal[:s, :s], float("-inf")).softmax(dim=-1)
        return self.drop(att) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyLM(nn.Module):
    """A GPT-style language model: the classic DataParallel cuda:0 out-of-memory case."""

    def __init__(self, c: LMConfig, block: type[_Block] = _Block) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        if c.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lm(config: LMConfig | None = None) -> Workload:
    c = config or LMConfig()
    return Workload(
        name="lm",
        description=(
            f"transformer LM, {c.layers} layers, d={c.d_model}, vocab {c.vocab}, seq {c.seq}"
        ),
        model=lambda: TinyLM(c),
        batch=lambda rows, device: (
            torch.randint(0, c.vocab, (rows, c.seq), device=device),
            torch.randint(0, c.vocab, (rows, c.seq), device=device),
        ),
        loss=lm_loss,
        optimizer=_adamw,
        shapes={"seq": c.seq, "vocab": c.vocab, "d_model": c.d_model, "layers": c.layers},
    )


def mlp() -> Workload:
    """The two-Linear ToyModel of PyTorch's model-parallel tutorial, made bigger."""
    d_in, hidden, d_out = 2048, 8192, 1024
    return Workload(
        name="mlp",
        description=f"Linear({d_in}, {hidden}) -> ReLU -> Linear({hidden}, {d_out}), MSE, SGD",
        model=lambda: nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out)),
        batch=lambda rows, device: (
            torch.randn(rows, d_in, device=device),
            torch.randn(rows, d_out, device=device),
        ),
        loss=F.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.001),
        shapes={"d_in": d_in, "hidden": hidden, "d_out": d_out},
    )


class MnistNet(nn.Module):
    """pytorch/examples' MNIST convnet, with BatchNorm after each convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.bn2 = nn.BatchNorm2d(64)
        self.drop1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(9216, 128)
        self.drop2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.drop1(F.max_pool2d(x, 2)).flatten(1)
        return self.fc2(self.drop2(F.relu(self.fc1(x))))


def convnet() -> Workload:
    return Workload(
        name="convnet",
        description="MNIST-shaped convnet with BatchNorm and dropout, Adadelta",
        model=MnistNet,
        batch=lambda rows, device: (
            torch.randn(rows, 1, 28, 28, device=device),
            torch.randint(0, 10, (rows,), device=device),
        ),
        loss=F.cross_entropy,
        optimizer=lambda params: torch.optim.Adadelta(params, lr=1.0),
        shapes={"classes": 10},
    )


class FaceNet(nn.Module):
    """A face-recognition style classifier: conv backbone -> 512-d features -> classes."""

    def __init__(self, classes: int, features: int = 512) -> None:
        super().__init__()
        chans = [3, 64, 128, 256]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(chans):
            layers += [nn.Conv2d(a, b, 3, 2, 1, bias=False), nn.BatchNorm2d(b), nn.ReLU()]
        self.backbone = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.embed = nn.Sequential(nn.Linear(chans[-1], features), nn.BatchNorm1d(features))
        self.head = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.embed(self.backbone(x))
        return f, self.head(f)


class CentreLoss(nn.Module):
    """Cross-entropy plus a centre loss (Wen et al. 2016): one learned centre per class."""

    def __init__(self, classes: int, features: int = 512, weight: float = 0.01) -> None:
        super().__init__()
        self.centres = nn.Parameter(torch.randn(classes, features))
        self.weight = weight

    def forward(self, outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor):  # type: ignore[no-untyped-def]
        features, logits = outputs
        centre = (features - self.centres[targets]).pow(2).sum(dim=1).mean() / 2
        return F.cross_entropy(logits, targets) + self.weight * centre


def classifier() -> Workload:
    classes, features, side = 10_000, 512, 112
    return Workload(
        name="classifier",
        description=f"face-recognition style: {features}-d features, {classes} classes, "
        "cross-entropy + centre loss, SGD momentum",
        model=lambda: FaceNet(classes, features),
        batch=lambda rows, device: (
            torch.randn(rows, 3, side, side, device=device),
            torch.randint(0, classes, (rows,), device=device),
        ),
        loss=CentreLoss(classes, features),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
        shapes={"classes": classes, "features": features},
    )


@dataclass
class AttnConfig(LMConfig):
    vocab: int = 8192  # tokens
    seq: int = 1024  # tokens per row: the attention matrix is seq x seq per head
    dropout: float = 0.1  # on residual branches (not inside attention)
    tie_embeddings: bool = True  # GPT-2 ties the output projection to the token embedding


class _SdpaBlock(_Block):
    """A pre-norm transformer block whose attention is ``F.scaled_dot_product_attention``."""

    needs_mask = False  # is_causal=True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SdpaLM(TinyLM):
    """GPT-style LM on ``scaled_dot_product_attention`` (flash / memory-efficient on GPUs)."""

    def __init__(self, c: AttnConfig) -> None:
        super().__init__(c, _SdpaBlock)


def attention(config: AttnConfig | None = None, name: str = "attention") -> Workload:
    """A transformer on ``F.scaled_dot_product_attention``: its memory depends on the
    kernel the target GPU picks (flash / memory-efficient save O(seq) per head, math saves
    the seq x seq attention matrix)."""
    c = config or AttnConfig()
    return Workload(
        name=name,
        description=(
            f"SDPA transformer LM, {c.layers} layers, d={c.d_model}, {c.heads} heads, "
            f"vocab {c.vocab}, seq {c.seq}"
        ),
        model=lambda: SdpaLM(c),
        batch=lambda rows, device: (
            torch.randint(0, c.vocab, (rows, c.seq), device=device),
            torch.randint(0, c.vocab, (rows, c.seq), device=device),
        ),
        loss=lm_loss,
        optimizer=_adamw,
        shapes={"seq": c.seq, "vocab": c.vocab, "d_model": c.d_model, "layers": c.layers,
                "heads": c.heads},
    )


def gpt2_small() -> Workload:
    """GPT-2 small's shape (124M parameters: 12 layers, d=768, 12 heads, vocab 50257,
    seq 1024, tied embeddings) on SDPA: the benchmark's workload."""
    return attention(AttnConfig(vocab=50257, seq=1024, d_model=768, layers=12, heads=12),
                     name="gpt2-small")


BUILTINS: dict[str, Callable[[], Workload]] = {
    "lm": lm,
    "mlp": mlp,
    "convnet": convnet,
    "classifier": classifier,
    "attention": attention,
}
assert tuple(BUILTINS) == BUILTIN_WORKLOADS  # the names the CLI gives without torch


# ---- loading -----------------------------------------------------------------------------


def load_workload(spec: str) -> Workload:
    """A built-in name, ``module.path:function`` or ``path/to/file.py:function``."""
    if spec in BUILTINS:
        return _checked(BUILTINS[spec](), spec)
    if ":" not in spec:
        raise WorkloadError(
            f"unknown workload {spec!r}; built-ins are {', '.join(BUILTINS)}; for your own "
            "write module.path:function or path/to/file.py:function"
        )
    where, _, fn_name = spec.rpartition(":")
    if not fn_name.isidentifier():
        raise WorkloadError(f"workload {spec!r}: {fn_name!r} is not a function name")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(Path(where), spec)
    else:
        module = _import(where, spec)
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise WorkloadError(
            f"workload {spec!r}: {where} has no function {fn_name!r}"
            + _suggest(module)
        )
    if not callable(fn):
        raise WorkloadError(f"workload {spec!r}: {fn_name} is not callable")
    try:
        wl = fn()
    except Exception as e:
        raise WorkloadError(
            f"workload {spec!r}: {fn_name}() raised {type(e).__name__}: {e}"
        ) from e
    return _checked(wl, spec)


def _checked(wl: Any, spec: str) -> Workload:
    if not isinstance(wl, Workload):
        raise WorkloadError(
            f"workload {spec!r}: the function returned {type(wl).__name__}, not a "
            "dpprof.Workload; return dpprof.Workload(model=..., batch=..., loss=...)"
        )
    if wl.name == "custom":
        wl.name = spec
    wl.validate()
    return wl


def _import(name: str, spec: str) -> Any:
    sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            raise WorkloadError(
                f"workload {spec!r}: no module named {e.name!r} (is it on PYTHONPATH, or "
                "did you mean a file path like path/to/file.py:function?)"
            ) from e
        raise WorkloadError(f"workload {spec!r}: importing {name} failed: {e}") from e
    except Exception as e:
        raise WorkloadError(
            f"workload {spec!r}: importing {name} raised {type(e).__name__}: {e}"
        ) from e
    finally:
        sys.path.remove(str(Path.cwd()))


def _load_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise WorkloadError(f"workload {spec!r}: no such file {str(path)!r}")
    # The file's own folder is importable, as `python path/to/file.py` makes it: a workload
    # that imports a module beside it works wherever dpprof is started (kept on the path:
    # model() and batch() may import lazily).
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_name = f"dpprof_user_workload_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise WorkloadError(f"workload {spec!r}: cannot load {path} as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise WorkloadError(
            f"workload {spec!r}: running {path} raised {type(e).__name__}: {e}"
        ) from e
    return module


def _suggest(module: Any) -> str:
    names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
    found = [n for n in names if "workload" in n.lower()]
    return f" (it has: {', '.join(found)})" if found else ""


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor of a nested batch or output (torch's pytree: tuples,
    lists, dicts, namedtuples and every type registered with it); other leaves are kept."""
    return tree_map_only(torch.Tensor, fn, x)


def tensors_in(x: Any) -> list[torch.Tensor]:
    """Every tensor of a nested batch or output, in pytree order."""
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def make_optimizer(wl: Workload, model: nn.Module, loss_fn: Any) -> torch.optim.Optimizer:
    """The workload's optimizer over the model's parameters (and the loss module's)."""
    params = list(model.parameters())
    if isinstance(loss_fn, nn.Module):
        params += list(loss_fn.parameters())
    opt = wl.optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer() returned {type(opt).__name__}, not a torch Optimizer")
    return opt
