# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training code reset: save every local change, then put the repository at the pinned commit. It ACTS.

Unlike a probe part, ``probe(payload)`` here changes the target. It is called the same way so that it costs one
``pct exec``: ``Target.run_probes`` ships this file's source to the target's python on stdin; on a bare host
``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing of ours but the
container-side modules of ``SHARED``, the answer is plain JSON. git is called exactly as the probe part calls it,
through :mod:`pve_ct_git` (a view of the repository whose config is an allowlist of the real one's keys, so nothing
the repository's owner configured runs as root; no system or global config; no ``GIT_*`` of the caller). Reads run
as root; every call that writes the repository (fetch, update-ref, checkout, reset) runs as the owner of the work
tree's top (root for a repository of root's), in the owner's copy of the view, so a link the owner planted in
``.git`` can only hurt the owner. Files of the work tree are read and removed through directory file descriptors
from the top, opened once from ``/`` without following a link (:func:`open_top`), never through a link.

In this order, and nothing is changed in the work tree, the index, HEAD or any branch before step 5:

1. re-check what the fact pass found (the facts can be seconds old): a work tree whose top is ``path``, no
   unfinished merge/rebase/..., no conflict, no untracked repository inside, the backup directory outside it, a git
   dir and common dir of the top's owner reached through no link (``untrusted``);
2. fetch the commit from ``remote`` when the repository lacks it (``git fetch --no-tags <remote> <sha>``; only
   objects and FETCH_HEAD are written); a failed fetch ends the run;
3. refuse when a tracked path (now or in the commit) has a clean/smudge filter the repository's config defines
   (``filter``: git-lfs; a checkout without it writes pointers over the content), and when the checkout would
   overwrite IGNORED files (checkpoints, data): ignored files are never saved, so they must never be touched;
4. when anything is dirty, save it to ``<backup_dir>/<UTC stamp>/`` (mode 0700) and prove the saved copy restores
   it, before anything is reset:

   * ``changes.patch``: ``git diff --binary HEAD``, every tracked change (staged or not), binary files included;
   * ``staged.patch``: ``git diff --binary --cached HEAD``, what was staged;
   * ``changed.tar.gz``: the work tree's BYTES of every changed tracked file, and of every file the checkout
     rewrites whose bytes differ from its blob although git's stat cache calls it unchanged (a notebook whose
     outputs a clean filter such as nbstripout kept out of the blob): whatever git's diff makes of a file, its
     bytes are in the backup;
   * ``untracked.tar.gz``: the untracked files that are not ignored (``git ls-files --others --exclude-standard``);
   * ``manifest.json``: each tarball's entries with the sha256 of their bytes (a link: of its target);
   * ``HEAD`` (the old sha, then the branch or ``(detached)``), ``status.txt`` (``git status --porcelain``) and
     ``RESTORE.txt`` (the commands that put it all back, every name shell-quoted).

   The proof: ``git stash create``, on a copy of the index, records the work tree and the index as trees (its
   objects go to a scratch object directory: nothing of the repository is written); each patch applied to the old
   HEAD in a throw-away index (``GIT_INDEX_FILE``) must give exactly its tree, and each tarball must hold exactly
   the saved entries with the bytes the work tree has then (read again). Any failure here removes the backup and
   ends the run; so does the deadline (checked for each saved file). With less than :data:`RESERVE` s left
   after saving, the run ends (``timeout``) with the backup complete and nothing reset;
5. a detached HEAD that no branch or tag contains gets a ref, ``refs/pve-gpu-recover/detached/<stamp>``, so that
   commits made on it stay reachable (a branch keeps its commits: it is never moved);
6. ``git checkout --force --detach <commit>``, given :data:`GRACE` s beyond the deadline so that it is never
   killed halfway (or ``git reset --hard`` when HEAD is already the commit: a branch at
   it stays checked out). Detached, because the pin is a commit, not a branch: moving a branch to it would drop the
   commits the branch had beyond it, and leaving a branch name on a tree it no longer describes would mislead;
7. remove the untracked files that were saved, exactly those and only while they still have the saved bytes (not
   ``git clean``: after the checkout, clean would read the commit's .gitignore, and a file the old .gitignore
   ignored, never saved, could be deleted); never through a link (a directory the checkout turned into a link to
   elsewhere is not entered); a directory they leave empty goes too;
8. with ``keep``, remove the oldest backups in ``backup_dir`` beyond the newest ``keep`` (this run's is kept).

Failure answers ``{"error": kind, "message", "cmd", "rc", "stdout_tail", "stderr_tail", "backup" (the backup
directory, or None), "touched" (whether step 5 or later had begun)}``.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=disallowed-name,ansible-bad-function

import contextlib
import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tarfile
import tempfile
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_act, pve_ct_git

SHARED = (pve_ct_act, pve_ct_git)  # container-side modules Target.run_probes ships with this part
PATCH_ARGS = (
    "--binary",
    "--no-color",
    "--no-ext-diff",
    "--no-textconv",
    "--no-renames",
    "--src-prefix=a/",
    "--dst-prefix=b/",
)
# `git stash create` writes commit objects: an identity of its own, whatever the target's git config says.
IDENTITY = ("user.name=pve-gpu-recover", "user.email=pve-gpu-recover@localhost")
KEEP_REF = "refs/pve-gpu-recover/detached/"
UNMERGED = {"DD", "AU", "UD", "UA", "DU", "AA", "UU"}
SPARE = 1024 * 1024  # bytes the backup's file system keeps free beyond the backup
TAIL_LINES = 40
KILL_WAIT = 5
# The checkout (or reset) is started only when this much of reset_timeout is left, and may overrun the deadline by
# GRACE: git killed midway would leave a half-written work tree and an index.lock.
RESERVE = 30.0
GRACE = 120.0
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def short(sha):
    return sha[:12] if sha else "(none)"


def shown(path):
    """A path read from git as JSON-safe text: undecodable bytes as ``\\xNN``."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class Git:
    """git in one repository within the reset's deadline; a command past it is killed with its process group."""

    def __init__(self, git, top, deadline, budget):
        self.git = git
        self.top = top
        self.deadline = deadline
        self.budget = budget
        self.env = pve_ct_git.git_env(top)
        self.owner = None  # (uid, gid) that git's writes run as, None: root (a repository of root's)
        self.owner_env = self.env

    def run(self, *args, config=(), env=None, write=False, grace=0.0):
        """``(rc, stdout, stderr)``. ``write``: a call that writes the repository runs as its owner (not root), in
        the owner's copy of the view; ``grace``: seconds it may run past the deadline."""
        argv = pve_ct_git.git_argv(self.git, self.top, args, config)
        remaining = self.deadline - time.monotonic()
        as_owner = {}
        if write and self.owner is not None:
            as_owner = {"user": self.owner[0], "group": self.owner[1], "extra_groups": []}
        if remaining <= 0:
            raise pve_ct_act.ActError(
                "timeout", f"the reset's {self.budget:g} s (reset_timeout) ran out before `git {args[0]}`"
            )
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(self.owner_env if as_owner else self.env, **(env or {})),
                cwd="/",
                start_new_session=True,  # so that a timeout kills what git started too (ssh, remote helpers)
                **as_owner,
            )
        except OSError as error:
            raise pve_ct_act.ActError("no_git", f"cannot run `{self.git}`: {error.strerror}", cmd=argv) from None
        try:
            out, err = process.communicate(timeout=remaining + grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            try:
                out, err = process.communicate(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                out, err = b"", b""
            raise pve_ct_act.ActError(
                "timeout",
                f"`git {' '.join(args)}` did not finish within the reset's {self.budget:g} s (reset_timeout) and "
                f"was killed",
                cmd=argv,
                stderr=err.decode(errors="replace"),
            ) from None
        return process.returncode, out, err.decode(errors="replace")

    def must(self, *args, what, kind="git", config=(), env=None, write=False, grace=0.0):
        rc, out, err = self.run(*args, config=config, env=env, write=write, grace=grace)
        if rc != 0:
            argv = pve_ct_git.git_argv(self.git, self.top, args, config)
            raise pve_ct_act.ActError(
                kind, f"{what} failed (exit {rc}): {pve_ct_git.first_error(err)}", cmd=argv, rc=rc, stderr=err
            )
        return out


def collisions(git, commit, untracked):
    """Ignored files a checkout of ``commit`` would overwrite (:func:`pve_ct_git.collisions`)."""
    tracked = pve_ct_git.split_z(git.must("ls-files", "-z", what="listing the tracked files"))
    listed = pve_ct_git.split_z(
        git.must("ls-tree", "-r", "--name-only", "-z", commit, what="listing the commit's files")
    )
    return pve_ct_git.collisions(git.top, tracked, listed, untracked)


def free_bytes(directory):
    """Free bytes on the file system that holds ``directory`` (or its nearest existing parent)."""
    while not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    return shutil.disk_usage(directory).free


def write_file(path, data):
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


# -- the work tree's entries, never through a link ---------------------------------------------------------
def open_top(top):
    """The directory ``top`` (absolute, as realpath gives it) opened from ``/`` one component at a time, never
    through a link: every read, digest and removal of the reset works from this fd, so a repository renamed away
    and replaced by a link (by whoever owns its parent) is never followed."""
    fd = os.open("/", DIRECTORY)
    try:
        for part in [p for p in top.split("/") if p]:
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
    fd = os.dup(top) if isinstance(top, int) else open_top(os.path.realpath(top))
    parts = path.split("/")
    try:
        for part in parts[:-1]:
            deeper = os.open(part, DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


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
                raise pve_ct_act.ActError("backup", f"{shown(path)} was replaced while it was saved; run again")
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
        fds = [os.dup(top) if isinstance(top, int) else open_top(os.path.realpath(top))]
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


def restore_text(top, directory, commit, *, head, branch, files):
    """RESTORE.txt: what was saved and the commands that put it back (run in the repository's top). Every name a
    user chose (the branch, the paths) is shell-quoted: the commands are pasted into a root shell."""
    q = shlex.quote
    lines = [
        f"Saved by pve-gpu-recover (training_code) before {top} was reset to {commit}.",
        f"HEAD was {head} ({'branch ' + q(branch) if branch else 'detached'}).",
        "",
        f"To put the local changes back, in {q(top)}:",
        "",
        f"  git checkout {q(branch) if branch else '--detach ' + q(head or '')}",
    ]
    if "changes.patch" in files:
        lines += [
            f"  git apply {q(directory + '/changes.patch')}          # every tracked change, staged or not",
            f"  git apply --cached {q(directory + '/staged.patch')}  # optional: stage again what was staged",
        ]
    if "changed.tar.gz" in files:
        lines.append(
            f"  tar -xzf {q(directory + '/changed.tar.gz')} -C {q(top)}  # the changed files' exact bytes (also what "
            "a clean filter hid from the patch)"
        )
    if "untracked.tar.gz" in files:
        lines.append(f"  tar -xzf {q(directory + '/untracked.tar.gz')} -C {q(top)}  # the untracked files")
    lines += [
        "",
        "manifest.json holds the sha256 of every saved file's bytes.",
        "To carry the changes onto the pinned commit instead (no checkout), use `git apply -3` for the patch.",
        "",
    ]
    return "\n".join(lines)


STAMP_NAME = re.compile(r"(\d{8}T\d{6}Z)(?:-(\d+))?")


def backups_in(root):
    """The backup directories ``make_directory`` names (``<stamp>``, ``<stamp>-2``...) in ``root``, oldest first."""
    found = []
    for name in os.listdir(root):
        match = STAMP_NAME.fullmatch(name)
        if match:
            found.append(((match.group(1), int(match.group(2) or 1)), name))
    return [name for _, name in sorted(found)]


class Reset:
    def __init__(self, payload):
        self.path = payload["path"]
        self.top = os.path.realpath(self.path)
        self.commit = payload["commit"].lower()
        self.remote = payload.get("remote") or None
        self.root = payload["backup_dir"]
        self.stamp = payload["stamp"]
        self.git_name = payload.get("git") or "git"
        self.budget = float(payload["timeout"])
        self.keep = payload.get("keep")
        self.deadline = time.monotonic() + self.budget
        self.git = None
        self.git_dir = None
        self.view = None
        self.top_fd = None  # the work tree, opened once from / without following a link
        self.backup = None  # the backup directory once written
        self.saved = {}  # the tarballs' manifest records, by tarball
        self.touched = False  # whether anything of the repository was changed (step 5 on)
        if self.remote and self.remote.startswith("-"):
            raise pve_ct_act.ActError(
                "invalid", f"remote {self.remote!r} starts with '-'; give a remote's name or a URL"
            )
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            raise pve_ct_act.ActError(
                "invalid", f"keep is {self.keep!r}; keep at least the newest backup (1) or all (None)"
            )

    # -- 1. re-check -------------------------------------------------------------------------------------------
    def check(self):
        git = pve_ct_git.find_git(self.git_name)
        if git is None:
            raise pve_ct_act.ActError("no_git", f"git not found in the target (`{self.git_name}`); install it there")
        if not os.path.isdir(self.top):
            raise pve_ct_act.ActError("no_repository", f"there is no directory {self.path}")
        self.git = Git(git, self.top, self.deadline, self.budget)
        try:
            self.top_fd = open_top(self.top)
        except OSError as error:
            raise pve_ct_act.ActError(
                "untrusted", f"{self.path} cannot be opened from / without following a link: {error.strerror}"
            ) from None
        info = os.fstat(self.top_fd)
        try:
            git_dir, common = pve_ct_git.locate(self.top)
        except pve_ct_git.Untrusted as error:
            raise pve_ct_act.ActError("untrusted", f"{error}; nothing was done") from None
        if git_dir is None:
            raise pve_ct_act.ActError("no_repository", f"{self.path} is not a git work tree (no .git)")
        try:
            self.view = pve_ct_git.View(git, self.top, git_dir, common, owner=(info.st_uid, info.st_gid))
        except (OSError, subprocess.SubprocessError, pve_ct_git.ViewError) as error:
            raise pve_ct_act.ActError(
                "no_repository", f"cannot read the repository's config in {common}: {error}"
            ) from None
        self.git.env = self.view.env
        self.git.owner, self.git.owner_env = self.view.owner, self.view.owner_env
        worktree = self.view.value("core.worktree")
        if worktree is not None and os.path.realpath(os.path.join(git_dir, worktree)) != self.top:
            raise pve_ct_act.ActError("no_repository", f"the work tree of the repository at {self.path} is {worktree}")
        self.git_dir = git_dir
        root = os.path.realpath(self.root)
        if root == self.top or root.startswith(self.top.rstrip("/") + "/"):
            raise pve_ct_act.ActError(
                "invalid", f"the backup directory {self.root} lies inside the repository {self.path}"
            )
        what = pve_ct_git.operation(git_dir)
        if what:
            raise pve_ct_act.ActError("operation", f"a {what} is in progress in {self.path}; finish or abort it first")
        rc, out, _ = self.git.run("rev-parse", "-q", "--verify", "HEAD^{commit}")
        head = out.decode().strip() if rc == 0 else None
        rc, out, _ = self.git.run("symbolic-ref", "-q", "--short", "HEAD")
        branch = out.decode(errors="replace").strip() if rc == 0 else None
        status = self.git.must(
            "status",
            "--porcelain=v1",
            "-z",
            "--untracked-files=no",
            "--ignore-submodules=dirty",
            what="reading the status (`git status`)",
        )
        entries = pve_ct_git.status_entries(status)
        conflicts = [shown(path) for code, path, _ in entries if code in UNMERGED]
        if conflicts:
            raise pve_ct_act.ActError(
                "conflict", f"{self.path} has unmerged paths: {', '.join(conflicts[:5])}; resolve them"
            )
        listed = self.git.must(
            "ls-files", "--others", "--exclude-standard", "-z", what="listing the untracked files (`git ls-files`)"
        )
        untracked = pve_ct_git.split_z(listed)
        nested = [shown(path) for path in untracked if path.endswith("/")]
        if nested:
            raise pve_ct_act.ActError(
                "nested", f"{', '.join(nested[:5])} in {self.path}: untracked git repositories inside"
            )
        tracked = entries
        if head is None and tracked:
            raise pve_ct_act.ActError(
                "unborn", f"{self.path} has no commit yet but files are staged; commit or unstage them"
            )
        return head, branch, tracked, untracked

    # -- 2. fetch ----------------------------------------------------------------------------------------------
    def present(self):
        rc, _, _ = self.git.run("cat-file", "-e", f"{self.commit}^{{commit}}")
        return rc == 0

    def ensure_commit(self):
        """Fetch the commit when the repository lacks it; True when it was fetched."""
        if self.present():
            return False
        if not self.remote:
            raise pve_ct_act.ActError(
                "missing",
                f"commit {self.commit} is not in the repository at {self.path} and no remote is set to fetch it from",
            )
        args = ("fetch", "--quiet", "--no-tags", "--no-recurse-submodules", self.remote, self.commit)
        rc, _, err = self.git.run(*args, write=True)
        self.settle()
        if rc != 0:
            raise pve_ct_act.ActError(
                "fetch",
                f"fetching {short(self.commit)} from {self.remote} failed (exit {rc}): {pve_ct_git.first_error(err)}",
                cmd=pve_ct_git.git_argv(self.git.git, self.top, args),
                rc=rc,
                stderr=err,
            )
        if not self.present():
            raise pve_ct_act.ActError("fetch", f"{self.remote} was fetched but it has no commit {self.commit}")
        return True

    def settle(self):
        """A file git rewrote in the view's common dir (it replaces a file by renaming a new one over it, so the
        link is replaced, not followed) goes to the real common dir: a fetch into a shallow clone updates
        ``shallow``. Read without following a link, written through the common dir's fd under a new name
        (O_EXCL|O_NOFOLLOW), owned by the repository's owner, then renamed over the old one (a rename replaces a
        link, never follows it)."""
        source = self.view.owned or self.view.dir
        uid, gid = self.view.owner or (0, 0)
        for name in ("shallow", "packed-refs"):
            try:
                handle = os.open(os.path.join(source, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue  # none, or still the link to the real one
            with os.fdopen(handle, "rb") as f:
                info = os.fstat(f.fileno())
                if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or info.st_nlink != 1:
                    continue  # not what git (run as the owner) wrote: never copied (a hard link to root's file)
                data = f.read()
            common = open_top(self.view.common)
            try:
                temp = f"{name}.pve-gpu-recover"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp, dir_fd=common)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                with open(os.open(temp, flags, 0o644, dir_fd=common), "wb") as out:
                    out.write(data)
                    os.fchown(out.fileno(), uid, gid)
                os.replace(temp, name, src_dir_fd=common, dst_dir_fd=common)
            finally:
                os.close(common)

    def refuse_filters(self):
        """A reset is due: refuse it when a path tracked now or by the commit has a filter the config defines."""
        if not pve_ct_git.filter_drivers(self.view.config):
            return
        paths = pve_ct_git.split_z(self.git.must("ls-files", "-z", what="listing the tracked files"))
        listed = pve_ct_git.split_z(
            self.git.must("ls-tree", "-r", "--name-only", "-z", self.commit, what="listing the commit's files")
        )
        counts = pve_ct_git.filtered(
            lambda args, env: self.git.must(*args, what="reading the filter attributes (`git check-attr`)", env=env),
            self.view.config,
            paths,
            self.commit,
            listed,
        )
        if counts:
            raise pve_ct_act.ActError("filter", pve_ct_git.filter_problem(self.path, self.commit, counts))

    # -- 4. save -----------------------------------------------------------------------------------------------
    def hidden(self, head, tracked, untracked):
        """Files the checkout rewrites whose bytes differ from the index although git, trusting its stat cache,
        calls them unchanged: a file added through a clean filter (a notebook through nbstripout) keeps its outputs
        in the work tree while the blob has none. Only the files that differ between HEAD and the commit are
        rewritten by the checkout, so only those are read."""
        if head is None or head == self.commit:
            return []
        changed = {path for _, path, _ in tracked} | set(untracked)
        rewritten = pve_ct_git.split_z(
            self.git.must(
                "diff",
                "--name-only",
                "-z",
                "--no-renames",
                head,
                self.commit,
                what="listing what the checkout rewrites",
            )
        )
        rewritten = [p for p in rewritten if p not in changed]
        if not rewritten:
            return []
        index = {}
        for line in pve_ct_git.split_z(
            self.git.must("ls-files", "-s", "-z", what="reading the index (`git ls-files -s`)")
        ):
            info, _, path = line.partition("\t")
            mode, sha, _ = info.split(" ", 2)
            index[path] = (mode, sha)
        object_format = (self.view.value("extensions.objectformat") or "sha1").lower()
        found = []
        for path in rewritten:
            mode, sha = index.get(path, (None, None))
            if mode in (None, "160000"):
                continue
            now = entry_digest(self.top_fd, path, blob=object_format)
            if now is not None and now[1] != sha:
                found.append(path)
        return found

    def save(self, head, branch, tracked, untracked, hidden):
        """Write the backup directory and prove it holds the work tree; its description."""
        changes = staged = b""
        if tracked:
            changes = self.git.must(
                "diff", *PATCH_ARGS, "--ignore-submodules=dirty", "HEAD", what="saving the changes (`git diff HEAD`)"
            )
            staged = self.git.must(
                "diff", "--cached", *PATCH_ARGS, "--ignore-submodules=dirty", "HEAD", what="saving the staged changes"
            )
            if not changes and not staged:
                raise pve_ct_act.ActError(
                    "backup",
                    f"`git diff HEAD` shows nothing for {len(tracked)} changed paths (changes inside a submodule? "
                    f"submodules are not managed: commit or discard them there)",
                )
        status = self.git.must(
            "status",
            "--porcelain=v1",
            "--untracked-files=all",
            "--ignore-submodules=dirty",
            what="reading the status",
            config=["core.quotePath=false"],
        )
        # The working tree's bytes of every changed file (a rename: its new name), whatever git's diff made of them.
        files_of_changes = [path for _, path, _ in tracked] + hidden
        sizes = 0
        for path in [*files_of_changes, *untracked]:
            with contextlib.suppress(OSError):
                fd, name = parent_fd(self.top_fd, path)
                try:
                    sizes += os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
                finally:
                    os.close(fd)
        need, free = len(changes) + len(staged) + sizes + SPARE, free_bytes(self.root)
        if need > free:
            raise pve_ct_act.ActError(
                "no_space",
                f"saving the local changes needs about {need // 2**20 + 1} MiB but {self.root} has "
                f"{free // 2**20} MiB free; free space there, or add large files to .gitignore (ignored files are "
                f"never saved nor touched)",
            )
        directory = self.make_directory()
        self.backup = directory
        try:
            files, manifest = [], {}
            if tracked:
                write_file(os.path.join(directory, "changes.patch"), changes)
                write_file(os.path.join(directory, "staged.patch"), staged)
                files += ["changes.patch", "staged.patch"]
            for name, paths in (("changed.tar.gz", files_of_changes), ("untracked.tar.gz", untracked)):
                records = self.write_tarball(os.path.join(directory, name), paths) if paths else None
                if records is not None:
                    manifest[name] = records
                    files.append(name)
            write_file(os.path.join(directory, "HEAD"), f"{head or '(no commit)'}\n{branch or '(detached)'}\n".encode())
            write_file(os.path.join(directory, "status.txt"), status)
            write_file(os.path.join(directory, "manifest.json"), json.dumps(manifest, indent=1).encode())
            files += ["HEAD", "status.txt", "manifest.json", "RESTORE.txt"]
            restore = restore_text(self.top, directory, self.commit, head=head, branch=branch, files=files)
            write_file(os.path.join(directory, "RESTORE.txt"), restore.encode())
            if tracked:
                self.prove_patches(directory, head)
            for name, records in manifest.items():
                self.prove_tarball(os.path.join(directory, name), records)
        except BaseException:
            _remove(directory)
            self.backup = None
            raise
        self.saved = manifest
        return {
            "dir": directory,
            "files": sorted(files),
            "changed": len(tracked),
            "untracked": len(untracked),
            "filtered": [shown(p) for p in hidden],
            "restore": os.path.join(directory, "RESTORE.txt"),
        }

    def make_directory(self):
        """``<backup_dir>/<stamp>`` (``-2``, ``-3``... when a run of the same second made one), mode 0700."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        for number in range(1, 100):
            directory = os.path.join(self.root, self.stamp if number == 1 else f"{self.stamp}-{number}")
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                continue
            return directory
        raise pve_ct_act.ActError("backup", f"{self.root} holds 99 backups named {self.stamp}*; remove some")

    def write_tarball(self, target, paths):
        """The entries at ``paths``, their bytes as on disk; the manifest's records of what it holds."""
        records = []
        with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
            with tarfile.open(fileobj=handle, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
                for path in paths:
                    if time.monotonic() > self.deadline:
                        raise pve_ct_act.ActError(
                            "timeout",
                            f"the reset's {self.budget:g} s (reset_timeout) ran out while saving {shown(path)}; "
                            "nothing was reset: raise reset_timeout, or add large files to .gitignore",
                        )
                    try:
                        record = add_entry(tar, self.top_fd, path)
                    except OSError as error:
                        if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                            continue  # deleted, or a directory of it is not one now: the patch holds the deletion
                        raise pve_ct_act.ActError("backup", f"cannot save {shown(path)}: {error.strerror}") from None
                    if record is not None:
                        records.append(record)
            handle.flush()
            os.fsync(handle.fileno())
        return records

    def prove_tarball(self, target, records):
        """The tarball holds exactly the recorded entries, each with the bytes the work tree has NOW (read again,
        never through a link): a file that changed while it was saved stops the run before anything is reset."""
        want = {r["path"]: (r["kind"], r["sha256"]) for r in records}
        with tarfile.open(target, "r:gz") as tar:
            got = {member.name: member_digest(tar, member) for member in tar.getmembers()}
        if got != want:
            wrong = sorted(shown(p) for p in set(got) ^ set(want) | {p for p in want if got.get(p) != want[p]})
            raise pve_ct_act.ActError("backup", f"{target} does not hold exactly the saved files (wrong: {wrong[:5]})")
        moved = sorted(shown(p) for p, digest in want.items() if entry_digest(self.top_fd, p) != digest)
        if moved:
            raise pve_ct_act.ActError(
                "backup", f"{', '.join(moved[:5])} changed while it was saved (a live job writing?); run again"
            )

    def prove_patches(self, directory, head):
        """Each patch applied to the old HEAD in a throw-away index gives exactly the tree git records for the work
        tree (changes.patch) and for the index (staged.patch). Every object git writes for this goes to a scratch
        object directory: the repository is not written."""
        with tempfile.TemporaryDirectory(prefix="pve-gpu-recover-", dir=pve_ct_git.scratch_root()) as scratch:
            objects = {
                "GIT_OBJECT_DIRECTORY": os.path.join(scratch, "objects"),
                "GIT_ALTERNATE_OBJECT_DIRECTORIES": os.path.join(self.view.dir, "objects"),
            }
            os.mkdir(objects["GIT_OBJECT_DIRECTORY"])
            # On a copy of the index: stash create refreshes and rewrites the index it reads.
            index = os.path.join(scratch, "index")
            if os.path.exists(os.path.join(self.git_dir, "index")):
                shutil.copyfile(os.path.join(self.git_dir, "index"), index)
            stash = self.git.must(
                "stash",
                "create",
                what="recording the work tree (`git stash create`)",
                config=IDENTITY,
                env=dict(objects, GIT_INDEX_FILE=index),
            ).decode()
            if not stash.strip():
                raise pve_ct_act.ActError(
                    "backup", "`git stash create` recorded nothing although tracked files changed"
                )
            trees = f"{stash.strip()}^{{tree}}", f"{stash.strip()}^2^{{tree}}"
            work_tree, index_tree = (
                self.git.must("rev-parse", *trees, what="reading its trees", env=objects).decode().split()
            )
            for name, want in (("changes.patch", work_tree), ("staged.patch", index_tree)):
                env = dict(objects, GIT_INDEX_FILE=os.path.join(scratch, f"{name}.index"))
                self.git.must("read-tree", head, what="reading the old HEAD into a scratch index", env=env)
                patch = os.path.join(directory, name)
                if os.path.getsize(patch):
                    self.git.must(
                        "apply", "--cached", patch, what=f"applying {name} to the old HEAD", kind="backup", env=env
                    )
                got = self.git.must("write-tree", what="writing the scratch tree", env=env).decode().strip()
                if got != want:
                    raise pve_ct_act.ActError(
                        "backup", f"{name} applied to {short(head)} gives tree {got}, not the saved state's {want}"
                    )

    # -- 5. and 6. ---------------------------------------------------------------------------------------------
    def keep_detached(self, head, branch):
        """A ref for a detached HEAD that no branch or tag contains (its commits would be reachable from nowhere)."""
        if head is None or branch is not None or head == self.commit:
            return None
        contained = self.git.must(
            "for-each-ref",
            "--count=1",
            "--format=%(refname)",
            "--contains",
            head,
            "refs/heads",
            "refs/tags",
            what="looking for a branch or tag that holds HEAD",
        )
        if contained.strip():
            return None
        ref = f"{KEEP_REF}{self.stamp}"
        self.git.must("update-ref", ref, head, what=f"keeping the detached HEAD as {ref}", write=True)
        return ref

    def reset(self, head):
        if head == self.commit:
            self.git.must(
                "reset",
                "--quiet",
                "--hard",
                what="resetting the work tree (`git reset --hard`)",
                kind="reset",
                write=True,
                grace=GRACE,
            )
        else:
            self.git.must(
                "checkout",
                "--quiet",
                "--force",
                "--no-recurse-submodules",
                "--detach",
                self.commit,
                what=f"checking out {short(self.commit)}",
                kind="reset",
                write=True,
                grace=GRACE,
            )

    def remove(self, untracked):
        """Remove the saved untracked files that the commit does not track, exactly as they were saved, never
        through a link (see :func:`remove_entry`); prune directories left empty."""
        tracked = set(pve_ct_git.split_z(self.git.must("ls-files", "-z", what="listing the tracked files")))
        saved = {r["path"]: (r["kind"], r["sha256"]) for r in self.saved.get("untracked.tar.gz", [])}
        removed = []
        for path in untracked:
            if path in tracked or path not in saved:
                continue
            if remove_entry(self.top_fd, path, saved[path]):
                removed.append(shown(path))
        return removed

    def prune(self):
        """Remove the oldest backups beyond ``keep`` (the newest ``keep`` stay, this run's among them); the names
        removed."""
        if self.keep is None or not os.path.isdir(self.root):
            return []
        names = backups_in(self.root)
        current = os.path.basename(self.backup) if self.backup else None
        older = [name for name in names if name != current]
        room = self.keep - (1 if current else 0)
        pruned = []
        for name in older[: max(0, len(older) - room)]:
            full = os.path.join(self.root, name)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
                pruned.append(name)
        return pruned

    def execute(self):
        started = time.monotonic()
        head, branch, tracked, untracked = self.check()
        fetched = self.ensure_commit()
        if head != self.commit or tracked or untracked:
            self.refuse_filters()
        if head != self.commit:
            in_the_way = collisions(self.git, self.commit, untracked)
            if in_the_way:
                raise pve_ct_act.ActError(
                    "collision",
                    f"checking out {short(self.commit)} would overwrite ignored files: "
                    f"{', '.join(shown(p) for p in in_the_way[:5])}; move them out of {self.path}",
                )
        backup = kept = None
        removed, pruned = [], []
        if head != self.commit or tracked or untracked:
            hidden = self.hidden(head, tracked, untracked)
            if tracked or untracked or hidden:
                backup = self.save(head, branch, tracked, untracked, hidden)
            left = self.deadline - time.monotonic()
            if left < min(RESERVE, self.budget / 4):
                raise pve_ct_act.ActError(
                    "timeout",
                    f"only {max(left, 0):.0f} s of the reset's {self.budget:g} s (reset_timeout) were left after "
                    f"saving; the checkout is never started without {min(RESERVE, self.budget / 4):g} s: nothing was "
                    "reset (the backup is complete); raise reset_timeout and run again",
                )
            self.touched = True
            kept = self.keep_detached(head, branch)
            self.reset(head)
            removed = self.remove(untracked)
            pruned = self.prune()
        now = self.git.must("rev-parse", "--verify", "HEAD^{commit}", what="reading HEAD").decode().strip()
        return {
            "head_before": head,
            "branch_before": branch,
            "head": now,
            "fetched": fetched,
            "backup": backup,
            "kept_ref": kept,
            "removed": removed,
            "pruned": pruned,
            "seconds": round(time.monotonic() - started, 3),
        }


def probe(payload):
    """ACTS: save the local changes of the repository in ``payload``, then put it at the commit; answer what was done.

    ``payload``: ``{"path", "commit" (full sha), "remote" (name, URL or None), "backup_dir", "git", "stamp"
    ("20261203T101500Z"), "timeout" (s), "keep" (backups kept, None: every one)}``.

    Success: ``{"head_before", "branch_before", "head", "fetched", "backup" ({"dir", "files", "changed",
    "untracked", "filtered", "restore"} or None: nothing was dirty), "kept_ref", "removed", "pruned", "seconds"}``.
    Failure: ``{"error", "message", "cmd", "rc", "stdout_tail", "stderr_tail", "backup", "touched"}``.
    """
    try:
        reset = Reset(payload)
    except (KeyError, TypeError, ValueError) as error:
        return {
            "error": "invalid",
            "message": f"the reset payload is incomplete: {error}",
            "backup": None,
            "touched": False,
        }
    except pve_ct_act.ActError as error:
        return {"error": error.kind, "message": str(error), "backup": None, "touched": False}
    try:
        return reset.execute()
    except (pve_ct_act.ActError, OSError) as error:
        failure = pve_ct_act.failure(error, TAIL_LINES)
    finally:
        if reset.view is not None:
            reset.view.close()
        if reset.top_fd is not None:
            os.close(reset.top_fd)
    failure.update(backup=reset.backup, touched=reset.touched)
    return failure
