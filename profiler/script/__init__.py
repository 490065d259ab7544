"""``dpprof run -- python train.py``: the user's unmodified script on virtual GPUs.

:mod:`~dpprof.script.launch` parses the command; :mod:`~dpprof.script.runner` runs the
script once, measured, with :mod:`~dpprof.script.hooks` counting its steps and
:mod:`~dpprof.script.wrappers` re-enacting its parallel wrappers (the loss inside forward's
deferred outputs, :mod:`~dpprof.script.deferred_outputs`); :mod:`~dpprof.script.effects`
keeps its writes out of the user's files; :mod:`~dpprof.script.session` runs it as written and
measures each fix that has a strategy (:mod:`~dpprof.script.strategy`, one module per fix
named after it: :mod:`~dpprof.script.loss_in_forward_run`, :mod:`~dpprof.script.ddp_run`,
:mod:`~dpprof.script.gradient_as_bucket_view_run`, found by
:mod:`~dpprof.script.strategy_registry`), :mod:`~dpprof.script.rungs` the ladder's rungs;
:mod:`~dpprof.script.notes` says what the runs found, and the rewrites
(:mod:`~dpprof.script.rewrite`, one module per change, over :mod:`~dpprof.script.source`)
write each change as a diff of the script's own lines.
"""
