# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training code reset: save every local change, then put the repository at the pinned commit. It ACTS.

Unlike a probe part, ``probe(payload)`` here changes the target. It is called the same way so that it costs one
``pct exec``: ``Target.run_probes`` ships this file's source to the target's python on stdin; on a bare host
``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing of ours but the
container-side modules of ``SHARED``, the answer is plain JSON. git is called exactly as the probe part calls it,
through :mod:`ct_git` (a view of the repository whose config is an allowlist of the real one's keys, so nothing
the repository's owner configured runs as root; no system or global config; no ``GIT_*`` of the caller). Reads run
as root; every call that writes the repository (fetch, update-ref, checkout, reset) runs as the owner of the work
tree's top (root for a repository of root's), in the owner's copy of the view, so a link the owner planted in
``.git`` can only hurt the owner. The top is opened once from ``/`` without following a link nor passing a
directory another user than root and its owner could have put there (:func:`ct_git.open_top`), and kept open to
the end: git works on the opened directory (``-C``, ``GIT_WORK_TREE`` and the git dir below
``/proc/self/fd/<fd>``), and files of the work tree are read and removed through directory file descriptors from
it, never through a link: a path swapped for a link after the open is never followed.

Beside it, shipped with it in the same ``pct exec`` (``SHARED``, each under its own dotted name): git_runner.py
(git within the reset's deadline through ct_git.read, writes as the owner; the probe's git too), nofollow.py (the
work tree's entries, never through a link), worktree.py (status, filters, collisions), users.py (the last look)
and backups.py (steps 4 and 8: the backup, its proof, the old backups removed), whose ``Backup`` ``Reset``
inherits.

In this order, and nothing is changed in the work tree, the index, HEAD or any branch before step 5:

1. re-check what the fact pass found (the facts can be seconds old): a work tree whose top is ``path``, no
   unfinished merge/rebase/..., no conflict, no untracked repository inside, the backup directory outside it, a git
   dir and common dir of the top's owner reached through no link (``untrusted``);
2. fetch the commit from ``remote`` when the repository lacks it (``git fetch --no-tags <remote> <sha>``; only
   objects and FETCH_HEAD are written); a failed fetch ends the run;
3. when a tracked path (now or in the commit) has a clean/smudge ``filter`` attribute (git-lfs), git runs as the
   owner with the owner's own config from here on, reads included (:meth:`Reset.choose_git`; a filter whose program
   the target lacks: ``filter``); the commit, its trees and every blob the reset writes are checked against their
   ids (``tampered``); refuse when the checkout would overwrite IGNORED files (checkpoints, data): ignored files
   are never saved, so they must never be touched;
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
   after saving, the run ends (``timeout``) with the backup complete and nothing reset. A backup that would leave
   less than ``min_free`` on its file system is not written (``no_space``). Unattended (``window_check``), a last
   look for a live process using the repository (users.py) ends the run with ``needs_window``, its backup removed;
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
import os
import stat
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import (
    backups,
    git_runner,
    nofollow,
    users,
    worktree,
)

# Container-side modules Target.run_probes ships with this part, each after what its own SHARED names
# (target.shared_modules).
SHARED = (ct_act, ct_fs, ct_run, ct_git, worktree, git_runner, nofollow, users, backups)

KEEP_REF = "refs/pve-gpu-recover/detached/"
UNMERGED = {"DD", "AU", "UD", "UA", "DU", "AA", "UU"}
TAIL_LINES = 40
# The checkout (or reset) is started only when this much of reset_timeout is left, and may overrun the deadline by
# GRACE: git killed midway would leave a half-written work tree and an index.lock.
RESERVE = 30.0
GRACE = 120.0


class Reset(backups.Backup):
    def __init__(self, payload):
        self.path = payload["path"]
        self.top = ct_fs.clean(self.path)  # never resolved: a link on the way is refused (check)
        self.commit = payload["commit"].lower()
        self.remote = payload.get("remote") or None
        self.root = payload["backup_dir"]
        self.stamp = payload["stamp"]
        self.git_name = payload.get("git") or "git"
        self.budget = float(payload["timeout"])
        self.keep = payload.get("keep")
        self.min_free = int(payload.get("min_free") or 0)
        self.window_check = bool(payload.get("window_check"))  # unattended: never reset under a live process
        self.filters = {}  # {driver: paths}: git runs as the owner with the owner's own config (choose_git)
        self.deadline = time.monotonic() + self.budget
        self.git = None
        self.git_dir = None
        self.view = None
        self.top_fd = None  # the work tree, opened once from / without following a link (self.git.top names it)
        self.backup = None  # the backup directory once written
        self.saved = {}  # the tarballs' manifest records, by tarball
        self.touched = False  # whether anything of the repository was changed (step 5 on)
        if self.remote and self.remote.startswith("-"):
            raise ct_act.ActError("invalid", f"remote {self.remote!r} starts with '-'; give a remote's name or a URL")
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            raise ct_act.ActError(
                "invalid", f"keep is {self.keep!r}; keep at least the newest backup (1) or all (None)"
            )

    # -- 1. re-check -------------------------------------------------------------------------------------------
    def check(self):
        git = ct_git.find_git(self.git_name)
        if git is None:
            raise ct_act.ActError("no_git", f"git not found in the target (`{self.git_name}`); install it there")
        try:
            self.top_fd = ct_git.open_top(self.top)
        except ct_git.Refused as error:
            raise ct_act.ActError("untrusted", f"{error}; nothing was done") from None
        except OSError:
            raise ct_act.ActError("no_repository", f"there is no directory {self.path}") from None
        # From here on git and every read work on the opened top (self.git.top), never on the path again.
        within = f"the reset's {self.budget:g} s of reset_timeout"
        self.git = git_runner.Git(git, self.top_fd, self.path, self.deadline, within=within)
        info = os.fstat(self.top_fd)
        try:
            git_dir, common = ct_git.locate(self.git.top)
        except ct_git.Untrusted as error:
            raise ct_act.ActError("untrusted", f"{error}; nothing was done") from None
        if git_dir is None:
            raise ct_act.ActError("no_repository", f"{self.path} is not a git work tree (no .git)")
        self.view = self.git.open_view(git_dir, common, (info.st_uid, info.st_gid))
        self.git.use_view(self.view)
        elsewhere = self.view.value("core.worktree")
        here = ct_git.real(self.git.top)  # where the opened top lies now
        if elsewhere is not None and os.path.realpath(os.path.join(ct_git.real(git_dir), elsewhere)) != here:
            raise ct_act.ActError("no_repository", f"the work tree of the repository at {self.path} is {elsewhere}")
        self.git_dir = git_dir
        root = os.path.realpath(self.root)
        if root == self.top or root.startswith(self.top.rstrip("/") + "/"):
            raise ct_act.ActError("invalid", f"the backup directory {self.root} lies inside the repository {self.path}")
        what = worktree.operation(git_dir)
        if what:
            raise ct_act.ActError("operation", f"a {what} is in progress in {self.path}; finish or abort it first")

    def state(self):
        """``(head, branch, tracked changes, untracked paths)``, read by the git chosen (:meth:`choose_git`)."""
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
        entries = worktree.status_entries(status)
        conflicts = [nofollow.shown(path) for code, path, _ in entries if code in UNMERGED]
        if conflicts:
            raise ct_act.ActError(
                "conflict", f"{self.path} has unmerged paths: {', '.join(conflicts[:5])}; resolve them"
            )
        listed = self.git.must(
            "ls-files", "--others", "--exclude-standard", "-z", what="listing the untracked files (`git ls-files`)"
        )
        untracked = ct_git.split_z(listed)
        nested = [nofollow.shown(path) for path in untracked if path.endswith("/")]
        if nested:
            raise ct_act.ActError(
                "nested", f"{', '.join(nested[:5])} in {self.path}: untracked git repositories inside"
            )
        tracked = entries
        if head is None and tracked:
            raise ct_act.ActError(
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
            raise ct_act.ActError(
                "missing",
                f"commit {self.commit} is not in the repository at {self.path} and no remote is set to fetch it from",
            )
        args = ("fetch", "--quiet", "--no-tags", "--no-recurse-submodules", self.remote, self.commit)
        rc, _, err = self.git.run(*args, write=True)
        self.settle()
        if rc != 0:
            raise ct_act.ActError(
                "fetch",
                f"fetching {git_runner.short(self.commit)} from {self.remote} failed (exit {rc}): "
                f"{ct_git.first_error(err)}",
                cmd=self.git.shown(ct_git.git_argv(self.git.git, self.git.top, args)),
                rc=rc,
                stderr=err,
            )
        if not self.present():
            raise ct_act.ActError("fetch", f"{self.remote} was fetched but it has no commit {self.commit}")
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
            try:
                common = ct_git.open_dir(self.view.common)
            except ct_git.Untrusted as error:
                raise ct_act.ActError("untrusted", f"{error}; the fetch's {name} was not copied") from None
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

    def choose_git(self):
        """``{driver: paths}``: when tracked paths, now or in the commit, name a clean/smudge filter (git-lfs), git
        runs as the work tree's owner with the owner's own config from here on, reads and writes alike (root's own
        for a repository of root's): a checkout without the filter would write its blobs (LFS pointers) over the
        content, and a status without it would call the content changed. Never another owner's configuration as
        root. A filter whose program the target lacks stops the reset (``filter``) before anything changes."""
        listed = ct_git.split_z(
            self.git.must("ls-tree", "-r", "--name-only", "-z", self.commit, what="listing the commit's files")
        )
        counts = worktree.filtered(
            lambda args, env: self.git.must(*args, what="reading the filter attributes (`git check-attr`)", env=env),
            self.commit,
            listed,
        )
        if not counts:
            return {}
        self.git.as_owner(self.git_dir)
        listing = self.git.run("config", "--null", "--get-regexp", r"^filter\.")[1]
        missing = worktree.missing_filters(listing, set(counts), self.git.env.get("PATH"))
        if missing:
            raise ct_act.ActError("filter", worktree.missing_problem(self.path, missing))
        return counts

    def verify(self, head, tracked):
        """The commit, its trees and every blob the reset writes (those that differ from HEAD's, and the changed
        tracked paths) are what their ids say: a replace ref is never followed (ct_git.git_env) and an object whose
        bytes were changed is refused (``tampered``) before anything is written."""
        object_format = (self.view.value("extensions.objectformat") or "sha1").lower()
        try:
            entries = ct_git.verify_commit(self.git.run, self.commit, object_format)
            paths = {path for _, path, _ in tracked}
            if head is None:
                paths = {path.decode("utf-8", "surrogateescape") for path in entries}
            elif head != self.commit:
                listed = self.git.must(
                    "diff",
                    "--name-only",
                    "-z",
                    "--no-renames",
                    head,
                    self.commit,
                    what="listing what the checkout writes",
                )
                paths.update(ct_git.split_z(listed))
            for path in sorted(paths):
                _, kind, oid = entries.get(path.encode("utf-8", "surrogateescape"), (None, None, None))
                if kind != "blob":
                    continue  # not in the commit (removed), or a submodule
                rc, out, err = self.git.run("cat-file", "blob", oid)
                if rc != 0:
                    raise ct_git.unreadable(oid, err)
                ct_git.checked(object_format, "blob", oid, out)
        except ct_git.Tampered as error:
            raise ct_act.ActError("tampered", f"the pinned commit in {self.path}: {error}; nothing was reset") from None

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
                what=f"checking out {git_runner.short(self.commit)}",
                kind="reset",
                write=True,
                grace=GRACE,
            )

    def remove(self, untracked):
        """Remove the saved untracked files that the commit does not track, exactly as they were saved, never
        through a link (see :func:`nofollow.remove_entry`); prune directories left empty."""
        tracked = set(ct_git.split_z(self.git.must("ls-files", "-z", what="listing the tracked files")))
        saved = {r["path"]: (r["kind"], r["sha256"]) for r in self.saved.get("untracked.tar.gz", [])}
        removed = []
        for path in untracked:
            if path in tracked or path not in saved:
                continue
            if nofollow.remove_entry(self.top_fd, path, saved[path]):
                removed.append(nofollow.shown(path))
        return removed

    def execute(self):
        started = time.monotonic()
        self.check()
        fetched = self.ensure_commit()
        self.filters = self.choose_git()
        head, branch, tracked, untracked = self.state()
        if head != self.commit or tracked or untracked:
            self.verify(head, tracked)
        if head != self.commit:
            in_the_way = git_runner.collisions(self.git, self.commit, untracked)
            if in_the_way:
                raise ct_act.ActError(
                    "collision",
                    f"checking out {git_runner.short(self.commit)} would overwrite ignored files: "
                    f"{', '.join(nofollow.shown(p) for p in in_the_way[:5])}; move them out of {self.path}",
                )
        backup = kept = None
        removed, pruned = [], []
        if head != self.commit or tracked or untracked:
            hidden = self.hidden(head, tracked, untracked)
            if tracked or untracked or hidden:
                backup = self.save(head, branch, tracked, untracked, hidden)
            left = self.deadline - time.monotonic()
            if left < min(RESERVE, self.budget / 4):
                raise ct_act.ActError(
                    "timeout",
                    f"only {max(left, 0):.0f} s of the reset's {self.budget:g} s (reset_timeout) were left after "
                    f"saving; the checkout is never started without {min(RESERVE, self.budget / 4):g} s: nothing was "
                    "reset (the backup is complete); raise reset_timeout and run again",
                )
            if self.window_check:
                found = users.last_look([self.top], self.deadline)
                if found:  # a job started while the backup was written: nothing is reset, this run's backup goes
                    if self.backup:
                        backups.remove_tree(self.backup)
                        self.backup = None
                    return {"needs_window": {"path": self.path, "users": found}}
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
            "filters": self.filters,
            "seconds": round(time.monotonic() - started, 3),
        }


def probe(payload):
    """ACTS: save the local changes of the repository in ``payload``, then put it at the commit; answer what was done.

    ``payload``: ``{"path", "commit" (full sha), "remote" (name, URL or None), "backup_dir", "git", "stamp"
    ("20261203T101500Z"), "timeout" (s), "keep" (backups kept, None: every one), "min_free" (bytes the backup's
    file system keeps free beyond the backup), "window_check" (unattended: look once more for a live process
    using the repository right before the reset; optional)}``.

    Success: ``{"head_before", "branch_before", "head", "fetched", "backup" ({"dir", "files", "changed",
    "untracked", "filtered", "restore"} or None: nothing was dirty), "kept_ref", "removed", "pruned", "seconds"}``.
    Not reset because a live process uses the repository (``window_check``): ``{"needs_window": {"path", "users":
    [{"pid", "name", "how", "file" or "error"}]}}``, this run's backup removed.
    Failure: ``{"error", "message", "cmd", "rc", "stdout_tail", "stderr_tail", "backup", "touched"}``.
    """
    # In a CT, the pct exec's timeout ending this script ends the git it started too. On a bare host the parts run
    # in a thread of the module, where no signal handler can be set (ValueError): the module's own deadline rules.
    ct_run.end_with_me()
    try:
        reset = Reset(payload)
    except (KeyError, TypeError, ValueError) as error:
        return {
            "error": "invalid",
            "message": f"the reset payload is incomplete: {error}",
            "backup": None,
            "touched": False,
        }
    except ct_act.ActError as error:
        return {"error": error.kind, "message": str(error), "backup": None, "touched": False}
    try:
        return reset.execute()
    except (ct_act.ActError, OSError) as error:
        failure = ct_act.failure(error, TAIL_LINES)
    finally:
        if reset.view is not None:
            reset.view.close()
        if reset.top_fd is not None:
            os.close(reset.top_fd)
    failure.update(backup=reset.backup, touched=reset.touched)
    return failure
