"""A zoo of real models from the libraries people train with, built from configs (no
weights downloaded), at sizes a CPU runs in a second: the fidelity tests and
``benchmarks/zoo.py`` run them. Each function returns a :class:`dpprof.Workload`; a
Hugging Face model is called the Hugging Face way, ``model(**batch)`` with the labels in
the batch and the loss computed inside (under DataParallel the replicas' losses are
gathered into a vector: the criterion takes its mean).

Needs the ``zoo`` extra (``pip install -e ".[zoo]"``): transformers, torchvision, timm.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

import dpprof

SEQ, VOCAB = 32, 512

_TORCHVISION_SHIM: list[Any] = []  # keeps the library fragment alive


def torchvision_importable() -> None:
    """PyPI's torchvision wheels are built against CUDA torch: over a CPU build their C
    extension does not load, and ``import torchvision`` (also done by ``transformers``)
    stops at the fake registration of ``torchvision::nms``. The zoo's models are pure
    Python: declare the two ops' schemas (never called) so the import goes through."""
    if "torchvision" in sys.modules:
        return
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "FRAGMENT")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION_SHIM.append(lib)
        import torchvision  # noqa: F401
    except ImportError:
        pass


torchvision_importable()


def hf_loss(out: Any, targets: Any) -> torch.Tensor:
    """The loss a Hugging Face model computed from the labels (a vector under DataParallel:
    one per replica)."""
    return out.loss.mean()


def _lm_batch(rows: int, device: torch.device) -> tuple[dict[str, torch.Tensor], None]:
    ids = torch.randint(0, VOCAB, (rows, SEQ), device=device)
    return {"input_ids": ids, "labels": ids.clone()}, None


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def gpt2() -> dpprof.Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return dpprof.Workload(name="hf-gpt2", model=lambda: GPT2LMHeadModel(config),
                           batch=_lm_batch, loss=hf_loss, optimizer=_adamw)


def llama() -> dpprof.Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    return dpprof.Workload(name="hf-llama", model=lambda: LlamaForCausalLM(config),
                           batch=_lm_batch, loss=hf_loss, optimizer=_adamw)


def bert() -> dpprof.Workload:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=SEQ, num_labels=3)

    def batch(rows: int, device: torch.device) -> tuple[dict[str, torch.Tensor], None]:
        return {"input_ids": torch.randint(0, VOCAB, (rows, SEQ), device=device),
                "labels": torch.randint(0, 3, (rows,), device=device)}, None

    return dpprof.Workload(name="hf-bert", model=lambda: BertForSequenceClassification(config),
                           batch=batch, loss=hf_loss, optimizer=_adamw)


def _images(side: int, classes: int) -> Any:
    def batch(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(rows, 3, side, side, device=device),
                torch.randint(0, classes, (rows,), device=device))
    return batch


def resnet18() -> dpprof.Workload:
    from torchvision.models import resnet18 as build

    return dpprof.Workload(name="tv-resnet18", model=lambda: build(weights=None, num_classes=10),
                           batch=_images(32, 10), loss=F.cross_entropy,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))


def vit() -> dpprof.Workload:
    from torchvision.models import VisionTransformer

    return dpprof.Workload(
        name="tv-vit", model=lambda: VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
            mlp_dim=128, num_classes=10),
        batch=_images(32, 10), loss=F.cross_entropy, optimizer=_adamw)


def timm_convnext() -> dpprof.Workload:
    import timm

    return dpprof.Workload(
        name="timm-convnext",
        model=lambda: timm.create_model("convnext_atto", pretrained=False, num_classes=10),
        batch=_images(32, 10), loss=F.cross_entropy, optimizer=_adamw)


def timm_vit() -> dpprof.Workload:
    import timm

    return dpprof.Workload(
        name="timm-vit",
        model=lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                        patch_size=8, depth=2, num_classes=10),
        batch=_images(32, 10), loss=F.cross_entropy, optimizer=_adamw)


ZOO = ["gpt2", "llama", "bert", "resnet18", "vit", "timm_convnext", "timm_vit"]

# the library each model is built with (the functions import it when called)
NEEDS = {"gpt2": "transformers", "llama": "transformers", "bert": "transformers",
         "resnet18": "torchvision", "vit": "torchvision", "timm_convnext": "timm",
         "timm_vit": "timm"}
