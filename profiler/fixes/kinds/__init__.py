"""One module per fix, each its :class:`~dpprof.fixes.fix_kind.FixKind` as ``FIX``;
:mod:`dpprof.fixes.fix_registry` lists them."""
