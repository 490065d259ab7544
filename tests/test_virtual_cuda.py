"""VirtualCuda: torch.cuda played by virtual devices in a CPU-only build.

Byte counts are derived from the shapes in each test (4 bytes per float32 element, 8 per
int64, every storage rounded up to 512 B as the CUDA caching allocator rounds it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from dpprof.emulator import cuda_devices
from dpprof.emulator.cuda_devices import DataDependentShapeError
from dpprof.emulator.dispatch_state import HOST
from dpprof.emulator.stand_in_values import STAND_IN_FLOAT, STAND_IN_INT
from dpprof.emulator.virtual_cuda import VirtualCuda, parse_visible_devices
from dpprof.script import wrappers


def r512(n: int) -> int:
    return -(-n // 512) * 512


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_reports_the_virtual_gpus() -> None:
    with VirtualCuda(4, gpu="a100-80gb"):
        assert torch.cuda.is_available()
        assert torch.cuda.device_count() == 4
        props = torch.cuda.get_device_properties(2)
        assert props.name == torch.cuda.get_device_name(2) == "NVIDIA A100-SXM4-80GB"
        assert torch.cuda.get_device_capability() == (8, 0)
        assert props.total_memory == 80 * 2**30 or props.total_memory > 79 * 2**30
        free, total = torch.cuda.mem_get_info()
        assert total == props.total_memory and free <= total
        assert torch.cuda.current_device() == 0
        torch.cuda.set_device(3)
        assert torch.cuda.current_device() == 3
        with torch.cuda.device(1):
            assert torch.cuda.current_device() == 1
        assert torch.cuda.current_device() == 3
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.manual_seed_all(0)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
        assert e.query() and s.query()


def test_the_current_stream_is_kept_and_its_allocations_pooled_apart() -> None:
    MiB = 2**20
    with VirtualCuda(2) as vc:
        default = torch.cuda.current_stream()
        side = torch.cuda.Stream(priority=-1)
        assert default == torch.cuda.default_stream() and side != default
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() == side
            x = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.current_stream() == default
        del x
        # the default stream cannot have the side stream's free 20 MiB segment
        y = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.max_memory_reserved() == 40 * MiB
        with side:
            assert torch.accelerator.current_stream() == side
            z = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")  # its own block again
        assert torch.cuda.max_memory_reserved() == 40 * MiB
        assert list(vc.rt.storages.events.streams.values()) == [side.stream_id] * 2
        del y, z


def test_everything_is_restored_on_exit() -> None:
    before = (torch.cuda.is_available, torch.cuda.device_count, torch.Tensor.to,
              torch.Tensor.cuda, torch.tensor, nn.DataParallel, nn.Module.to)
    with VirtualCuda(2):
        assert torch.cuda.is_available()
    after = (torch.cuda.is_available, torch.cuda.device_count, torch.Tensor.to,
             torch.Tensor.cuda, torch.tensor, nn.DataParallel, nn.Module.to)
    assert before == after
    assert torch.zeros(2).device.type == "cpu"
    assert not torch.zeros(2).is_cuda


def test_factories_and_moves_land_on_the_named_device() -> None:
    with VirtualCuda(4) as vc:
        a = torch.zeros(1000, device="cuda:1")  # 4000 B
        b = torch.ones(10, 10, device=torch.device("cuda", 2))  # 400 B
        c = torch.tensor([1.0, 2.0, 3.0], device="cuda")  # current device: 0, 12 B
        d = torch.randn(300, 5).cuda(3)  # 6000 B
        e = torch.arange(100).to("cuda:3")  # int64: 800 B
        assert [vc.rt.storages.device_of(t) for t in (a, b, c, d, e)] == [1, 2, 0, 3, 3]
        assert a.device == torch.device("cuda", 1) and a.is_cuda and a.get_device() == 1
        assert torch.cuda.memory_allocated(0) == r512(12)
        assert torch.cuda.memory_allocated(1) == r512(4000)
        assert torch.cuda.memory_allocated(2) == r512(400)
        assert torch.cuda.memory_allocated(3) == r512(6000) + r512(800)
        host = e.cpu()
        assert host.device.type == "cpu" and vc.rt.storages.device_of(host) == HOST
        del a
        assert torch.cuda.memory_allocated(1) == 0
        assert torch.cuda.max_memory_allocated(1) == r512(4000)
        torch.cuda.reset_peak_memory_stats(1)
        assert torch.cuda.max_memory_allocated(1) == 0


def test_pinned_memory_as_cuda_s_host_allocator_gives_it() -> None:
    # a CPU build has no page-locked allocator (pin_memory() needs CUDA): pinning copies
    # the host tensor and remembers the copy as pinned, as torch's pin_memory does; a
    # non-blocking copy from a GPU lands in pinned memory (torch's _to_copy pins its
    # output), a blocking one does not; a GPU tensor cannot be pinned
    with VirtualCuda(2) as vc:
        host = torch.arange(6.0).view(2, 3).t()
        pinned = host.pin_memory()
        assert pinned.is_pinned() and not host.is_pinned()
        assert pinned.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
        assert pinned.stride() == host.stride() and torch.equal(pinned, host)
        assert pinned.pin_memory() is pinned
        assert pinned[1:].is_pinned()  # a view shares its storage's page-locked memory
        gpu = torch.zeros(100, device="cuda:1")
        assert gpu.to("cpu", non_blocking=True).is_pinned()
        assert not gpu.to("cpu").is_pinned() and not gpu.cpu().is_pinned()
        assert vc.rt.storages.device_of(gpu.to(torch.device("cpu"), non_blocking=True)) == HOST
        with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
            gpu.pin_memory()


def test_an_int_names_a_cuda_device_as_on_a_gpu_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The DDP tutorial's rank as a device: an int names the accelerator (CUDA there), which
    a CPU build's C++ cannot find; here it is the virtual CUDA, through CUDA_VISIBLE_DEVICES
    as any logical index."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    real, randn, new_zeros = torch.device, torch.randn, torch.Tensor.new_zeros
    with VirtualCuda(4) as vc:
        a = torch.randn(100, device=1)
        b = torch.zeros(2, 3).cuda(1)
        c = torch.zeros(2, 3).to(1)
        d = a.new_zeros(10, device=0)
        e = torch.empty(5, device=torch.device(1))
        f = torch.full((4,), 2.0, device=0)
        assert torch.device(1) == real("cuda", 1) and type(torch.device(0)) is real
        assert isinstance(a.device, torch.device) and issubclass(real, torch.device)
        assert torch.device("cuda:1") == real("cuda", 1) and torch.device("cpu").type == "cpu"
        assert [vc.rt.storages.device_of(t) for t in (a, b, c, d, e, f)] == [3, 3, 3, 1, 3, 1]
        assert a.device == torch.device(1)
    assert (torch.device, torch.randn, torch.Tensor.new_zeros) == (real, randn, new_zeros)


def test_module_to_and_cuda_move_parameters_and_buffers() -> None:
    with VirtualCuda(2) as vc:
        m = nn.Sequential(nn.Linear(100, 300), nn.BatchNorm1d(300)).to("cuda:1")
        # weight 100*300, bias 300, bn weight/bias 300 each, running mean/var 300 each,
        # num_batches_tracked one int64
        expected = r512(4 * 30000) + 5 * r512(4 * 300) + r512(8)
        assert torch.cuda.memory_allocated(1) == expected
        assert torch.cuda.memory_allocated(0) == 0
        assert all(vc.rt.storages.device_of(p) == 1 for p in m.parameters())
        m2 = nn.Linear(10, 10).cuda()
        assert next(m2.parameters()).device == torch.device("cuda", 0)
        ints = nn.Linear(10, 10).to(1)  # an int device, as mp.spawn scripts write it
        assert vc.rt.storages.device_of(ints.weight) == 1


def test_module_to_a_dtype_alone_converts_in_place() -> None:
    """Module.to(dtype) calls t.to(None, dtype, False) on each tensor: device None stays
    where it is, the dtype converts (a bf16 workload builds this way)."""
    with VirtualCuda(2) as vc:
        m = nn.Linear(100, 300).to("cuda:1").to(torch.bfloat16)
        assert m.weight.dtype == torch.bfloat16
        assert vc.rt.storages.device_of(m.weight) == 1
        assert torch.cuda.memory_allocated(1) == r512(2 * 30000) + r512(2 * 300)
        t = torch.empty(8, device="cuda:1").to(None, torch.float16, False)
        assert t.dtype == torch.float16 and vc.rt.storages.device_of(t) == 1


def test_a_crossing_sends_the_gradient_back() -> None:
    with VirtualCuda(2) as vc:
        x = torch.randn(64, 32, device="cuda:0", requires_grad=True)
        y = x.to("cuda:1")
        assert vc.rt.storages.device_of(y) == 1
        (y * 2).sum().backward()
        assert x.grad is not None and vc.rt.storages.device_of(x.grad) == 0


def test_cuda_visible_devices_maps_logical_to_virtual(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    with VirtualCuda(4) as vc:
        assert torch.cuda.device_count() == 2
        t = torch.zeros(256, device="cuda:0")
        assert vc.rt.storages.device_of(t) == 2  # logical 0 is the third virtual GPU
        assert t.device == torch.device("cuda", 0)
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.zeros(1, device="cuda:2")


def test_cuda_visible_devices_set_before_the_first_cuda_call() -> None:
    with VirtualCuda(4):
        os.environ["CUDA_VISIBLE_DEVICES"] = "3"  # as a script does before its first use
        try:
            assert torch.cuda.device_count() == 1
            os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2"  # after initialisation: ignored
            assert torch.cuda.device_count() == 1
        finally:
            del os.environ["CUDA_VISIBLE_DEVICES"]


@pytest.mark.parametrize(("value", "expected"), [
    (None, [0, 1, 2, 3]), ("", []), ("1,3", [1, 3]), ("1,7,2", [1]), ("0,0", [0]),
    ("GPU-abc", []), (" 2 , 1 ", [2, 1]),
])
def test_parse_visible_devices(value: str | None, expected: list[int]) -> None:
    assert parse_visible_devices(value, 4) == expected


def test_accelerator_api() -> None:
    with VirtualCuda(3):
        acc = torch.accelerator
        assert acc.is_available() and acc.device_count() == 3
        assert acc.current_accelerator() == torch.device("cuda")
        acc.set_device_index(2)
        assert acc.current_device_index() == 2
        t = torch.zeros(1024, device=acc.current_accelerator())  # current device: 2
        assert acc.memory_allocated(2) == 4096 and acc.memory_allocated(0) == 0
        assert acc.max_memory_allocated(2) == 4096
        del t


def test_values_of_meta_tensors_are_counted_stand_ins() -> None:
    with VirtualCuda(2) as vc:
        loss = torch.randn(8, 4, device="cuda").sum()
        assert loss.item() == STAND_IN_FLOAT
        assert f"{loss:.2f}" == f"{STAND_IN_FLOAT:.2f}"
        # values drawn on a GPU have no values here (its generator is not the host's)
        n = torch.randint(0, 9, (5,), device="cuda").sum()
        assert int(n) == STAND_IN_INT
        assert bool(torch.randn(1, device="cuda") > 0) is False
        assert torch.randn(2, 3, device="cuda").tolist() == [[0.0] * 3] * 2
        assert torch.randn(4, device="cuda").numpy().tolist() == [0.0] * 4
        counts = vc.rt.stand_ins.counts
        assert counts == {"item": 3, "bool": 1, "tolist": 1, "numpy": 1}
        # small values that follow from numbers alone are real (no stand-in counted)
        assert int(torch.ones(5, dtype=torch.int64, device="cuda").sum()) == 5
        assert bool(torch.ones(1, device="cuda") > 0) is True
        assert torch.arange(6, device="cuda").view(2, 3).tolist() == [[0, 1, 2], [3, 4, 5]]
        assert vc.rt.stand_ins.counts == counts
        # torch.isfinite(x).all() on the user's line: the emulated values are finite
        assert bool(torch.isfinite(loss).all()) is True
        assert vc.rt.stand_ins.counts["bool (isfinite)"] == 1
        assert any("test_virtual_cuda.py" in site for site in vc.rt.stand_ins.sites)


@pytest.mark.parametrize("read", ["item", "float", "int", "bool", "tolist", "numpy",
                                  "format"])
def test_values_read_under_inference_mode_are_as_under_no_grad(read: str) -> None:
    """Evaluation loops (timm's validate) read losses under ``torch.inference_mode``, where
    ``.item()`` reaches the dispatch mode whole (no autograd key decomposes it): the same
    stand-in, counted the same, as under ``no_grad``; values that are known stay real."""
    readers = {"item": lambda t: t.sum().item(), "float": lambda t: float(t.sum()),
               "int": lambda t: int(t.sum()), "bool": lambda t: bool(t.sum() > 0),
               "tolist": lambda t: t.tolist(), "numpy": lambda t: t.numpy().tolist(),
               "format": lambda t: f"{t.sum():.3f}"}

    def under(context: type) -> tuple[object, object, dict[str, int]]:
        with VirtualCuda(2) as vc:
            model = nn.Linear(8, 2).cuda()
            with context():
                emulated = readers[read](model(torch.randn(4, 8, device="cuda")))
                known = readers[read](torch.ones(2, 2, device="cuda"))
            return emulated, known, dict(vc.rt.stand_ins.counts)

    assert under(torch.inference_mode) == under(torch.no_grad)
    assert under(torch.inference_mode)[1] == readers[read](torch.ones(2, 2))


def test_ops_with_no_tensor_run_uncounted() -> None:
    """``record_function`` (FSDP2 names each of its hooks with one) reaches the mode as
    ops that take and return no tensor: run as they are, without the counting (and the
    same events as counting them)."""
    from dpprof.emulator.virtual_devices import VirtualDevices

    def step(skip: bool) -> tuple[list[str], list[tuple[int, int, int]]]:
        counted: list[str] = []
        count = VirtualDevices.count_dispatch

        def spy(self: VirtualDevices, func: object, *args: object, **kw: object) -> object:
            counted.append(str(func))
            return count(self, func, *args, **kw)

        rules = cuda_devices.RULES
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(VirtualDevices, "count_dispatch", spy)
            mp.setattr(rules, "_found", {})
            if not skip:  # the registry without the rule for ops with no tensor
                mp.setattr(rules, "_checks", [(check, rule) for check, rule in rules._checks
                                              if check is not cuda_devices._tensorless])
            with VirtualCuda(2) as vc:
                x = torch.randn(8, 4, device="cuda")
                with torch.profiler.record_function("hook"):
                    y = (x * 2).sum()
                del x, y
                events = [(e.device, e.requested, e.allocated) for e in vc.rt.storages.events]
        return counted, events

    counted, events = step(skip=True)
    assert not any("profiler" in op for op in counted)
    plain, plain_events = step(skip=False)
    assert any("_record_function_enter" in op for op in plain)
    assert events == plain_events
    assert cuda_devices._tensorless(torch.ops.profiler._record_function_enter_new.default)
    assert not cuda_devices._tensorless(torch.ops.aten.empty.memory_format)  # makes one
    assert not cuda_devices._tensorless(torch.ops.aten.add.t)  # a generic list: may hold one


def test_data_dependent_shapes_of_unknown_values_are_the_stand_ins_counted() -> None:
    """A shape that depends on values the emulation does not have (an activation's) is the
    one its stand-ins give (zeros: a mask selects nothing), counted at the line; values it
    follows (a mask of host data) give the real one."""
    with VirtualCuda(1) as vc:
        x = torch.randn(10, 3, device="cuda")
        assert torch.nonzero(x > 0).shape == (0, 2)
        assert x[x[:, 0] > 0].shape == (0, 3)
        assert torch.unique(x, return_counts=True)[1].shape == (1,)  # one value: zero
        assert vc.rt.stand_ins.counts == {"shape": 3}
        keep = torch.tensor([True, False] * 5).cuda()
        assert x[keep].shape == (5, 3) and vc.rt.stand_ins.total == 3
        assert x[keep].device == torch.device("cuda", 0)
        labels = torch.tensor([0, 2, 2, 5]).cuda()
        assert torch.bincount(labels).tolist() == [1, 0, 2, 0, 0, 1]
        assert vc.rt.stand_ins.total == 3
        # under inference_mode composites reach the dispatch whole (Ultralytics' validator
        # assigns its targets by mask_gt.nonzero(as_tuple=True) there)
        with torch.inference_mode():
            rows, cols = (x > 0).nonzero(as_tuple=True)
            assert rows.shape == cols.shape == (0,)
            assert torch.where(x > 0)[0].shape == (0,) and torch.argwhere(x).shape == (0, 2)
            assert torch.where(keep)[0].tolist() == [0, 2, 4, 6, 8]
        assert vc.rt.stand_ins.counts == {"shape": 6}


def test_data_dependent_shapes_without_a_real_host_name_the_fix() -> None:
    with VirtualCuda(1, rt=cuda_devices.CudaDevices(1, real_host=False)):
        x = torch.randn(10, device="cuda")
        with pytest.raises(DataDependentShapeError, match="--compute"):
            torch.nonzero(x > 0)
        with pytest.raises(DataDependentShapeError, match="--compute"):
            x[x > 0]


def test_over_cpu_tensors_values_are_real() -> None:
    with VirtualCuda(2, base="cpu") as vc:
        x = torch.ones(3, device="cuda:1") * 2
        assert x.sum().item() == 6.0
        assert torch.nonzero(x).shape == (3, 1)  # data-dependent shapes work
        assert vc.rt.storages.device_of(x) == 1
        assert not vc.rt.stand_ins.counts


# the virtual GPUs' default, an A100: torch's cuBLAS workspace off Hopper, ":4096:2:16:8"
# (CublasHandlePool.cpp), one a thread's handle; cuBLASLt's own, 1 MiB, with a first addmm
A100_CUBLAS_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
A100_FORWARD_WORKSPACES = A100_CUBLAS_WORKSPACE + 2**20


def test_data_parallel_is_the_re_enactment() -> None:
    with VirtualCuda(4, installers=[wrappers.install]) as vc:
        model = nn.DataParallel(nn.Linear(20, 30)).cuda()
        assert isinstance(model, nn.DataParallel)
        out = model(torch.randn(16, 20).cuda())
        assert out.shape == (16, 30) and vc.rt.storages.device_of(out) == 0
        # each other GPU held the replica's weight and bias as one flat broadcast buffer
        # ((20*30 + 30) floats), its 4-row chunk of the input (4*20 floats) and its output
        # (4*30 floats); afterwards only the chunk, which the replica's Linear saved; and
        # from the replica's addmm on, its thread's cuBLAS and cuBLASLt workspaces
        for i in (1, 2, 3):
            assert torch.cuda.max_memory_allocated(i) == (
                r512(4 * 630) + r512(4 * 80) + r512(4 * 120) + A100_FORWARD_WORKSPACES)
            assert torch.cuda.memory_allocated(i) == r512(4 * 80) + A100_FORWARD_WORKSPACES
        out.sum().backward()
        assert vc.rt.storages.device_of(model.module.weight.grad) == 0


def test_an_optimizer_built_before_cuda_keeps_the_modules_parameters() -> None:
    with VirtualCuda(1) as vc:
        m = nn.Linear(16, 16)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        m.cuda()
        assert opt.param_groups[0]["params"][0] is m.weight
        m(torch.randn(4, 16).cuda()).sum().backward()
        opt.step()
        momentum = opt.state[m.weight]["momentum_buffer"]
        assert vc.rt.storages.device_of(momentum) == 0
        # weight, bias, their gradients and momentum (the batch died with backward); the
        # forward's cuBLAS and cuBLASLt workspaces and autograd's cuBLAS one
        assert torch.cuda.memory_allocated() == 3 * (r512(4 * 256) + r512(4 * 16)) + (
            A100_FORWARD_WORKSPACES + A100_CUBLAS_WORKSPACE)


def test_numbers_made_from_numbers_alone_are_read_with_their_real_values() -> None:
    # timm's drop-path rates: linspace(0, rate, depth), split per stage and read with
    # .tolist()/.item() in __init__; the values follow from the arguments, so the emulator
    # recomputes them on the host instead of answering with stand-ins
    expected = torch.linspace(0, 0.1, 6)
    with VirtualCuda(2) as vc:
        rates = torch.linspace(0, 0.1, 6, device="cuda")
        on_host = torch.linspace(0, 0.1, 6, device="cpu")
        assert [p.tolist() for p in rates.split([2, 4])] == [
            expected[:2].tolist(), expected[2:].tolist()]
        assert on_host[4].item() == expected[4].item()
        assert torch.arange(3, 30, 3, device="cuda")[5].item() == 18
        assert vc.rt.stand_ins.total == 0
        # values that follow from no arguments still get their stated stand-ins
        assert torch.randn(3, device="cuda")[0].item() == STAND_IN_FLOAT
        assert vc.rt.stand_ins.counts == {"item": 1}


def test_meta_storages_have_addresses_of_their_own() -> None:
    """Shared storages are told apart by address (safetensors' and Hugging Face's tied-weight
    check before a save): each storage its own, a view its offset, tied weights one."""
    with VirtualCuda(2):
        a = torch.zeros(100, device="cuda")
        b = torch.zeros(100, device="cuda")
        lin = nn.Linear(4, 4).cuda()
        tied = nn.Embedding(4, 4).cuda()
        tied.weight = lin.weight
        ptrs = {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr(),
                lin.bias.untyped_storage().data_ptr()}
        assert len(ptrs) == 3 and 0 not in ptrs
        assert a[10:].data_ptr() == a.data_ptr() + 40
        assert tied.weight.data_ptr() == lin.weight.data_ptr()
        assert torch.zeros(0, device="cuda").data_ptr() == 0
        assert torch.ones(3).data_ptr() != 0  # the host's are real


@pytest.mark.parametrize("map_location", ["cuda", "cuda:1", 1, None, {"cuda:0": "cuda:1"}])
def test_torch_load_onto_a_virtual_gpu(map_location: object, tmp_path: object) -> None:
    """A checkpoint loaded with map_location=device (or saved on a GPU): a CPU build cannot
    make CUDA storages; the tensors arrive on the virtual GPU, tied ones still tied."""
    from pathlib import Path

    path = Path(str(tmp_path)) / "ckpt.pt"
    w = torch.arange(12.0).view(3, 4)
    torch.save({"w": w, "view": w[1], "step": 7}, path)
    with VirtualCuda(2) as vc:
        before = vc.memory.memory_allocated(1)
        state = torch.load(path, map_location=map_location)
        assert state["step"] == 7
        if map_location is None or isinstance(map_location, dict):
            assert state["w"].device.type == "cpu"  # saved on the host: stays there
            assert state["w"].tolist() == w.tolist()
            return
        index = 0 if map_location == "cuda" else 1
        assert state["w"].device == torch.device("cuda", index)
        assert state["view"].data_ptr() == state["w"].data_ptr() + 16
        assert vc.memory.memory_allocated(index) - (before if index == 1 else 0) == r512(48)


def test_torch_cuda_random_state_is_a_stand_in() -> None:
    """torch.cuda.random's own functions (Trainer saves its generator state with each
    checkpoint): they answer, and the state is a stand-in that is never saved as real."""
    with VirtualCuda(2) as vc:
        state = torch.cuda.random.get_rng_state()
        assert state.dtype == torch.uint8 and state.shape == (16,)
        assert vc.rt.is_emulated(state)
        assert len(torch.cuda.random.get_rng_state_all()) == 2
        torch.cuda.random.manual_seed_all(0)
        torch.cuda.random.set_rng_state(state)


def test_singular_values_on_a_gpu_allocate_no_singular_vectors() -> None:
    """torch.linalg.svdvals decides, as on a GPU without a dispatch mode, not to compute the
    singular vectors (the emulator's own mode would make torch compute them)."""
    with VirtualCuda(1):
        x = torch.empty(512, 256, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        s = torch.linalg.svdvals(x)
        # the values, and the copy of x LAPACK/cuSOLVER overwrites: no U (512 x 256), no Vh
        assert torch.cuda.max_memory_allocated() - before < 512 * 256 * 4 + 256 * 4 + 4096
        assert s.shape == (256,)
        xg = torch.empty(512, 256, device="cuda", requires_grad=True)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.linalg.svdvals(xg)  # its backward needs U and Vh: computed, as on a GPU
        assert torch.cuda.max_memory_allocated() - before >= 512 * 256 * 4 + 256 * 256 * 4


def test_a_device_entered_or_set_as_default_is_the_constructors_device() -> None:
    # torch's DeviceContext gives its device to torch's constructors; wrapped by the
    # emulation they must still be the functions it names (on a GPU the 1000 floats below
    # are on cuda:1, and torch.tensor's on the default device)
    with VirtualCuda(2) as vc:
        with torch.device("cuda:1"):
            a = torch.empty(1000)
            b = torch.tensor([1.0, 2.0])
        assert [vc.rt.storages.device_of(t) for t in (a, b)] == [1, 1]
        assert a.device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(1) == r512(4000) + r512(8)
        torch.set_default_device("cuda")
        try:
            c = torch.zeros(250)
        finally:
            torch.set_default_device(None)
        assert vc.rt.storages.device_of(c) == 0 and torch.cuda.memory_allocated(0) == r512(1000)
        assert torch.zeros(3).device.type == "cpu"


def test_the_program_s_own_meta_tensors_are_on_no_device() -> None:
    # a model built on meta (torchtitan, Lightning's empty_init) holds no bytes anywhere
    # until to_empty gives it memory on a GPU; .to() of it fails as torch's own does
    with VirtualCuda(2) as vc:
        torch.cuda.set_device(1)
        with torch.device("meta"):
            model = nn.Linear(1000, 1000)
        explicit = torch.zeros(10, device="meta") * 2
        moved = torch.ones(3).to("meta")
        for t in (model.weight, explicit, moved):
            assert t.device == torch.device("meta") and t.is_meta and not t.is_cuda
        assert torch.cuda.memory_allocated(0) == torch.cuda.memory_allocated(1) == 0
        with pytest.raises(NotImplementedError, match="to_empty"):
            model.to("cuda")
        model.to_empty(device="cuda")
        assert model.weight.device == torch.device("cuda", 1)
        assert vc.rt.storages.device_of(model.weight) == 1
        assert torch.cuda.memory_allocated(1) == r512(4_000_000) + r512(4000)
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
            model.weight.data.copy_(torch.empty(1000, 1000, device="meta"))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_large_value_read_to_the_host_takes_no_host_memory_until_written() -> None:
    """A model's state copied to the host (a state dict with ``cpu_offload``, as Lightning's
    distributed checkpoint takes it) has no values here: each copy is a stand-in of zeros.
    Written by ``torch.zeros``, a 7B model's quarter took 24 GB of host memory and the run
    was killed; the zeros are now pages the kernel gives only when touched."""
    with VirtualCuda(1):
        gpu = torch.empty(2**28, device="cuda")  # 1 GiB
        before = _resident_bytes()
        host = gpu.cpu()
        grown = _resident_bytes() - before
        assert host.device.type == "cpu" and host.shape == gpu.shape
        assert grown < 64 * 2**20, grown
        host[:8] = 1.0  # a stand-in is a plain host tensor: written and read as one
        assert host[:16].tolist() == [1.0] * 8 + [0.0] * 8


def test_the_memory_snapshot_is_the_simulated_allocator_s_in_torch_s_format(
        tmp_path: Path) -> None:
    """``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``, as a user profiling
    memory calls them: the CPU build has neither (the script failed at its first call).
    The snapshot holds the simulated caching allocator's segments (their sizes add up to
    what ``memory_reserved`` answers) and, since the record began, each block's alloc and
    free; torch's own readers of snapshots (``torch.cuda._memory_viz``) take it."""
    import pickle

    from torch.cuda import _memory_viz

    with VirtualCuda(2):
        kept = torch.empty(1024, device="cuda")  # before the record: in segments, no trace
        torch.cuda.memory._record_memory_history(max_entries=1000)
        model = nn.Linear(256, 512).cuda()
        model(torch.randn(64, 256, device="cuda")).sum().backward()
        path = tmp_path / "snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        reserved = torch.cuda.memory_reserved(0)
        allocated = torch.cuda.memory_allocated(0)
        torch.cuda.memory._record_memory_history(enabled=None)
        del kept
    snap = pickle.loads(path.read_bytes())
    segments = [s for s in snap["segments"] if s["device"] == 0]
    assert sum(s["total_size"] for s in segments) == reserved
    live = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["size"] for b in live) == allocated
    trace = snap["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    frees = [e for e in trace if e["action"] == "free_completed"]
    # from the record on: the weight's copy first (the tensor made before is no entry),
    # then the bias, the input, the output and the gradients
    assert allocs[0]["size"] == r512(512 * 256 * 4) and len(allocs) >= 6
    assert {(e["addr"], e["size"]) for e in frees} <= {(e["addr"], e["size"]) for e in allocs}
    assert snap["device_traces"][1] == []  # nothing on the second GPU
    summary = _memory_viz.segsum(snap)  # torch's reader: the same totals
    assert f"segments: {len(snap['segments'])}" in summary
    assert f"total_reserved: {_memory_viz.Bytes(reserved)}" in summary
    played = _memory_viz.trace(snap)  # and its replay of the trace, action by action
    assert played.count("cudaMalloc(") == sum(e["action"] == "segment_alloc" for e in trace)
    assert played.count("# free completed for") == len(frees)


def test_clip_grad_norm_with_foreach_runs_as_on_a_gpu() -> None:
    # torch groups the gradients by their real device (meta here), and foreach=True
    # refuses a device without foreach kernels: a GPU has them
    with VirtualCuda(1):
        model = nn.Linear(64, 64).cuda()
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        assert norm.is_cuda and norm.shape == ()
