"""The virtual-device runtime's rules, each on a small hand-checked case."""

import pytest
import torch

from dpprof.emulator.vdevice import HOST, VirtualDeviceError, VirtualDevices, round_size, to_device


@pytest.fixture(params=["meta", "cpu"])
def rt(request: pytest.FixtureRequest) -> VirtualDevices:
    return VirtualDevices(2, base=request.param)


def test_round_size() -> None:
    assert round_size(0) == 0
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(4_000_000) == 4_000_256


def test_factories_take_the_current_device_and_round(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(1):
            t = torch.empty(100)  # 400 B requested, 512 B allocated
        assert rt.device_of(t) == 1
        assert rt.counters[1].live_requested == 400
        assert rt.counters[1].live_allocated == 512
        assert rt.counters[0].live_allocated == 0
        h = torch.empty(10)  # the host by default: not counted on any GPU
        assert rt.device_of(h) == HOST
    assert rt.counters[0].live_allocated == 0


def test_outputs_follow_inputs_and_views_are_free(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(1):
            a = torch.ones(256)  # 1 KiB
        with rt.device(0):  # the current device does not matter when inputs exist
            b = a * 2
            v = b[10:20]
            b.add_(1)  # in place: no new storage
        assert rt.device_of(b) == 1 and rt.device_of(v) == 1
        assert rt.counters[1].live_allocated == 2048
        assert rt.counters[0].live_allocated == 0


def test_host_scalars_mix_with_device_tensors(rt: VirtualDevices) -> None:
    with rt:
        s = torch.tensor(3.0)  # host 0-dim
        with rt.device(1):
            a = torch.ones(8)
        b = a * s
        assert rt.device_of(b) == 1
        assert rt.device_of(s + 1) == HOST


def test_two_devices_in_one_op_is_an_error(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(0):
            a = torch.ones(4)
        with rt.device(1):
            b = torch.ones(4)
        with pytest.raises(VirtualDeviceError, match="cuda:0 and cuda:1"):
            a + b


def test_frees_are_seen_when_the_last_view_dies(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(0):
            a = torch.empty(1024)  # 4 KiB
            v = a[:10]
        del a
        assert rt.counters[0].live_allocated == 4096  # the view keeps the storage
        del v
        assert rt.counters[0].live_allocated == 0
        assert rt.counters[0].peak_allocated == 4096


def test_crossing_copies_forward_and_gradient_back(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(0):
            w = torch.ones(128, requires_grad=True)  # 512 B on cuda:0
            x = w * 2
        y = to_device(rt, x, 1)
        assert rt.device_of(y) == 1
        assert to_device(rt, y, 1) is y  # already there: no copy, as tensor.to
        before0 = rt.counters[0].live_allocated
        with rt.device(1):
            y.sum().backward()
        assert rt.device_of(w.grad) == 0  # the gradient came back to cuda:0
        assert rt.counters[0].live_allocated == before0 + 512  # w.grad


def test_categories_labels_and_peak_snapshot(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(0), rt.category("parameters"):
            p = torch.empty(256)  # 1 KiB
        rt.reset_peaks()
        with rt.device(0), rt.category("activations"):
            a = torch.empty(512)  # 2 KiB
            g = torch.empty(256)  # 1 KiB, later becomes a gradient
        rt.label(g, "gradients")
        del a
        snap = rt.peak_snapshot(0)
        assert snap.allocated_bytes == rt.counters[0].peak_allocated == 4096
        assert snap.by_category == {"parameters": 1024, "activations": 2048, "gradients": 1024}
        assert rt.live_bytes(0) == 2048
        del p, g


def test_reset_peaks_restarts_from_resident(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(0):
            big = torch.empty(4096)
            del big
            keep = torch.empty(256)
        assert rt.counters[0].peak_allocated == 16384
        rt.reset_peaks()
        assert rt.counters[0].peak_allocated == 1024
        del keep


def test_phases_and_timeline(rt: VirtualDevices) -> None:
    with rt:
        with rt.phase("forward", device=0):
            a = torch.empty(128)
        with rt.phase("backward", device=0):
            b = torch.empty(128)
            del a
    assert [p.name for p in rt.phases] == ["forward", "backward"]
    assert [b for _, b in rt.timeline(0)] == [0, 512, 1024, 512]
    assert rt.counters[0].peak_phase == "backward"
    del b


def test_unknown_device_is_refused() -> None:
    rt = VirtualDevices(2)
    with pytest.raises(VirtualDeviceError, match="does not exist"):
        rt.device(2)
