"""The seal's second line: a mount namespace of dpprof's own, where the kernel overlays the
folders a script writes into, so that any writer (C, C++, Rust, a subprocess) writes into the
run's overlay there.

:func:`enter` puts the process into a new user and mount namespace, once, while it has one
thread (the kernel refuses ``unshare(CLONE_NEWUSER)`` to a threaded process): the user
keeps their own uid and gid (root all of them), and nothing mounted here is seen outside.
It is tried first in a forked child (a machine that refuses unprivileged user namespaces,
or overlayfs in them, leaves the process as it was). Then each run mounts a
:class:`KernelOverlay`: a fresh ``tmpfs`` holds, for each sealed folder, a private upper
layer over the real folder (overlayfs, ``userxattr``), and the folders are overlaid
shallowest first (a mount point inside one gets an overlay of its own, over its own
filesystem), each over its real folder as a descriptor opened before any overlay held it and
closed once they are on: while the run is under way no path of the namespace leads to a real
folder (the one way around is another process's ``/proc/PID/root``, which the kernel refuses
across user namespaces where it checks ptrace access, and which no writer of a training
script takes). After the run the
overlays come off, the real folders show again, untouched, and
:meth:`KernelOverlay.changes` lists what the upper layers hold (files, folders, whiteouts:
removals).

Linux only (kernel 5.11 or later for overlayfs in a user namespace); elsewhere, or where the
probe fails, :func:`enter` says why and the seal keeps its Python line and its audit hook.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Sequence

from dpprof.script.output_files import note_output_readers
from dpprof.script.overlay_changes import Change
from dpprof.script.real_fs import lstat_or_none

__all__ = ["KernelOverlay", "enter", "entered", "sealed_folders", "why_not"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2
# filesystems no run writes a file of the user's into, and overlayfs does not stack on
_PSEUDO = frozenset({"proc", "sysfs", "devpts", "devtmpfs", "cgroup", "cgroup2", "autofs",
                     "binfmt_misc", "tracefs", "debugfs", "securityfs", "pstore", "bpf",
                     "mqueue", "hugetlbfs", "configfs", "nsfs", "efivarfs", "fusectl",
                     "rpc_pipefs", "selinuxfs"})

_STATE: dict[str, str | None] = {"entered": None, "why_not": None, "inside": None}


def entered() -> bool:
    """Whether the process is in dpprof's mount namespace (each run can be overlaid)."""
    return _STATE["entered"] == "yes"


# why_not() where the process ran threads before dpprof's entry (the kernel refuses them a
# user namespace): something imported at the interpreter's start (a sitecustomize, a .pth
# file, PYTHONSTARTUP) that starts threads; torch does, on import
THREADED = "the process already runs threads"
WHERE_UNTHREADED = ("run dpprof without what imports a threaded library (torch starts a thread "
                    "on import) as Python starts: a sitecustomize, a .pth file, PYTHONSTARTUP")


def why_not() -> str | None:
    """Why the kernel line is not there (None: it is, or was not tried)."""
    return _STATE["why_not"]


_LIBC: list[ctypes.CDLL] = []


def _libc() -> ctypes.CDLL:
    if not _LIBC:  # find_library runs ldconfig: once
        _LIBC.append(ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True))
    return _LIBC[0]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None,
           flags: int, data: str | None) -> None:
    _check(libc.mount(source.encode() if source else None, target.encode(),
                      fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                      data.encode() if data else None), f"mount {target}")


def _umount(libc: ctypes.CDLL, target: str) -> None:
    libc.umount2(target.encode(), _MNT_DETACH)


def _threads() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _unshare(libc: ctypes.CDLL) -> None:
    """Into a new user and mount namespace, as the same user (root: with every id mapped,
    by a helper left outside, since a process that has left cannot map more than itself)."""
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _unshare_root(libc)
    else:
        _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare")
        with contextlib.suppress(FileNotFoundError), open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
    _STATE["inside"] = "yes"


def _unshare_root(libc: ctypes.CDLL) -> None:
    me = os.getpid()
    r, w = os.pipe()
    helper = os.fork()
    if helper == 0:  # waits for the parent to leave, maps every id for it, ends
        os.close(w)
        ok = os.read(r, 1) == b"1"
        try:
            if ok:
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{me}/{name}", "w") as f:
                        f.write("0 0 4294967295")
        except OSError:
            os._exit(1)
        os._exit(0 if ok else 1)
    os.close(r)
    result = libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS)
    code = ctypes.get_errno()
    os.write(w, b"1" if result == 0 else b"0")
    os.close(w)
    _, status = os.waitpid(helper, 0)
    if result != 0:
        raise OSError(code, f"unshare: {os.strerror(code)}")
    if status != 0:
        raise OSError(errno.EPERM, "unshare: the ids could not be mapped")


def enter() -> bool:
    """Put the process into a mount namespace of its own (see the module); True where it
    is (or was already). Call it early: before any thread starts."""
    if _STATE["entered"] is not None:
        return entered()
    _STATE["entered"] = "no"
    if not sys.platform.startswith("linux"):
        _STATE["why_not"] = "not Linux"
        return False
    if os.environ.get("DPPROF_NO_NAMESPACE"):
        _STATE["why_not"] = "DPPROF_NO_NAMESPACE is set"
        return False
    if _threads() != 1:
        _STATE["why_not"] = THREADED
        return False
    probe = _probe()
    if probe is not None:
        _STATE["why_not"] = probe
        return False
    # a process reading this one's output (``| tee log.txt``) is out of sight from inside a
    # user namespace of our own: the files it writes are noted before
    note_output_readers()
    try:
        _unshare(_libc())
    except OSError as e:
        _STATE["why_not"] = str(e)
        return False
    _STATE["entered"] = "yes"
    _STATE["why_not"] = None
    return True


def _probe() -> str | None:
    """In a forked child: enter, mount an overlay over a temporary folder, write through it;
    None where all of it works, else why not."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        reason = b""
        try:
            libc = _libc()
            _unshare(libc)
            with tempfile.TemporaryDirectory(prefix="dpprof-probe-") as tmp:
                over = KernelOverlay([tmp])
                over.mount()
                with open(os.path.join(tmp, "probe"), "w") as f:
                    f.write("x")
                over.unmount_trees()
                held = [c.path for c in over.changes()]
                over.close()
                if held != [os.path.join(tmp, "probe")] or os.listdir(tmp):
                    reason = b"the overlay did not hold the probe's write"
        except BaseException as e:  # any failure is the answer
            reason = str(e).encode()[:500] or type(e).__name__.encode()
        os.write(w, reason)
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    text = b"".join(chunks).decode(errors="replace")
    return text or None


# the mount table as last read -> its (mount point, filesystem type) pairs: read before every
# run, parsed again only where it changed
_MOUNTS_READ: dict[bytes, list[tuple[str, str]]] = {}


def _mount_points() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount the process sees."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read()
    except OSError:
        return []
    known = _MOUNTS_READ.get(table)
    if known is not None:
        return list(known)
    out = []
    try:
        for line in table.decode().splitlines():
            fields = line.split()
            sep = fields.index("-")
            point = fields[4].encode().decode("unicode_escape")
            out.append((point, fields[sep + 1]))
    except (UnicodeDecodeError, ValueError):
        pass
    _MOUNTS_READ.clear()
    _MOUNTS_READ[table] = out
    return list(out)


def sealed_folders(candidates: Iterable[str]) -> list[str]:
    """The folders a run's kernel overlay covers: each writable candidate that exists (not
    ``/``), those inside another left out, then each mount point inside one (its own
    filesystem needs an overlay of its own), shallowest first."""
    tops: list[str] = []
    for c in candidates:
        if not c:
            continue
        p = os.path.realpath(c)
        st = lstat_or_none(p)
        if p == "/" or st is None or not stat.S_ISDIR(st.st_mode) or not os.access(p, os.W_OK):
            continue
        if p not in tops:
            tops.append(p)
    tops = [t for t in tops if not any(t != o and t.startswith(o + "/") for o in tops)]
    nested = [point for point, fstype in _mount_points()
              if fstype not in _PSEUDO and any(point.startswith(t + "/") for t in tops)]
    folders = sorted(set(tops) | set(nested), key=lambda p: (p.count("/"), p))
    return folders


class KernelOverlay:
    """One run's overlays over ``folders`` (see the module)."""

    def __init__(self, folders: Sequence[str]) -> None:
        self.folders = list(folders)
        # the private tmpfs: upper and work layers; what else a run keeps private (outside
        # every overlay)
        self.stage = ""
        self._mounted: list[str] = []
        self._libc = _libc()
        self._cwd = ""

    def mount(self) -> None:
        if _STATE["inside"] != "yes":  # never over the machine's own folders
            raise OSError(errno.EPERM, "not in dpprof's mount namespace")
        libc = self._libc
        self._cwd = os.getcwd()
        self.stage = tempfile.mkdtemp(prefix="dpprof-seal-")
        if any(ch in self.stage for ch in ",:\\"):
            raise OSError(errno.EINVAL, f"{self.stage}: no overlay over a path with , or :")
        _mount(libc, "tmpfs", self.stage, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0700")
        self._mounted.append(self.stage)
        fd = os.open(self.stage, os.O_RDONLY | os.O_DIRECTORY)
        # each real folder held by a descriptor, every one before any overlay hides one: the
        # lower layers are named through them, and once the overlays are on, the descriptors
        # are closed; no path of the namespace leads to a real folder (see the module: nothing
        # of the user's is written, or linked from elsewhere, around the overlays)
        lowers: list[int] = []
        try:
            for folder in self.folders:
                lowers.append(os.open(folder, os.O_PATH | os.O_DIRECTORY))
            for i in range(len(self.folders)):
                for part in "uw":
                    os.mkdir(os.path.join(self.stage, f"{part}{i}"), 0o700)
            # the layers named through descriptors: once a folder above the stage is
            # overlaid, its path shows the folder's lower layer, without the stage
            s = f"/proc/self/fd/{fd}"
            for i, folder in enumerate(self.folders):
                _mount(libc, "overlay", folder, "overlay", 0,
                       f"lowerdir=/proc/self/fd/{lowers[i]},upperdir={s}/u{i},"
                       f"workdir={s}/w{i},userxattr")
                self._mounted.append(folder)
            # the stage, hidden now where a folder above it is overlaid, shown again
            _mount(libc, f"/proc/self/fd/{fd}", self.stage, None, _MS_BIND, None)
            self._mounted.append(self.stage)
        except OSError:
            self.unmount_trees()
            self.close()
            raise
        finally:
            os.close(fd)
            for lower in lowers:
                os.close(lower)
        os.chdir(self._cwd)  # into the overlay of the working directory

    def uppers(self) -> list[tuple[str, str]]:
        """Each overlay's upper layer (where the run's files are) and the folder it covers."""
        return [(os.path.join(self.stage, f"u{i}"), folder)
                for i, folder in enumerate(self.folders)]

    def changes(self) -> list[Change]:
        """What the run left in the upper layers: files and links it wrote, folders it made,
        real paths it removed (whiteouts); read once the overlays are off
        (:meth:`unmount_trees`), against the real folders."""
        if len(self._mounted) > 1:
            raise OSError(errno.EBUSY, "the overlays are still on: unmount_trees() first")
        out: list[Change] = []
        for i, folder in enumerate(self.folders):
            upper = os.path.join(self.stage, f"u{i}")
            self._walk(upper, folder, folder, "", out)
        return out

    def _walk(self, upper: str, lower: str, folder: str, rel: str, out: list[Change]) -> None:
        try:
            names = sorted(os.listdir(os.path.join(upper, rel) if rel else upper))
        except OSError:
            return
        for name in names:
            r = os.path.join(rel, name) if rel else name
            up = os.path.join(upper, r)
            st = os.lstat(up)
            real = lstat_or_none(os.path.join(lower, r))
            path = os.path.join(folder, r)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                if real is not None:
                    out.append(Change(path, "removed", replaced=True))
            elif stat.S_ISDIR(st.st_mode):
                opaque = _xattr(up, "user.overlay.opaque") == b"y"
                if real is None or not stat.S_ISDIR(real.st_mode) or opaque:
                    out.append(Change(path, "folder", mtime_ns=st.st_mtime_ns,
                                      replaced=real is not None))
                self._walk(upper, lower, folder, r, out)
            else:
                out.append(Change(path, "link" if stat.S_ISLNK(st.st_mode) else "file",
                                  st.st_size, st.st_mtime_ns, replaced=real is not None,
                                  concrete=up))

    def unmount_trees(self) -> None:
        """The overlays off (the stage stays, for what is copied out of it). Each unmount
        waits for the kernel's grace period (milliseconds on a loaded machine), so only the
        outermost are unmounted: a lazy unmount takes every mount made on top of one with it
        (the overlay of a mount point inside a folder, the stage shown again inside ``/tmp``),
        each of which was mounted after the folder it lies in."""
        trees = self._mounted[1:]
        for k in reversed(range(len(trees))):
            if not any(trees[k].startswith(t + "/") for t in trees[:k]):
                _umount(self._libc, trees[k])
        self._mounted = self._mounted[:1]
        if self._cwd:
            with contextlib.suppress(OSError):
                os.chdir(self._cwd)

    def close(self, chdir: bool = True) -> None:
        """The stage unmounted and removed; ``chdir``: back into the working directory
        (False where it is called in a thread of its own, once :meth:`unmount_trees` has:
        the working directory is the process's, the main thread's to set)."""
        for target in reversed(self._mounted):
            _umount(self._libc, target)
        self._mounted = []
        if self.stage:
            with contextlib.suppress(OSError):
                os.rmdir(self.stage)
        if chdir and self._cwd:
            with contextlib.suppress(OSError):
                os.chdir(self._cwd)


def _xattr(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except (OSError, AttributeError):
        return None
