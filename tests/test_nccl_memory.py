"""NCCL's memory on a rank's GPU (dpprof.emulator.nccl_memory): the recorded world-1 ranks,
and what each NCCL_* setting moves, against NCCL's documented and printed numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dpprof.backends.emulated import context_model
from dpprof.backends.emulated_config import EmulationConfig
from dpprof.emulator.context import NCCL_RANK_BYTES, device_context
from dpprof.emulator.nccl_memory import (
    NcclSettings,
    nccl_rank_memory,
    p2p_connection_bytes,
)

DATA = Path(__file__).parent / "data"
MiB = 2**20
H100 = (9, 0)


def _memory(world: int, **env: str) -> object:
    return nccl_rank_memory(world, compute_capability=H100, link="nvlink",
                            settings=NcclSettings.from_env(env))


def _pinned(world: int, channels: int, **env: str):  # type: ignore[no-untyped-def]
    """A ring-only world with its channels pinned: nothing left for the topology to decide."""
    env = {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": str(channels),
           "NCCL_MAX_NCHANNELS": str(channels), **env}
    return nccl_rank_memory(world, compute_capability=H100, link="nvlink",
                            settings=NcclSettings.from_env(env))


def test_world_one_holds_every_recorded_rank() -> None:
    """The five fresh H200 ranks (world 1): the process group's growth outside the allocator
    (NVML used less reserved, after init_process_group and an all-reduce, less before);
    the H100's DDP rank less the same step in one process. Each lies within the model's
    range at world 1, and the need (the high end) is the highest of them."""
    h200 = json.loads((DATA / "h200_measured.json").read_text())
    seen = []
    for workload in ("mlp", "lm", "attention", "convnet", "classifier"):
        stages = h200["parts"][f"rank-{workload}"]["result"]["stages"]
        names = [s["stage"] for s in stages]
        after = stages[names.index("process_group")]
        before = stages[names.index("process_group") - 1]  # cuBLAS's, or cuDNN's
        seen.append((after["process_used_bytes"] - after["reserved_bytes"])
                    - (before["process_used_bytes"] - before["reserved_bytes"]))
    h100 = json.loads((DATA / "h100_measured.json").read_text())["mlp_batch64_run1"]
    seen.append((h100["ddp"]["nvml_peak_used_bytes"] - h100["ddp"]["peak_reserved_bytes"])
                - (h100["single"]["nvml_peak_used_bytes"]
                   - h100["single"]["peak_reserved_bytes"]))
    m = nccl_rank_memory(1)
    assert all(m.low_bytes <= b <= m.high_bytes for b in seen), seen
    assert m.high_bytes == max(seen) == NCCL_RANK_BYTES
    # the spread stated: 558-562 MiB
    assert (m.low_bytes // MiB, m.high_bytes // MiB) == (558, 562)


def test_a_connection_takes_the_sizes_nccl_allocated_on_eight_h100s() -> None:
    """NCCL_DEBUG_SUBSYS=ALLOC on 8 x H100 over P2P/CUMEM printed two sizes per connection,
    10,485,760 B and 2,097,152 B (NVIDIA/nccl#1685): the receiver's buffers and the
    sender's head; on Ampere over NVLink NCCL reads instead, and the sender holds Simple's
    4 MiB (NCCL_BUFFSIZE's documented default), the receiver the rest."""
    assert p2p_connection_bytes(NcclSettings()) == (2_097_152, 10_485_760)
    send, recv = p2p_connection_bytes(NcclSettings(), read=True)
    assert send >= 4 * MiB and recv == 10_485_760 - 4 * MiB


def test_nccl_buffsize_moves_each_receive_buffer_by_the_simple_buffer() -> None:
    """NCCL_BUFFSIZE sizes the Simple protocol's buffer (documented default 4 MiB). A
    receive buffer held 9,637,888 B before the 2 MiB rounding (the 9.19 MiB a proxy pins
    per connection for the same buffers on the host, 9,641,984 B with its page): at 1 MiB
    it holds 3 MiB less, 6,492,160 B, so 8 MiB once rounded: 2 MiB less a channel."""
    default, smaller = _pinned(4, 8), _pinned(4, 8, NCCL_BUFFSIZE="1048576")
    assert p2p_connection_bytes(NcclSettings.from_env({"NCCL_BUFFSIZE": "1048576"}))[1] == 8 * MiB
    assert default.high_bytes - smaller.high_bytes == 8 * 2 * MiB
    bigger = _pinned(4, 8, NCCL_BUFFSIZE="0x1000000")  # 16 MiB, hex as NCCL's strtoll reads
    assert bigger.high_bytes - default.high_bytes == 8 * 12 * MiB


def test_channels_pin_the_range_and_move_the_figure_by_a_connection_pair_each() -> None:
    """NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS with one algorithm leave nothing to the
    topology: the ring's buffers are the channels x one send (2 MiB) and one receive
    (10 MiB) connection, as printed on the H100s above."""
    for channels in (2, 4, 16):
        m = _pinned(8, channels)
        assert m.parts_high_bytes["p2p_buffers"] == channels * 12 * MiB
        assert m.parts_high_bytes["nvls_buffers"] == 0
    assert _pinned(8, 4).high_bytes < _pinned(8, 16).high_bytes
    capped = _memory(8, NCCL_MAX_NCHANNELS="4")
    assert capped.high_bytes < _memory(8).high_bytes
    assert capped.parts_high_bytes["p2p_buffers"] == 4 * 2 * 12 * MiB  # ring + tree


def test_nvls_takes_its_chunks_per_channel_and_head() -> None:
    """NVLS on 8 Hopper GPUs: 16 NVLS channels, 8 heads (one per GPU: 'NVLS Head 0..7' in
    NVIDIA/nccl#1453's log), two directions of NCCL_NVLS_CHUNKSIZE (128 KiB) x 8 steps:
    256 MiB, and 2 MiB of credits; off with NCCL_NVLS_ENABLE=0 or an NCCL_ALGO without it,
    halved with half the chunk."""
    assert _memory(8).parts_high_bytes["nvls_buffers"] == 256 * MiB + 2 * MiB
    assert _memory(8, NCCL_NVLS_CHUNKSIZE="65536").parts_high_bytes["nvls_buffers"] == (
        128 * MiB + 2 * MiB)
    assert _memory(8, NCCL_NVLS_ENABLE="0").parts_high_bytes["nvls_buffers"] == 0
    assert _memory(8, NCCL_ALGO="^NVLS").parts_high_bytes["nvls_buffers"] == 0
    assert _memory(8, NCCL_ALGO="Ring,Tree").parts_high_bytes["nvls_buffers"] == 0
    # Ampere has no NVLS, nor does PCIe
    ampere = nccl_rank_memory(8, compute_capability=(8, 0), link="nvlink")
    assert ampere.parts_high_bytes["nvls_buffers"] == 0
    assert nccl_rank_memory(8, link="pcie").parts_high_bytes["nvls_buffers"] == 0


def test_without_p2p_the_buffers_are_in_host_memory() -> None:
    """'SHM is used between devices when peer-to-peer cannot happen, therefore, host memory
    is used' (NCCL's environment documentation, NCCL_SHM_DISABLE)."""
    for env in ({"NCCL_P2P_DISABLE": "1"}, {"NCCL_P2P_LEVEL": "LOC"}):
        assert _memory(8, **env).parts_high_bytes["p2p_buffers"] == 0
    assert _memory(8).parts_high_bytes["p2p_buffers"] > 0


def test_the_protocol_sizes_nothing_and_the_settings_read_are_noted() -> None:
    plain, simple = _memory(8), _memory(8, NCCL_PROTO="Simple")
    assert (plain.low_bytes, plain.high_bytes) == (simple.low_bytes, simple.high_bytes)
    assert any("NCCL_PROTO=Simple" in n for n in simple.notes)


def test_two_ranks_share_one_peer_for_ring_and_tree() -> None:
    """At two ranks a chain's tree links the same two GPUs the ring does: no more buffers;
    from three on, the other direction too."""
    two, three = _memory(2, NCCL_ALGO="Ring,Tree"), _memory(3, NCCL_ALGO="Ring,Tree")
    assert three.parts_high_bytes["p2p_buffers"] == 2 * two.parts_high_bytes["p2p_buffers"]


def test_connecting_at_init_raises_the_low_end() -> None:
    """NCCL_RUNTIME_CONNECT=0 (or no cuMem) connects every algorithm at init, so the least
    NCCL can hold includes the tree and NVLS, not only the ring."""
    lazy, eager = _memory(8), _memory(8, NCCL_RUNTIME_CONNECT="0")
    assert eager.low_bytes > lazy.low_bytes and eager.high_bytes == lazy.high_bytes
    assert _memory(8, NCCL_CUMEM_ENABLE="0").low_bytes == eager.low_bytes


def test_more_nodes_add_network_buffers_unless_gdr_is_off() -> None:
    one = nccl_rank_memory(16, gpus_per_node=16)
    two = nccl_rank_memory(16, gpus_per_node=8)
    assert two.parts_high_bytes["net_buffers"] > 0 == one.parts_high_bytes["net_buffers"]
    off = nccl_rank_memory(16, gpus_per_node=8,
                           settings=NcclSettings.from_env({"NCCL_NET_GDR_LEVEL": "LOC"}))
    assert off.parts_high_bytes["net_buffers"] == 0


def test_a_value_nccl_cannot_read_is_named_with_its_fix() -> None:
    m = _memory(4, NCCL_BUFFSIZE="4M")
    assert m.high_bytes == _memory(4).high_bytes
    problem = [n for n in m.notes if "NCCL_BUFFSIZE='4M'" in n]
    assert len(problem) == 1 and "give a count or bytes" in problem[0]


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 64), per_node=st.sampled_from([None, 1, 2, 4, 8]),
       buffsize=st.sampled_from([None, 1 << 20, 1 << 22, 1 << 24]),
       channels=st.sampled_from([None, 1, 4, 32]),
       algo=st.sampled_from([None, "Ring", "Tree", "^NVLS", "NVLS,Ring"]),
       link=st.sampled_from(["nvlink", "pcie"]))
def test_the_range_is_ordered_and_grows_with_peers(world: int, per_node: int | None,
                                                   buffsize: int | None,
                                                   channels: int | None, algo: str | None,
                                                   link: str) -> None:
    env = {k: str(v) for k, v in (("NCCL_BUFFSIZE", buffsize), ("NCCL_MAX_NCHANNELS", channels),
                                  ("NCCL_ALGO", algo)) if v is not None}
    s = NcclSettings.from_env(env)
    m = nccl_rank_memory(world, gpus_per_node=per_node, link=link, settings=s)
    assert 0 < m.low_bytes <= m.high_bytes == sum(m.parts_high_bytes.values())
    more = nccl_rank_memory(world + 1, gpus_per_node=per_node, link=link, settings=s)
    assert more.high_bytes >= m.high_bytes
    if buffsize is not None and buffsize < 1 << 24:
        bigger = NcclSettings.from_env({**env, "NCCL_BUFFSIZE": str(1 << 24)})
        assert nccl_rank_memory(world, gpus_per_node=per_node, link=link,
                                settings=bigger).high_bytes >= m.high_bytes


def test_a_ddp_ranks_context_counts_nccl_at_the_runs_world_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """compare's DDP ranks: NCCL at the run's GPUs, with the environment's NCCL_* settings."""
    model = nn.Linear(4, 4)
    monkeypatch.delenv("NCCL_MAX_NCHANNELS", raising=False)
    one = context_model(EmulationConfig(gpus=1, gpu_memory_bytes=80 << 30), model)
    eight = context_model(EmulationConfig(gpus=8, gpu_memory_bytes=80 << 30), model)
    assert one.nccl_bytes == NCCL_RANK_BYTES < eight.nccl_bytes
    # the range reaches the user in the note, its high end in the figure
    (said,) = [a for a in eight.assumptions if a.startswith("DDP (and FSDP) ranks: NCCL")]
    low, high = (int(b.replace(",", "")) for b in
                 re.search(r"allocator, ([\d,]+)-([\d,]+) B a rank", said).groups())
    assert low < high == eight.nccl_bytes
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "2")
    capped = context_model(EmulationConfig(gpus=8, gpu_memory_bytes=80 << 30), model)
    assert capped.nccl_bytes < eight.nccl_bytes
    assert any("NCCL_MAX_NCHANNELS=2" in a for a in capped.assumptions)
    ctx = device_context(H100, False, world_size=8, link="pcie")
    assert ctx.nccl_bytes < eight.nccl_bytes  # PCIe: fewer channels, no NVLS


def test_the_launchers_local_world_size_splits_the_ranks_into_nodes() -> None:
    """torchrun's LOCAL_WORLD_SIZE in the script's environment: 16 ranks, 8 a node, cross
    the network; without it they are taken as one node's."""
    two_nodes = device_context(H100, False, world_size=16, nccl_env={"LOCAL_WORLD_SIZE": "8"})
    one_node = device_context(H100, False, world_size=16, nccl_env={})
    assert any("2 nodes" in a for a in two_nodes.assumptions)
    assert not any("2 nodes" in a for a in one_node.assumptions)
    assert two_nodes.nccl_bytes != one_node.nccl_bytes
