"""The virtual-device runtime's rules, each on a small hand-checked case."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dpprof.emulator.allocator_config import block_bytes
from dpprof.emulator.device_copies import to_device
from dpprof.emulator.dispatch_state import HOST, VirtualDeviceError
from dpprof.emulator.virtual_devices import VirtualDevices


@pytest.fixture(params=["meta", "cpu"])
def rt(request: pytest.FixtureRequest) -> VirtualDevices:
    return VirtualDevices(2, base=request.param)


def test_factories_take_the_current_device_and_round(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(1):
            t = torch.empty(100)  # 400 B requested, 512 B allocated
        assert rt.storages.device_of(t) == 1
        assert rt.storages.counters[1].live_requested == 400
        assert rt.storages.counters[1].live_allocated == 512
        assert rt.storages.counters[0].live_allocated == 0
        h = torch.empty(10)  # the host by default: not counted on any GPU
        assert rt.storages.device_of(h) == HOST
    assert rt.storages.counters[0].live_allocated == 0


def test_outputs_follow_inputs_and_views_are_free(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(1):
            a = torch.ones(256)  # 1 KiB
        with rt.device(0):  # the current device does not matter when inputs exist
            b = a * 2
            v = b[10:20]
            b.add_(1)  # in place: no new storage
        assert rt.storages.device_of(b) == 1 and rt.storages.device_of(v) == 1
        assert rt.storages.counters[1].live_allocated == 2048
        assert rt.storages.counters[0].live_allocated == 0


def test_host_scalars_mix_with_device_tensors(rt: VirtualDevices) -> None:
    with rt:
        s = torch.tensor(3.0)  # host 0-dim
        with rt.device(1):
            a = torch.ones(8)
        b = a * s
        assert rt.storages.device_of(b) == 1
        assert rt.storages.device_of(s + 1) == HOST


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
        assert rt.storages.counters[0].live_allocated == 4096  # the view keeps the storage
        del v
        assert rt.storages.counters[0].live_allocated == 0
        assert rt.storages.counters[0].peak_allocated == 4096


def test_crossing_copies_forward_and_gradient_back(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(0):
            w = torch.ones(128, requires_grad=True)  # 512 B on cuda:0
            x = w * 2
        y = to_device(rt, x, 1)
        assert rt.storages.device_of(y) == 1
        assert to_device(rt, y, 1) is y  # already there: no copy, as tensor.to
        before0 = rt.storages.counters[0].live_allocated
        with rt.device(1):
            y.sum().backward()
        assert rt.storages.device_of(w.grad) == 0  # the gradient came back to cuda:0
        assert rt.storages.counters[0].live_allocated == before0 + 512  # w.grad


def test_categories_labels_and_peak_snapshot(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(0), rt.category("parameters"):
            p = torch.empty(256)  # 1 KiB
        rt.reset_peaks()
        with rt.device(0), rt.category("activations"):
            a = torch.empty(512)  # 2 KiB
            g = torch.empty(256)  # 1 KiB, later becomes a gradient
        rt.storages.label(g, "gradients")
        del a
        snap = rt.storages.peak_snapshot(0)
        assert snap.allocated_bytes == rt.storages.counters[0].peak_allocated == 4096
        assert snap.by_category == {"parameters": 1024, "activations": 2048, "gradients": 1024}
        assert rt.storages.live_bytes(0) == 2048
        del p, g


def test_an_event_cut_in_half_by_a_stop_signal_is_not_in_the_log(rt: VirtualDevices) -> None:
    """A stop signal raises between any two bytecodes of the script's time, so also between
    the appends of one event's columns: the event is taken out again and the log reads as
    before it, its columns aligned for the frees that follow (an interrupted run's partial
    result read a device column one longer than the others: an internal error "index 17 is
    out of bounds for axis 0 with size 17" where exit 143 was due)."""
    from array import array

    class SignalOnAppend(array):  # type: ignore[type-arg]
        signals = 1  # the first append: the signal's handler raises; then appended as usual

        def append(self, value: int) -> None:
            if SignalOnAppend.signals:
                SignalOnAppend.signals -= 1
                raise KeyboardInterrupt
            super().append(value)

    with rt:
        with rt.device(0), rt.category("activations"):
            a = torch.empty(512)  # 2 KiB
        log = rt.storages.events
        whole = list(log)
        serial = log.serial
        log.serial = SignalOnAppend("q", serial)
        with pytest.raises(KeyboardInterrupt), rt.device(1):
            torch.empty(256)  # its device column appended, then the signal
        log.serial = array("q", log.serial)
        assert {len(c) for c in (log.device, log.serial, log.requested, log.allocated)} == \
            {len(whole)}
        assert list(log) == whole
        assert rt.storages.live_bytes(1) == 0  # nor is its free, once the tensor is gone
        with rt.device(0), rt.category("activations"):
            b = torch.empty(256)  # 1 KiB, after it: on the device it was made on
        assert log[-1].device == 0 and log[-1].allocated == 1024
        assert sorted(int(i) for ix in log.indices_by_device().values() for i in ix) == \
            list(range(len(log)))
        assert rt.storages.peak_snapshot(0).by_category == {"activations": 3072}
        del a, b


def test_a_stop_signal_in_a_storages_death_is_raised_after_it(
        rt: VirtualDevices, monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage dies in a weak reference's callback, where Python prints an exception and
    drops it: a stop signal whose handler runs there ("Exception ignored in ... _on_dead",
    a traceback under an interrupted run, which went on) is raised once it has returned."""
    import signal
    import sys
    import time

    from dpprof import errors

    monkeypatch.setattr(errors, "_STATE", type(errors._STATE)())  # no signal taken yet
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    previous = signal.signal(signal.SIGINT, errors.on_stop_signal)
    try:
        with rt:
            with rt.device(0):
                t = torch.empty(256)
            free = rt.storages._on_free

            def signal_arrives(key: int) -> None:
                free(key)
                errors.on_stop_signal(signal.SIGINT, sys._getframe())  # its handler, here

            monkeypatch.setattr(rt.storages, "_on_free", signal_arrives)
            with pytest.raises(KeyboardInterrupt):
                del t
                time.sleep(0.2)  # the callback long returned
                for _ in range(100):  # the main thread's next instructions
                    pass
    finally:
        signal.signal(signal.SIGINT, previous)
    assert unraisable == []
    assert rt.storages.live_bytes(0) == 0


def test_reset_peaks_restarts_from_resident(rt: VirtualDevices) -> None:
    with rt:
        with rt.device(0):
            big = torch.empty(4096)
            del big
            keep = torch.empty(256)
        assert rt.storages.counters[0].peak_allocated == 16384
        rt.reset_peaks()
        assert rt.storages.counters[0].peak_allocated == 1024
        del keep


def test_phases_and_timeline(rt: VirtualDevices) -> None:
    with rt:
        with rt.phase("forward", device=0):
            a = torch.empty(128)
        with rt.phase("backward", device=0):
            b = torch.empty(128)
            del a
    assert [p.name for p in rt.storages.phases] == ["forward", "backward"]
    assert [b for _, b in rt.storages.timeline(0)] == [0, 512, 1024, 512]
    assert rt.storages.counters[0].peak_phase == "backward"
    del b


def test_mirrored_devices_repeat_each_event_of_their_devices_storages() -> None:
    rt = VirtualDevices(4)
    with rt:
        with rt.device(1):
            before = torch.empty(256)  # made before the mirrors: cuda:1's alone
        rt.mirrors.set_mirrors({1: [2, 3]})
        assert (rt.mirrors.multiplicity(1), rt.mirrors.multiplicity(2), rt.mirrors.multiplicity(0)) == (3, 1, 1)
        with rt.device(1), rt.category("activations"):
            a = torch.empty(512)  # 2 KiB on cuda:1, and a mirror on cuda:2 and cuda:3
            b = torch.empty(128)
        rt.storages.label(a, "gradients")  # a later label is its mirrors' too
        with rt.device(0):
            c = torch.empty(64)  # cuda:0 is not mirrored
        rt.mirrors.set_mirrors({})  # a storage keeps the mirrors it was made with
        del a, before
        with rt.device(1):
            d = torch.empty(64)  # made after: not mirrored
    log = [(e.device, e.requested) for e in rt.storages.events]
    assert log == [(1, 1024), (1, 2048), (2, 2048), (3, 2048), (1, 512), (2, 512), (3, 512),
                   (0, 256), (1, -2048), (2, -2048), (3, -2048), (1, -1024), (1, 256)]
    assert len({e.serial for e in rt.storages.events if e.requested > 0}) == 9  # a serial each
    for dev in (2, 3):
        assert rt.storages.counters[dev].peak_allocated == 2048 + 512
        assert rt.storages.counters[dev].live_allocated == 512
        snap = rt.storages.peak_snapshot(dev)
        assert snap.by_category == {"gradients": 2048, "activations": 512}
    assert rt.storages.counters[1].live_allocated == 512 + 512
    del b, c, d


def test_unknown_device_is_refused() -> None:
    rt = VirtualDevices(2)
    with pytest.raises(VirtualDeviceError, match="does not exist"):
        rt.device(2)


def _reference_snapshot(events: list[tuple[int, int, int, int]], labels: dict[int, str],
                        index: int, before: int) -> tuple[int, int, dict[str, int]]:
    """The live set replayed event by event: a storage is live after an allocation (or a
    resize's re-allocation), gone after its free or a 0-byte event."""
    live: dict[int, tuple[int, int]] = {}
    for dev, serial, req, alloc in events[:before]:
        if dev != index:
            continue
        if alloc > 0 or req > 0:
            live[serial] = (alloc, req)
        else:
            live.pop(serial, None)
    by_cat: dict[str, int] = {}
    for serial, (a, _) in live.items():
        by_cat[labels.get(serial, "other")] = by_cat.get(labels.get(serial, "other"), 0) + a
    return (sum(a for a, _ in live.values()), sum(r for _, r in live.values()),
            {k: v for k, v in by_cat.items()})


def test_snapshots_and_timelines_match_an_event_by_event_replay() -> None:
    """Read from the log's columns as arrays: the same live sets as replaying the log in
    order, on every device, at every event index (frees, resizes, 0-byte storages, the
    host, devices without events)."""
    import random

    rng = random.Random(7)
    rt = VirtualDevices(3)
    events: list[tuple[int, int, int, int]] = []
    live: dict[int, tuple[int, int]] = {}  # serial -> (device, requested)
    for _ in range(600):
        serial = rng.randrange(1, 80)
        if serial in live:
            dev, req = live[serial]
            if rng.random() < 0.3:  # a resize: the old size freed, the new one allocated
                new = rng.choice([0, 1, 700, 4096])
                events += [(dev, serial, -req, -block_bytes(req)),
                           (dev, serial, new, block_bytes(new))]
                live[serial] = (dev, new)
            else:
                events.append((dev, serial, -req, -block_bytes(req)))
                del live[serial]
        else:
            dev = rng.choice([HOST, 0, 1])
            req = rng.choice([0, 3, 512, 513, 10_000])
            events.append((dev, serial, req, block_bytes(req)))
            live[serial] = (dev, req)
    labels = {s: rng.choice(["parameters", "activations"]) for s in range(1, 80, 2)}
    for ev in events:
        rt.storages.events.add(*ev)
    for s, cat in labels.items():
        rt.storages.set_label(s, cat)
    for index in (0, 1, 2):
        for before in range(0, len(events) + 1, 7):
            snap = rt.storages.snapshot(index, before)
            alloc, req, by_cat = _reference_snapshot(events, labels, index, before)
            assert (snap.allocated_bytes, snap.requested_bytes) == (alloc, req)
            assert {k: v for k, v in snap.by_category.items() if v} == {
                k: v for k, v in by_cat.items() if v}
        for start in (0, 1, 250, len(events)):
            points = rt.storages.timeline(index, start)
            live_bytes = _reference_snapshot(events, labels, index, start)[0]
            want = [(start, live_bytes)]
            for i in range(start, len(events)):
                if events[i][0] == index:
                    live_bytes += events[i][3]
                    want.append((i + 1, live_bytes))
            assert points == want
        assert rt.storages.event_indices(index) == [i for i, e in enumerate(events) if e[0] == index]


def test_frozen_heap_spares_older_objects_and_gives_them_back() -> None:
    """Inside, a full collection skips what existed before (gc.freeze); after, those objects
    are collectable again, nothing stays frozen, and an enclosing freeze is left alone."""
    import gc

    from dpprof.emulator.heap import frozen_heap

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    assert gc.get_freeze_count() == 0
    import weakref

    old = Cycle()
    old_ref = weakref.ref(old)
    del old  # garbage already, but not collected before the context starts
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        new = Cycle()
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None  # the emulation's own garbage is collected
        assert old_ref() is not None  # the older object is skipped
        with frozen_heap():  # nested: leaves the outer freeze alone
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # collectable again after the context


@pytest.mark.parametrize("n_events", [5, 399, 400, 401, 799, 800, 801, 1203, 5000])
def test_timeline_points_keep_the_first_maximum_of_each_equal_slice(n_events: int) -> None:
    """The downsampled timeline (at most TIMELINE_POINTS per device): the maximum of each
    equal slice of the points, the first one where several reach it, as a walk over the
    slices finds them; ties are frequent here (sizes from a small set)."""
    import random

    from dpprof.backends.emulated_figures import TIMELINE_POINTS, timeline_points
    from dpprof.emulator.events import PhaseMark

    rng = random.Random(n_events)
    rt = VirtualDevices(2)
    live: list[tuple[int, int]] = []
    for i in range(n_events):
        if live and rng.random() < 0.45:
            dev, serial = live.pop(rng.randrange(len(live)))
            rt.storages.events.add(dev, serial, -512, -512)
        else:
            dev = rng.choice([0, 1])
            rt.storages.events.add(dev, i + 1, 512, 512)
            live.append((dev, i + 1))
        if i % 97 == 0:
            rt.storages.phases.append(PhaseMark(i, f"phase {i}"))
    for start in (0, n_events // 3):
        for index in (0, 1):
            points = rt.storages.timeline(index, start)
            if len(points) > TIMELINE_POINTS:  # the walk over the slices
                step = len(points) / TIMELINE_POINTS
                points = [max(points[int(k * step): int((k + 1) * step) or None],
                              key=lambda p: p[1]) for k in range(TIMELINE_POINTS)]
            got = timeline_points(rt, index, start)
            assert [(p.t, p.allocated_bytes) for p in got] == [
                (float(ev - start), b) for ev, b in points]
            marks = [(m.event_index, m.name) for m in rt.storages.phases if m.event_index >= start]
            assert [p.phase for p in got] == [
                ([name for idx, name in marks if idx <= ev] or [""])[-1] for ev, _ in points]


def test_in_place_updates_that_return_nothing_are_skipped_over_meta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An optimizer's foreach updates allocate nothing: over meta their (Python) meta
    kernels are skipped, with the same events as running them; host tensors still run."""
    import dpprof.emulator.op_memo as op_memo

    def adamw_steps(skip: bool) -> tuple[list[tuple[int, int, int]], float]:
        monkeypatch.setattr(op_memo, "_IN_PLACE_ONLY", {})
        if not skip:
            monkeypatch.setattr(op_memo, "writes_in_place_only", lambda func: False)
        rt = VirtualDevices(1)
        with rt, rt.device(0):
            lin = torch.nn.Linear(64, 32, device="meta")
            opt = torch.optim.AdamW(lin.parameters(), foreach=True)
            for _ in range(2):
                lin(torch.empty(8, 64, device="meta")).sum().backward()
                opt.step()
                opt.zero_grad()
        monkeypatch.undo()
        step = float(next(iter(opt.state.values()))["step"])  # a host tensor: it ran
        return [(e.device, e.requested, e.allocated) for e in rt.storages.events], step

    skipped, steps = adamw_steps(skip=True)
    assert op_memo.writes_in_place_only(torch.ops.aten._foreach_lerp_.Scalar)
    assert not op_memo.writes_in_place_only(torch.ops.aten._foreach_add.List)  # allocates
    assert adamw_steps(skip=False) == (skipped, steps)
    assert steps == 2.0


def memo_run(monkeypatch: pytest.MonkeyPatch, skip: bool, switch: str,
             body: Callable[[], Any]) -> tuple[list[tuple[int, int, int]], Any, int]:
    """``body`` on one virtual device with a fresh op memo, its path ``switch`` (the op_memo
    function that picks it) on, or off (``skip`` False): the events, what ``body`` gave and
    the memo's hits."""
    import dpprof.emulator.op_memo as op_memo

    monkeypatch.setattr(op_memo, "OP_MEMO", op_memo.OpMemo())
    if not skip:
        monkeypatch.setattr(op_memo, switch, lambda func: None)
    rt = VirtualDevices(1)
    with rt, rt.device(0):
        result = body()
    monkeypatch.undo()
    return ([(e.device, e.requested, e.allocated) for e in rt.storages.events], result,
            rt.memo.cache_hits)


def test_out_variants_into_a_tensor_of_their_shape_skip_the_kernel_over_meta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DDP's ``mul(grad, 1 / N, out=view)``, FSDP2's copies into a list of buffers: where
    the same op on the same metadata once left ``out`` unresized, its meta kernel is not
    run again; ``out`` (or nothing) comes back, the events as running it; an ``out`` it
    must resize is run every time."""
    import dpprof.emulator.op_memo as op_memo

    def body() -> list[tuple[int, ...]]:
        shapes = []
        bucket = torch.empty(96)
        grads = [torch.empty(8, 4), torch.empty(8, 4)]
        for _ in range(3):
            for k, g in enumerate(grads):
                view = bucket[32 * k:32 * (k + 1)].view(8, 4)
                got = torch.mul(g, 0.25, out=view)
                assert got is view
            parts = [torch.empty(4, 4), torch.empty(4, 4)]
            torch.split_with_sizes_copy(grads[0], [4, 4], out=parts)  # returns nothing
        small = torch.empty(0)
        for _ in range(2):  # resized: a new storage each time, counted
            torch.mul(grads[0], 0.25, out=small)
            shapes.append(tuple(small.shape))
            small = torch.empty(0)
        return shapes

    def run(skip: bool) -> tuple[list[tuple[int, int, int]], Any, int]:
        return memo_run(monkeypatch, skip, "out_argument", body)

    events, shapes, hits = run(skip=True)
    assert op_memo.out_argument(torch.ops.aten.mul.out) == ("out", True)
    assert op_memo.out_argument(torch.ops.aten.split_with_sizes_copy.out) == ("out", False)
    assert op_memo.out_argument(torch.ops.aten.mul.Tensor) is None
    assert op_memo.out_argument(torch.ops.aten.add_.Tensor) is None
    plain_events, plain_shapes, plain_hits = run(skip=False)
    assert (events, shapes) == (plain_events, plain_shapes)
    assert shapes == [(8, 4), (8, 4)]
    assert hits - plain_hits == 6  # the second and third round of each copy


def test_in_place_ops_on_their_shapes_skip_the_kernel_over_meta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An LSTM cell's ``sigmoid_``, ``tanh_`` and ``add_``: where the same in-place op on
    the same metadata once returned its tensor unresized, its meta kernel is not run again;
    the tensor comes back and the events are those of running it; a shape it cannot take
    still raises, and ``resize_`` (which changes its tensor) runs every time."""
    import dpprof.emulator.op_memo as op_memo

    def body() -> list[tuple[int, ...]]:
        shapes = []
        gates, cell = torch.empty(20, 800), torch.empty(20, 200)
        for _ in range(3):
            assert gates.sigmoid_() is gates
            assert cell.add_(gates[:, :200]) is cell
            with pytest.raises(RuntimeError):
                cell.add_(gates)  # (20, 800) does not broadcast into (20, 200)
        grown = torch.empty(4)
        for n in (8, 16):
            grown.resize_(n)
            shapes.append(tuple(grown.shape))
        return shapes

    def run(skip: bool) -> tuple[list[tuple[int, int, int]], Any, int]:
        return memo_run(monkeypatch, skip, "writes_self_only", body)

    events, shapes, hits = run(skip=True)
    assert op_memo.writes_self_only(torch.ops.aten.sigmoid_.default)
    assert op_memo.writes_self_only(torch.ops.aten.add_.Tensor)
    assert not op_memo.writes_self_only(torch.ops.aten.add.Tensor)  # allocates
    assert not op_memo.writes_self_only(torch.ops.aten.mul.out)  # writes out=, not self
    assert not op_memo.writes_self_only(torch.ops.aten.uniform_.default)  # draws numbers
    plain_events, plain_shapes, plain_hits = run(skip=False)
    assert (events, shapes) == (plain_events, plain_shapes)
    assert shapes == [(8,), (16,)]
    assert hits - plain_hits == 4  # the second and third round of sigmoid_ and add_


def test_mirror_classes_can_change_between_mappings() -> None:
    """Devices of a class share their counts only while they mirror the same device."""
    rt = VirtualDevices(5)
    with rt:
        rt.mirrors.set_mirrors({1: [2, 3, 4]})
        with rt.device(1):
            a = torch.empty(256)  # 1 KiB on cuda:1..4
        del a
        rt.mirrors.set_mirrors({1: [2, 3]})  # cuda:4 leaves the class
        with rt.device(1):
            b = torch.empty(512)  # 2 KiB on cuda:1..3
        with rt.device(4):
            c = torch.empty(64)
        rt.mirrors.set_mirrors({})
        with rt.device(3):
            d = torch.empty(128)  # cuda:3 alone now
    peaks = [rt.storages.counters[i].peak_allocated for i in range(5)]
    live = [rt.storages.counters[i].live_allocated for i in range(5)]
    assert peaks == [0, 2048, 2048, 2560, 1024]
    assert live == [0, 2048, 2048, 2560, 512]
    del b, c, d


class _ZerosInBackward(torch.autograd.Function):
    """A backward formula that makes a tensor from nothing (as ``at::zeros`` in one)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        scratch = torch.zeros(100)  # 400 B, no tensor input, no device
        return grad * 2 + scratch.sum()


def test_a_factory_inside_backward_lands_on_the_nodes_device(rt: VirtualDevices) -> None:
    """CUDA's engine runs a node under its device's guard: a factory in cuda:1's backward
    is on cuda:1, whatever the current device (cuda:0 here)."""
    with rt:
        with rt.device(1):
            x = torch.ones(8, requires_grad=True)
        with rt.device(0):
            _ZerosInBackward.apply(x).sum().backward()
            y = torch.empty(100)  # outside backward: the current device again
    on = {e.device for e in rt.storages.events if abs(e.requested) == 400}
    assert on == {1, 0}
    assert [e.device for e in rt.storages.events if e.requested == 400] == [1, 0]
    del x, y
