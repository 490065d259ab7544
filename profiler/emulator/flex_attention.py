"""FlexAttention (``torch.nn.attention.flex_attention``) on virtual devices, with the memory of
the kernel a GPU would run.

Two kernels run it on a GPU, and their memory differs by the whole score matrix:

* compiled by Inductor (``torch.compile(flex_attention)``, or inside a compiled function or
  module: how torchtitan, gpt-fast and Hugging Face's flex path call it), a fused Triton
  kernel. Its forward allocates the output (the query's dtype, ``[B, Hq, M, Dv]``) and two
  float32 rows per query, the log-sum-exp and the row maxima (``torch/_inductor/kernel/flex/
  flex_attention.py``, ``flex_attention``); its backward allocates ``delta`` (a float32 row
  per query, the sum of ``out * grad_out``) and the three gradients (``grad_query``; the key's
  and value's as ``[Bq, Hkv, N, D]``, summed over the batch where the key's batch was
  broadcast). No ``[B, H, M, N]`` scores ever exist.
* uncompiled, the dense eager path (``sdpa_dense``, ``sdpa_dense_backward``: torch warns that
  it "materializes the full scores matrix"), which the emulation runs as it is, its scores
  counted where it makes them.

Both go through torch's own autograd function (``FlexAttentionAutogradOp``), so what is saved
for the backward is the same. Where torch's own eager path cannot run on the emulated tensors,
two things are mended: the score_mod's joint graph is traced with the emulation's dispatch mode
off and the tensors showing their real (meta or CPU) device (tracing makes fake tensors of
them), and the higher-order ops get a rule for the emulation's mode (the kernel above, or the
dense path under the mode). Under ``--compute`` the fused kernel's outputs hold the dense
path's values, computed outside the accounting.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dpprof.emulator.emulated_cuda import EmulatedCuda
from dpprof.emulator.patcher import Patch

__all__ = ["compiled_region", "enter_compiled_region", "install", "leave_compiled_region"]

_REGION = threading.local()


def enter_compiled_region() -> None:
    """What runs from now until :func:`leave_compiled_region` is what Inductor would have
    compiled (a call of a function or module given to ``torch.compile``): a flex_attention
    there is the fused kernel. Regions nest; one per thread."""
    _REGION.depth = getattr(_REGION, "depth", 0) + 1


def leave_compiled_region() -> None:
    _REGION.depth = max(getattr(_REGION, "depth", 0) - 1, 0)


@contextlib.contextmanager
def compiled_region() -> Iterator[None]:
    """:func:`enter_compiled_region` for the block inside."""
    enter_compiled_region()
    try:
        yield
    finally:
        leave_compiled_region()


def in_compiled_region() -> bool:
    return getattr(_REGION, "depth", 0) > 0


def _hop_module() -> Any:
    # the package binds the HOP itself under the module's name: import the module by path
    return importlib.import_module("torch._higher_order_ops.flex_attention")


def install(vc: EmulatedCuda, p: Patch) -> None:
    """Give torch's flex_attention ops a rule for ``vc``'s dispatch mode and trace its
    score_mod graphs outside the emulation; the rules are withdrawn when ``vc`` ends."""
    hop = _hop_module()
    mode_type = type(vc.rt)
    traced = hop.create_fw_bw_graph

    def create_fw_bw_graph(score_mod: Callable[..., Any], index_values: Any,
                           other_buffers: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        with _real_devices(vc), _disable_current_modes():
            return traced(score_mod, index_values, other_buffers)

    p(hop, "create_fw_bw_graph", create_fw_bw_graph)
    # flex_attention's own eager call compiles its wrapper with backend="eager" (dynamo
    # cannot trace the emulation) and warns that it is not compiled (the region decides
    # here): its debugging switch calls the op as it is, with neither
    import torch.nn.attention.flex_attention as public

    p(public, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    p(public, "flex_attention_hop", lifting_captured(public.flex_attention_hop))
    # the outputs of the fused forwards: their backward is the fused one too, as Inductor
    # compiles a compiled function's backward with it (it runs after the region has ended)
    fused: set[int] = set()  # their storages' serials (the ledger's)
    for op, rule in ((hop.flex_attention, _forward_rule(vc, hop, fused)),
                     (hop.flex_attention_backward, _backward_rule(vc, hop, fused))):
        # a copy of the op's table with the mode's rule: restoring puts torch's back
        p(op, "python_key_table", {**op.python_key_table, mode_type: rule})


def lifting_captured(hop: Callable[..., Any]) -> Callable[..., Any]:
    """The op, called with the tensors a score_mod reads that require grad (a learned bias
    in its closure or its module's globals) passed as its buffers, as dynamo lifts them when
    it traces flex_attention: called as they are, the op's autograd never sees them and they
    get no gradient. Inside, the score_mod reads each where it did, set for the call to the
    buffer the op passes."""
    def call(query: Any, key: Any, value: Any, score_mod: Callable[..., Any],
             block_mask: Any, scale: Any, kernel_options: Any,
             score_mod_other_buffers: tuple[Any, ...] = (),
             mask_mod_other_buffers: tuple[Any, ...] = ()) -> Any:
        learned = _learned_reads(score_mod) if torch.is_grad_enabled() else []
        if not learned:
            return hop(query, key, value, score_mod, block_mask, scale, kernel_options,
                       score_mod_other_buffers, mask_mod_other_buffers)
        given = len(score_mod_other_buffers)

        def lifted(score: Any, b: Any, h: Any, m: Any, n: Any, *buffers: Any) -> Any:
            held = [read.get() for read in learned]
            for read, buffer in zip(learned, buffers[given:], strict=True):
                read.set(buffer)
            try:
                return score_mod(score, b, h, m, n, *buffers[:given])
            finally:
                for read, was in zip(learned, held, strict=True):
                    read.set(was)

        return hop(query, key, value, lifted, block_mask, scale, kernel_options,
                   (*score_mod_other_buffers, *(read.get() for read in learned)),
                   mask_mod_other_buffers)

    return call


class _Read:
    """Where a score_mod reads a tensor: a closure cell, or a name of its globals."""

    def __init__(self, cell: Any = None, names: dict[str, Any] | None = None,
                 name: str = "") -> None:
        self.cell, self.names, self.name = cell, names, name

    def get(self) -> Any:
        return self.cell.cell_contents if self.names is None else self.names[self.name]

    def set(self, value: Any) -> None:
        if self.names is None:
            self.cell.cell_contents = value
        else:
            self.names[self.name] = value


def _learned_reads(score_mod: Callable[..., Any]) -> list[_Read]:
    """The tensors requiring grad that ``score_mod`` reads from its closure or globals."""
    reads = []
    for cell in getattr(score_mod, "__closure__", None) or ():
        try:
            reads.append(_Read(cell=cell) if _learned(cell.cell_contents) else None)
        except ValueError:  # an empty cell
            continue
    names = getattr(score_mod, "__globals__", None)
    code = getattr(score_mod, "__code__", None)
    if isinstance(names, dict) and code is not None:
        reads += [_Read(names=names, name=n) for n in code.co_names
                  if _learned(names.get(n))]
    return [r for r in reads if r is not None]


def _learned(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


@contextlib.contextmanager
def _real_devices(vc: EmulatedCuda) -> Iterator[None]:
    """Tensors show their real device (meta or CPU), as inside the dispatch mode."""
    vc.rt.state.in_dispatch += 1
    try:
        yield
    finally:
        vc.rt.state.in_dispatch -= 1


def _computes(vc: EmulatedCuda) -> bool:
    return bool(vc.rt.base.type != "meta")


def _forward_rule(vc: EmulatedCuda, hop: Any, fused: set[int]
                  ) -> Callable[..., Any]:
    def rule(mode: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             score_mod: Callable[..., Any], block_mask: tuple[Any, ...], scale: float,
             kernel_options: dict[str, Any], score_mod_other_buffers: tuple[Any, ...] = (),
             mask_mod_other_buffers: tuple[Any, ...] = ()) -> Any:
        args = (query, key, value, score_mod, block_mask, scale, kernel_options,
                score_mod_other_buffers, mask_mod_other_buffers)
        if not in_compiled_region():
            with mode:
                return hop.sdpa_dense(*args)
        b, hq, m = query.shape[0], query.shape[1], query.shape[2]
        with mode:
            out = query.new_empty((b, hq, m, value.shape[-1]))
            lse = query.new_empty((b, hq, m), dtype=torch.float32)
            max_scores = query.new_empty((b, hq, m), dtype=torch.float32)
        if _computes(vc):
            _fill(vc, (out, lse, max_scores), lambda: hop.sdpa_dense(*args))
        serial = vc.rt.storages.serial_of(out)
        if serial is not None:
            fused.add(serial)
        return out, lse, max_scores

    return rule


def _backward_rule(vc: EmulatedCuda, hop: Any, fused: set[int]
                   ) -> Callable[..., Any]:
    def rule(mode: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             out: torch.Tensor, logsumexp: torch.Tensor, grad_out: torch.Tensor | None,
             grad_logsumexp: torch.Tensor | None, fw_graph: Any, joint_graph: Any,
             block_mask: tuple[Any, ...], scale: float, kernel_options: dict[str, Any],
             score_mod_other_buffers: tuple[Any, ...],
             mask_mod_other_buffers: tuple[Any, ...]) -> Any:
        args = (query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                joint_graph, block_mask, scale, kernel_options, score_mod_other_buffers,
                mask_mod_other_buffers)
        if vc.rt.storages.serial_of(out) not in fused:
            with mode:
                return hop.sdpa_dense_backward(*args)
        bq, hq, m = query.shape[0], query.shape[1], query.shape[2]
        bkv, hkv, n = key.shape[0], key.shape[1], key.shape[2]
        with mode:
            delta = query.new_empty((bq, hq, m), dtype=torch.float32)
            grad_query = torch.empty_like(query)
            grad_key = key.new_empty((bq, hkv, n, key.shape[-1]))
            grad_value = value.new_empty((bq, hkv, n, value.shape[-1]))
            del delta
            if bq != bkv:  # a key broadcast over the batch: its gradients summed over it
                grad_key = grad_key.sum(0, keepdim=True)
                grad_value = grad_value.sum(0, keepdim=True)
            captured = tuple(torch.empty_like(b) if isinstance(b, torch.Tensor)
                             and b.requires_grad else None for b in score_mod_other_buffers)
        if _computes(vc):
            dense: list[Any] = []

            def values() -> Any:
                dense.append(hop.sdpa_dense_backward(*args))
                return dense[0][:3]

            _fill(vc, (grad_query, grad_key, grad_value), values)
            if any(c is not None for c in captured):
                _fill(vc, tuple(c for c in captured if c is not None),
                      lambda: tuple(g for g in dense[0][3] if g is not None))
        return grad_query, grad_key, grad_value, captured

    return rule


def _fill(vc: EmulatedCuda, targets: tuple[torch.Tensor, ...],
          values: Callable[[], Any]) -> None:
    """Under --compute: ``targets`` (counted on their devices) take the values ``values()``
    computes with the emulation's dispatch off (its temporaries counted nowhere)."""
    with _real_devices(vc), torch._C._DisableTorchDispatch(), torch.no_grad():
        for target, value in zip(targets, values(), strict=True):
            target.copy_(value)
