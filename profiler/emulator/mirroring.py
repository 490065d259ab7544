"""Mirroring of DataParallel's replicas: replicas on equal shards run the same program on
their devices, so one runs and the devices of the others mirror its device event for event
(:meth:`ReplicaMirrors.set_mirrors`), over meta tensors only. A part of the virtual devices'
dispatch mode, following its ledger of storages (:class:`~dpprof.emulator.storage_ledger.
StorageLedger`)."""

from __future__ import annotations

import contextlib
import dataclasses
from array import array
from collections.abc import Collection, Iterator, Sequence
from itertools import chain

import numpy as np
import torch

from dpprof.emulator.events import NO_EVENTS, DeviceCounters
from dpprof.emulator.storage_ledger import StorageLedger


class ReplicaMirrors:
    """Which devices mirror which (a device's storages stand for storages on its mirrors
    too), and the mirrors' events, appended to ``ledger``'s log after each event of the
    device they mirror."""

    def __init__(self, ledger: StorageLedger) -> None:
        self.ledger = ledger
        # DataParallel replicas on equal shards: one runs, the devices of the others
        # mirror its device event for event (:meth:`set_mirrors`), over meta tensors only.
        self.dedupe_replicas = False
        self.dedupe_failure: str | None = None  # why mirroring could not stand for a replica
        self.mirrored_replicas = 0  # replica forwards stood for by a mirror, not run
        # the dtype the caller's autocast region asked for where DataParallel's replicas
        # computed in float16 instead (data_parallel.replica_autocast); None: they did not
        self.replicas_float16_instead_of: torch.dtype | None = None
        self._mirrors: dict[int, tuple[int, ...]] = {}  # device -> the devices mirroring it
        self._own: frozenset[int] = frozenset()  # mirrors with events of their own too
        self._unmirrored: frozenset[int] = frozenset()  # mirrors new storages skip for now
        # serial -> (its mirrors' serials, their devices), for its later events
        self._mirror_serials: dict[int, tuple[array[int], array[int]]] = {}
        # the blocks of mirrors' serials: their first serials (ascending), (length, the
        # mirrored storage's serial)
        self._device_columns: dict[tuple[int, ...], array[int]] = {}  # kept: ids are keys
        self._distinct_counters: dict[int, list[DeviceCounters]] = {}
        self._fills: dict[tuple[int, int], array[int]] = {}

    def check_movable(self, serial: int) -> None:
        """Raise where storage ``serial`` is mirrored (it cannot move to another device)."""
        if serial in self._mirror_serials:
            raise ValueError(f"storage {serial} is mirrored: it cannot move")

    def mirror_shift(self, index: int, of: int) -> int | None:
        """How many events after each of device ``of``'s events device ``index`` has the
        same event, when every event of ``index`` is one of ``of``'s so placed (a mirror
        of it, :meth:`set_mirrors`); None otherwise. Such a device's figures are
        ``of``'s, its timeline ``of``'s shifted by that many events."""
        cols, by_device = self.ledger.columns()
        mine, theirs = by_device.get(index, NO_EVENTS), by_device.get(of, NO_EVENTS)
        if len(mine) != len(theirs) or not len(mine):
            return None
        shift = int(mine[0] - theirs[0])
        if shift <= 0 or not np.array_equal(mine - theirs, np.full(len(mine), shift)):
            return None
        for name in ("requested", "allocated"):
            if not np.array_equal(cols[name][mine], cols[name][theirs]):
                return None
        return shift

    def mirrors_of(self, device: int) -> tuple[int, ...]:
        return self._mirrors.get(device, ())

    def mirrored_device(self, index: int) -> int | None:
        """The device ``index`` mirrors now (:meth:`set_mirrors`), if any."""
        for d, ms in self._mirrors.items():
            if index in ms:
                return d
        return None

    def blas_devices(self, device: int) -> tuple[int, ...]:
        """The devices a cuBLAS op run on ``device`` stands for: ``device`` and the devices
        mirroring it."""
        # a mirror runs the op too, at the same place in its own sequence: its cuBLAS
        # handle's workspace goes there, as in the replica it stands for (an output device
        # with events of its own is simulated from its own sequence, not its source's)
        return (device, *(d for d in self._mirrors.get(device, ())
                          if d not in self._unmirrored))

    def following(self) -> bool:
        return bool(self._mirror_serials or self._mirrors)

    def follow(self, device: int, serial: int, requested: int, allocated: int) -> None:
        """The same event on each device mirroring ``serial``'s (once it is mirrored)."""
        entry = self._mirror_serials.get(serial)
        if entry is None:
            devices = self._mirrors.get(device)
            if not devices or requested < 0 or allocated < 0:
                return  # not mirrored, or made before its device was
            if self._unmirrored:
                devices = tuple(d for d in devices if d not in self._unmirrored)
                if not devices:
                    return
                self._device_columns.setdefault(devices, array("q", devices))
            n = len(devices)
            first = self.ledger.new_serials_labelled_as(n, serial)
            entry = (array("q", range(first, first + n)), self._device_columns[devices])
            self._mirror_serials[serial] = entry
        serials, device_column = entry
        n = len(serials)
        log = self.ledger.events
        log.device.extend(device_column)
        log.serial.extend(serials)
        fills = self._fills
        col = fills.get((requested, n))
        log.requested.extend(col if col is not None else self._filled(requested, n))
        col = fills.get((allocated, n))
        log.allocated.extend(col if col is not None else self._filled(allocated, n))
        # Each mirror's peak event is the index after this whole run of mirror events: a
        # snapshot there sees the same events of its device as one right after its own
        # event, so the devices of a class stay equal and share their counters.
        at = len(log.device)
        counters = self._distinct_counters.get(id(device_column))
        if counters is None:
            counters = self._class_counters(device_column)
        for c in counters:
            c.live_requested += requested
            c.live_allocated += allocated
            if c.live_allocated > c.peak_allocated:
                c.peak_allocated = c.live_allocated
                c.peak_event = at
                c.peak_phase = self.ledger.state.phase
            if c.live_requested > c.peak_requested:
                c.peak_requested = c.live_requested

    def _filled(self, value: int, n: int) -> array[int]:
        """``value`` ``n`` times, as a column to append (the same sizes recur)."""
        key = (value, n)
        col = self._fills.get(key)
        if col is None:
            if len(self._fills) > 4096:
                self._fills.clear()
            col = self._fills[key] = array("q", (value,)) * n
        return col

    def _class_counters(self, devices: array[int]) -> list[DeviceCounters]:
        """The distinct counters of ``devices`` (a class of mirrors shares one)."""
        seen: dict[int, DeviceCounters] = {}
        for d in devices:
            c = self.ledger.counters[d]
            seen.setdefault(id(c), c)
        found = self._distinct_counters[id(devices)] = list(seen.values())
        return found

    def set_mirrors(self, mirrors: dict[int, Sequence[int]], own: Collection[int] = ()) -> None:
        """From now on every storage made on a device ``d`` in ``mirrors`` stands for one
        on each device of ``mirrors[d]`` too: each of its events (allocation, free,
        resize) is followed by the same event on those devices, in order, under serials
        of their own filed under its category. DataParallel's replicas on equal shards
        run the same program on their devices, so one runs and the others mirror it;
        each device's own sequence of events is then the one it would have. Replaces the
        previous mapping; storages made under it keep their mirrors.

        ``own``: mirrors that also have events of their own (DataParallel's output device:
        the gathered outputs, the loss); they never share counters with their class."""
        for d in (*mirrors, *chain.from_iterable(mirrors.values())):
            self.ledger.check_index(d)
        self._mirrors = {d: tuple(ms) for d, ms in mirrors.items() if ms}
        self._own = frozenset(own)
        for ms in self._mirrors.values():
            self._device_columns.setdefault(ms, array("q", ms))
        # Devices that mirror the same device share one counters object from now on (their
        # events are the same): those that already share one, or that hold nothing (no
        # storage mirrored under an older mapping can reach some of them only) and have
        # equal counters. All others get their own.
        holders: dict[int, list[int]] = {}
        counters = self.ledger.counters
        for i, c in enumerate(counters):
            holders.setdefault(id(c), []).append(i)
        classes = {tuple(sorted(m for m in ms if m not in self._own))
                   for ms in self._mirrors.values()}
        for devices in holders.values():
            if len(devices) > 1 and tuple(devices) not in classes:
                for i in devices[1:]:
                    counters[i] = dataclasses.replace(counters[i])
        for ms in self._mirrors.values():
            shared = [m for m in ms if m not in self._own]
            if not shared:
                continue
            first = counters[shared[0]]
            if all(counters[m] == first and not counters[m].live_requested
                   and not counters[m].live_allocated for m in shared):
                for m in shared[1:]:
                    counters[m] = first
        self._distinct_counters.clear()

    @contextlib.contextmanager
    def not_mirrored_on(self, devices: Collection[int]) -> Iterator[None]:
        """Storages made in the block have no mirror on ``devices`` (a mirror whose own
        program differs there: the output device's share of the gradient is a view)."""
        old = self._unmirrored
        self._unmirrored = old | frozenset(devices)
        try:
            yield
        finally:
            self._unmirrored = old

    def multiplicity(self, device: int) -> int:
        """How many devices ``device``'s storages stand for now (itself and its mirrors)."""
        return 1 + len(self._mirrors.get(device, ()))
