"""The built-in workloads by name, without torch (the CLI's help and defaults name them;
:data:`dpprof.scenarios.workloads.BUILTINS` builds them)."""

from __future__ import annotations

__all__ = ["BUILTIN_WORKLOADS", "DEFAULT"]

BUILTIN_WORKLOADS = ("lm", "mlp", "convnet", "classifier", "attention")
DEFAULT = "lm"  # --workload when not given
