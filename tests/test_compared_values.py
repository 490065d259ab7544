"""``torch.allclose`` and ``torch.equal`` over a virtual GPU's tensors answer as CUDA does:
the comparison's tensors are allocated and the bool is read from them (the real one where
the values are followed, else a counted stand-in). They raised over meta tensors before
("Tensor.item() cannot be called on meta tensors"; equal has no Meta kernel): YOLOv5's AMP
check calls allclose."""

from __future__ import annotations

import torch

from dpprof.emulator.virtual_cuda import VirtualCuda


def test_allclose_and_equal_answer_from_the_values_followed_as_on_the_host() -> None:
    pairs = [(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.05, 3.0])),
             (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])),
             (torch.tensor([[1, 2]]), torch.tensor([1, 2])),  # shapes differ: equal is False
             (torch.zeros(0, 6), torch.zeros(0, 6))]  # no element: close and equal
    expected = [(torch.allclose(a.float(), b.float(), atol=0.1), torch.equal(a, b))
                for a, b in pairs]
    with VirtualCuda(1) as vc:
        got = [(torch.allclose(a.cuda().float(), b.cuda().float(), atol=0.1),
                torch.equal(a.cuda(), b.cuda())) for a, b in pairs]
        assert vc.rt.stand_ins.total == 0
    assert got == expected
    assert [g for g, _ in got] == [True, True, True, True]
    assert [e for _, e in got] == [False, True, False, True]


def test_allclose_of_values_not_followed_is_a_counted_stand_in_and_allocates_as_cuda() -> None:
    with VirtualCuda(1) as vc:
        a = torch.randn(1024, device="cuda")  # the model's kind of values: not followed
        before = vc.rt.storages.counters[0].peak_allocated
        assert torch.allclose(a, a * 2) is False  # the stand-in bool
        # isclose's 1 KiB of bools (a block of 1 KiB), all()'s one byte (a block of 512 B),
        # and a * 2's 4 KiB alive beside them
        assert vc.rt.storages.counters[0].peak_allocated - before == 4096 + 1024 + 512
        assert vc.rt.stand_ins.counts == {"bool": 1}
