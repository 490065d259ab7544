"""DataParallel and DDP re-enacted: primitives and whole scenarios, against hand counts.

Sizes are *requested* bytes (before the 512 B rounding) unless a name says allocated.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.emulator.allocator_config import block_bytes
from dpprof.emulator.comm import (
    broadcast_coalesced,
    gather_tensors,
    reduce_add_coalesced,
    scatter_tensor,
    take_tensors_cpp,
)
from dpprof.emulator.virtual_devices import VirtualDevices
from dpprof.result import DeviceResult
from dpprof.scenarios.shards import shard_sizes
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import Workload


def test_shard_sizes_follow_tensor_chunk() -> None:
    assert shard_sizes(10, 4) == [3, 3, 3, 1]
    assert shard_sizes(6, 4) == [2, 2, 2]
    assert shard_sizes(33, 8) == [5, 5, 5, 5, 5, 5, 3]
    assert shard_sizes(512, 4) == [128] * 4
    for b, n in [(10, 4), (6, 4), (33, 8), (7, 3), (1, 8)]:
        assert shard_sizes(b, n) == [len(c) for c in torch.arange(b).chunk(n)]


def test_take_tensors_closes_a_group_once_it_reaches_the_limit() -> None:
    ts = [torch.empty(n, device="meta") for n in (3, 3, 3, 1)]  # 12, 12, 12, 4 bytes
    groups = take_tensors_cpp(ts, 24)
    assert [[t.numel() for t in g] for g in groups] == [[3, 3], [3, 1]]
    mixed = [torch.empty(2, device="meta"), torch.empty(2, dtype=torch.float16, device="meta")]
    assert len(take_tensors_cpp(mixed, 10**6)) == 2  # one group per dtype


def test_scatter_keeps_a_view_on_the_source_device_and_copies_the_rest() -> None:
    rt = VirtualDevices(4)
    with rt, rt.device(0):
        x = torch.empty(10, 100)  # 4000 B on cuda:0
        chunks = scatter_tensor(rt, x, [0, 1, 2, 3], None, 0)
        assert [c.shape[0] for c in chunks] == [3, 3, 3, 1]
        assert chunks[0].untyped_storage() is x.untyped_storage()
        assert [rt.storages.device_of(c) for c in chunks] == [0, 1, 2, 3]
        assert [rt.storages.counters[i].live_requested for i in range(4)] == [4000, 1200, 1200, 400]


def test_broadcast_coalesced_flattens_groups_and_views_into_them() -> None:
    rt = VirtualDevices(3)
    with rt, rt.device(0):
        a, b = torch.empty(1000), torch.empty(500)  # one group: 6000 B
        outs = broadcast_coalesced(rt, [a, b], [0, 1, 2])
        assert outs[0][0] is a and outs[0][1] is b  # device 0 keeps the originals
        for d in (1, 2):
            assert rt.storages.counters[d].live_requested == 6000  # one flat buffer each
            assert outs[d][0].untyped_storage() is outs[d][1].untyped_storage()
        assert rt.storages.counters[0].live_requested == 6000  # the cat temporary is gone
        assert rt.storages.counters[0].peak_requested == 12000  # ... but it existed
        del outs
        assert rt.storages.counters[1].live_requested == 0


def test_gather_allocates_the_whole_output_on_the_target() -> None:
    rt = VirtualDevices(2)
    with rt:
        parts = []
        for d in (0, 1):
            with rt.device(d):
                parts.append(torch.empty(3, 10))
        out = gather_tensors(rt, parts, 0, 0)
        assert out.shape == (6, 10)
        assert rt.storages.device_of(out) == 0
        assert rt.storages.counters[0].live_requested == 120 + 240


def test_reduce_add_coalesced_writes_one_flat_result_on_the_destination() -> None:
    rt = VirtualDevices(2)
    with rt:
        grads = []
        for d in (0, 1):
            with rt.device(d):
                grads.append([torch.ones(100), torch.ones(50)])
        before = rt.storages.counters[0].live_requested
        (r1, r2) = reduce_add_coalesced(rt, grads, 0)
        assert rt.storages.device_of(r1) == 0 and r1.untyped_storage() is r2.untyped_storage()
        assert rt.storages.counters[0].live_requested == before + 600  # one flat result
        # each device flattened its group (a cat): 600 B temporaries, now freed
        assert rt.storages.counters[1].peak_requested == 600 + 600


D = 1000  # Linear(D, D) without bias: W = 4 MB of weight, batch 4 over 2 devices
W = D * D * 4
ROW = D * 4


def _tiny() -> Workload:
    return Workload(
        name="tiny",
        model=lambda: nn.Linear(D, D, bias=False),
        batch=lambda rows, device: (
            torch.randn(rows, D, device=device), torch.randn(rows, D, device=device)
        ),
        loss=F.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )


def _devices(name: str, compute: bool = False, **extra: object) -> list[DeviceResult]:
    r = run_scenario(name, _tiny(), EmulationConfig(
        gpus=2, gpu_memory_bytes=2**31, compute=compute,
        step=StepConfig(batch=4), **extra,  # type: ignore[arg-type]
    ))
    assert r.status == "ok", r.message
    return r.devices


def _peaks(name: str, compute: bool = False, **extra: object) -> list[int]:
    return [d.peak_requested_bytes for d in _devices(name, compute, **extra)]


def test_dp_loss_primary_hand_count() -> None:
    dev0, dev1 = _peaks("dp-loss-primary")
    # cuda:0 at the reduce-add: the parameter, its replica's gradient and the reduced
    # gradient (3 W), the whole batch and targets moved there and the gathered outputs,
    # which the loop's ``outputs`` keeps through backward (3 x 4 rows), the loss (4 B) and
    # the gradient seed (4 B).
    assert dev0 == 3 * W + 3 * 4 * ROW + 4 + 4
    # cuda:1 in forward: the broadcast weight, its 2-row input chunk and output. (The weight
    # is not saved for backward: the input needs no gradient.)
    assert dev1 == W + 2 * ROW + 2 * ROW


def test_dp_loss_forward_hand_count() -> None:
    dev0, dev1 = _peaks("dp-loss-forward")
    # the weight's share still dominates; the gathered (loss * rows, rows) of the two
    # replicas (16 B) live through backward as the loop's ``outputs``
    assert dev0 == 3 * W + 2 * 4 * ROW + 4 + 4 + 16
    # cuda:1 in forward: weight, input and target chunks, output, and three 4 B scalars
    # (the replica's loss, loss * rows, rows).
    assert dev1 == W + 3 * 2 * ROW + 3 * 4


def test_single_and_ddp_hand_count() -> None:
    (single,) = _peaks("single")
    # parameter and gradient; 2 rows of inputs and targets; the output (the loop keeps it
    # through backward) and its gradient; loss and seed.
    assert single == 2 * W + 4 * 2 * ROW + 4 + 4
    # DDP's steady state: plus the reducer's bucket (= gradient size). Over gloo the
    # first iteration's bucket dies at the rebuild, so that is the peak.
    assert _peaks("ddp", ddp_backend="gloo") == [single + W, single + W]
    # Over NCCL (the default) the first iteration's bucket outlives the rebuild (its
    # all-reduce's work keeps it) through the measured step: the peak a GPU reaches
    # counts it as a transient, one more gradient's size; the steady state is gloo's.
    (single_allocated,) = (d.peak_allocated_bytes for d in _devices("single"))
    for d in _devices("ddp"):
        assert d.peak_requested_bytes == single + W + W
        assert d.transient_bytes == {"ddp_unreaped_buckets": block_bytes(W)}
        assert d.steady_peak_allocated_bytes == single_allocated + block_bytes(W)


@pytest.mark.parametrize("name", ["dp-loss-primary", "dp-loss-forward", "ddp"])
def test_uneven_and_small_batches_use_fewer_devices(name: str) -> None:
    r = run_scenario(name, _tiny(), EmulationConfig(
        gpus=4, gpu_memory_bytes=2**31, step=StepConfig(batch=6),
    ))
    assert r.status == "ok"
    used = [d.index for d in r.devices if d.used]
    if name == "ddp":
        assert used == [0, 1, 2, 3]  # every rank runs, ceil(6 / 4) = 2 rows each
        assert {d.batch_rows for d in r.devices} == {2}
    else:
        assert used == [0, 1, 2]  # 6 over 4 -> chunks of 2, 2, 2: three GPUs
        assert r.devices[3].peak_allocated_bytes == 0
        assert any("uses only 3 GPU" in n for n in r.notes)


def test_compute_mode_dp_matches_single_device_full_batch() -> None:
    """On CPU tensors, one DP step changes the weights as one device on the full batch."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x, t = torch.randn(6, 8), torch.randn(6, 4)
    ref = nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    F.mse_loss(ref(x), t).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad

    from dpprof.emulator.data_parallel import EmulatedDataParallel
    from dpprof.emulator.device_copies import to_device

    rt = VirtualDevices(3, base="cpu")
    with rt:
        with rt.device(0):
            m = nn.Linear(8, 4)
        m.load_state_dict(model.state_dict())
        dp = EmulatedDataParallel(m, rt, [0, 1, 2])
        with rt.device(0):
            out = dp(to_device(rt, x.clone(), 0))
            loss = F.mse_loss(out, to_device(rt, t.clone(), 0))
            loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(("gpus", "replica_dtype"), [(1, torch.bfloat16), (2, torch.float16)])
def test_dataparallel_replicas_autocast_in_their_threads_default_dtype(
        gpus: int, replica_dtype: torch.dtype) -> None:
    """Inside ``torch.autocast("cuda", dtype=torch.bfloat16)``, torch's ``parallel_apply``
    runs each of two or more replicas in a thread of its own, which enters
    ``torch.amp.autocast(device_type, enabled=True)`` with no dtype: ``autocast.__init__``
    reads the thread's own autocast dtype, CUDA's default float16 in a new thread
    (aten/src/ATen/autocast_mode.cpp keeps it per thread). DataParallel over one GPU runs the
    module in the caller's thread, in bfloat16."""
    seen: list[torch.dtype] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            seen.append(y.dtype)
            return y

    wl = Workload(name="probe", model=Probe,
                  batch=lambda rows, device: (torch.randn(rows, 8, device=device),
                                              torch.randn(rows, 8, device=device)),
                  loss=lambda out, target: F.mse_loss(out.float(), target))
    s = run_scenario("dp-loss-primary", wl, EmulationConfig(
        gpus=gpus, gpu_memory_bytes=2**34, dedupe_replicas=False,
        step=StepConfig(batch=8, amp="bfloat16")))
    assert s.status == "ok", s.message
    assert seen and set(seen) == {replica_dtype}
    assert any("float16" in n and "thread" in n for n in s.notes) == (gpus > 1)
