"""Values known in part (dpprof.emulator.small_values): over meta tensors a storage can hold
elements that follow from host data beside elements the model computed. Generated programs
concatenate known and unknown pieces, combine them pointwise, convert them, copy them into
the chunks of a buffer (as an all-gather into one tensor does) and read regions back
(sliced or picked by index_select); the same program on plain CPU tensors is the
reference. The guarantee: a read of known elements gives the real values, a read that
touches one unknown element is a counted stand-in, never a made-up value passed off as
real; a boolean mask made of known elements indexes as on the real tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpprof.emulator.virtual_cuda import VirtualCuda


@dataclass(frozen=True)
class Program:
    pieces: tuple[tuple[tuple[int, ...], bool], ...]  # (values, known from host data)
    other: tuple[tuple[int, ...], bool] | None  # a second operand, added elementwise
    rows: int  # the buffer's chunks, each a copy of the concatenation
    widened: bool  # the concatenation converted to float64 before it is copied
    picked: bool  # the columns read back picked by index_select, else sliced
    read: tuple[int, int]  # the columns read back
    mask_column: int  # the column a boolean mask is made of

    @property
    def width(self) -> int:
        return sum(len(v) for v, _ in self.pieces)

    def known_columns(self) -> list[bool]:
        known = [k for values, k in self.pieces for _ in values]
        if self.other is not None:
            known = [a and self.other[1] for a in known]
        return known


@st.composite
def programs(draw: Any) -> Program:
    piece = st.tuples(st.lists(st.integers(-3, 3), min_size=1, max_size=4).map(tuple),
                      st.booleans())
    pieces = tuple(draw(st.lists(piece, min_size=1, max_size=4)))
    width = sum(len(v) for v, _ in pieces)
    other = draw(st.none() | st.tuples(
        st.lists(st.integers(-3, 3), min_size=width, max_size=width).map(tuple),
        st.booleans()))
    start = draw(st.integers(0, width - 1))
    return Program(pieces, other, draw(st.integers(1, 3)), draw(st.booleans()),
                   draw(st.booleans()), (start, draw(st.integers(start + 1, width))),
                   draw(st.integers(0, width - 1)))


def _made(values: tuple[int, ...], known: bool, device: str) -> torch.Tensor:
    """A piece from host data (its values followed), or one a random op touched (none)."""
    t = torch.tensor(values, dtype=torch.float32).to(device)
    return t if known else torch.randn(len(values), device=device).mul(0).add(t)


def _run(p: Program, device: str) -> tuple[torch.Tensor, Any]:
    joined = torch.cat([_made(v, k, device) for v, k in p.pieces]) * 2 + 1
    if p.other is not None:
        joined = joined + _made(*p.other, device)
    if p.widened:
        joined = joined.to(torch.float64)
    buf = torch.empty(p.rows, p.width, device=device)
    for part in buf.view(-1).chunk(p.rows):
        part.copy_(joined)
    if p.picked:
        columns = torch.arange(p.read[0], p.read[1]).to(device)
        return buf, buf.index_select(1, columns).tolist()
    return buf, buf[:, p.read[0]:p.read[1]].tolist()


@settings(max_examples=150, deadline=None)
@given(programs())
def test_a_read_is_the_real_values_or_a_counted_stand_in(p: Program) -> None:
    real_buf, real_read = _run(p, "cpu")
    known = p.known_columns()
    with VirtualCuda(2) as vc:
        buf, read = _run(p, "cuda")
        made_up = vc.rt.stand_ins.total
        if all(known[p.read[0]:p.read[1]]):
            assert read == real_read and made_up == 0
        else:
            assert made_up == 1  # the host copy (.tolist()) of an unknown element
        mask = buf[:, p.mask_column] >= 1
        if known[p.mask_column]:
            picked = buf[mask]
            assert picked.shape == real_buf[real_buf[:, p.mask_column] >= 1].shape
            assert picked.device == torch.device("cuda", 0)
        else:  # the shape the stand-ins give (zeros: nothing selected), counted
            assert buf[mask].shape[0] == 0
            assert vc.rt.stand_ins.total == made_up + 1


def test_a_write_of_unknown_values_forgets_the_known_ones_it_covers() -> None:
    """Known elements overwritten by the model's arithmetic are known no longer: a later
    read is a stand-in, never the stale value."""
    with VirtualCuda(1) as vc:
        counts = torch.tensor([4.0, 5.0, 6.0]).cuda()
        counts[1:].copy_(torch.randn(2, device="cuda"))
        assert counts[:1].tolist() == [4.0] and vc.rt.stand_ins.total == 0
        assert counts.tolist() == [0.0, 0.0, 0.0]  # a read in part unknown: a stand-in
        assert vc.rt.stand_ins.total == 1
        counts.mul_(torch.randn(3, device="cuda"))
        counts[:1].tolist()
        assert vc.rt.stand_ins.total == 2
