# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The runner's own files: its directories, the lock, atomic writes, the reports it reads back, old runs pruned.

The reports directory may sit where other users can reach (a shared state directory): nothing here is opened,
written or removed through a link someone planted. Directories are checked before use (a real directory, this
user's or root's, that not every user can write), the lock is opened with O_NOFOLLOW and never truncated unless it
is the runner's own regular file, new files are made with O_EXCL (mkstemp) and renamed over their path (a rename
replaces a planted link, it never writes through it), and pruning never follows a link.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from drift.errors import DriftError, LockHeld

RUN_DIR = re.compile(r"^\d{8}T\d{6}Z-\d+$")


def iso(timestamp):
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- pure: what makes a path unsafe ---------------------------------------------------------------------------------
def dir_problem(info, euid):
    """Why a directory with ``os.lstat`` result ``info`` is unsafe for the runner run as ``euid``, or None.

    A link could send the runner's writes anywhere; a directory another user owns, or every user can write, lets
    them plant one.
    """
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in (euid, 0):
        return f"is owned by uid {info.st_uid}, neither this user (uid {euid}) nor root"
    if info.st_mode & 0o002:
        # Anyone could plant a link in it (the group is the owner's choice to trust).
        return f"is writable by every user (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def lock_problem(info, euid):
    """Why an existing lock file with ``os.lstat`` result ``info`` is not the runner's own, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_nlink != 1:
        # A hard link to another file: writing the holder's pid would change that file.
        return f"has {info.st_nlink} hard links"
    if info.st_uid not in (euid, 0):
        return f"is owned by uid {info.st_uid}, neither this user (uid {euid}) nor root"
    return None


# -- directories ----------------------------------------------------------------------------------------------------
def private_dir(path, mode=0o750):
    """``path`` made when missing (``mode``, parents too) and checked with :func:`dir_problem`; raises DriftError."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        # exist_ok would accept a link to a directory: lstat below decides instead.
        path.mkdir(mode=mode, parents=True)
    try:
        info = os.lstat(path)
    except OSError as error:
        raise DriftError(f"cannot use the directory {path}: {error}") from None
    problem = dir_problem(info, os.geteuid())
    if problem:
        raise DriftError(
            f"refusing the directory {path}: it {problem}; the runner writes its lock, reports and summary there, "
            "so it must be a real directory of this user (or root) that not every user can write: remove or fix "
            "it (chmod o-w), or pass another --reports-dir"
        )
    return path


def new_dir(path, mode=0o750):
    """A directory that did not exist (``mode``): never one someone made, or linked, beforehand."""
    path = Path(path)
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        raise DriftError(
            f"{path} exists already: refusing to write a run into a directory the runner did not make"
        ) from None
    return path


# -- writes ---------------------------------------------------------------------------------------------------------
def write_atomic(path, text, mode=0o644):
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never half of one.

    A temporary file in the same directory (named ``.<name>.<random>.tmp``: node_exporter reads ``*.prom`` only),
    made by mkstemp (O_EXCL: never an existing file or link), fsync'ed, chmod'ed to ``mode``, renamed over ``path``
    (a link planted at ``path`` is replaced, never written through); then the directory is fsync'ed so the rename
    survives a crash. The temporary file is removed if anything fails.
    """
    path = Path(path)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fchmod(out.fileno(), mode)
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def open_lock(path):
    """The lock file's descriptor: made when missing, else the runner's own regular file; never through a link."""
    path = Path(path)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        # O_EXCL first: a new file is surely ours; an existing one is checked before it is used.
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    handle = None
    try:
        # O_NONBLOCK: a planted fifo must not hang the runner before it is refused.
        handle = os.open(path, flags | os.O_NONBLOCK)
        problem = lock_problem(os.fstat(handle), os.geteuid())
    except OSError as error:
        # A link (ELOOP), a directory (EISDIR), ...: say what is there.
        try:
            problem = lock_problem(os.lstat(path), os.geteuid()) or f"cannot be opened ({error.strerror})"
        except OSError:
            problem = f"cannot be opened ({error.strerror})"
    if problem:
        if handle is not None:
            os.close(handle)
        raise DriftError(
            f"refusing the lock file {path}: it {problem}, not the runner's own lock; remove it (the runner makes "
            "a new one) or pass another --lock-file"
        )
    os.set_blocking(handle, True)
    return handle


def acquire_lock(path, clock=time.time):
    """Hold ``path`` with a non-blocking flock for this process's life; a held lock raises LockHeld naming its pid.

    The holder writes ``<pid> <started>`` into the file; the lock goes with the process (fd closed on exit), so a
    killed runner never leaves a stale lock behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open_lock(path)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            os.close(handle)
            raise
        holder = os.pread(handle, 200, 0).decode(errors="replace").split()
        os.close(handle)
        pid = holder[0] if holder else "unknown"
        since = f", since {holder[1]}" if len(holder) > 1 else ""
        raise LockHeld(
            f"another drift run holds {path} (pid {pid}{since}); this one exits without running: wait for it to "
            f"finish (ps -p {pid}) or, if it hangs, stop it and run again"
        ) from None
    # Ours and held: the previous holder's record is replaced.
    os.ftruncate(handle, 0)
    os.pwrite(handle, f"{os.getpid()} {iso(clock())}\n".encode(), 0)
    return handle


# -- reading back and pruning ---------------------------------------------------------------------------------------
def load_reports(directory):
    """``{target: {"path", "report"}}`` from ``<directory>/<target>/<run id>.json`` (the newest when several).

    A report that cannot be read is kept as ``{"path", "report": None, "error"}``: the target fails naming it.
    """
    found = {}
    for path in sorted(Path(directory).glob("*/*.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
            name = report.get("target") or path.parent.name
        except (OSError, ValueError, AttributeError) as error:
            found.setdefault(
                path.parent.name, {"path": str(path), "report": None, "error": f"unreadable report {path}: {error}"}
            )
            continue
        previous = found.get(name)
        if (
            previous is None
            or previous["report"] is None
            or str(report.get("written")) >= str(previous["report"].get("written"))
        ):
            found[name] = {"path": str(path), "report": report}
    return found


def prune_runs(root, keep):
    """Remove all but the newest ``keep`` run directories (``<stamp>-<pid>``) under ``root``; nothing else.

    A link named like a run is left alone, and rmtree removes a link inside a run, never what it points to.
    """
    runs = sorted(
        entry.path for entry in os.scandir(root) if RUN_DIR.match(entry.name) and entry.is_dir(follow_symlinks=False)
    )
    for old in runs[: max(len(runs) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
