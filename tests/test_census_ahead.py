"""The census taken ahead (in a thread while ``dpprof run`` imports torch), made current at the
first run from the kernel's record of what changed meanwhile: for any program of changes in
that window, by any writer, it is the census a walk takes then, and the check after the runs
finds what the full walk finds (a file made in the window watched by its inode as the walk
watches it); where it is not the census asked for, it is not used."""

from __future__ import annotations

import contextlib
import subprocess
import sys
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


TAKEN_BY_A_CHILD = """
import os, sys
from dpprof.script import census, census_ahead

user, pids = sys.argv[1], sys.argv[2]
take = census.take


def noting_its_process(*args, **kwargs):
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\\n")
    return take(*args, **kwargs)


census.take = noting_its_process
census_ahead.start([user])
with open(os.path.join(user, "made meanwhile.pyc"), "wb") as f:
    f.write(b"\\0")
snap = census_ahead.claim([user], [])
assert snap is not None and snap.watch is not None and snap.watch.complete
assert snap.entries == take([user], watch=False).entries
os.link(os.path.join(user, "log.csv"), os.path.join(sys.argv[3], "elsewhere"))
with open(os.path.join(sys.argv[3], "elsewhere"), "a") as f:  # a link the record cannot name
    f.write("written through a link from a folder nobody watches\\n")
assert os.path.join(user, "log.csv") in snap.watch.changed(), snap.watch.changed()
print("parent", os.getpid())
"""


def test_the_console_script_takes_the_census_in_a_child_into_its_own_record(
        tmp_path: Path) -> None:
    """``dpprof run``'s process has one thread when it begins the census: it forks, and the
    child takes the census into the kernel's record the parent made (one inotify instance),
    handing back the snapshot and its watches. The parent's record then names what a run
    changes, also through a file's own watch, which the child made; the snapshot is the
    walk's."""
    user, outside = tmp_path / "user", tmp_path / "outside"
    tree(user)
    outside.mkdir()
    pids = tmp_path / "pids.txt"
    done = subprocess.run([sys.executable, "-c", TAKEN_BY_A_CHILD, str(user), str(pids),
                           str(outside)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    parent = int(done.stdout.split()[-1])
    taken_by = [int(p) for p in pids.read_text().split()]
    assert len(taken_by) == 1 and taken_by[0] != parent
