"""What runs scenarios beyond a comparison's own: each fix measured on the user's workload
(:mod:`~dpprof.measure.fix_savings`), the ladder's rungs when no fix fits
(:mod:`~dpprof.measure.ladder`), the largest batch (:mod:`~dpprof.measure.maxbatch_search`),
the math compared with ``single`` (:mod:`~dpprof.measure.equivalence`), and the answer fields
a comparison fills after its scenarios (:mod:`~dpprof.measure.answer_fields`)."""
