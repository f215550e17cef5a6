# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A directory on the controller that only this user could have written to, and its files (controller side).

What the controller keeps between runs and then uses without looking again (the uv_lock lookup's compiled locks) is
used only when nobody else could have put it there: the directory is reached from ``/`` one component at a time
without following a link (a missing one is made, mode 0700), every directory above it is root's or this user's and
writable by nobody else unless sticky (``/tmp``), and the directory itself is this user's with mode 0700 (one this
user made 0755 is made 0700: nobody else could write there). A file in it is read only when it is this user's regular
file (never through a link) that nobody else can write. Anything else is :class:`Untrusted`, whose message says
what was found.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

# What the lookups keep is small (a hashed lock of a full ML stack: a few hundred KB); more is not theirs.
MAX_FILE_BYTES = 32 * 1024 * 1024


class Untrusted(Exception):
    """The directory or file could have been written by someone else; the message says what was found."""


def open_private_dir(path, *, euid=None):
    """An open descriptor of the directory ``path`` (absolute, ``~`` expanded) that only this user can change,
    made if missing; raises :class:`Untrusted` naming the component that cannot be trusted."""
    euid = os.geteuid() if euid is None else euid
    if not os.path.isabs(path):
        raise Untrusted(f"{path} is not an absolute path")
    names = [name for name in path.split("/") if name not in ("", ".")]
    if ".." in names or not names:
        raise Untrusted(f"{path} is no directory of its own (it names '..' or is /)")
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    seen = "/"
    try:
        for depth, name in enumerate(names):
            seen = os.path.join(seen, name)
            child = _step(fd, name, seen)
            os.close(fd)
            fd = child
            info = os.fstat(fd)
            if depth < len(names) - 1:
                if info.st_uid not in (0, euid) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
                    raise Untrusted(f"{seen} is {_whose(info, euid)} and writable by others")
            elif info.st_uid != euid:
                raise Untrusted(f"{seen} is owned by uid {info.st_uid}, not by this user (uid {euid})")
            elif info.st_mode & 0o022:
                raise Untrusted(f"{seen} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})")
            elif info.st_mode & 0o077:
                os.fchmod(fd, 0o700)  # this user's, and nobody else could write there: made private
    except BaseException:
        os.close(fd)
        raise
    return fd


def _step(parent, name, seen):
    """The descriptor of ``name`` in ``parent`` (made 0700 if missing), never through a link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent)
            return os.open(name, flags, dir_fd=parent)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if os.path.islink(seen) else "not a directory"
            raise Untrusted(f"{seen} is {kind}") from None
        raise Untrusted(f"{seen} cannot be opened ({error.strerror})") from None


def _whose(info, euid):
    return "this user's" if info.st_uid == euid else f"owned by uid {info.st_uid}"


def read_private(dir_fd, name, *, euid=None, cap=MAX_FILE_BYTES):
    """The bytes of ``name`` in the private directory ``dir_fd``; None when there is none. Raises :class:`Untrusted`
    for a link, anything but a regular file, a file of another user or one others can write, or one over ``cap``."""
    euid = os.geteuid() if euid is None else euid
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        found = "a symbolic link" if error.errno == errno.ELOOP else f"not readable ({error.strerror})"
        raise Untrusted(f"it is {found}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Untrusted("it is not a regular file")
        if info.st_uid != euid:
            raise Untrusted(f"it is owned by uid {info.st_uid}, not by this user (uid {euid})")
        if info.st_mode & 0o022:
            raise Untrusted(f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})")
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise Untrusted(f"it is larger than {cap} bytes")
    finally:
        os.close(fd)


def write_private(dir_fd, name, data):
    """``data`` as ``name`` in the private directory ``dir_fd`` (mode 0600), through a new file renamed over it: a
    reader never sees half of it, and a link planted at the name is replaced, never written through."""
    temporary = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
