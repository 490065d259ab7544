"""The census' shortcut (dpprof.script.tree_watch): the check after a run skips its walk only
where the walk would find what it found before. Hypothesis generates programs of filesystem
changes, in this process and in a child process (a writer Python's line never sees), and the
check with the watch must find exactly what a full walk finds."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpprof.script import census

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify: Linux")


def _tree(root: Path) -> None:
    (root / "data" / "deep").mkdir(parents=True)
    for i in range(3):
        (root / f"f{i}.txt").write_text("x" * 10)
        (root / "data" / f"d{i}.bin").write_bytes(b"\0" * 10)
    (root / "data" / "deep" / "w.pt").write_bytes(b"w")
    (root / "link").symlink_to("f0.txt")


def _found(snap: census.Snapshot, exclude: Sequence[str] = ()) -> list[census.Difference]:
    return census.differences(snap, census.again(snap, exclude))


def _walked(snap: census.Snapshot, exclude: Sequence[str] = ()) -> list[census.Difference]:
    return census.differences(snap, census.take(snap.roots, exclude, snap.limit))


def test_nothing_changed_skips_the_walk(tmp_path: Path) -> None:
    _tree(tmp_path)
    snap = census.take([str(tmp_path)], watch=True)
    (tmp_path / "f1.txt").read_text()  # reads are no change
    os.listdir(tmp_path / "data")
    assert census.again(snap) is snap
    assert census.again(snap) is snap


def test_a_change_by_another_process_is_found_and_every_later_check_walks(
        tmp_path: Path) -> None:
    _tree(tmp_path)
    snap = census.take([str(tmp_path)], watch=True)
    subprocess.run(["sh", "-c", f"printf z >> '{tmp_path}/data/d1.bin'"], check=True)
    assert [(d.path, d.what) for d in _found(snap)] == [
        (str(tmp_path / "data" / "d1.bin"), "changed")]
    after = census.again(snap)  # the file stays changed: each later run is told so too
    assert after is not snap and census.differences(snap, after)


def test_events_in_an_excluded_folder_are_not_the_users(tmp_path: Path) -> None:
    _tree(tmp_path)
    kept = tmp_path / "kept"
    snap = census.take([str(tmp_path)], [str(kept)], watch=True)
    kept.mkdir()
    (kept / "ckpt.pt").write_bytes(b"1")
    assert census.again(snap, [str(kept)]) is snap


def test_a_file_mapped_for_writing_is_walked_for(tmp_path: Path) -> None:
    _tree(tmp_path)
    snap = census.take([str(tmp_path)], watch=True)
    fd = os.open(tmp_path / "f2.txt", os.O_RDWR)
    try:
        with mmap.mmap(fd, 10) as m:
            m[:1] = b"y"  # a store raises no event
            assert census.again(snap) is not snap
    finally:
        os.close(fd)


def test_a_census_cut_at_its_limit_watches_what_it_noted(tmp_path: Path) -> None:
    _tree(tmp_path)
    snap = census.take([str(tmp_path)], limit=3, watch=True)
    assert not snap.complete
    assert census.again(snap) is snap
    (tmp_path / "data" / "d0.bin").write_bytes(b"changed")  # not among the 3 noted
    assert _found(snap) == _walked(snap)


_NAMES = st.sampled_from(["f0.txt", "f1.txt", "data/d0.bin", "data/deep/w.pt", "new.txt",
                          "data/new.bin", "data/deep", "link"])
OPS = st.one_of(
    st.tuples(st.just("append"), _NAMES), st.tuples(st.just("write"), _NAMES),
    st.tuples(st.just("truncate"), _NAMES), st.tuples(st.just("chmod"), _NAMES),
    st.tuples(st.just("utime"), _NAMES), st.tuples(st.just("remove"), _NAMES),
    st.tuples(st.just("rename"), _NAMES, _NAMES), st.tuples(st.just("mkdir"), _NAMES),
    st.tuples(st.just("hardlink"), _NAMES, _NAMES), st.tuples(st.just("read"), _NAMES),
    st.tuples(st.just("child_append"), _NAMES),
)


def _apply(root: Path, op: tuple[str, ...]) -> None:
    p = root / op[1]
    try:
        if op[0] == "append":
            with open(p, "ab") as f:
                f.write(b"+")
        elif op[0] == "write":
            p.write_bytes(b"new")
        elif op[0] == "truncate":
            os.truncate(p, 0)
        elif op[0] == "chmod":
            os.chmod(p, 0o600, follow_symlinks=False) if not p.is_symlink() else None
        elif op[0] == "utime":
            os.utime(p, ns=(1, 1), follow_symlinks=False)
        elif op[0] == "remove":
            os.rmdir(p) if p.is_dir() and not p.is_symlink() else os.unlink(p)
        elif op[0] == "rename":
            os.rename(p, root / op[2])
        elif op[0] == "mkdir":
            os.mkdir(p)
        elif op[0] == "hardlink":
            os.link(p, root / op[2], follow_symlinks=False)
        elif op[0] == "read":
            p.read_bytes()
        elif op[0] == "child_append":
            subprocess.run([sys.executable, "-c",
                            f"open({str(p)!r}, 'ab').write(b'c')"], check=False,
                           capture_output=True)
    except OSError:
        pass  # the op's own failure (a missing file, a folder): no change, as on any run


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(program=st.lists(OPS, min_size=0, max_size=6),
       limit=st.sampled_from([2, 5, census.LIMIT]))
def test_the_watch_finds_what_the_walk_finds(tmp_path_factory: pytest.TempPathFactory,
                                             program: list[tuple[str, ...]],
                                             limit: int) -> None:
    root = tmp_path_factory.mktemp("tree")
    _tree(root)
    snap = census.take([str(root)], limit=limit, watch=True)
    for op in program:
        _apply(root, op)
    assert _found(snap) == _walked(snap)
