"""Every run of the script starts from the same random state, so that paired runs draw the
same data.

dpprof compares runs of one script (as written, with the loss inside forward, with DDP in
place, a rung of the ladder): what a fix saves is the difference between two runs, and it
means that only where both ran the same batches. A script that draws its batches' sizes or
contents at random without seeding (a sequence length from ``random.randint``, a batch size
from ``np.random.choice``, an augmentation's crop) would draw others in each run, and so in
each ``dpprof run``: the same script measured 248 MB on cuda:0 once and 536 MB the next time,
and its alternatives' savings mixed the fix with the data. Each run starts with torch's,
Python's and NumPy's global generators seeded alike (a script's own seeding still applies
from where it seeds); dpprof's own states are restored after it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["SEED", "same_seeds"]

SEED = 0  # what every run's generators start from


@contextlib.contextmanager
def same_seeds() -> Iterator[None]:
    """Inside, torch's (host and devices), Python's and NumPy's global generators start
    from :data:`SEED`; their states before are back after."""
    states = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)
    try:
        yield
    finally:
        torch.random.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
