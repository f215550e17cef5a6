# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: open a directory from ``/`` and walk it without trusting anyone who could have changed it.

The compile cache's probe part and its acting script both import it (``SHARED``), and so does ct/git_paths.py (the
training code's repository is opened by the same :func:`open_root`): ``Target.run_probes`` ships its source with
theirs in the same ``pct exec``, and on a node it is imported as usual. So: standard library only,
Python 3.9+, nothing of ours imported. The node's judgement (cache_facts) applies the same :func:`refusal`.

:func:`open_root` opens a root one component at a time with O_NOFOLLOW, each component owned by someone
:func:`trusted_owners` trusts; :func:`open_inside` enters a subdirectory only on the same mount (mount id, so a bind
mount too) and only when its parent's non-root owner owns it. Everything after works through these fds.
:func:`refusal` names the paths that are never a root to purge. Who uses a root is ct/proc.py's.
"""

import errno
import os
import pwd
import stat

# -- which paths are never a root to purge ---------------------------------------------------------------------
# A root that IS one of these is refused (and so is any root with fewer than two path components).
PROTECTED = ("/", "/usr", "/etc", "/var", "/opt", "/srv")
# A root inside one of these is refused: no compile cache lives in the system's own files.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin", "/sys")
SYSTEM_TREES += ("/usr",)


def clean(path):
    """``/tmp//x/./y/`` -> ``/tmp/x/y``; a leading ``//`` (kept by POSIX normpath) becomes ``/``."""
    path = os.path.normpath(path)
    return "/" + path.lstrip("/") if path.startswith("//") else path


def inside(path, directory):
    """Whether ``path`` is ``directory`` or lies below it (plain string logic on clean absolute paths)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def refusal(path, homes):
    """Why ``path`` may never be a cache root that is purged, or None. ``homes``: ``{home: [users]}``.

    ``refusal("/", {})`` -> ``"it is the filesystem root /"``; ``refusal("/root", {"/root": ["root"]})`` ->
    ``"it is the home directory of root"``; ``refusal("/home/alice/.cache/x", {})`` -> None;
    ``refusal("/var/cache", {"/var/cache/man": ["man"]})`` -> ``"it contains the home directory /var/cache/man
    of man"``; ``refusal("/tmp", {})`` -> ``"it has fewer than 2 path components (...)"``;
    ``refusal("/usr/local/cache", {})`` -> ``"it lies inside the system tree /usr"``.
    """
    if not isinstance(path, str) or not path.startswith("/"):
        return "it is not an absolute path"
    if ".." in path.split("/"):
        return "it contains '..'"
    path = clean(path)
    if path == "/":
        return "it is the filesystem root /"
    if path in PROTECTED:
        return f"it is the system directory {path}"
    for home, users in sorted(homes.items()):
        if path == home:
            return f"it is the home directory of {', '.join(users)}"
    for home, users in sorted(homes.items()):
        if home != path and inside(home, path):
            return f"it contains the home directory {home} of {', '.join(users)}"
    if len([part for part in path.split("/") if part]) < 2:
        return "it has fewer than 2 path components (a cache is a directory of its own, like /tmp/torchinductor_root)"
    for tree in SYSTEM_TREES:
        if inside(path, tree):
            return f"it lies inside the system tree {tree}"
    return None


# -- opening a root and walking it without trusting anyone who could have changed it ---------------------------
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
MAX_DEPTH = 64  # deeper directories are left alone (named): every level holds one fd while it is walked


class Unsafe(Exception):
    """A root that cannot be opened without trusting a user who could have changed it: what was found, then the fix
    for a cache root. ``found``: what was found alone, for a caller that says its own fix (the training code's
    repository, :func:`ct_git_paths.open_top`)."""

    def __init__(self, found, fix=""):
        super().__init__(found + fix)
        self.found = found


class Linked(Unsafe):
    """A component is a symbolic link, never followed: ``path`` (the link), ``points`` (where it points), ``here``
    (its directory) and ``owner`` (that directory's uid: who could have made it)."""

    def __init__(self, path, points, here, owner):
        super().__init__(
            f"{path} is a symlink (to {points})",
            "; a root is opened without following links: give the directory itself as the root",
        )
        self.path, self.points, self.here, self.owner = path, points, here, owner


class NotADirectory(Unsafe):
    """The path itself is there but no directory."""


def who(uid):
    """``alice (uid 1000)``; ``uid 4321`` when the target's passwd has no such user."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def mount_id(fd):
    """The mount id of the open ``fd`` (``mnt_id`` of /proc/self/fdinfo): a bind mount of the same filesystem has
    its parent's st_dev, never its mount id."""
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as handle:
        for line in handle:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "/proc/self/fdinfo names no mnt_id, so mount points cannot be told")


def trusted_owners(here, info, uid):
    """Who may own a directory found in the directory ``here`` (its ``info``), for the cache user ``uid``: None
    when only root can put entries there; ``(0, uid)`` in a sticky directory of root's (``/tmp``: an entry can be
    swapped only by its owner); ``(uid,)`` in the cache user's own directory (they may move any entry of it).
    Unsafe where another user, a group or everyone may put any directory in place of the next component."""
    others = info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and info.st_gid != 0)
    sticky = info.st_mode & stat.S_ISVTX
    if info.st_uid == 0 and not others:
        return None
    if info.st_uid == 0 and sticky:
        return (0, uid)
    if info.st_uid == uid and (sticky or not others):
        return (uid,)
    if info.st_uid not in (0, uid):
        raise Unsafe(f"it lies under {here}, owned by {who(info.st_uid)}, who could put any directory in its place")
    writers = "every user" if info.st_mode & stat.S_IWOTH else f"group {info.st_gid}"
    raise Unsafe(
        f"it lies under {here}, which {writers} may write (mode {stat.S_IMODE(info.st_mode):04o}, no sticky bit): "
        "any of them could put another directory in its place",
        f"; chmod +t {here}, or give a root under a directory only root and the cache user can write",
    )


def open_root(path, uid=None):
    """Open the directory ``path`` (clean, absolute) from ``/``, one component at a time, never following a link,
    each component owned by someone :func:`trusted_owners` trusts for ``uid``: its fd, or None when it does not
    exist. ``uid``: the cache user; None: the owner of ``path`` itself (the training code's repository: root and
    its owner), so each component is judged once the last one is open (what each directory was when it was
    opened, as with a given uid). :class:`Linked` for a link on the way, :class:`NotADirectory` when ``path`` is no
    directory, :class:`Unsafe` else."""
    fd = os.open("/", DIRECTORY)
    here = "/"
    opened = []  # (directory, its fstat, the component below it, that component's owner), judged with the owner
    try:
        for name in [part for part in path.split("/") if part]:
            info = os.fstat(fd)
            if uid is not None:
                trusted_owners(here, info, uid)  # before the component is even looked at
            below = os.path.join(here, name)
            try:
                child = os.open(name, DIRECTORY, dir_fd=fd)
            except OSError as error:
                if error.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    raise
                kind = kind_at(fd, name)
                if kind == "link":
                    raise Linked(below, os.readlink(name, dir_fd=fd), here, info.st_uid) from None
                if kind and below == path:
                    raise NotADirectory("it is not a directory") from None
                return None
            os.close(fd)
            fd = child
            step = (here, info, below, os.fstat(fd).st_uid)
            if uid is None:
                opened.append(step)
            else:
                _judge(*step, uid)
            here = below
        owner = os.fstat(fd).st_uid if uid is None else uid
        for step in opened:
            _judge(*step, owner)
        done, fd = fd, None
        return done
    finally:
        if fd is not None:
            os.close(fd)


def _judge(here, info, below, owner, uid):
    """Unsafe when ``below`` (owned by ``owner``), found in ``here`` (``info``), is not owned by someone
    :func:`trusted_owners` trusts there for ``uid``."""
    owners = trusted_owners(here, info, uid)
    if owners is not None and owner not in owners:
        trusted = " or ".join(map(who, sorted(set(owners))))
        raise Unsafe(
            f"{below} is owned by {who(owner)}, but in {here} only {trusted} can be trusted (another user may have "
            "put it there)",
            ": remove it, or give another root",
        )


def kind_at(fd, name):
    """``"link"``, ``"dir"``, ``"other"`` for the entry ``name`` of the directory ``fd``; None when it is gone."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    return "link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "other"


class Dir:
    """A directory open for a walk: its fd, path, fstat, mount id and depth below the root (the caller closes)."""

    __slots__ = ("depth", "fd", "info", "mount", "path")

    def __init__(self, fd, path, depth=0):
        self.fd, self.path, self.depth = fd, path, depth
        self.info = os.fstat(fd)
        self.mount = mount_id(fd)


def open_dir(fd, path):
    """A :class:`Dir` of a dup of ``fd``, the root open as ``path``."""
    copy = os.dup(fd)
    try:
        return Dir(copy, path)
    except BaseException:
        os.close(copy)
        raise


def open_inside(parent, name):
    """Open the subdirectory ``name`` of the :class:`Dir` ``parent`` to walk it: ``(Dir, None)``, or ``(None,
    why)`` for one never entered: ``"mount"`` (another st_dev or mount id: a bind mount too), ``"owner"`` (not
    owned by the owner of its parent, a non-root user, who could have moved it in from where they may not delete),
    ``"depth"``, or ``"gone"`` (no directory now: a link or a file took its place)."""
    if parent.depth >= MAX_DEPTH:
        return None, "depth"
    try:
        fd = os.open(name, DIRECTORY | getattr(os, "O_NONBLOCK", 0), dir_fd=parent.fd)
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return None, "gone"
        raise
    try:
        child = Dir(fd, os.path.join(parent.path, name), parent.depth + 1)
    except BaseException:
        os.close(fd)
        raise
    why = None
    if child.info.st_dev != parent.info.st_dev or child.mount != parent.mount:
        why = "mount"
    elif parent.info.st_uid not in (0, child.info.st_uid):
        why = "owner"
    if why:
        os.close(fd)
        return None, why
    return child, None


LEFT = {
    "owner": "owned by another user than its directory's owner, who could have moved it in: never entered",
    "depth": f"more than {MAX_DEPTH} levels deep: never entered",
}
