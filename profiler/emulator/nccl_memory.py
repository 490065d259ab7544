"""NCCL's memory on a rank's GPU, outside the caching allocator, by what sizes it.

A rank of a process group over NCCL holds, besides its CUDA context, NCCL's own memory on
its GPU: the library's code and its communicator (a fixed part, measured), one small set of
structures per channel, the buffers of each connection to a peer (per channel, per
protocol) and NVLink SHARP's (NVLS) multicast buffers. :func:`nccl_rank_memory` models
them from NCCL's source (2.28.9, the version the H200's records ran; line numbers below are
that tag's) and the records, as a range: what NCCL decides from the machine's topology
(how many channels its search finds, which algorithms the collectives' sizes pick) is not
known here, so the low end takes the least and the high end the most NCCL can pick; a
rank's need takes the high end. The ``NCCL_*`` settings that pin or size them
(:class:`NcclSettings`, read from the environment the script runs in) narrow or move it.
NCCL's host memory (the proxy's buffers, shared memory between processes) is not on the GPU
and not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

__all__ = [
    "FIXED_BYTES",
    "FIXED_MEASURED_BYTES",
    "NCCL_SOURCE",
    "NcclRankMemory",
    "NcclSettings",
    "nccl_clique_memory",
    "nccl_rank_memory",
    "net_connection_bytes",
    "nvls_buffer_bytes",
    "p2p_connection_bytes",
]

_MiB = 1024 * 1024
NCCL_SOURCE = "NCCL 2.28.9 (github.com/NVIDIA/nccl, tag v2.28.9-1)"

# src/include/device.h:24,86,92-93,109-110: NCCL_STEPS 8, MAXCHANNELS 64,
# NCCL_LL_MAX_NTHREADS 512, NCCL_LL_LINES_PER_THREAD 8, NCCL_LL128_MAX_NTHREADS 640,
# NCCL_LL128_ELEMS_PER_THREAD 120; device.h:70 union ncclLLFifoLine is 16 bytes.
# src/init.cc:697-699 sizes each protocol's buffer from them:
_STEPS = 8
MAX_CHANNELS = 64
LL_BUFFSIZE_DEFAULT = 8 * 512 * _STEPS * 16  # DEFAULT_LL_BUFFSIZE: 524,288 B
LL128_BUFFSIZE_DEFAULT = 120 * 640 * _STEPS * 8  # DEFAULT_LL128_BUFFSIZE: 4,915,200 B
SIMPLE_BUFFSIZE_DEFAULT = 1 << 22  # DEFAULT_BUFFSIZE: 4 MiB (NCCL_BUFFSIZE's documented default)
# src/include/comm.h:37-38,45-70: ncclSendMem / ncclRecvMem are padded to MEM_ALIGN (4096 B);
# a connection's device memory is rounded up to CUDA_IPC_MIN (2 MiB), and so is every
# allocation NCCL makes with cuMem (src/include/alloc.h:225-226, the minimum granularity of
# device memory, 2 MiB on the GPUs here).
_CONN_MEM_BYTES = 4096
_GRANULE_BYTES = 2 * _MiB
# src/transport/nvls.cc:148-153: NVLS channels (16 on compute capability 9.x, 24 on a single
# Blackwell node, 32 across nodes) and NCCL_NVLS_CHUNKSIZE's default, 128 KiB;
# src/include/device.h:207 NCCL_MAX_NVLS_ARITY 32.
_NVLS_CHANNELS_SM90 = 16
_NVLS_CHANNELS_SM100_ONE_NODE = 24
_NVLS_CHANNELS_SM100 = 32
_NVLS_CHUNK_DEFAULT = 128 * 1024
_NVLS_MAX_ARITY = 32
_NVLS_CREDIT_BYTES = 64  # nvls.cc:405: memSize per (channel, direction, head)
# src/channel.cc:42,45,56: initChannel allocates three device arrays per channel (the shared
# peers, this communicator's peers, the ring's ranks), each a cuMem allocation of 2 MiB.
_CHANNEL_STRUCTURE_BYTES = 3 * _GRANULE_BYTES

# The channels NCCL's ring search finds (src/init.cc:1019 searches up to MAXCHANNELS/2 = 32,
# src/graph/connect.cc:460 doubles them), which only the machine's topology decides: the
# least NCCL runs with (one searched channel, doubled), and the most seen on a board of the
# link's kind (8 GPUs on NVSwitch, Hopper SXM: 32 channels, NVIDIA/nccl#1685; 16 on the
# H800's fewer NVLinks, NVIDIA/nccl#892; over PCIe 2, NVIDIA/nccl-tests#228, and twice that
# where a PCIe Gen4 link's 24 GB/s carries two searched channels at 12 GB/s, search.cc:981).
_DEFAULT_CHANNELS = {"nvlink": (2, 32), "pcie": (2, 4)}

# The records (tests/data/h200_measured.json's rank-* parts, world 1: scripts/gpu_measure.py
# inits the process group with device_id, so NCCL's communicator is made there, and runs one
# all-reduce): NVML's used memory of the process less memory_reserved, after the process
# group less before it, the same in all five fresh ranks on an NVIDIA H200 (torch
# 2.11.0+cu130, NCCL 2.28.9); and a DDP rank's less the same step in one process on an
# NVIDIA H100 80GB HBM3 (tests/data/h100_measured.json, the same torch), which also counts
# the kernels DDP's step loads. At world 1 NCCL connects no peer and sets up no NVLS
# (nvls.cc:161 needs two GPUs), so this is its code, its communicator and its channels'
# structures.
FIXED_MEASURED_BYTES = {"h200_process_group": 585_105_408, "h100_ddp_rank": 589_299_712}
FIXED_BYTES = (min(FIXED_MEASURED_BYTES.values()), max(FIXED_MEASURED_BYTES.values()))

_ALGORITHMS = ("ring", "tree", "nvls")


def _int_env(env: Mapping[str, str], name: str, problems: list[str]) -> int | None:
    """An ``NCCL_*`` integer as NCCL's ncclLoadParam reads it (strtoll, base 0: decimal,
    0x hex, 0 octal; src/misc/param.cc:84); None where unset or unreadable."""
    text = env.get(name, "").strip()
    if not text:
        return None
    octal = len(text) > 1 and text[0] == "0" and text.isdigit()  # Python's base 0 refuses it
    try:
        return int(text, 8) if octal else int(text, 0)
    except ValueError:
        problems.append(f"{name}={text!r} is not a number NCCL reads (NCCL's strtoll takes 0 "
                        "from it); left out here: unset it or give a count or bytes")
        return None


def _algorithms(text: str) -> frozenset[str]:
    """The all-reduce algorithms ``NCCL_ALGO`` allows: a list (``Ring,Tree``), one to leave
    out after ``^`` (``^NVLS``), or per collective (``allreduce:ring;...``; src/graph/tuning.cc
    parses it); NVLSTree counts as NVLS, CollNet is not modelled."""
    value = text.strip().lower()
    if ";" in value or ":" in value:
        parts = dict(p.split(":", 1) for p in value.split(";") if ":" in p)
        value = parts.get("allreduce", "")
        if not value:
            return frozenset(_ALGORITHMS)
    exclude = value.startswith("^")
    names = {n.strip().replace("nvlstree", "nvls") for n in value.lstrip("^").split(",")}
    named = {n for n in names if n in _ALGORITHMS}
    return frozenset(set(_ALGORITHMS) - named) if exclude else frozenset(named)


@dataclass(frozen=True)
class NcclSettings:
    """The ``NCCL_*`` settings that size NCCL's memory on the GPU (None: NCCL's default)."""

    simple_buffsize_bytes: int = SIMPLE_BUFFSIZE_DEFAULT  # NCCL_BUFFSIZE
    ll_buffsize_bytes: int = LL_BUFFSIZE_DEFAULT  # NCCL_LL_BUFFSIZE
    ll128_buffsize_bytes: int = LL128_BUFFSIZE_DEFAULT  # NCCL_LL128_BUFFSIZE
    min_channels: int | None = None  # NCCL_MIN_NCHANNELS (or NCCL_MIN_CTAS)
    max_channels: int | None = None  # NCCL_MAX_NCHANNELS (or NCCL_MAX_CTAS)
    min_ctas: int | None = None  # NCCL_MIN_CTAS: NVLS's channels too (nvls.cc:199)
    max_ctas: int | None = None  # NCCL_MAX_CTAS
    algorithms: frozenset[str] = frozenset(_ALGORITHMS)  # NCCL_ALGO (all-reduce's)
    protocol: str | None = None  # NCCL_PROTO: read, but it sizes nothing (below)
    nvls_enable: int = 2  # NCCL_NVLS_ENABLE: 0 off, 1 forced, 2 where the GPU supports it
    nvls_chunk_bytes: int = _NVLS_CHUNK_DEFAULT  # NCCL_NVLS_CHUNKSIZE
    nvls_channels: int | None = None  # NCCL_NVLS_NCHANNELS
    p2p_disabled: bool = False  # NCCL_P2P_DISABLE=1 or NCCL_P2P_LEVEL=LOC
    shm_disabled: bool = False  # NCCL_SHM_DISABLE=1
    p2p_read: bool | None = None  # NCCL_P2P_READ_ENABLE; None: on Ampere (8.0) over NVLink
    net_gdr: bool | None = None  # NCCL_NET_GDR_LEVEL=LOC turns it off; None: NCCL decides
    runtime_connect: bool = True  # NCCL_RUNTIME_CONNECT
    cumem: bool = True  # NCCL_CUMEM_ENABLE
    given: tuple[str, ...] = ()  # the NCCL_* variables read, as NAME=value
    problems: tuple[str, ...] = field(default=())  # values NCCL cannot read

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NcclSettings:
        """The settings an environment gives (unset ones at NCCL's defaults)."""
        problems: list[str] = []
        kw: dict[str, object] = {}
        for name, key in (("NCCL_BUFFSIZE", "simple_buffsize_bytes"),
                          ("NCCL_LL_BUFFSIZE", "ll_buffsize_bytes"),
                          ("NCCL_LL128_BUFFSIZE", "ll128_buffsize_bytes"),
                          ("NCCL_NVLS_CHUNKSIZE", "nvls_chunk_bytes"),
                          ("NCCL_NVLS_NCHANNELS", "nvls_channels"),
                          ("NCCL_NVLS_ENABLE", "nvls_enable")):
            value = _int_env(env, name, problems)
            if value is not None and value < 0 and name.endswith("BUFFSIZE"):
                if value != -2:  # -2: NCCL's own "unset" (init.cc:713)
                    problems.append(f"{name}={value} is below 0; NCCL would size a buffer "
                                    "of it: left out here: unset it or give bytes")
                value = None
            if value is not None:
                kw[key] = value
        # connect.cc:328-355 reads NCCL_MIN/MAX_NCHANNELS (and the older NRINGS), init.cc:1415
        # the CTAs; connect.cc:487-491 applies both
        for bound, names in (("min", ("NCCL_MIN_NRINGS", "NCCL_MIN_NCHANNELS", "NCCL_MIN_CTAS")),
                             ("max", ("NCCL_MAX_NRINGS", "NCCL_MAX_NCHANNELS", "NCCL_MAX_CTAS"))):
            values = [v for v in (_int_env(env, n, problems) for n in names) if v is not None]
            if values:
                kw[f"{bound}_channels"] = max(values) if bound == "min" else min(values)
            ctas = _int_env(env, names[-1], [])
            if ctas is not None:
                kw[f"{bound}_ctas"] = ctas
        flags = {n: _int_env(env, n, problems) for n in (
            "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_P2P_READ_ENABLE",
            "NCCL_RUNTIME_CONNECT", "NCCL_CUMEM_ENABLE")}
        level = env.get("NCCL_P2P_LEVEL", "").strip().upper()
        kw["p2p_disabled"] = bool(flags["NCCL_P2P_DISABLE"]) or level in ("LOC", "0")
        kw["shm_disabled"] = bool(flags["NCCL_SHM_DISABLE"])
        if flags["NCCL_P2P_READ_ENABLE"] is not None:
            kw["p2p_read"] = bool(flags["NCCL_P2P_READ_ENABLE"])
        if flags["NCCL_RUNTIME_CONNECT"] is not None:
            kw["runtime_connect"] = bool(flags["NCCL_RUNTIME_CONNECT"])
        if flags["NCCL_CUMEM_ENABLE"] is not None:
            kw["cumem"] = bool(flags["NCCL_CUMEM_ENABLE"])
        if env.get("NCCL_NET_GDR_LEVEL", "").strip().upper() in ("LOC", "0"):
            kw["net_gdr"] = False
        if env.get("NCCL_ALGO", "").strip():
            kw["algorithms"] = _algorithms(env["NCCL_ALGO"])
        if env.get("NCCL_PROTO", "").strip():
            kw["protocol"] = env["NCCL_PROTO"].strip()
        given = tuple(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("NCCL_"))
        return cls(**kw, given=given, problems=tuple(problems))  # type: ignore[arg-type]


def _granules(size_bytes: int) -> int:
    """``size_bytes`` rounded up to NCCL's 2 MiB (ALIGN_SIZE to CUDA_IPC_MIN / granularity)."""
    return -(-size_bytes // _GRANULE_BYTES) * _GRANULE_BYTES


def p2p_connection_bytes(settings: NcclSettings, *, read: bool = False) -> tuple[int, int]:
    """GPU bytes of one P2P connection (over NVLink or PCIe), (send side, receive side):
    the receiver holds every protocol's buffer but, in read mode, Simple's, which the sender
    holds (src/transport/p2p.cc:377-380 and 445-448)."""
    simple = settings.simple_buffsize_bytes
    send = _CONN_MEM_BYTES + (simple if read else 0)
    recv = (_CONN_MEM_BYTES + settings.ll_buffsize_bytes + settings.ll128_buffsize_bytes
            + (0 if read else simple))
    return _granules(send), _granules(recv)


def net_connection_bytes(settings: NcclSettings, *, gdr: bool = True) -> tuple[int, int]:
    """GPU bytes of one network connection, (send, receive): with GPUDirect RDMA the sender
    keeps LL128's and Simple's buffers on the GPU, LL's on the host (src/transport/net.cc:881),
    the receiver all three (net.cc:1048), rounded to 2 MiB (net.cc:907); without it all are on
    the host."""
    if not gdr:
        return 0, 0
    send = settings.ll128_buffsize_bytes + settings.simple_buffsize_bytes
    recv = send + settings.ll_buffsize_bytes
    return _granules(send), _granules(recv)


def nvls_buffer_bytes(settings: NcclSettings, compute_capability: tuple[int, int],
                      local_ranks: int, nodes: int = 1) -> int:
    """GPU bytes of NVLS's buffers on one rank (src/transport/nvls.cc:333-343: channels x 2
    x NCCL_NVLS_CHUNKSIZE x NCCL_STEPS per head, one head per GPU of the node, search.cc:1038-
    1045; its credits, nvls.cc:405-433), each rounded to 2 MiB; 0 where NVLS cannot run."""
    channels = _nvls_channels(settings, compute_capability, nodes)
    if not channels or local_ranks < 2:
        return 0
    heads = min(_NVLS_MAX_ARITY, local_ranks)
    buffers = channels * 2 * settings.nvls_chunk_bytes * _STEPS * heads
    credits = channels * 2 * _NVLS_CREDIT_BYTES * heads
    return _granules(buffers) + _granules(credits)


def _nvls_channels(settings: NcclSettings, cc: tuple[int, int], nodes: int) -> int:
    """NVLS's channels (nvls.cc:178-199), bounded by the CTAs / channels settings."""
    if settings.nvls_enable == 0 or cc < (9, 0):
        return 0
    if settings.nvls_channels is not None:
        channels = settings.nvls_channels
    elif cc >= (10, 0):
        channels = _NVLS_CHANNELS_SM100 if nodes > 1 else _NVLS_CHANNELS_SM100_ONE_NODE
    else:
        channels = _NVLS_CHANNELS_SM90
    if settings.max_ctas is not None:
        channels = min(channels, settings.max_ctas)
    if settings.min_ctas is not None:
        channels = max(channels, settings.min_ctas)
    return max(channels, 0)


def _channels(settings: NcclSettings, link: str) -> tuple[int, int]:
    """The collectives' channels, (least, most): the search's range for the link, bounded as
    connect.cc:487-491 bounds it (at most MAX, then copied up to at least MIN)."""
    low, high = _DEFAULT_CHANNELS.get(link, _DEFAULT_CHANNELS["nvlink"])
    out = []
    for n in (low, high):
        if settings.max_channels is not None:
            n = min(n, max(settings.max_channels, 1))
        if settings.min_channels is not None:
            n = max(n, min(settings.min_channels, MAX_CHANNELS))
        out.append(min(n, MAX_CHANNELS))
    return out[0], out[1]


@dataclass(frozen=True)
class NcclRankMemory:
    """NCCL's bytes on one rank's GPU outside the allocator: a range, its parts at the high
    end, and what it rests on."""

    world_size: int
    low_bytes: int
    high_bytes: int
    parts_high_bytes: dict[str, int]
    notes: tuple[str, ...]


def nccl_rank_memory(world_size: int, *, compute_capability: tuple[int, int] = (9, 0),
                     link: str = "nvlink", gpus_per_node: int | None = None,
                     settings: NcclSettings | None = None) -> NcclRankMemory:
    """NCCL's memory on one rank's GPU in a world of ``world_size`` ranks, ``gpus_per_node``
    of them on each node (default: all on one), GPUs joined by ``link`` ("nvlink": NVLink /
    NVSwitch, "pcie"), for the all-reduces DDP and FSDP run."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    s = settings or NcclSettings()
    per_node = max(1, min(gpus_per_node or world_size, world_size))
    nodes = -(-world_size // per_node)
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    notes = [f"NCCL's memory on each rank's GPU modelled from {NCCL_SOURCE} and the records"]
    notes += [f"NCCL setting: {p}" for p in s.problems]
    if s.given:
        notes.append("NCCL settings read from the environment: " + ", ".join(s.given))
    low = {"fixed": FIXED_BYTES[0]}
    high = {"fixed": FIXED_BYTES[1]}
    if world_size == 1:
        notes.append(_fixed_note())
        return NcclRankMemory(1, low["fixed"], high["fixed"], high, tuple(notes))

    c_low, c_high = _channels(s, link)
    # every algorithm is connected at init where runtime connection is off (or cuMem, which
    # it needs, is: init.cc:1269-1285); else each at its first use (enqueue.cc:453), so the
    # low end has the one every all-reduce can take (ring), the high end all allowed
    at_init = not (s.runtime_connect and s.cumem)
    algos = s.algorithms or frozenset({"ring"})
    low_algos = algos if at_init else (algos & {"ring"} or frozenset({min(algos)}))

    # channels' structures beyond world 1's (how many world 1 set up is not recorded: at
    # least one, at most as many as now)
    high["channel_structures"] = (c_high - 1) * _CHANNEL_STRUCTURE_BYTES
    low["channel_structures"] = 0

    intra, inter = _transports(s, world_size, per_node, cc, link)
    for end, channels, chosen in (("low", c_low, low_algos), ("high", c_high, algos)):
        parts = low if end == "low" else high
        # a ring: one send and one receive per channel; a chain's tree (more than two
        # ranks) the other way too (trees.cc; the same peer at two ranks: the same
        # connection, which NCCL connects once)
        directions = (1 if "ring" in chosen or "tree" in chosen else 0) + (
            1 if "tree" in chosen and per_node > 2 else 0)
        parts["p2p_buffers"] = channels * directions * sum(intra)
        crossing = 1 if nodes > 1 else 0
        parts["net_buffers"] = channels * crossing * sum(inter) if end == "high" else 0
        nvls = nvls_buffer_bytes(s, cc, per_node, nodes) if (
            "nvls" in chosen and link == "nvlink" and s.nvls_enable) else 0
        parts["nvls_buffers"] = nvls
    notes.append(_fixed_note())
    notes.append(
        f"{c_low}-{c_high} channels (NCCL's topology search decides; NCCL_MIN_NCHANNELS / "
        "NCCL_MAX_NCHANNELS pin them); per channel a ring's send and receive connection"
        + (", a tree's the other way" if per_node > 2 else "")
        + f": {intra[0]:,} B + {intra[1]:,} B on the GPU over "
        + ("shared host memory (P2P off: nothing on the GPU)" if intra == (0, 0) else
           f"{link} P2P (Simple {s.simple_buffsize_bytes:,} B, LL128 "
           f"{s.ll128_buffsize_bytes:,} B, LL {s.ll_buffsize_bytes:,} B, rounded to 2 MiB)"))
    if nodes > 1:
        notes.append(f"{nodes} nodes: at most every channel's ring crosses to the next node "
                     f"at this rank, {inter[0]:,} B + {inter[1]:,} B a channel over the network"
                     + (" (GPUDirect RDMA)" if sum(inter) else " (host memory)"))
    if high["nvls_buffers"]:
        notes.append(f"NVLS (NVLink SHARP, where the GPUs hang off NVSwitches that support "
                     f"multicast): {high['nvls_buffers']:,} B at its first use "
                     "(NCCL_NVLS_ENABLE=0 or NCCL_ALGO without NVLS: none)")
    if s.protocol:
        notes.append(f"NCCL_PROTO={s.protocol} sizes nothing: each connection holds every "
                     "protocol's buffer (p2p.cc:447, net.cc:881/1048)")
    return NcclRankMemory(world_size, sum(low.values()), sum(high.values()), high,
                          tuple(notes))


def nccl_clique_memory(size: int, *, compute_capability: tuple[int, int] = (9, 0),
                       link: str = "nvlink", settings: NcclSettings | None = None
                       ) -> NcclRankMemory:
    """NCCL's memory on each GPU of one process's communicators over ``size`` of its GPUs:
    ``torch.cuda.nccl``'s, which ``torch/csrc/cuda/nccl.cpp`` makes with ``ncclCommInitAll``
    over a call's devices (one communicator per GPU) and keeps for the process's life, for
    ``torch.cuda.comm``'s broadcast and reduce on the NCCL path (DataParallel's replicate and
    its gradients' reduction). Broadcast and reduce run the ring alone (src/graph/tuning.cc,
    ncclTopoTuneModel: ``(coll == ncclFuncBroadcast || coll == ncclFuncReduce) && a !=
    NCCL_ALGO_RING``), so only the ring's connections are made, at its first use; where
    NCCL connects at init (``NCCL_RUNTIME_CONNECT=0``, or without cuMem) every allowed
    algorithm's are, as for a rank."""
    s = settings or NcclSettings()
    if s.runtime_connect and s.cumem:
        s = replace(s, algorithms=frozenset({"ring"}))
    m = nccl_rank_memory(size, compute_capability=compute_capability, link=link,
                         gpus_per_node=size, settings=s)
    first = (f"NCCL's memory on each GPU of this process's communicators over {size} GPUs "
             "(ncclCommInitAll, one per GPU: torch.cuda.comm's broadcast and reduce, "
             "DataParallel's), the ring's connections alone (broadcast and reduce run no "
             f"other), modelled from {NCCL_SOURCE} and the records")
    return replace(m, notes=(first, *m.notes[1:]))


def _transports(s: NcclSettings, world_size: int, per_node: int, cc: tuple[int, int],
                link: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """GPU bytes of one connection within the node and of one to another node."""
    if per_node < 2:
        intra = (0, 0)
    elif s.p2p_disabled and not s.shm_disabled:
        intra = (0, 0)  # SHM: its buffers in host memory (shm.cc:113,144)
    elif s.p2p_disabled:
        intra = net_connection_bytes(s, gdr=s.net_gdr is not False)
    else:
        read = s.p2p_read if s.p2p_read is not None else (link == "nvlink" and cc == (8, 0))
        intra = p2p_connection_bytes(s, read=read)  # paths.cc:371: read on A100 NVLink
    inter = net_connection_bytes(s, gdr=s.net_gdr is not False) if world_size > per_node \
        else (0, 0)
    return intra, inter


def _fixed_note() -> str:
    lo, hi = FIXED_BYTES
    return (f"NCCL's code and communicator: {lo:,}-{hi:,} B, measured at world 1 (an H200's "
            "five fresh ranks: the process group's growth outside the allocator; an H100's "
            "DDP rank less the same step in one process)")
