"""The census taken ahead (in a thread while ``dpprof run`` imports torch), made current at the
first run from the kernel's record of what changed meanwhile: for any program of changes in
that window, by any writer, it is the census a walk takes then, and the check after the runs
finds what the full walk finds (a file made in the window watched by its inode as the walk
watches it); where it is not the census asked for, it is not used."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_seal_census import CHANGES, from_record, tree, walked, write_through_a_link_outside

from dpprof.script import census, census_ahead

# changes of the run after the window that reach files the window may have made anew: a
# hard link from a folder not watched, written through by another process
RUN_CHANGES = {
    **CHANGES,
    "hard link to a file the window made, written through it": lambda r: (
        write_through_a_link_outside(r, "data/0/new.bin")),
    "hard link to a file the window replaced, written through it": lambda r: (
        write_through_a_link_outside(r, "log.csv")),
}


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(window=st.lists(st.sampled_from(sorted(CHANGES)), max_size=4),
       run=st.lists(st.sampled_from(sorted(RUN_CHANGES)), max_size=3),
       every_inode=st.booleans())
# the second replace's file has the first inode's number again (ext4), its watch gone with it
@example(window=["atomic replace", "atomic replace"],
         run=["hard link to a file the window replaced, written through it"], every_inode=True)
def test_a_census_made_current_is_the_census_taken_then(
        tmp_path_factory: pytest.TempPathFactory, window: list[str], run: list[str],
        every_inode: bool) -> None:
    if not every_inode:  # the kernel line: a link made outside and written through is the
        # one change its record does not name (dpprof.script.census), in the window as after
        window = [c for c in window if "hard link" not in c]
        run = [c for c in run if "hard link" not in c]
    root = tmp_path_factory.mktemp("user")
    tree(root)
    ahead = census.take([str(root)], every_inode=every_inode)
    for change in window:  # while dpprof starts: Python's bytecode, another process
        with contextlib.suppress(OSError):
            CHANGES[change](root)
    assert census.refresh(ahead)
    assert ahead.entries == census.take([str(root)], watch=False).entries, window
    for change in run:
        with contextlib.suppress(OSError):
            RUN_CHANGES[change](root)
        assert from_record(ahead) == walked(ahead), (window, run)


def test_the_census_taken_ahead_is_claimed_where_it_is_the_one_asked_for(
        tmp_path: Path) -> None:
    user = tmp_path / "user"
    tree(user)
    census_ahead.start([str(user)])
    (user / "made meanwhile.pyc").write_bytes(b"\0")
    snap = census_ahead.claim([str(user)], [])
    assert snap is not None and snap.waited_s > 0
    assert snap.entries == census.take([str(user)], watch=False).entries
    assert census_ahead.claim([str(user)], []) is None  # claimed once


@pytest.mark.parametrize("asked", ["other folders", "a folder it noted left out"])
def test_a_census_taken_ahead_of_other_folders_is_not_used(tmp_path: Path, asked: str) -> None:
    user, other = tmp_path / "user", tmp_path / "other"
    tree(user)
    other.mkdir()
    census_ahead.start([str(user)])
    if asked == "other folders":
        assert census_ahead.claim([str(user), str(other)], []) is None
    else:
        assert census_ahead.claim([str(user)], [str(user / "data")]) is None
