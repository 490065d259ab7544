"""``--ranks``: which ranks of a launched script run besides rank 0 (the words it takes,
what it means in a world of N ranks), without torch: the CLI declares the flag from it;
:mod:`dpprof.script.rank_runs` runs them."""

from __future__ import annotations

from dpprof.errors import UsageError

__all__ = ["RANKS_HELP", "check_ranks", "default_ranks", "ranks_to_run"]

RANKS_HELP = ("The ranks run besides rank 0 (the script as written), each as its own "
              "emulated process: 'last' (the world's last rank; the default over meta "
              "tensors: one more run of the script), 'all', ranks by number (1,3), or "
              "'none' (rank 0 stands for every rank; the default with --compute, where a "
              "rank's run computes the model on the CPU). The report says which ranks ran. "
              "A later rank reads what rank 0's run wrote, even what it removed later (a "
              "shared filesystem), and receives rank 0's broadcast_object_list objects.")


def default_ranks(compute: bool) -> str:
    """``--ranks`` when not given: the last rank over meta tensors (a rank costs one more
    run of the script, memory only), rank 0 alone over CPU tensors (``--compute``: a
    rank's run computes the model for real)."""
    return "none" if compute else "last"


def check_ranks(spec: str) -> str:
    """``--ranks``: the spec, normalised, or one line naming what is wrong."""
    words = [w.strip().lower() for w in spec.split(",") if w.strip()]
    if words in (["last"], ["all"], ["none"]):
        return words[0]
    if words and all(w == "last" or w.isdigit() for w in words):
        return ",".join(words)
    raise UsageError(f"--ranks {spec!r}: give last, all, none, or rank numbers such as 1,3")


def ranks_to_run(spec: str, world: int) -> tuple[list[int], list[int]]:
    """The ranks other than 0 that ``spec`` (:func:`check_ranks`) runs in a world of
    ``world`` ranks, ascending; and those it names beyond the world (not run)."""
    if world <= 1 or spec == "none":
        return [], []
    if spec == "all":
        return list(range(1, world)), []
    wanted = {world - 1 if w == "last" else int(w) for w in spec.split(",")}
    return (sorted(r for r in wanted if 0 < r < world),
            sorted(r for r in wanted if r >= world))
