"""DDP's reducer re-enacted (reducer.cpp, distributed.py): bucket assignment and options.

Sizes are requested bytes on meta tensors. (The whole step is checked against a real gloo
run in test_fidelity.py.)
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.emulator.ddp import EmulatedDDP, compute_bucket_assignment_by_size
from dpprof.emulator.virtual_devices import VirtualDevices
from dpprof.scenarios.step import DdpOptions, StepConfig
from dpprof.scenarios.workloads import Workload


@pytest.fixture
def assignments(monkeypatch: pytest.MonkeyPatch) -> list[list[list[int]]]:
    """Every bucket assignment an EmulatedDDP makes (initialize_buckets), in order."""
    seen: list[list[list[int]]] = []
    original = EmulatedDDP._initialize_buckets

    def recording(self: EmulatedDDP, assignment: list[list[int]]) -> None:
        seen.append([list(b) for b in assignment])
        original(self, assignment)

    monkeypatch.setattr(EmulatedDDP, "_initialize_buckets", recording)
    return seen

MiB = 1024 * 1024


def _t(nbytes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype,
                       device="meta")


def test_buckets_close_once_they_reach_the_limit_and_take_the_next_limit() -> None:
    ts = [_t(MiB // 2), _t(MiB // 2), _t(MiB), _t(3 * MiB), _t(MiB)]
    # limits [1 MiB, 2 MiB]: [0, 1] reaches 1 MiB; then 2 MiB: [2, 3] (4 MiB overshoots);
    # [4] is left open
    assert compute_bucket_assignment_by_size(ts, [MiB, 2 * MiB]) == [[0, 1], [2, 3], [4]]
    # one limit of sys.maxsize: everything in one bucket per dtype, sorted by index
    mixed = [_t(64), _t(64, torch.float16), _t(64)]
    assert compute_bucket_assignment_by_size(mixed, [sys.maxsize]) == [[0, 2], [1]]
    # with tensor indices (a rebuild in gradient-ready order) the order is kept
    assert compute_bucket_assignment_by_size(ts[:2], [MiB], [7, 3]) == [[7, 3]]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512))  # three 1 MiB weights


def _step(ddp: nn.Module, rows: int = 4) -> None:
    ddp(torch.empty(rows, 512)).sum().backward()
    for p in ddp.parameters():
        p.grad = None


def test_one_bucket_on_iteration_one_then_rebuilt_in_ready_order(
        assignments: list[list[list[int]]]) -> None:
    rt = VirtualDevices(1)
    with rt, rt.device(0):
        ddp = EmulatedDDP(_mlp(), rt, world_size=2)
        assert assignments == [[[0, 1, 2, 3, 4, 5]]]  # one bucket (the list reversed)
        _step(ddp)
        _step(ddp)
    # Rebuilt at iteration 2 from the ready order (last layer first): the first bucket
    # closes at 1 MiB (bias 4, weight 4 -> 1 MiB + 2 KiB), then 25 MiB takes the rest.
    assert assignments[1] == [[5, 4], [3, 2, 1, 0]]
    ddp.remove_hooks()


def test_bucket_cap_mb_also_caps_the_first_bucket(
        assignments: list[list[list[int]]]) -> None:
    rt = VirtualDevices(1)
    with rt, rt.device(0):
        ddp = EmulatedDDP(_mlp(), rt, world_size=2, bucket_cap_mb=1.5)
        _step(ddp)
        _step(ddp)
    # 1.5 MiB from the first bucket on: bias, weight, bias reach 1 MiB + 4 KiB, the next
    # weight takes the bucket past 1.5 MiB and closes it
    assert assignments[1] == [[5, 4, 3, 2], [1, 0]]
    ddp.remove_hooks()


def test_find_unused_parameters_buckets_from_construction_and_never_rebuilds(
        assignments: list[list[list[int]]]) -> None:
    rt = VirtualDevices(1)
    with rt, rt.device(0):
        ddp = EmulatedDDP(_mlp(), rt, world_size=2, find_unused_parameters=True)
        _step(ddp)
        _step(ddp)
    # limits [1 MiB, 25 MiB] over the parameters in order: the first weight alone reaches
    # 1 MiB; the rest stays open; sorted by smallest index, then the list reversed
    assert assignments == [[[1, 2, 3, 4, 5], [0]]]
    assert ddp.local_used_map_dev is not None and ddp.local_used_map_dev.dtype == torch.int32
    ddp.remove_hooks()


W = 1024 * 1024 * 4  # Linear(1024, 1024) weight


def _deep() -> Workload:
    return Workload(
        name="deep",
        model=lambda: nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)]),
        batch=lambda rows, device: (torch.randn(rows, 1024, device=device),
                                    torch.randn(rows, 1024, device=device)),
        loss=F.l1_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )


def _ddp_peak(ddp: DdpOptions | None = None) -> int:
    r = run_scenario("ddp", _deep(), EmulationConfig(
        gpus=2, gpu_memory_bytes=2**40, step=StepConfig(batch=4, ddp=ddp or DdpOptions())))
    assert r.status == "ok", r.message
    return r.devices[0].peak_requested_bytes


def test_gradient_as_bucket_view_saves_the_gradients_but_one() -> None:
    default = _ddp_peak()
    view = _ddp_peak(ddp=DdpOptions(gradient_as_bucket_view=True))
    # default: at the end of backward 4 gradients + 4 bucket slots; as views, each new
    # gradient dies once copied into its slot: at most one lives beside the buckets. (The
    # peak moves by a few activation gradients: 2 rows x 1024 floats each.)
    assert 3 * W - 4 * 2 * 1024 * 4 <= default - view <= 3 * W


def test_find_unused_parameters_clones_the_outputs() -> None:
    counts = []
    for fup in (False, True):
        rt = VirtualDevices(1)
        with rt, rt.device(0):
            ddp = EmulatedDDP(_mlp(), rt, world_size=2, find_unused_parameters=fup)
            start = len(rt.storages.events)
            out = ddp(torch.empty(4, 512))
            counts.append(sum(1 for e in rt.storages.events[start:] if e.requested == out.nbytes))
            del out
        ddp.remove_hooks()
    assert counts[1] == counts[0] + 1  # _DDPSink's clone of the one output


def test_no_sync_leaves_the_gradients_in_grad_and_the_next_backward_reduces_their_sum(
        assignments: list[list[list[int]]]) -> None:
    """distributed.py's no_sync(): the reducer expects no autograd hook for a forward made
    inside, so nothing is scaled into the buckets; the gradients add up in ``.grad``, and
    the first backward after it writes the sum (divided by the world) into the buckets."""
    rt = VirtualDevices(1, base="cpu")
    with rt, rt.device(0):
        torch.manual_seed(0)
        ddp = EmulatedDDP(_mlp(), rt, world_size=2)
        x1, x2 = torch.randn(4, 512), torch.randn(4, 512)
        params = list(ddp.parameters())
        views = [ddp._views[i] for i in range(len(params))]
        for v in views:
            v.fill_(7.0)
        with ddp.no_sync():
            ddp(x1).sum().backward()
        assert all(bool(v.eq(7.0).all()) for v in views)  # no bucket written
        first = [p.grad.clone() for p in params]
        ddp(x2).sum().backward()
        for p, g1, v in zip(params, first, views, strict=True):
            assert not torch.equal(p.grad, g1)  # accumulated
            assert torch.allclose(v, p.grad / 2)
        # the buckets are rebuilt from the synchronised backward's order alone: each
        # parameter once
        ddp(x1).sum().backward()
    assert sorted(i for b in assignments[-1] for i in b) == list(range(len(params)))
    ddp.remove_hooks()
