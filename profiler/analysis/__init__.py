"""The answers computed from a result: the comparison, cuda:0's excess by cause, the fixes,
the largest batch, the equivalence checks."""
