# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training code probe: where the repository's HEAD is, what is dirty, whether the pinned commit is there. READ ONLY.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probes`` (one ``pct exec``); on a
bare host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing of ours
but the container-side modules of ``SHARED`` (shipped with it), and the answer is plain JSON.

It runs git (never a shell) with a deadline (past it, git is killed with whatever it started: :func:`pve_ct_git.read`)
and only reads: ``status`` runs with ``GIT_OPTIONAL_LOCKS=0``, so not
even the index's stat cache is rewritten. Every git call goes through :mod:`pve_ct_git`, as the acting script's
do: a view of the repository whose config is an allowlist of the real one's keys, no system or global config, no
``GIT_*`` of the caller, no submodule; nothing of the repository is written.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=disallowed-name,ansible-bad-function

import os
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_git

SHARED = (pve_ct_git,)  # container-side modules Target.run_probes ships with this part


class Stop(Exception):
    """A git call that could not give an answer (timed out, could not run, failed): the probe says so and stops."""


def stopped(error, where):
    """The :class:`Stop` of a git read that gave no answer (:class:`pve_ct_git.Unfinished`), ``where`` it ran."""
    if error.timed_out:
        return Stop(f"{error} ({where}, within the probe's timeout)")
    return Stop(str(error))


def open_view(git, top, git_dir, common):
    """The repository's :class:`pve_ct_git.View` within ``git``'s deadline; Stop when its config cannot be read."""
    try:
        return pve_ct_git.View(git.git, top, git_dir, common, deadline=git.deadline)
    except pve_ct_git.Unfinished as error:
        raise stopped(error, f"reading the repository's config in {common}") from None
    except (OSError, pve_ct_git.ViewError) as error:
        raise Stop(f"cannot read the repository's config in {common}: {error}") from None


class Git:
    """Runs git in one repository within one deadline; ``run`` answers ``(rc, stdout bytes, stderr text)``."""

    def __init__(self, git, top, deadline):
        self.git = git
        self.top = top
        self.deadline = deadline
        self.env = pve_ct_git.git_env(top)  # until the view is open: `git --version` only

    def run(self, *args, env=None):
        try:
            return pve_ct_git.read(
                pve_ct_git.git_argv(self.git, self.top, args), dict(self.env, **(env or {})), self.deadline
            )
        except pve_ct_git.Unfinished as error:
            raise stopped(error, f"in {self.top}") from None

    def must(self, *args, env=None):
        rc, out, err = self.run(*args, env=env)
        if rc != 0:
            raise Stop(f"`git {' '.join(args)}` in {self.top} failed (exit {rc}): {pve_ct_git.first_error(err)}")
        return out


def collisions(git, commit, untracked):
    """Ignored files a checkout of ``commit`` would overwrite (:func:`pve_ct_git.collisions`)."""
    tracked = pve_ct_git.split_z(git.must("ls-files", "-z"))
    listed = pve_ct_git.split_z(git.must("ls-tree", "-r", "--name-only", "-z", commit))
    return pve_ct_git.collisions(git.top, tracked, listed, untracked)


def checkout_facts(git, view, commit, status, answer):
    """``commit_present``, and when a reset is due the ``filters`` a checkout would skip and the ignored files it
    would overwrite (``collisions``), into ``answer``."""
    if answer["head"] == commit:
        answer["commit_present"] = True
    else:
        rc, _, _ = git.run("cat-file", "-e", f"{commit}^{{commit}}")
        answer["commit_present"] = rc == 0
    if (answer["head"] != commit or status) and pve_ct_git.filter_drivers(view.config):
        paths = pve_ct_git.split_z(git.must("ls-files", "-z"))
        listed = []
        if answer["commit_present"]:
            listed = pve_ct_git.split_z(git.must("ls-tree", "-r", "--name-only", "-z", commit))
        answer["filters"] = pve_ct_git.filtered(
            lambda args, env: git.must(*args, env=env), view.config, paths, commit, listed
        )
    if answer["head"] != commit and answer["commit_present"]:
        untracked = [p for code, p, _ in pve_ct_git.status_entries(status) if code == "??"]
        answer["collisions"] = [
            p.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            for p in collisions(git, commit, untracked)
        ]


def probe(payload):
    """Answer ``{"path", "commit" (full sha), "git" (name or path), "timeout" (s)}`` with the repository's state.

    ``{"path", "exists" (a directory at path), "git" (the executable found, or None), "git_version", "repo" (path
    is the top of a git work tree), "bare", "toplevel" (the top of the work tree git found there), "head" (sha or
    None: no commit yet), "branch" (None: detached), "status" (``git status --porcelain=v1 -z
    --untracked-files=all`` text: ignored files never appear), "operation" (an unfinished merge/rebase/...),
    "commit_present", "collisions" (ignored files a checkout of the commit would overwrite), "errors" (what could
    not be read), "untrusted" (why the git dir is not used: a ``.git`` file or commondir naming a directory its
    owner does not own, or reached through a link; else None), "filters" (``{driver: paths}``: when a reset is due,
    the clean/smudge filters the config defines that tracked paths use), "remotes" (the names of the remotes its
    config defines, once it was read; else None)}``.
    """
    path = payload["path"]
    commit = payload["commit"].lower()
    top = os.path.realpath(path)
    answer = {
        "path": path,
        "exists": os.path.isdir(top),
        "git": None,
        "git_version": None,
        "repo": False,
        "bare": False,
        "toplevel": None,
        "head": None,
        "branch": None,
        "status": None,
        "operation": None,
        "commit_present": None,
        "collisions": [],
        "errors": [],
        "untrusted": None,
        "filters": {},
        "remotes": None,
    }
    git_path = pve_ct_git.find_git(payload.get("git") or "git")
    if git_path is None:
        return answer
    answer["git"] = git_path
    git = Git(git_path, top if answer["exists"] else "/", time.monotonic() + float(payload.get("timeout", 60)))
    view = None
    try:
        version = git.must("--version").decode(errors="replace").split()
        answer["git_version"] = version[2] if len(version) > 2 else None
        if not answer["exists"]:
            return answer
        try:
            git_dir, common = pve_ct_git.locate(top)
        except pve_ct_git.Untrusted as error:
            answer["untrusted"] = str(error)
            return answer
        if git_dir is None:
            answer["bare"] = pve_ct_git.looks_bare(top)
            return answer
        view = open_view(git, top, git_dir, common)
        git.env = view.env
        # The remotes a fetch of a missing commit can name (the view keeps their URLs, nothing else of them).
        answer["remotes"] = pve_ct_git.remote_names(view.config)
        worktree = view.value("core.worktree")
        if (view.value("core.bare") or "").lower() in ("true", "yes", "on", "1"):
            answer["bare"] = True
            return answer
        if worktree is not None:
            answer["toplevel"] = os.path.normpath(os.path.join(git_dir, worktree))
            if os.path.realpath(answer["toplevel"]) != top:
                return answer  # a work tree that starts elsewhere (core.worktree): the module refuses it
        answer["toplevel"] = top
        answer["repo"] = True
        answer["operation"] = pve_ct_git.operation(git_dir)
        rc, out, _ = git.run("rev-parse", "-q", "--verify", "HEAD^{commit}")
        answer["head"] = out.decode().strip() if rc == 0 else None
        rc, out, _ = git.run("symbolic-ref", "-q", "--short", "HEAD")
        answer["branch"] = out.decode(errors="replace").strip() if rc == 0 else None
        status = git.must("status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignore-submodules=dirty")
        answer["status"] = status.decode("utf-8", errors="backslashreplace")
        checkout_facts(git, view, commit, status, answer)
    except Stop as error:
        answer["errors"].append(str(error))
    finally:
        if view is not None:
            view.close()
    return answer
