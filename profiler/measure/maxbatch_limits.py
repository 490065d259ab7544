"""The largest-batch search's fixed numbers, without torch (the CLI's help names them;
:mod:`dpprof.measure.maxbatch_search` searches with them)."""

from __future__ import annotations

__all__ = ["DEFAULT_UPPER", "LADDER_MICRO_BATCHES"]

# gradient accumulation's rung in the largest-batch search: the micro-batches per step
LADDER_MICRO_BATCHES = 4
DEFAULT_UPPER = 1 << 22  # rows: a search bound, reported as "capped" when reached
