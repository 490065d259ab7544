"""The DDP alternative's rank of a DataParallel wrapper, and when it is built.

The DDP fix writes ``DDP(<module>.cuda(rank), device_ids=[rank])`` where the script makes its
DataParallel, so the rank is built there too: the module moved to the rank's GPU, then DDP's
broadcast of the module's state and its gradient buckets, before the batches and whatever
else the script allocates after the wrap, as in the fixed script. Built at the wrapper's
first forward instead, after the first batch, the caching allocator's segments can come out
otherwise (VGG-11, batch 32 over 2 emulated A100s: 4.12 GB reserved a rank against the fixed
script's 4.66 GB; ResNet-50, ViT-B/16, GPT-2 and AlexNet alike either way). A wrapper the
script does not bind to a name where it makes it (``model.features =
nn.DataParallel(model.features)``, a module's own ``self.encoder = nn.DataParallel(...)``,
one made inside a forward) may be a part of a model, which its first forward shows: its rank
is built then (:mod:`dpprof.script.part_of_model`)."""

from __future__ import annotations

import ast
import sys
from typing import TYPE_CHECKING

from torch import nn

from dpprof.emulator.ddp import EmulatedDDP
from dpprof.emulator.ledgers import VariantLedger
from dpprof.scenarios.step import DdpOptions
from dpprof.script.parallel_state import current
from dpprof.script.part_of_model import WholeModel, modules_in_forward, trains_besides
from dpprof.script.rewrite import site_of
from dpprof.script.source import NoRewrite, running_source

if TYPE_CHECKING:
    from dpprof.emulator.virtual_cuda import VirtualCuda


def build_rank(vc: VirtualCuda, src: int, model: nn.Module, world: int,
               options: DdpOptions) -> EmulatedDDP:
    """One rank of DDP around ``model`` on the virtual GPU ``src``, with DDP's ``options``;
    DDP(gradient_as_bucket_view=True) followed in a ledger of the rank's GPU, from what the
    GPU holds now (the model)."""
    rt = vc.rt
    ledger = VariantLedger()
    counters = rt.storages.counters[src]
    ledger.live_requested = ledger.peak_requested = counters.live_requested
    ledger.live_allocated = ledger.peak_allocated = counters.live_allocated
    rt.ledgers[src] = ledger
    with rt.device(src):
        impl = EmulatedDDP(model, rt, world_size=world, bucket_cap_mb=options.bucket_cap_mb,
                           gradient_as_bucket_view=options.gradient_as_bucket_view,
                           find_unused_parameters=options.find_unused_parameters,
                           broadcast_buffers=options.broadcast_buffers,
                           bucket_view_ledger=ledger, nccl_stash=True)  # GPUs' DDP: NCCL
    current().log.ddp_devices.append(src)
    return impl


def rank_of(vc: VirtualCuda, src: int, model: nn.Module, world: int, options: DdpOptions,
            whole: WholeModel | None = None) -> EmulatedDDP:
    """The rank's DDP around ``model``: built (:func:`build_rank`), or, where ``model`` is the
    ``whole`` model a DataParallel is a part of, the one another part of it built already."""
    shared = current().whole_ddp.get(id(model)) if whole is not None else None
    if shared is not None and shared[0] is model:
        return shared[1]
    impl = build_rank(vc, src, model, world, options)
    if whole is not None:
        current().whole_ddp[id(model)] = (model, impl)
        current().log.part_of_model = whole.words
    return impl


def built_at_the_wrap(site: str, wrapped: nn.Module) -> WholeModel | bool:
    """Whether the rank is built where the script made its DataParallel (around ``wrapped``)
    at ``site``, outside any module's forward: True where the statement there binds it to a
    plain name (``model = nn.DataParallel(model).cuda()``: the wrapper is the model the
    script calls); the model it is set into, where it sets it as an attribute of a model
    that trains parameters of its own besides (``model.features =
    nn.DataParallel(model.features)``: the rank's DDP wraps that model, whole); else False,
    the rank built at the wrapper's first forward."""
    if next(modules_in_forward(), None) is not None:
        return False
    try:
        path, line = site_of(site)
    except NoRewrite:
        return False
    src = running_source(path)
    if src is None:
        return False
    held = [n for n in ast.walk(src.tree) if isinstance(n, ast.stmt)
            and n.lineno <= line <= (n.end_lineno or n.lineno)]
    if not held:
        return False
    stmt = max(held, key=lambda n: (n.lineno, sum(1 for _ in src.ancestors(n))))  # innermost
    targets = (stmt.targets if isinstance(stmt, ast.Assign) else
               [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
    if len(targets) != 1:
        return False
    if isinstance(targets[0], ast.Name):
        return True
    if not isinstance(targets[0], ast.Attribute):
        return False
    owner = _value_at(path, line, targets[0].value)
    if not isinstance(owner, nn.Module) or not trains_besides(owner, wrapped):
        return False
    return WholeModel(owner, targets[0].attr)


def _value_at(path: str, line: int, node: ast.expr) -> object:
    """What the dotted name ``node`` (``model``, ``self.net``) holds in the script's frame
    running ``path:line``, outside a constructor (an object being built is no whole model
    yet); None where there is no such frame or name."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.insert(0, node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_filename == path
                                     and frame.f_lineno == line):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or frame.f_code.co_name == "__init__":
        return None
    missing = object()
    value = frame.f_locals.get(node.id, frame.f_globals.get(node.id, missing))
    for name in names:
        value = getattr(value, name, missing)
    return None if value is missing else value
