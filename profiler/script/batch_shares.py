"""A rank's share of a batch the script makes by hand, in the DDP alternative's run
(:mod:`dpprof.script.ddp_run`): a torch factory's arguments (``torch.randint(0, V, (B, T))``,
``torch.randn(B, D)``, ``torch.full((B,), 1.0)``) with the batch's rows, along the dimension
DataParallel split them (its ``dim``), cut to the share; and whatever else the loop moves to
a GPU with the batch's rows (a batch made with numpy, ``torch.arange(B)``, rows picked from a
tensor in memory), cut as it moves: each rank moves its share, as a DDP script does."""

from __future__ import annotations

import ast
import functools
import os
import sys
import tokenize
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dpprof.emulator.call_sites import in_dpprof
from dpprof.emulator.dispatch_state import HOST
from dpprof.script.ddp_diff import BATCH_FACTORIES
from dpprof.script.installed_code import is_installed

if TYPE_CHECKING:
    from dpprof.emulator.patcher import Patcher
    from dpprof.emulator.virtual_cuda import VirtualCuda
    from dpprof.script.ddp_run import DdpState

__all__ = ["divide_hand_made_batches", "in_a_loop", "script_line", "with_rows"]


def with_rows(func: str, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int,
              share: int, dim: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``func``'s arguments with a size whose dimension ``dim`` is ``rows`` given ``share``
    rows there instead; None where the size has no such dimension."""
    def cut(size: Any) -> Any:
        if isinstance(size, (tuple, list, torch.Size)) and len(size) > dim and (
                size[dim] == rows):
            cut_size = [*size[:dim], share, *size[dim + 1:]]
            return torch.Size(cut_size) if isinstance(size, torch.Size) else type(size)(
                cut_size)
        return None

    if "size" in kwargs:
        new = cut(kwargs["size"])
        return None if new is None else (args, {**kwargs, "size": new})
    if func == "randint":  # randint(high, size) / randint(low, high, size)
        at = next((i for i, a in enumerate(args) if isinstance(a, (tuple, list, torch.Size))),
                  None)
        if at is None:
            return None
        new = cut(args[at])
        return None if new is None else ((*args[:at], new, *args[at + 1:]), kwargs)
    if func == "full" and args:  # full((B, D), value)
        new = cut(args[0])
        return None if new is None else ((new, *args[1:]), kwargs)
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):  # randn((B, D))
        new = cut(args[0])
        return None if new is None else ((new,), kwargs)
    if len(args) > dim and all(isinstance(a, int) for a in args[:dim + 1]) and (
            args[dim] == rows):  # randn(B, D); randn(T, B, D) split along 1
        return (*args[:dim], share, *args[dim + 1:]), kwargs
    return None


def script_line(frame: Any) -> str | None:
    """``file:line`` of ``frame`` where it is the script's own code (not a library's, not
    torch's, not dpprof's), else None."""
    name = frame.f_code.co_filename
    if name.startswith("<") or in_dpprof(name) or is_installed(name):
        return None
    return f"{name}:{frame.f_lineno}"


@functools.lru_cache(maxsize=32)
def _loop_lines(filename: str, stamp: tuple[int, int]) -> tuple[tuple[int, int], ...] | None:
    """The line spans of ``filename``'s loops (``for``, ``while``) as of ``stamp`` (its
    modification time and size: a script written again between runs is read again); None
    where its source cannot be read or parsed."""
    try:
        with tokenize.open(filename) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    return tuple((node.lineno, node.end_lineno or node.lineno) for node in ast.walk(tree)
                 if isinstance(node, (ast.For, ast.AsyncFor, ast.While)))


def in_a_loop(frame: Any) -> bool:
    """Whether the script's code that led to ``frame`` runs in a loop of the script (its
    training loop: a batch made there is each step's), at any of its frames from ``frame``
    outwards (a helper the loop calls); True where a file's source cannot be read."""
    while frame is not None:
        if script_line(frame) is not None:
            name = frame.f_code.co_filename
            try:
                st = os.stat(name)
            except OSError:
                return True
            spans = _loop_lines(name, (st.st_mtime_ns, st.st_size))
            if spans is None or any(a <= frame.f_lineno <= b for a, b in spans):
                return True
        frame = frame.f_back
    return False


def divide_hand_made_batches(state: DdpState, vc: VirtualCuda,
                             patcher: Patcher) -> None:
    """Batches the script makes in its loop without a DataLoader (a factory of
    :data:`dpprof.script.ddp_diff.BATCH_FACTORIES` in a loop of the script, with the batch
    DataParallel scattered in the dimension it split along, the first or its ``dim``:
    inputs, targets, labels): each rank makes its share, DataParallel's first chunk
    (``ceil(B / N)`` rows), as a DDP script would make ``B // N`` rows on every rank. One
    made once, before the loop (a GAN's fixed noise to draw samples from), is no step's
    batch."""
    rows = state.scattered_rows

    def dividing(func: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def factory(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            site = script_line(caller)
            if site is None or not in_a_loop(caller):
                return original(*args, **kwargs)
            share = state.share(vc)
            cut = with_rows(func, args, kwargs, rows, share, state.scattered_dim)
            if cut is None:
                return original(*args, **kwargs)
            made = f"torch.{func} at {site}"
            if made not in state.divided_sites:
                state.divided_sites.append(made)
            state.batch_rows = state.batch_rows or share
            return original(*cut[0], **cut[1])
        return factory

    for func in BATCH_FACTORIES:
        patcher.patch(torch, func, dividing(func, getattr(torch, func)))
    _divide_moves(state, vc, patcher)


def _divide_moves(state: DdpState, vc: VirtualCuda, patcher: Patcher) -> None:
    """What the loop moves from the host to a GPU (``.cuda()``, ``.to(device)``) with the
    batch's rows along DataParallel's dimension, made any other way (numpy's arrays,
    ``torch.arange(B)``, rows picked from a tensor in memory, a legacy ``FloatTensor(B,
    D)``): each rank moves its share, DataParallel's first chunk, as a DDP script whose rank
    makes ``B // N`` rows moves them. A tensor already a rank's share (a divided loader's, a
    cut factory's) has fewer rows and moves as it is."""
    rows, dim = state.scattered_rows, state.scattered_dim

    def cut_as_it_moves(original: Callable[..., Any],
                        to_gpu: Callable[[tuple[Any, ...], dict[str, Any]], bool]
                        ) -> Callable[..., Any]:
        def move(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if (self.dim() > dim and self.shape[dim] == rows and to_gpu(args, kwargs)
                    and vc.rt.storages.device_of(self) == HOST):
                caller = sys._getframe(1)
                site = script_line(caller)
                share = state.share(vc)
                if site is not None and share < rows and in_a_loop(caller):
                    if site not in state.moved_sites:
                        state.moved_sites.append(site)
                    state.batch_rows = state.batch_rows or share
                    self = self.narrow(dim, 0, share)
            return original(self, *args, **kwargs)
        return move

    def to_gpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        try:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
        except (TypeError, RuntimeError):
            return False
        return device is not None and device.type == "cuda"

    patcher.patch(torch.Tensor, "cuda", cut_as_it_moves(torch.Tensor.cuda,
                                                        lambda args, kwargs: True))
    patcher.patch(torch.Tensor, "to", cut_as_it_moves(torch.Tensor.to, to_gpu))
