"""One module per fix, each its :class:`~dpprof.analysis.fix_kind.FixKind` as ``FIX``;
:mod:`dpprof.analysis.fix_registry` lists them."""
