"""Import torchvision's Python models over a torch whose build its C ops do not match.

PyPI's torchvision wheels are built against CUDA torch; over the CPU wheel their C
extension does not load, and ``import torchvision`` then fails in its fake-kernel
registrations for ``torchvision::nms`` / ``qnms`` ("operator ... does not exist"). The
models are pure Python and need none of the ops: declaring the two schemas lets the
import finish. Nothing else is faked; on a matching install this does nothing.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIB: object | None = None


def import_torchvision() -> ModuleType:
    """``import torchvision`` (declaring the two schemas first when its ops are missing)."""
    global _LIB
    import torch

    try:
        return importlib.import_module("torchvision")
    except RuntimeError as e:
        if "torchvision::" not in str(e) or _LIB is not None:
            raise
    import sys

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS.values():
        with contextlib.suppress(RuntimeError):  # already declared (a loaded extension)
            lib.define(schema)
    _LIB = lib
    return importlib.import_module("torchvision")
