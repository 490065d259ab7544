"""The variant ledgers of the virtual devices: a device's allocations as a variant of the
program would make them (:class:`VariantLedger`), followed event by event beside the
device's own counters (:class:`VariantLedgers`, a part of the dispatch mode that follows
its ledger of storages)."""

from __future__ import annotations


class VariantLedger:
    """One device's allocations as a variant of the program would make them, where the
    variant differs only in when some storages die: every event of the device counts,
    except a storage's once it is :meth:`detach`-ed (its bytes stay until
    :meth:`release`) or :meth:`release`-d. DDP's ``gradient_as_bucket_view`` is such a
    variant of plain DDP (:class:`dpprof.emulator.ddp.BucketViewFollower`): a
    gradient dies into its bucket's view at its hook, the old buckets live on in the
    gradients at the rebuild.

    ``unsure`` says why the variant could not be followed (a storage shared with
    something the ledger cannot see); the variant must then be emulated on its own.
    """

    def __init__(self) -> None:
        self.live_allocated = self.live_requested = 0
        self.peak_allocated = self.peak_requested = 0
        self.unsure: str | None = None
        # serial -> the bytes a storage that no longer follows its events still holds
        self._detached: dict[int, tuple[int, int]] = {}

    def on_event(self, serial: int, requested: int, allocated: int) -> None:
        if serial not in self._detached:
            self._add(requested, allocated)

    def _add(self, requested: int, allocated: int) -> None:
        self.live_requested += requested
        self.live_allocated += allocated
        self.peak_allocated = max(self.peak_allocated, self.live_allocated)
        self.peak_requested = max(self.peak_requested, self.live_requested)

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_requested = self.live_allocated, self.live_requested

    def detach(self, serial: int, requested: int, allocated: int) -> None:
        """The storage (of these bytes) no longer follows its own events; its bytes stay."""
        self._detached.setdefault(serial, (requested, allocated))

    def release(self, serial: int, requested: int = 0, allocated: int = 0) -> None:
        """The storage dies now in the variant: the bytes it held when detached, else
        these (its own, live); its later events do not count."""
        r, a = self._detached.get(serial, (requested, allocated))
        self._detached[serial] = (0, 0)
        self._add(-r, -a)


class VariantLedgers(dict[int, VariantLedger]):
    """Device -> the variant ledger following its events (set by the caller: DDP's
    ``gradient_as_bucket_view``)."""

    def following(self) -> bool:
        return bool(self)

    def follow(self, device: int, serial: int, requested: int, allocated: int) -> None:
        ledger = self.get(device)
        if ledger is not None:
            ledger.on_event(serial, requested, allocated)

    def reset_peaks(self) -> None:
        for ledger in self.values():
            ledger.reset_peaks()
