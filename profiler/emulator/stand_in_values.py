"""The values an emulation over meta tensors makes up where a script reads one it does not
know (:meth:`dpprof.emulator.cuda_devices.CudaDevices.stand_in`), and their count by kind
and by the script's line, which the report states."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpprof.emulator.call_sites import caller_site

__all__ = ["STAND_INS", "STAND_IN_BOOL", "STAND_IN_FLOAT", "STAND_IN_INT", "StandIns"]

STAND_IN_FLOAT = 1.0
STAND_IN_INT = 1
STAND_IN_BOOL = False
STAND_INS = (
    f"values read from emulated tensors are stand-ins: floats {STAND_IN_FLOAT}, integers "
    f"{STAND_IN_INT}, booleans {STAND_IN_BOOL}, "
    "host copies (.cpu(), .numpy(), .tolist()) zeros, and an op whose output's shape "
    "depends on values (x[mask], nonzero, unique) takes the shape those zeros give it (a "
    "mask selects nothing); the values are finite: torch.isfinite answers True, "
    "torch.isnan and torch.isinf False, and GradScaler finds no inf"
)


@dataclass
class StandIns:
    """Values the emulation made up, counted by kind and by the user's line."""

    counts: dict[str, int] = field(default_factory=dict)
    sites: dict[str, int] = field(default_factory=dict)  # "file:line (kind)" -> count

    def add(self, kind: str, times: int = 1) -> None:
        """One more value of ``kind`` made up (``times``: for a mirrored DataParallel
        replica, once for each replica it stands for)."""
        self.counts[kind] = self.counts.get(kind, 0) + times
        key = f"{caller_site()} ({kind})"
        self.sites[key] = self.sites.get(key, 0) + times

    @property
    def total(self) -> int:
        return sum(self.counts.values())
