"""``dpprof run -- python train.py``: the user's unmodified script on virtual GPUs.

:mod:`~dpprof.script.launch` parses the command; :mod:`~dpprof.script.runner` runs the
script once, measured, with :mod:`~dpprof.script.hooks` counting its steps and
:mod:`~dpprof.script.wrappers` re-enacting its parallel wrappers; :mod:`~dpprof.script.effects`
keeps its writes out of the user's files; :mod:`~dpprof.script.session` runs it as written and
as each alternative, :mod:`~dpprof.script.rungs` the ladder's rungs;
:mod:`~dpprof.script.notes` says what the runs found, and :mod:`~dpprof.script.rewrite` (over
:mod:`~dpprof.script.source`) writes each change as a diff of the script's own lines.
"""
