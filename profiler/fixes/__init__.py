"""What each fix is: one object per fix (:mod:`~dpprof.fixes.kinds`), its type
(:mod:`~dpprof.fixes.fix_kind`) and the one list of them (:mod:`~dpprof.fixes.fix_registry`).
A fix measures itself through the :class:`~dpprof.fixes.fix_kind.Trial` it is handed, so
this package runs nothing itself: :mod:`dpprof.measure.fix_savings` hands it the emulator."""
