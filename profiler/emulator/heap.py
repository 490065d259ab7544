"""The garbage collector during an emulation.

An emulation makes many objects (autograd nodes, meta tensors, replicas), so CPython's
collector runs now and then a full collection, which scans every object of the process:
torch's own (hundreds of thousands, made by ``import torch``) as well as the emulation's.
Those are not the emulation's garbage. :func:`frozen_heap` moves the objects that exist when
it starts into the collector's permanent generation (``gc.freeze``) and back when it ends
(``gc.unfreeze``), so that a full collection during the emulation scans only what the
emulation made. Nothing is kept alive by it: an object that becomes garbage meanwhile is
collected after the emulation, by the next collection. The collector still runs, so when a
storage dies does not change (a storage freed by the collector dies in a collection that
scans what the emulation made, where its cycle was made).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Full collections skip the objects older than this context (see the module's doc).
    A no-op when something else froze objects already (an enclosing context, the program)."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
