# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training code reset's work tree entries, never through a link: from the repository's top, opened once
(the reset's fd, or a path opened by :func:`ct_git.open_top`), each entry reached one component at a time
without following a link (:func:`parent_fd`); an entry's digest (sha256, or git's blob id) read through the
directory fd, an entry added to a backup tarball with its bytes as they are on disk, a tarball member's digest,
and an entry removed only while it still has the saved bytes. A repository renamed away and replaced by a link,
or a directory the checkout turned into a link to elsewhere, is never followed.

Container side, shipped with the reset script: it is in the script's ``SHARED``, so ``Target.run_probes`` sends
its source in the same ``pct exec`` (registered under its own dotted name), and on a node it is imported as
usual. So: standard library only, Python 3.9+, nothing of ours but the container-side modules of its own
``SHARED``.
"""

import errno
import hashlib
import os
import stat
import tarfile

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git

SHARED = (ct_act, ct_git)  # container-side modules Target.run_probes ships with this module

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def shown(path):
    """A path read from git as JSON-safe text: undecodable bytes as ``\\xNN``."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def descend(fd, parts):
    """The directory ``parts`` names below the open directory ``fd``, each component opened with O_NOFOLLOW; ``fd``
    is consumed (closed, also when a component is a link or missing: OSError then)."""
    try:
        for part in parts:
            deeper = os.open(part, DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    except BaseException:
        os.close(fd)
        raise
    return fd


def parent_fd(top, path):
    """``(fd, name)``: the directory that holds ``path`` (relative to ``top``: an open directory fd, or a path
    opened without following a link), each component opened with O_NOFOLLOW, so that a directory the checkout
    turned into a link to elsewhere is never entered (OSError then)."""
    fd = os.dup(top) if isinstance(top, int) else ct_git.open_top(top)
    parts = path.split("/")
    return descend(fd, parts[:-1]), parts[-1]


class Hashing:
    """A file object that hashes what is read from it (tarfile reads a member's bytes through it)."""

    def __init__(self, handle, digest):
        self.handle = handle
        self.digest = digest

    def read(self, size=-1):
        data = self.handle.read(size)
        self.digest.update(data)
        return data


def blob_digest(object_format):
    """The hash of git's object ids in a repository of ``object_format`` (the caller feeds ``blob <size>\\0``)."""
    return hashlib.sha256() if object_format == "sha256" else hashlib.sha1(usedforsecurity=False)


def entry_digest(top, path, *, blob=None):
    """``(kind, hex)`` of the work tree's entry at ``path`` now, read without following a link: ``file`` (sha256 of
    its bytes) or ``link`` (sha256 of its target); None when it is gone or neither. ``blob`` ("sha1" or "sha256"):
    the git blob id of the bytes instead (what ``git hash-object --no-filters`` prints)."""
    try:
        fd, name = parent_fd(top, path)
    except OSError:
        return None
    try:
        return digest_at(fd, name, blob=blob)
    finally:
        os.close(fd)


def digest_at(fd, name, *, blob=None):
    """:func:`entry_digest` of the entry ``name`` of the open directory ``fd``."""
    try:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            data = os.fsencode(os.readlink(name, dir_fd=fd))
            digest = blob_digest(blob) if blob else hashlib.sha256()
            if blob:
                digest.update(b"blob %d\0" % len(data))
            digest.update(data)
            return "link", digest.hexdigest()
        if not stat.S_ISREG(info.st_mode):
            return None
        handle = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        with os.fdopen(handle, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest = blob_digest(blob) if blob else hashlib.sha256()
            if blob:
                digest.update(b"blob %d\0" % size)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return "file", digest.hexdigest()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None
        raise


def add_entry(tar, top, path):
    """Add the work tree's entry at ``path`` to ``tar``, its bytes as they are on disk, never through a link; its
    manifest record ``{"path", "kind", "sha256"}``, or None for a directory or anything else neither file nor link
    (nothing of it is lost: a directory's files are entries of their own)."""
    fd, name = parent_fd(top, path)
    try:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        member = tarfile.TarInfo(path)
        member.mode, member.mtime = stat.S_IMODE(info.st_mode), int(info.st_mtime)
        if stat.S_ISLNK(info.st_mode):
            target = os.readlink(name, dir_fd=fd)
            member.type, member.linkname = tarfile.SYMTYPE, target
            tar.addfile(member)
            return {"path": path, "kind": "link", "sha256": hashlib.sha256(os.fsencode(target)).hexdigest()}
        if not stat.S_ISREG(info.st_mode):
            return None
        handle = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        with os.fdopen(handle, "rb") as f:
            opened = os.fstat(f.fileno())
            if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                raise ct_act.ActError("backup", f"{shown(path)} was replaced while it was saved; run again")
            member.size = opened.st_size
            reader = Hashing(f, hashlib.sha256())
            tar.addfile(member, reader)
        return {"path": path, "kind": "file", "sha256": reader.digest.hexdigest()}
    finally:
        os.close(fd)


def member_digest(tar, member):
    """``(kind, sha256)`` of a member of a tarball the backup wrote."""
    if member.issym():
        return "link", hashlib.sha256(os.fsencode(member.linkname)).hexdigest()
    digest = hashlib.sha256()
    with tar.extractfile(member) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return "file", digest.hexdigest()


def remove_entry(top, path, want):
    """Remove the file or link at ``path`` when it still is what was saved (``want``: ``(kind, sha256)``), never
    through a link, and the directories it leaves empty; whether it was removed. ``top``: the work tree's open fd
    (or its path). The digest is read through the same directory fd the unlink uses. A path under a directory that
    is now a link (the checkout made it one) is left alone: the link's target is not the repository's."""
    try:
        fds = [os.dup(top) if isinstance(top, int) else ct_git.open_top(top)]
    except OSError:
        return False
    parts = path.split("/")
    try:
        for part in parts[:-1]:
            try:
                fds.append(os.open(part, DIRECTORY, dir_fd=fds[-1]))
            except OSError:
                return False  # gone, or a link now
        if digest_at(fds[-1], parts[-1]) != want:
            return False  # changed since it was saved (or a directory now): never removed unsaved
        try:
            os.unlink(parts[-1], dir_fd=fds[-1])
        except OSError:
            return False
        for depth in range(len(parts) - 1, 0, -1):
            try:
                os.rmdir(parts[depth - 1], dir_fd=fds[depth - 1])
            except OSError:
                break
        return True
    finally:
        for fd in fds:
            os.close(fd)
