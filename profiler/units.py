"""Parsing and formatting of byte sizes. Bytes inside; human units only at the edges."""

from __future__ import annotations

import re

BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
DECIMAL_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))

# Every unit name a size may carry, lower case: the binary and decimal units, "bytes" (as
# PyTorch's format_size prints small sizes) and the one-letter shorthands, which are binary
# as in nvidia-smi and PyTorch's messages ("24G" = 24 GiB).
UNIT_BYTES: dict[str, int] = {
    "": 1,
    "bytes": 1,
    **{name.lower(): size for name, size in BINARY_UNITS + DECIMAL_UNITS},
    **{name[0].lower(): size for name, size in BINARY_UNITS if name != "B"},
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920; ``"40GB"`` -> 40e9; a bare number is bytes.

    Raises ValueError with a message that shows the accepted forms.
    """
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in UNIT_BYTES:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number and a unit, "
            "e.g. 80GiB, 40GB, 24G (= GiB) or 512MiB"
        )
    value = float(m.group(1)) * UNIT_BYTES[unit]
    if value <= 0:
        raise ValueError(f"size {text!r} must be larger than zero")
    return int(value)


def has_unit(text: str) -> bool:
    """Does ``text`` name its unit (``80GiB``, ``512 MiB``), not only a number (``80``)?"""
    m = _SIZE.match(str(text))
    return bool(m and m.group(2))


def fmt_bytes(n: float | int | None, signed: bool = False) -> str:
    """Binary units, three significant digits: 1536 -> '1.50 KiB'."""
    if n is None:
        return "n/a"
    sign = ""
    if n < 0:
        sign, n = "-", -n
    elif signed:
        sign = "+"
    for unit, size in BINARY_UNITS[:-1]:
        if n >= size:
            v = n / size
            digits = 2 if v < 10 else 1 if v < 100 else 0
            return f"{sign}{v:.{digits}f} {unit}"
    return f"{sign}{int(n)} B"


def unit_for(values: list[int] | list[float]) -> tuple[str, int]:
    """The binary unit :func:`fmt_bytes` would print the largest of ``values`` in, and its
    size: one unit for a table or a chart whose numbers are compared."""
    top = max((abs(v) for v in values), default=0)
    return next(((u, size) for u, size in BINARY_UNITS if top >= size), ("B", 1))
