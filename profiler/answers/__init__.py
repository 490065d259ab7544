"""The answers: pure functions of a result. The comparison (:mod:`~dpprof.answers.comparison`),
cuda:0's excess by cause (:mod:`~dpprof.answers.attribution`), the figures every answer reads
(:mod:`~dpprof.answers.answer_figures`), ``dpprof watch``'s verdict and post-mortem
(:mod:`~dpprof.answers.post_mortem`), and the one builder of verdicts, recommendations and
notes (:mod:`~dpprof.answers.answer`)."""
