"""The model as a rung changes it: its repeated blocks (the ones a user checkpoints or
shards), checkpointed with non-reentrant ``torch.utils.checkpoint``, or sharded by FSDP2's
``fully_shard``; autocast and micro-batches are the step's, not the model's."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dpprof.emulator.fsdp import shard_model
from dpprof.measure.ladder_rungs import Rung
from dpprof.scenarios.workloads import Workload

# torch.nn's own layers (and subclasses: timm's BatchNormAct2d, LayerNorm2d) are never the
# block a user checkpoints: one layer saves its input either way, so checkpointing it alone
# saves nothing. A CNN repeats its Conv2d more often than its residual blocks.
LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.PReLU)
# plain containers group blocks (a ResNet's stages, a ViT's encoder.layers and its head)
# rather than being one; their subclasses (torchvision's MLPBlock) are blocks of their own
CONTAINERS: tuple[type[nn.Module], ...] = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks a user would checkpoint, with their qualified names: the children of
    the model's largest ``nn.ModuleList`` (most children; two at least), else the
    outermost instances of the module type that holds parameters and repeats most (two at
    least), leaving out torch.nn's own layers (:data:`LAYERS`) and plain containers
    (:data:`CONTAINERS`); empty when nothing repeats."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) >= 2]
    if lists:
        name, best = max(lists, key=lambda nm: len(nm[1]))
        return [(f"{name}.{k}" if name else str(k), child)
                for k, child in best.named_children()]
    kinds = Counter(type(m) for m in model.modules()
                    if m is not model and any(True for _ in m.parameters()))
    repeated = [k for k, n in kinds.most_common() if n >= 2
                and not issubclass(k, LAYERS) and k not in CONTAINERS]
    if not repeated:
        return []
    kind = repeated[0]
    out: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if type(m) is kind and not any(name.startswith(f"{o}.") for o, _ in out):
            out.append((name, m))
    return out


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap each repeated block's forward in non-reentrant ``torch.utils.checkpoint`` (as
    :data:`CODE_CHECKPOINT` shows the user); the number of blocks wrapped."""
    from torch.utils.checkpoint import checkpoint

    blocks = repeated_blocks(model)
    for _, block in blocks:
        forward = block.forward

        def run(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = run  # type: ignore[method-assign]
    return len(blocks)


def _checkpointed_model(build: Callable[[], nn.Module]) -> nn.Module:
    model = build()
    checkpoint_blocks(model)
    return model


def checkpointed(wl: Workload) -> Workload:
    """``wl`` with its model's repeated blocks checkpointed (the same weights: the blocks
    are wrapped after the model is built)."""
    return dataclasses.replace(wl, model=functools.partial(_checkpointed_model, wl.model))


def _sharded_model(build: Callable[[], nn.Module], reshard_after_forward: bool,
                   param_dtype: str | None, checkpoint: bool, offload: bool = False
                   ) -> nn.Module:
    model = build()
    if checkpoint:  # the blocks' forwards wrapped first, then sharded (as torchtitan does)
        checkpoint_blocks(model)
    return shard_model(model, [b for _, b in repeated_blocks(model)], reshard_after_forward,
                       getattr(torch, param_dtype) if param_dtype is not None else None,
                       offload)


def fully_sharded(wl: Workload, reshard_after_forward: bool = True,
                  param_dtype: str | None = None, checkpoint: bool = False,
                  offload: bool = False) -> Workload:
    """``wl`` with its model under FSDP2: ``fully_shard`` on each repeated block, then the
    root, over the default process group (:func:`dpprof.emulator.fsdp.shard_model`;
    ``reshard_after_forward``: True ZeRO-3, False ZeRO-2; ``param_dtype``: FSDP2's
    ``MixedPrecisionPolicy`` in that dtype, reduced in float32), the blocks checkpointed
    first where ``checkpoint``."""
    return dataclasses.replace(wl, model=functools.partial(
        _sharded_model, wl.model, reshard_after_forward, param_dtype, checkpoint, offload))


def rung_workload(wl: Workload, rung: Rung) -> Workload:
    """``wl`` as ``rung`` changes its model: the repeated blocks checkpointed, sharded by
    FSDP2 (with its mixed precision), or neither (autocast and micro-batches are the
    step's)."""
    if rung.reshard_after_forward is not None:
        return fully_sharded(wl, rung.reshard_after_forward, rung.param_dtype,
                             rung.checkpoint, rung.offload)
    return checkpointed(wl) if rung.checkpoint else wl
