# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training code probe: where the repository's HEAD is, what is dirty, whether the pinned commit is there. READ ONLY.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probes`` (one ``pct exec``); on a
bare host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing of ours
but the container-side modules of ``SHARED`` (shipped with it), and the answer is plain JSON.

It runs git (never a shell) with a deadline (past it, git is killed with whatever it started) and only reads:
the reset script's runner, :class:`git_runner.Git`, read-only; ``status`` runs with ``GIT_OPTIONAL_LOCKS=0``, so
not even the index's stat cache is rewritten. Every git call goes through :mod:`ct_git`, as the acting script's
do: a view of the repository whose config is an allowlist of the real one's keys, no system or global config, no
``GIT_*`` of the caller, no submodule; nothing of the repository is written. A repository whose tracked paths have
clean/smudge filters is read by git running as its owner with the owner's own config
(:meth:`git_runner.Git.as_owner`). Its path is opened once from ``/`` without following a link nor passing a
directory another user could change (:func:`ct_git.open_top`), and git and every read work on the opened directory
from then on (``/proc/self/fd/<fd>``), never on the path again; the pinned commit and its trees are checked
against their ids.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=disallowed-name,ansible-bad-function

import contextlib
import os
import shutil
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import git_runner, worktree

SHARED = (ct_act, ct_fs, ct_git, worktree, git_runner)  # container-side modules Target.run_probes ships with this part


def commit_facts(git, view, commit, answer):
    """``commit_present`` (its commit and trees checked against their ids) and ``filters`` (the drivers tracked
    paths, now or in the commit, name) into ``answer``; with filters, git runs as the repository's owner with the
    owner's own config from here on (:meth:`git_runner.Git.as_owner`), so that status sees through the clean filter
    as theirs does."""
    if answer["head"] == commit:
        answer["commit_present"] = True
    else:
        rc, _, _ = git.run("cat-file", "-e", f"{commit}^{{commit}}")
        answer["commit_present"] = rc == 0
    if answer["commit_present"]:
        # What status compares the work tree with, and a checkout would write, is what the commit's id says.
        try:
            ct_git.verify_commit(git.run, commit, (view.value("extensions.objectformat") or "sha1").lower())
        except ct_git.Tampered as error:
            raise ct_act.ActError("tampered", f"the pinned commit in {git.path}: {error}") from None
    listed = []
    if answer["head"] != commit and answer["commit_present"]:
        listed = ct_git.split_z(git.must("ls-tree", "-r", "--name-only", "-z", commit))
    answer["filters"] = worktree.filtered(lambda args, env: git.must(*args, env=env), commit, listed)
    if answer["filters"]:
        git.as_owner(view.git_dir)
        listing = git.run("config", "--null", "--get-regexp", r"^filter\.")[1]
        answer["missing_filters"] = worktree.missing_filters(listing, set(answer["filters"]), git.env.get("PATH"))
        if answer["missing_filters"]:  # their git could not read it either: read as before, a reset is refused
            git.use_view(view)


def checkout_facts(git, commit, status, answer):
    """When a checkout is due, the ignored files it would overwrite (``collisions``) into ``answer``."""
    if answer["head"] != commit and answer["commit_present"]:
        untracked = [p for code, p, _ in worktree.status_entries(status) if code == "??"]
        answer["collisions"] = [
            p.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            for p in git_runner.collisions(git, commit, untracked)
        ]


def open_top(top):
    """``(fd, refused)``: ``top`` opened from ``/`` (:func:`ct_git.open_top`), or None when there is no directory
    or it is refused; the sentence of a link or an untrusted directory on the way (its target or what took its
    place is not the repository configured: never used), else None."""
    try:
        return ct_git.open_top(top), None
    except ct_git.Refused as error:
        return None, str(error)
    except OSError:
        return None, None  # nothing there, or no directory


def backup_space(top, backup_dir, status):
    """``{"dir", "free", "estimate"}``: the free bytes of the file system the backup would go to (its directory's
    nearest existing one) and the backup's size estimated from the dirty paths' sizes (a changed file three times:
    two patches and the tarball; an untracked file once); None when nothing would be saved."""
    if not status:
        return None
    where = backup_dir
    while not os.path.isdir(where) and where != "/":
        where = os.path.dirname(where)
    estimate = 0
    for code, path, _ in worktree.status_entries(status):
        with contextlib.suppress(OSError):
            estimate += os.lstat(os.path.join(top, path)).st_size * (1 if code == "??" else 3)
    return {"dir": where, "free": shutil.disk_usage(where).free, "estimate": estimate}


def probe(payload):
    """Answer ``{"path", "commit" (full sha), "git" (name or path), "timeout" (s)}`` with the repository's state.

    ``{"path", "exists" (a directory at path), "git" (the executable found, or None), "git_version", "repo" (path
    is the top of a git work tree), "bare", "toplevel" (the top of the work tree git found there), "head" (sha or
    None: no commit yet), "branch" (None: detached), "status" (``git status --porcelain=v1 -z
    --untracked-files=all`` text: ignored files never appear), "operation" (an unfinished merge/rebase/...),
    "commit_present", "collisions" (ignored files a checkout of the commit would overwrite), "errors" (what could
    not be read), "untrusted" (why the git dir is not used: a ``.git`` file or commondir naming a directory its
    owner does not own, or reached through a link; else None), "filters" (``{driver: paths}``: the clean/smudge
    filters tracked paths, now or in the commit, name: git then reads as the owner with the owner's own config),
    "missing_filters" (``{driver: program}`` the target lacks), "remotes" (the names of the remotes its
    config defines, once it was read; else None), "linked" (the sentence of a link on the way to ``path``, or of a
    directory on the way that another user than root and the owner could have put there: nothing more is read;
    else None), "backup_space" (when something would be saved: :func:`backup_space`; else None)}``.
    """
    path = payload["path"]
    commit = payload["commit"].lower()
    top = ct_fs.clean(path)
    answer = {
        "path": path,
        "exists": False,
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
        "linked": None,
        "backup_space": None,
        "missing_filters": {},
    }
    fd, answer["linked"] = open_top(top)
    answer["exists"] = fd is not None or answer["linked"] is not None
    if answer["linked"]:
        return answer
    git_path = ct_git.find_git(payload.get("git") or "git")
    if git_path is None:
        if fd is not None:
            os.close(fd)
        return answer
    answer["git"] = git_path
    deadline = time.monotonic() + float(payload.get("timeout", 60))
    # Everything from here on works on the opened top (git.top, /proc/self/fd/<fd>), never on the path again.
    git = git_runner.Git(git_path, fd, top, deadline, within="the probe's timeout", read_only=True)
    try:
        version = git.must("--version").decode(errors="replace").split()
        answer["git_version"] = version[2] if len(version) > 2 else None
        if fd is not None:
            read_repository(git, commit, payload.get("backup_dir"), answer)
    except ct_act.ActError as error:
        answer["errors"].append(str(error))
    finally:
        if fd is not None:
            os.close(fd)
    return answer


def read_repository(git, commit, backup_dir, answer):
    """The repository's state in the opened top (``git.top``) into ``answer`` (see :func:`probe`)."""
    try:
        git_dir, common = ct_git.locate(git.top)
    except ct_git.Untrusted as error:
        answer["untrusted"] = str(error)
        return
    if git_dir is None:
        answer["bare"] = ct_git.looks_bare(git.top)
        return
    view = git.open_view(git_dir, common)
    try:
        git.use_view(view)
        # The remotes a fetch of a missing commit can name (the view keeps their URLs, nothing else of them).
        answer["remotes"] = worktree.remote_names(view.config)
        elsewhere = view.value("core.worktree")
        if (view.value("core.bare") or "").lower() in ("true", "yes", "on", "1"):
            answer["bare"] = True
            return
        if elsewhere is not None:
            answer["toplevel"] = os.path.normpath(os.path.join(ct_git.real(git_dir), elsewhere))
            if os.path.realpath(answer["toplevel"]) != ct_git.real(git.top):
                return  # a work tree that starts elsewhere (core.worktree): the module refuses it
        answer["toplevel"] = git.path
        answer["repo"] = True
        answer["operation"] = worktree.operation(git_dir)
        rc, out, _ = git.run("rev-parse", "-q", "--verify", "HEAD^{commit}")
        answer["head"] = out.decode().strip() if rc == 0 else None
        rc, out, _ = git.run("symbolic-ref", "-q", "--short", "HEAD")
        answer["branch"] = out.decode(errors="replace").strip() if rc == 0 else None
        commit_facts(git, view, commit, answer)
        status = git.must("status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignore-submodules=dirty")
        answer["status"] = status.decode("utf-8", errors="backslashreplace")
        if backup_dir:
            answer["backup_space"] = backup_space(git.top, backup_dir, status)
        checkout_facts(git, commit, status, answer)
    finally:
        view.close()
