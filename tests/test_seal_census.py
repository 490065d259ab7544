"""The check after each run, read from the kernel's record of changes (inotify) instead of a
walk that stats every file: for any program of changes, by any writer, it finds exactly what
the full walk finds; where the record is not whole, it walks."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpprof.script import census
from dpprof.script.folder_watch import FolderWatch


def tree(root: Path) -> None:
    for k in range(12):
        sub = root / "data" / str(k // 4)
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{k}.bin").write_bytes(bytes([k]) * 8)
    (root / "log.csv").write_text("step,loss\n")
    (root / "link").symlink_to("log.csv")


def walked(before: census.Snapshot) -> list[census.Difference]:
    """What the full walk finds (the record not consulted)."""
    return census.differences(before, census.take(before.roots, watch=False, limit=before.limit))


def from_record(before: census.Snapshot) -> list[census.Difference]:
    assert before.watch is not None and before.watch.complete
    return census.differences(before, census.again(before))


# each change as a writer makes it; "sh" ones by a process of their own, unseen by Python
CHANGES = {
    "rewrite in place (C stdio, a shell)": lambda r: subprocess.run(
        ["sh", "-c", f"printf x > '{r}/data/0/0.bin'"], check=True),
    "append": lambda r: (r / "log.csv").open("a").write("1,0.5\n"),
    "same bytes, old times put back": lambda r: (
        (r / "data/1/4.bin").write_bytes(bytes([4]) * 8),
        os.utime(r / "data/1/4.bin", ns=(0, 0))),
    "chmod": lambda r: (r / "data/1/5.bin").chmod(0o600),
    "remove": lambda r: (r / "data/2/8.bin").unlink(),
    "create": lambda r: (r / "data/0/new.bin").write_bytes(b"n"),
    "atomic replace": lambda r: ((r / "tmp").write_text("t"), os.replace(r / "tmp", r / "log.csv")),
    "folder renamed away": lambda r: os.rename(r / "data/2", r / "elsewhere"),
    "folder removed and made again": lambda r: (
        shutil.rmtree(r / "data/1"), (r / "data/1").mkdir(), (r / "data/1/4.bin").write_text("z")),
    "new folders with files": lambda r: (
        (r / "out/a/b").mkdir(parents=True), (r / "out/a/b/c.txt").write_text("c")),
    "link retargeted": lambda r: ((r / "link").unlink(), (r / "link").symlink_to("data")),
    "a read": lambda r: (r / "data/0/1.bin").read_bytes(),
    "hard link from a folder not watched, written through it (a shell)":
        lambda r: write_through_a_link_outside(r, "data/0/2.bin"),
}


def write_through_a_link_outside(root: Path, rel: str) -> None:
    """A hard link to the user's file made in a folder outside the watched ones, and the
    file appended to through that link by another process: no event of the file's folder
    tells either."""
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir(exist_ok=True)
    link = outside / f"{len(list(outside.iterdir()))}.lnk"
    os.link(root / rel, link)
    subprocess.run(["sh", "-c", f"printf y >> '{link}'"], check=True)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=st.lists(st.sampled_from(sorted(CHANGES)), max_size=5))
def test_the_record_finds_what_the_walk_finds(tmp_path_factory: pytest.TempPathFactory,
                                              program: list[str]) -> None:
    root = tmp_path_factory.mktemp("user")
    tree(root)
    before = census.take([str(root)])
    assert from_record(before) == walked(before) == []
    for change in program:
        with contextlib.suppress(OSError):  # one that needs what an earlier one removed
            CHANGES[change](root)
        # after each run: as the walk, and the same again after a later run (the record
        # keeps what changed since the snapshot, not since the last check)
        assert from_record(before) == walked(before), program


def test_a_change_the_folders_times_do_not_show_is_found(tmp_path: Path) -> None:
    """A file rewritten in place by another process leaves its folder's times as they were:
    the record names it all the same."""
    tree(tmp_path)
    before = census.take([str(tmp_path)])
    folder_before = os.lstat(tmp_path / "data/0")
    subprocess.run(["sh", "-c", f"printf x > '{tmp_path}/data/0/0.bin'"], check=True)
    assert os.lstat(tmp_path / "data/0").st_mtime_ns == folder_before.st_mtime_ns
    assert from_record(before) == [census.Difference(str(tmp_path / "data/0/0.bin"),
                                                     "changed")]


def test_a_write_through_a_hard_link_made_outside_is_found(tmp_path: Path) -> None:
    """``link()`` tells the file's inode, not its folder, and a write through the new link
    is an event of the link's folder: the file's own watch names it."""
    user = tmp_path / "user"
    tree(user)
    before = census.take([str(user)])
    write_through_a_link_outside(user, "data/0/2.bin")
    assert from_record(before) == walked(before) == [
        census.Difference(str(user / "data/0/2.bin"), "changed")]


def test_paths_left_out_are_left_out_of_the_record_too(tmp_path: Path) -> None:
    tree(tmp_path)
    kept = tmp_path / "kept"
    kept.mkdir()
    before = census.take([str(tmp_path)], exclude=[str(kept)])
    (kept / "w.txt").write_text("a write dpprof keeps")
    (tmp_path / "data/0/0.bin").write_bytes(b"changed")
    after = census.again(before, [str(kept)])
    assert census.differences(before, after) == [
        census.Difference(str(tmp_path / "data/0/0.bin"), "changed")]


def test_where_the_record_is_not_whole_the_check_walks(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue that overflowed (or no inotify at all): the walk, finding the change."""
    tree(tmp_path)
    before = census.take([str(tmp_path)])
    assert before.watch is not None
    (tmp_path / "data/0/0.bin").write_bytes(b"changed")
    monkeypatch.setattr(FolderWatch, "changed", lambda self: (
        setattr(self, "complete", False), set())[1])
    walks: list[object] = []
    real_take = census.take
    monkeypatch.setattr(census, "take", lambda *a, **k: walks.append(a) or real_take(*a, **k))
    assert census.differences(before, census.again(before)) == [
        census.Difference(str(tmp_path / "data/0/0.bin"), "changed")]
    assert walks


def test_a_folder_walked_from_moved_away_makes_the_check_walk(tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    tree(user)
    before = census.take([str(user)])
    os.rename(user, tmp_path / "moved")
    assert census.differences(before, census.again(before)) == walked(before) != []


def test_where_no_new_link_can_be_made_a_file_linked_already_is_watched_by_its_inode(
        tmp_path: Path) -> None:
    """``every_inode=False`` (the kernel line): a file with a link outside the watched folders
    before the runs is still watched by its inode: a write through that link is found."""
    user = tmp_path / "user"
    tree(user)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.link(user / "data/0/2.bin", outside / "old.lnk")
    before = census.take([str(user)], every_inode=False)
    subprocess.run(["sh", "-c", f"printf y >> '{outside / 'old.lnk'}'"], check=True)
    assert from_record(before) == walked(before) == [
        census.Difference(str(user / "data/0/2.bin"), "changed")]


def test_every_file_watched_by_its_inode_from_the_run_that_needs_it(tmp_path: Path) -> None:
    """A run that no kernel line holds, after runs that were: from then on a link made from
    a folder not watched, and a write through it, are found."""
    user = tmp_path / "user"
    tree(user)
    before = census.take([str(user)], every_inode=False)
    census.watch_every_inode(before)
    write_through_a_link_outside(user, "data/1/5.bin")
    assert from_record(before) == walked(before) == [
        census.Difference(str(user / "data/1/5.bin"), "changed")]


def test_a_folder_made_again_with_the_old_ones_inode_number_is_walked(tmp_path: Path) -> None:
    """A folder removed and made again may get the inode number of the one removed (ext4
    reuses it): it is another folder, which no watch covers, so a file made in it is found
    only where the check walks it; its old watch saw the folder go."""
    tree(tmp_path)
    before = census.take([str(tmp_path)], every_inode=False)
    old = os.lstat(tmp_path / "data/1").st_ino
    shutil.rmtree(tmp_path / "data/1")
    for _ in range(20):  # until the file system hands the number out again
        (tmp_path / "data/1").mkdir()
        if os.lstat(tmp_path / "data/1").st_ino == old:
            break
        (tmp_path / "data/1").rename(tmp_path / f"data/other-{len(os.listdir(tmp_path))}")
    else:
        pytest.skip("this file system did not reuse the inode number")
    (tmp_path / "data/1/made in the new folder.bin").write_bytes(b"n")
    assert from_record(before) == walked(before)
    assert census.Difference(str(tmp_path / "data/1/made in the new folder.bin"),
                             "created") in from_record(before)


def test_a_file_with_two_links_in_the_folders_is_named_by_both(tmp_path: Path) -> None:
    """One inode, one watch: a write through a third link, made outside, names the file at
    both of its paths the census noted."""
    user = tmp_path / "user"
    tree(user)
    os.link(user / "data/0/2.bin", user / "data/1/two.lnk")
    before = census.take([str(user)])
    write_through_a_link_outside(user, "data/0/2.bin")
    assert from_record(before) == walked(before) == [
        census.Difference(str(user / "data/0/2.bin"), "changed"),
        census.Difference(str(user / "data/1/two.lnk"), "changed")]


LET_GO = """
import os, sys, threading, time
from dpprof.script import census, folder_watch

closed = []  # what each descriptor closed was, by which thread
real_close = os.close


def close(fd):
    closed.append((os.readlink(f"/proc/self/fd/{fd}"), threading.get_ident()))
    real_close(fd)


folder_watch.os.close = close
snap = census.take([sys.argv[1]])
assert snap.watch is not None and snap.watch.complete
closed.clear()  # the first watch of a process finds libc by running ldconfig
del snap
for _ in range(500):
    if closed:
        break
    time.sleep(0.01)
assert [what for what, _ in closed] == ["anon_inode:inotify"], closed
assert closed[0][1] != threading.get_ident(), closed
"""


def test_a_watch_let_go_is_closed_off_the_thread_that_lets_it_go(tmp_path: Path) -> None:
    """Closing an inotify instance waits for the kernel to free its marks (a grace period,
    milliseconds for thousands of watched files): a census let go closes it in a thread of
    its own, and it is closed. In a process of its own: in the suite's, another test's
    watch let go meanwhile is closed too (and its descriptor's number reused)."""
    tree(tmp_path)
    done = subprocess.run([sys.executable, "-c", LET_GO, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
