"""DDP's ``gradient_as_bucket_view=True``, as ``dpprof run`` measures it (the
``gradient-as-bucket-view`` fix's strategy, :mod:`dpprof.fixes.kinds.bucket_view`): not a
run of its own. The rank of an alternative that runs as DDP follows the option in a ledger
of its device while it runs plain (:meth:`dpprof.script.ddp_run.DdpInPlace.after_run`); the
fix is that rank's peak under the option, its change DDP's diff with the flag."""

from __future__ import annotations

from dpprof.fixes.kinds.bucket_view import FIX
from dpprof.result import STATUS_ERROR, Fix
from dpprof.script.ddp_run import ddp_state, diff_ddp
from dpprof.script.strategy import AlternativeRuns, RunStrategy
from dpprof.units import fmt_bytes

__all__ = ["STRATEGY", "BucketViewRun"]


class BucketViewRun(RunStrategy):
    """The fix read from the ledger a DDP alternative's rank followed (see the module)."""

    def measure(self, runs: AlternativeRuns) -> None:
        found = next(((alt, state) for alt, state in ((alt, ddp_state(alt)) for _, alt in runs.runs)
                      if state is not None and (state.bucket_view_peak_bytes is not None
                                                or state.bucket_view_unsure is not None)), None)
        if found is None:
            return
        alt, followed = found
        main = runs.main
        if alt.scenario.status == STATUS_ERROR:  # the DDP run it was followed in failed
            return
        if followed.bucket_view_peak_bytes is None or not main.scenario.devices:
            if followed.bucket_view_unsure:
                runs.notes.append("no gradient_as_bucket_view alternative: "
                                  f"{followed.bucket_view_unsure}")
            return
        p0 = main.scenario.devices[0].peak_allocated_bytes
        q = followed.bucket_view_peak_bytes
        plain = max((d.peak_allocated_bytes for d in alt.scenario.devices), default=q)
        extra = plain - q
        runs.fixes.append(Fix(
            name=self.name, title=self.kind.title, primary_peak_bytes=q, max_peak_bytes=q,
            saves_bytes=p0 - q,
            detail=f".grad becomes a view of the reducer's bucket: {fmt_bytes(extra)} less "
            "than plain DDP per GPU at the peak" + (
                "" if extra > 0 else " (the peak comes before the gradients all exist; "
                "the gradient-sized copy is still saved later in the step)"),
            code=diff_ddp(main, runs.gpus, followed, runs.cfg.launch.script_file,
                          bucket_view=True)))


STRATEGY = BucketViewRun(FIX)
