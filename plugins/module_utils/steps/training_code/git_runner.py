# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training code step's git, the probe's and the reset's alike: one repository's git run within one deadline
through :func:`ct_git.read` (the one CT runner, :func:`ct_run.run`: a command past it is killed with its process
group), on the work tree's top as it was opened (``-C /proc/self/fd/<fd>``, the fd kept for every call: a path
swapped for a link after the open is never followed). Read-only for the probe; in the reset every call that writes
the repository runs as the owner of its work tree, in the owner's copy of the :mod:`ct_git` view; with filters,
every call as the owner with the owner's own config (:meth:`Git.as_owner`). Also the view opened within the
deadline, the ignored files a checkout would overwrite, and a commit's sha as messages show it.

Container side, shipped with the probe part and the reset script: it is in their ``SHARED``, so
``Target.run_probes`` sends its source in the same ``pct exec`` (registered under its own dotted name), and on a
node it is imported as usual. So: standard library only, Python 3.9+, nothing of ours but the container-side
modules of its own ``SHARED``.
"""

import os
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import worktree

SHARED = (ct_act, ct_git, worktree)  # container-side modules Target.run_probes ships with this module


def short(sha):
    return sha[:12] if sha else "(none)"


class Git:
    """git in one repository within one deadline; ``run`` answers ``(rc, stdout bytes, stderr text)``. A call that
    gives no answer is an :class:`ct_act.ActError`: ``timeout`` (killed at the deadline, named ``within``: the
    probe's timeout, the reset's reset_timeout), ``no_git`` (git cannot run), ``git`` (it printed more than a read
    keeps). ``fd``: the work tree's top, opened (:func:`ct_git.open_top`), where git works (None: none yet, ``/``);
    ``path``: the path it was opened as, for messages. ``read_only`` (the probe): a call that writes is refused."""

    def __init__(self, git, fd, path, deadline, *, within, read_only=False):
        self.git = git
        self.fds = () if fd is None else (fd,)
        self.top = "/" if fd is None else ct_git.at(fd)
        self.path = path
        self.deadline = deadline
        self.within = within
        self.read_only = read_only
        self.env = ct_git.git_env(self.top)  # until the view is open: `git --version` only
        self.owner = None  # (uid, gid) that git's writes run as, None: root (a repository of root's)
        self.owner_env = self.env
        self.always = False  # every call as the owner with the owner's own config (a filtered repository)
        self.user = None  # then (uid, gid, groups), None: root

    def open_view(self, git_dir, common, owner=None):
        """The repository's :class:`ct_git.View` within the deadline, its writes as ``owner``; ActError when its
        config cannot be read."""
        where = f"the repository's config in {ct_git.real(common)}"
        try:
            return ct_git.View(self.git, self.top, git_dir, common, owner=owner, deadline=self.deadline)
        except ct_git.Unfinished as error:
            if error.timed_out:
                raise ct_act.ActError("timeout", f"{error} (reading {where}, within {self.within})") from None
            raise ct_act.ActError("no_git", f"reading {where}: {error}") from None
        except (OSError, ct_git.ViewError) as error:
            raise ct_act.ActError("no_repository", f"cannot read {where}: {error}") from None

    def use_view(self, view):
        """Every call from now on in ``view`` (reads as root, writes as its owner in the owner's copy)."""
        self.env, self.owner, self.owner_env = view.env, view.owner, view.owner_env
        self.always, self.user = False, None

    def as_owner(self, git_dir):
        """From now on every call, reads included, runs as the owner of the work tree's top with the owner's own
        config (root's own for a repository of root's): their git, filters and all; never another owner's
        configuration as root."""
        info = os.stat(self.top)
        user, home = ct_git.identity(info.st_uid, info.st_gid)
        self.env = self.owner_env = ct_git.own_env(self.top, git_dir, home)
        self.always, self.user = True, None if info.st_uid == 0 else user

    def shown(self, argv):
        """``argv`` as messages show it: the opened top by the path it lies at now."""
        return [ct_git.real(arg) for arg in argv]

    def run(self, *args, config=(), env=None, write=False, grace=0.0):
        """``(rc, stdout, stderr)``. ``write``: a call that writes the repository runs as its owner (not root), in
        the owner's copy of the view; ``grace``: seconds it may run past the deadline, once started before it."""
        argv = ct_git.git_argv(self.git, self.top, args, config)
        if write and self.read_only:
            raise ct_act.ActError("invalid", f"`git {args[0]}` writes the repository, and this git only reads")
        if time.monotonic() >= self.deadline:
            raise ct_act.ActError(
                "timeout", f"the time was up before `git {args[0]}` in {self.path} (within {self.within})"
            )
        if self.always:
            base, user = self.env, self.user
        elif write and self.owner is not None:
            base, user = self.owner_env, (self.owner[0], self.owner[1], ())
        else:
            base, user = self.env, None
        try:
            return ct_git.read(argv, dict(base, **(env or {})), self.deadline + grace, user=user, fds=self.fds)
        except ct_git.Unfinished as error:
            if error.timed_out:
                said, kind = f"{error} (in {self.path}, within {self.within})", "timeout"
            else:
                said, kind = str(error), "no_git" if error.missing else "git"
            raise ct_act.ActError(kind, said, cmd=self.shown(argv)) from None

    def must(self, *args, what=None, kind="git", config=(), env=None, write=False, grace=0.0):
        """stdout of a call that must succeed; ActError ``kind`` naming ``what`` (the command in the top by
        default) else."""
        rc, out, err = self.run(*args, config=config, env=env, write=write, grace=grace)
        if rc != 0:
            argv = self.shown(ct_git.git_argv(self.git, self.top, args, config))
            what = what or f"`git {' '.join(args)}` in {self.path}"
            raise ct_act.ActError(
                kind, f"{what} failed (exit {rc}): {ct_git.first_error(err)}", cmd=argv, rc=rc, stderr=err
            )
        return out


def collisions(git, commit, untracked):
    """Ignored files a checkout of ``commit`` would overwrite (:func:`worktree.collisions`, in the opened top)."""
    tracked = ct_git.split_z(git.must("ls-files", "-z", what="listing the tracked files"))
    listed = ct_git.split_z(git.must("ls-tree", "-r", "--name-only", "-z", commit, what="listing the commit's files"))
    return worktree.collisions(git.top, tracked, listed, untracked)
