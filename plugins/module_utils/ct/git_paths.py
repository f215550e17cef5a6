# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: where a training repository lies, never through a link nor through a directory another
user could change. :func:`open_top` opens its path with :func:`ct_fs.open_root`, the compile cache's opener (from
``/`` one component at a time with O_NOFOLLOW, each component owned by root or the repository's owner wherever
another user could have put it there; :class:`Refused` else, one sentence); everything after works on the opened
directory, named by :func:`at` (``/proc/self/fd/<fd>``: git's ``-C``, ``GIT_WORK_TREE``, its git dir and every
read of ours resolve to the directory that was opened, whatever its path says now). :func:`locate` reads ``.git``
and ``commondir`` and accepts only a git dir and common dir of the work tree's owner reached through no link
(:class:`Untrusted` else). :mod:`ct_git` uses them (and names them as its own); standard library only, Python 3.9+,
nothing of ours but the modules of ``SHARED``.
"""

import errno
import os
import stat

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs

SHARED = (ct_fs,)  # container-side modules Target.run_probes ships with this module

PROC_FD = "/proc/self/fd/"


class Untrusted(Exception):
    """The work tree's git dir or common dir lies where its owner does not control it: never used."""


class Refused(Untrusted):
    """The repository's path goes through a link, or a directory that a user other than root and the repository's
    owner could have put in its place: whoever may change that directory could point it anywhere (at a repository
    of root's), so it is never used."""


def open_top(path):
    """The fd of the directory ``path`` (clean, absolute), opened by :func:`ct_fs.open_root` with root and the
    directory's own owner trusted. A link on the way is :class:`Refused` (the sentence names the link, where it
    points and who owns the directory it lies in), and so is a component another user could have put there (a
    directory above it writable by others without the sticky bit, or owned by a third user); a missing path is
    FileNotFoundError, one that is no directory NotADirectoryError."""
    try:
        fd = ct_fs.open_root(path)
    except ct_fs.Linked as error:
        raise Refused(
            f"{error.path} is a symlink (to {error.points}) in {error.here}, owned by {ct_fs.who(error.owner)}: the "
            "training repository is never reached through a link (whoever may change that directory could point it "
            "at another repository, one of root's); set the path to the repository itself"
        ) from None
    except ct_fs.NotADirectory:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None
    except ct_fs.Unsafe as error:
        raise Refused(
            f"the training repository {path} cannot be trusted: {error.found}; a repository is used only where no "
            "user but root and its owner could have put it or anything above it: move it there, or set the owner "
            "and mode of the directory named"
        ) from None
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    return fd


def at(fd):
    """The path of the open directory ``fd``: ``/proc/self/fd/<fd>`` (for git, which keeps the fd: ct_run.run's
    ``fds``)."""
    return f"{PROC_FD}{fd}"


def fd_of(path):
    """The fd a path of :func:`at` starts with, or None for any other path."""
    head = path[len(PROC_FD) :].partition("/")[0] if path.startswith(PROC_FD) else ""
    return int(head) if head.isdigit() else None


def real(path):
    """Where a path of :func:`at` lies now (the opened directory's current path: for messages, and as the base of a
    relative path read from its files); any other path as it is."""
    fd = fd_of(path)
    if fd is None:
        return path
    rest = path[len(at(fd)) :].lstrip("/")
    try:
        where = os.readlink(at(fd))
    except OSError:
        return path  # closed already: named as it was given
    return os.path.join(where, rest) if rest else where


def open_dir(path):
    """The fd of the directory ``path`` without following a link: below an opened top (a path of :func:`at`), each
    component from its fd with O_NOFOLLOW; any other path by :func:`open_top`."""
    base = fd_of(path)
    if base is None:
        return open_top(path)
    fd = os.dup(base)
    try:
        for part in [part for part in path[len(at(base)) :].split("/") if part]:
            deeper = os.open(part, ct_fs.DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owned_dir(path, uid, what, top):
    """``path`` as a directory of ``uid`` (or root's, for a work tree of root's) reached through no link (below an
    opened top: none below it); ``top`` names the work tree in messages."""
    clean = os.path.normpath(path)
    if os.path.realpath(clean) != real(clean):
        raise Untrusted(
            f"the {what} of {top} is {real(clean)}, reached through a symlink (to {os.path.realpath(clean)}): a git "
            "dir is used only where no link leads; move the repository's git dir into place"
        )
    try:
        info = os.lstat(clean)
    except FileNotFoundError:
        raise Untrusted(f"the {what} of {top} is {real(clean)}, which does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise Untrusted(f"the {what} of {top} is {real(clean)}, which is not a directory")
    if info.st_uid != uid:
        raise Untrusted(
            f"the {what} of {top} is {real(clean)}, owned by uid {info.st_uid}, not by the work tree's owner (uid "
            f"{uid}): another user's repository is never reset through a .git file or commondir naming it"
        )
    return clean


def _read_small(path):
    """The first 4 KiB of the regular file ``path``, never through a link; None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise Untrusted(f"{real(path)} cannot be read without following a link: {error.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise Untrusted(f"{real(path)} is not a regular file")
        return handle.read(4096).decode("utf-8", "surrogateescape")


def locate(top):
    """``(git_dir, common_dir)`` of the work tree at ``top`` (an opened top, :func:`at`; or a path), read from its
    ``.git`` (a directory, or a file ``gitdir: <path>``) and the git dir's ``commondir``, without running git;
    ``(None, None)`` when ``top`` has no ``.git``. Both must be directories of the top's owner reached through no
    link (a ``.git`` file naming another user's repository, /etc/.git, is :class:`Untrusted`), and ``.git`` itself
    no link. A ``.git`` directory is named below ``top`` (so, below an opened top, it is the opened one's); a path
    a file names relative to its directory is read from where that directory lies now (:func:`real`)."""
    uid = os.stat(top).st_uid
    name = real(top)
    dotgit = os.path.join(top, ".git")
    try:
        info = os.lstat(dotgit)
    except FileNotFoundError:
        return None, None
    if stat.S_ISLNK(info.st_mode):
        raise Untrusted(
            f"{real(dotgit)} is a symlink (to {os.readlink(dotgit)}); a git dir is used only where no link leads"
        )
    if stat.S_ISDIR(info.st_mode):
        git_dir = dotgit
    elif stat.S_ISREG(info.st_mode):
        if info.st_uid != uid:
            raise Untrusted(f"{real(dotgit)} is owned by uid {info.st_uid}, not by the work tree's owner (uid {uid})")
        text = _read_small(dotgit) or ""
        if not text.startswith("gitdir: "):
            return None, None
        git_dir = os.path.join(name, text[len("gitdir: ") :].strip())
    else:
        return None, None
    git_dir = _owned_dir(git_dir, uid, "git dir", name)
    common = git_dir
    text = _read_small(os.path.join(git_dir, "commondir"))
    if text is not None:
        common = _owned_dir(os.path.join(real(git_dir), text.strip()), uid, "common git dir", name)
    return git_dir, common


def looks_bare(top):
    """Whether ``top`` itself is a git dir (a bare repository): HEAD, objects and refs, no work tree."""
    return all(os.path.exists(os.path.join(top, name)) for name in ("HEAD", "objects", "refs"))
