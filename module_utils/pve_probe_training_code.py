# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training code probe: where the repository's HEAD is, what is dirty, whether the pinned commit is there. READ ONLY.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probes`` (one ``pct exec``); on a
bare host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, no imports from
ansible, and the answer is plain JSON.

It runs git (never a shell) with a deadline and only reads: ``status`` runs with ``GIT_OPTIONAL_LOCKS=0``, so not
even the index's stat cache is rewritten. How every git call here is made (the acting script makes them the same
way, see pve_script_training_code):

* ``-C <the repository's real path>`` and ``GIT_CEILING_DIRECTORIES=<its parent>``: a directory that is not a
  repository is never mistaken for a repository further up (a reset there would hit the wrong tree);
* ``-c safe.directory=<path>``: a repository owned by another user of the CT is read as root all the same
  (git >= 2.38 takes this from the command line; an older git's refusal is reported with the fix);
* ``-c core.fsmonitor=false -c core.hooksPath=/dev/null``: nothing the repository's own config names is run as root;
* every ``GIT_*`` variable of the environment dropped (``GIT_DIR``, ``GIT_INDEX_FILE``... would point git elsewhere),
  ``LC_ALL=C`` (messages are matched), ``GIT_TERMINAL_PROMPT=0`` (nothing ever waits for a password).
"""

import os
import shutil
import subprocess
import time

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NOT_A_REPOSITORY = "not a git repository"
NOT_A_WORK_TREE = "must be run in a work tree"  # a bare repository
DUBIOUS = "dubious ownership"
# What an unfinished operation leaves in the git dir, first match wins (rebase-apply/applying is `git am`).
OPERATIONS = (
    ("MERGE_HEAD", "merge"),
    ("rebase-merge", "rebase"),
    ("rebase-apply/applying", "am"),
    ("rebase-apply", "rebase"),
    ("CHERRY_PICK_HEAD", "cherry-pick"),
    ("REVERT_HEAD", "revert"),
    ("BISECT_LOG", "bisect"),
)


class Stop(Exception):
    """A git call that could not give an answer (timed out, could not run, failed): the probe says so and stops."""


def find_git(git, env):
    """The git executable: ``git`` itself when it is a path, else looked up on PATH; None when there is none."""
    if "/" in git:
        return git if os.path.isfile(git) and os.access(git, os.X_OK) else None
    return shutil.which(git, path=env.get("PATH") or DEFAULT_PATH)


def git_env(top, environ=None):
    """The environment of every git call: no ``GIT_*`` of the caller, the C locale, no prompt, no optional lock,
    and a ceiling at the repository's parent so that git never looks for a repository above ``top``."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if not k.startswith("GIT_")}
    env.update(
        LC_ALL="C",
        LANG="C",
        GIT_TERMINAL_PROMPT="0",
        GIT_OPTIONAL_LOCKS="0",
        GIT_CEILING_DIRECTORIES=os.path.dirname(top),
    )
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def git_argv(git, top, args):
    """``git -c safe.directory=<top> -c core.fsmonitor=false -c core.hooksPath=/dev/null -C <top> <args...>``."""
    safe = ["-c", f"safe.directory={top}", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null"]
    return [git, *safe, "-C", top, *args]


class Git:
    """Runs git in one repository within one deadline; ``run`` answers ``(rc, stdout bytes, stderr text)``."""

    def __init__(self, git, top, deadline):
        self.git = git
        self.top = top
        self.deadline = deadline
        self.env = git_env(top)

    def run(self, *args):
        remaining = self.deadline - time.monotonic()
        shown = "git " + " ".join(args)
        if remaining <= 0:
            raise Stop(f"stopped before `{shown}`: the probe's time is up")
        try:
            done = subprocess.run(
                git_argv(self.git, self.top, args),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=self.env,
                cwd="/",
                timeout=remaining,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise Stop(f"`{shown}` in {self.top} did not finish within the probe's time and was killed") from None
        except OSError as error:
            raise Stop(f"cannot run `{self.git}`: {error.strerror}") from None
        return done.returncode, done.stdout, done.stderr.decode(errors="replace")

    def must(self, *args):
        rc, out, err = self.run(*args)
        if rc != 0:
            raise Stop(failure(self.top, args, rc, err))
        return out


def failure(top, args, rc, err):
    """One sentence for a failed git call; git's refusal of another user's repository says what to do."""
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    if DUBIOUS in err:
        return (
            f"git refuses {top}: {lines[0] if lines else 'dubious ownership'} (the repository belongs to another "
            f"user and this git does not take safe.directory from the command line); trust it for root in the "
            f"target: git config --global --add safe.directory {top}"
        )
    said = next((line for line in lines if line.startswith(("fatal:", "error:"))), lines[-1] if lines else "")
    return f"`git {' '.join(args)}` in {top} failed (exit {rc}): {said or 'no output'}"


def status_entries(text):
    """``git status --porcelain=v1 -z`` -> ``[(XY, path, original path or None)]``; a rename or copy is followed
    by its original path in the next NUL-separated field. Paths come as git wrote them: no quoting at all."""
    fields = text.split("\0")
    entries, index = [], 0
    while index < len(fields):
        field = fields[index]
        index += 1
        if not field:
            continue
        code, path, original = field[:2], field[3:], None
        if "R" in code or "C" in code:
            original = fields[index] if index < len(fields) else None
            index += 1
        entries.append((code, path, original))
    return entries


def operation(git_dir):
    """The unfinished merge, rebase, am, cherry-pick, revert or bisect in ``git_dir``, or None."""
    for name, what in OPERATIONS:
        if os.path.exists(os.path.join(git_dir, name)):
            return what
    return None


def split_z(data):
    """NUL-separated git output -> list of paths (bytes decoded as UTF-8, undecodable bytes kept as escapes)."""
    return [p for p in data.decode("utf-8", errors="surrogateescape").split("\0") if p]


def collisions(git, commit, untracked):
    """Files in the way of checking out ``commit`` that a checkout would overwrite but nothing saves: IGNORED files.

    A path the commit tracks collides when something exists there that is neither tracked now (its changes are
    in the patch) nor untracked (it is in the tarball): an ignored file, or a directory holding ignored files, or
    an ignored file where the commit needs a directory. ``git checkout --force`` would overwrite it silently.
    """
    tracked = set(split_z(git.must("ls-files", "-z")))
    known = tracked | set(untracked)
    found, checked = [], set()
    for path in split_z(git.must("ls-tree", "-r", "--name-only", "-z", commit)):
        if path in tracked:
            continue
        parts = path.split("/")
        for depth in range(1, len(parts)):  # a file where the commit needs a directory
            parent = "/".join(parts[:depth])
            if parent in checked:
                continue
            checked.add(parent)
            full = os.path.join(git.top, parent)
            if os.path.lexists(full) and (os.path.islink(full) or not os.path.isdir(full)) and parent not in known:
                found.append(parent)
        full = os.path.join(git.top, path)
        if path in known or not os.path.lexists(full):
            continue
        if os.path.isdir(full) and not os.path.islink(full):
            for directory, _, files in os.walk(full):
                inside = [os.path.relpath(os.path.join(directory, f), git.top) for f in files]
                found.extend(p for p in inside if p not in known)
        else:
            found.append(path)
    return sorted(set(found))


def probe(payload):
    """Answer ``{"path", "commit" (full sha), "git" (name or path), "timeout" (s)}`` with the repository's state.

    ``{"path", "exists" (a directory at path), "git" (the executable found, or None), "git_version", "repo" (path
    is the top of a git work tree), "bare", "toplevel" (the top of the work tree git found there), "head" (sha or
    None: no commit yet), "branch" (None: detached), "status" (``git status --porcelain=v1 -z
    --untracked-files=all`` text: ignored files never appear), "operation" (an unfinished merge/rebase/...),
    "commit_present", "collisions" (ignored files a checkout of the commit would overwrite), "errors" (what could
    not be read)}``.
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
    }
    git_path = find_git(payload.get("git") or "git", os.environ)
    if git_path is None:
        return answer
    answer["git"] = git_path
    git = Git(git_path, top if answer["exists"] else "/", time.monotonic() + float(payload.get("timeout", 60)))
    try:
        version = git.must("--version").decode(errors="replace").split()
        answer["git_version"] = version[2] if len(version) > 2 else None
        if not answer["exists"]:
            return answer
        rc, out, err = git.run("rev-parse", "--show-toplevel", "--absolute-git-dir")
        if rc != 0 and (NOT_A_REPOSITORY in err or NOT_A_WORK_TREE in err):
            answer["bare"] = NOT_A_WORK_TREE in err
            return answer
        if rc != 0:
            raise Stop(failure(top, ("rev-parse", "--show-toplevel"), rc, err))
        toplevel, git_dir = out.decode(errors="surrogateescape").splitlines()[:2]
        answer["toplevel"] = toplevel
        if os.path.realpath(toplevel) != top:
            return answer  # a work tree that starts elsewhere (core.worktree): the module refuses it
        answer["repo"] = True
        answer["operation"] = operation(git_dir)
        rc, out, _ = git.run("rev-parse", "-q", "--verify", "HEAD^{commit}")
        answer["head"] = out.decode().strip() if rc == 0 else None
        rc, out, _ = git.run("symbolic-ref", "-q", "--short", "HEAD")
        answer["branch"] = out.decode(errors="replace").strip() if rc == 0 else None
        status = git.must("status", "--porcelain=v1", "-z", "--untracked-files=all")
        answer["status"] = status.decode("utf-8", errors="backslashreplace")
        if answer["head"] == commit:
            answer["commit_present"] = True
            return answer
        rc, _, _ = git.run("cat-file", "-e", f"{commit}^{{commit}}")
        answer["commit_present"] = rc == 0
        if answer["commit_present"]:
            untracked = [p for code, p, _ in status_entries(status.decode("utf-8", "surrogateescape")) if code == "??"]
            answer["collisions"] = [
                p.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                for p in collisions(git, commit, untracked)
            ]
    except Stop as error:
        answer["errors"].append(str(error))
    return answer
