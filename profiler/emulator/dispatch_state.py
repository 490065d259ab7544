"""What the virtual devices' dispatch mode has set now (the current device, category and
phase, a forced placement), read by the mode and by the ledger of storages it holds; the
device index of the host; the error a real GPU's refusal becomes."""

from __future__ import annotations

from dataclasses import dataclass

HOST = -1  # the device index of the host


class VirtualDeviceError(RuntimeError):
    """The program did something a real GPU would refuse (tensors on two devices)."""


@dataclass
class DispatchState:
    """The contexts the dispatch mode's callers have entered (one object, shared by the
    mode and its parts: every storage allocated reads the category and the phase)."""

    category: str = "activations"
    device: int = HOST
    forced: int | None = None  # place every new storage here (copies between devices)
    allow_cross: bool = False
    phase: str = ""
    # torch's own code that names the device of an emulated tensor (``device=x.device``,
    # which is meta underneath) means this virtual device (None: the rules of dispatch)
    meta_device: int | None = None
