"""CUDA graphs on virtual devices: a capture serves its allocations from the graph's private
pool (kept reserved, reused only by captures into that pool), a replay allocates nothing.

Sizes are whole MiB above 10 MiB, so each block is its own segment (a request of 10 MiB or
more gets a segment of its size rounded to 2 MiB, c10's kMinLargeAlloc and kRoundLarge).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from script_runs import peak_reserved
from torch import nn

from dpprof.emulator.allocator import private_pool_key, stream_of_key
from dpprof.emulator.allocator_replay import simulate
from dpprof.emulator.cuda_graphs import DEFAULT_STREAM_CAPTURE
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.errors import NotEmulated
from dpprof.script.session import ScriptConfig, parse_command, run_command

MiB = 2**20


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def mib(n: int) -> torch.Tensor:
    return torch.empty(n * MiB, dtype=torch.uint8, device="cuda")


def test_what_a_capture_frees_stays_reserved_for_its_pool_alone() -> None:
    with VirtualCuda(1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            assert torch.cuda.is_current_stream_capturing()
            scratch = mib(30)
            out = mib(12)
            del scratch
        assert not torch.cuda.is_current_stream_capturing()
        assert torch.cuda.memory_allocated() == 12 * MiB
        # eager code cannot have the pool's free 30 MiB segment: it makes its own
        eager = mib(30)
        assert torch.cuda.max_memory_reserved() == (30 + 12 + 30) * MiB
        del eager, out


def test_the_same_code_eagerly_reuses_the_freed_segment() -> None:
    # the control of the test above: no graph, one pool, the 30 MiB segment reused
    with VirtualCuda(1):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            scratch = mib(30)
            out = mib(12)
            del scratch
            again = mib(30)
        assert torch.cuda.max_memory_reserved() == (30 + 12) * MiB
        del again, out


def test_a_capture_into_a_shared_pool_reuses_its_free_blocks() -> None:
    with VirtualCuda(1):
        first, second, third = (torch.cuda.CUDAGraph() for _ in range(3))
        s = torch.cuda.Stream()
        with torch.cuda.graph(first, stream=s):
            tmp = mib(30)
            del tmp
        with torch.cuda.graph(second, pool=first.pool(), stream=s):
            tmp = mib(30)  # the first capture's free segment
            del tmp
        assert torch.cuda.max_memory_reserved() == 30 * MiB
        handle = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(third, pool=handle, stream=s):
            tmp = mib(30)  # another pool: a segment of its own
            del tmp
        assert torch.cuda.max_memory_reserved() == 60 * MiB
        pools = sorted(seg["segment_pool_id"] for seg in torch.cuda.memory_snapshot())
        assert pools == sorted([first.pool(), handle])


def test_a_replay_allocates_nothing() -> None:
    with VirtualCuda(1) as vc:
        x = mib(16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x.float().sum(0)  # a 64 MiB temporary, and the output
        before = (len(vc.rt.storages.events), torch.cuda.memory_allocated(),
                  torch.cuda.max_memory_reserved())
        for _ in range(3):
            x.fill_(1)
            g.replay()
        after = (len(vc.rt.storages.events), torch.cuda.memory_allocated(),
                 torch.cuda.max_memory_reserved())
        assert before == after
        assert y.shape == ()


def test_a_capture_on_the_default_stream_is_refused_as_cuda_does() -> None:
    with VirtualCuda(1):
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
            g.capture_begin()
        assert DEFAULT_STREAM_CAPTURE.startswith("CUDA graphs must")


def test_a_stream_knows_it_is_capturing() -> None:
    with VirtualCuda(1):
        s, other = torch.cuda.Stream(), torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            assert s.is_capturing() and not other.is_capturing()
            with torch.cuda.stream(other):  # another stream: not the capture's
                assert not torch.cuda.is_current_stream_capturing()
                eager = mib(12)
        assert not s.is_capturing()
        by_pool = {seg["segment_pool_id"]: seg["total_size"]
                   for seg in torch.cuda.memory_snapshot()}
        assert by_pool == {(0, 0): 12 * MiB}
        del eager


def test_a_replay_under_compute_stops_the_run() -> None:
    with VirtualCuda(1, base="cpu"):
        x = torch.ones(4, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2
        assert y.tolist() == [2.0] * 4  # the capture itself ran
        with pytest.raises(NotEmulated, match="not re-run under --compute"):
            g.replay()


def test_make_graphed_callables_runs_forward_and_backward_from_the_pool() -> None:
    with VirtualCuda(1) as vc:
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
        x = torch.randn(256, 1024, device="cuda", requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(model, (x,))
        pooled = [seg for seg in torch.cuda.memory_snapshot() if seg["segment_pool_id"] != (0, 0)]
        assert pooled  # the captured forward and backward took their memory from a pool
        events = len(vc.rt.storages.events)
        out = graphed(x)
        out.sum().backward()
        # the replays made nothing; the loss and its gradient are eager work
        assert len(vc.rt.storages.events) - events < 8
        assert model[0].weight.grad is not None


def test_the_allocator_keeps_a_private_pool_through_empty_cache() -> None:
    pool = private_pool_key(1, 7)
    assert pool < 0 and stream_of_key(pool) == 7
    for key, kept in ((pool, 30 * MiB), (7, 0)):
        s = simulate([("alloc", 0, 30 * MiB, key), ("free", 0, 0), ("empty_cache", None, 0)])
        assert (s.peak_reserved_bytes, s.final_reserved_bytes) == (30 * MiB, kept)


def test_a_private_pool_is_kept_when_an_allocation_runs_out_of_memory() -> None:
    # the out-of-memory retry frees the ordinary pools' cached segments, never a pool a
    # graph still uses: here the second allocation fails where a stream's would not
    pool = private_pool_key(1, 7)
    events = [("alloc", 0, 30 * MiB, pool), ("free", 0, 0), ("alloc", 1, 30 * MiB)]
    assert simulate(events, capacity_bytes=40 * MiB).oom
    assert simulate([("alloc", 0, 30 * MiB, 7), *events[1:]], capacity_bytes=40 * MiB).fits


def test_a_capture_streams_cublas_workspace_is_allocated_in_its_pool() -> None:
    # cuBLAS keeps a workspace per (handle, stream): the capture's stream gets its own at
    # its first matmul, from the graph's pool
    from dpprof.emulator.context import device_context
    from dpprof.emulator.reserved import workspace_inserts

    with VirtualCuda(1) as vc:
        w = torch.empty(64, 64, device="cuda")
        w @ w  # the default stream's
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w @ w
            w @ w  # the same handle and stream: no other workspace
        ctx = device_context((9, 0), uses_cudnn=False)
        inserts = workspace_inserts(ctx, 0, vc.rt.blas_first, vc.rt.blas_side)
    keys = [key for _, _, _, key in inserts]
    assert keys.count(0) == ctx.cublas_workspaces + ctx.cublaslt_workspaces
    side = [k for k in keys if k]
    assert len(side) == 1 and side[0] < 0 and stream_of_key(side[0]) == g.capture_stream_id


# Whole-network capture as PyTorch's CUDA graphs notes show it: warm up on a side stream,
# capture forward, backward and the optimizer step, replay with new data; or (GRAPHED = 0)
# the same steps eagerly
WHOLE_NETWORK = """
    import torch
    from torch import nn

    GRAPHED = {graphed}
    model = nn.Sequential(nn.Linear(4096, 2048), nn.ReLU(), nn.Linear(2048, 512)).cuda()
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    static_input = torch.randn(640, 4096, device="cuda")
    static_target = torch.randn(640, 512, device="cuda")

    def step():
        loss = loss_fn(model(static_input), static_target)
        loss.backward()
        optimizer.step()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(s)
    optimizer.zero_grad(set_to_none=True)
    if GRAPHED:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_loss = step()
    replays = 0
    for _ in range(5):
        static_input.copy_(torch.randn(640, 4096, device="cuda"))
        static_target.copy_(torch.randn(640, 512, device="cuda"))
        if GRAPHED:
            g.replay()
        else:
            optimizer.zero_grad(set_to_none=True)
            step()
        replays += 1
    print("read", torch.cuda.max_memory_reserved(), replays)
"""


def test_a_whole_network_graph_runs_and_reserves_its_pool(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reserved = {}
    for graphed in (0, 1):
        script = tmp_path / f"whole_{graphed}.py"
        script.write_text(textwrap.dedent(WHOLE_NETWORK.format(graphed=graphed)))
        result, _ = run_command(ScriptConfig(launch=parse_command(["python", str(script)], 1),
                                             steps=20), alternatives=False)
        s = result.scenarios[0]
        assert s.status == "ok", s.message
        read = [line.split() for line in capsys.readouterr().out.splitlines()
                if line.startswith("read ")]
        assert [int(n) for n in read[0][2:]] == [5]  # every step (or replay) ran
        assert s.devices[0].peak_reserved_bytes >= int(read[0][1])  # what the script read
        reserved[graphed] = s.devices[0].peak_reserved_bytes
    # torch.cuda.graph empties the cache before it captures: the warm-up's segments on its
    # side stream go back, where the eager steps on the default stream find them cached
    # and take segments of their own beside them; the capture's pool stays reserved
    # (test_what_a_capture_frees_stays_reserved_for_its_pool_alone)
    assert reserved[1] < reserved[0]


def test_a_pool_goes_back_at_empty_cache_once_no_graph_uses_it() -> None:
    """c10's releasePool: a graph reset or deleted stops using its pool; the last one makes
    the pool freeable, and the next empty_cache releases its cached segments (not before,
    and not while another graph captured into the same pool lives)."""
    with VirtualCuda(1):
        s = torch.cuda.Stream()
        first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            first.capture_begin()
            scratch = mib(30)
            del scratch
            first.capture_end()
            second.capture_begin(pool=first.pool())
            scratch = mib(12)  # from the pool's free 30 MiB segment
            del scratch
            second.capture_end()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 30 * MiB  # both graphs use the pool
        del first
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 30 * MiB  # the second still does
        second.reset()
        assert torch.cuda.memory_reserved() == 30 * MiB  # freeable, not yet released
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0


RELEASED = """
import torch
s = torch.cuda.Stream()
g = torch.cuda.CUDAGraph()
with torch.cuda.stream(s):
    g.capture_begin()
    scratch = torch.empty(30 * 2**20, dtype=torch.uint8, device="cuda")
    del scratch
    g.capture_end()
{drop}
torch.cuda.empty_cache()
eager = torch.empty(30 * 2**20, dtype=torch.uint8, device="cuda")
"""


def test_a_runs_reserve_lets_a_deleted_graphs_pool_go(tmp_path: Path) -> None:
    kept, released = (peak_reserved(tmp_path, RELEASED.format(drop=drop))
                      for drop in ("", "del g"))
    # kept, the pool's 30 MiB segment stays beside the eager one; released, it goes first
    assert kept - released == 30 * MiB
