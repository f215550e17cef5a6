# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training code reset: save every local change, then put the repository at the pinned commit. It ACTS.

Unlike a probe part, ``probe(payload)`` here changes the target. It is called the same way so that it costs one
``pct exec``: ``Target.run_probes`` ships this file's source to the target's python on stdin; on a bare host
``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, imports nothing of ours,
the answer is plain JSON. git is called exactly as the probe part calls it (pve_probe_training_code: the
repository's real path, a ceiling above it, safe.directory, no fsmonitor, no hooks, no ``GIT_*`` of the caller).

In this order, and nothing is changed in the work tree, the index, HEAD or any branch before step 5:

1. re-check what the fact pass found (the facts can be seconds old): a work tree whose top is ``path``, no
   unfinished merge/rebase/..., no conflict, no untracked repository inside, the backup directory outside it;
2. fetch the commit from ``remote`` when the repository lacks it (``git fetch --no-tags <remote> <sha>``; only
   objects and FETCH_HEAD are written); a failed fetch ends the run;
3. refuse when the checkout would overwrite IGNORED files (checkpoints, data): ignored files are never saved,
   so they must never be touched;
4. when anything is dirty, save it to ``<backup_dir>/<UTC stamp>/`` (mode 0700) and prove the saved copy restores
   it, before anything is reset:

   * ``changes.patch``: ``git diff --binary HEAD``, every tracked change (staged or not), binary files included;
   * ``staged.patch``: ``git diff --binary --cached HEAD``, what was staged;
   * ``untracked.tar.gz``: the untracked files that are not ignored (``git ls-files --others --exclude-standard``);
   * ``HEAD`` (the old sha, then the branch or ``(detached)``), ``status.txt`` (``git status --porcelain``) and
     ``RESTORE.txt`` (the commands that put it all back).

   The proof: ``git stash create``, on a copy of the index, records the work tree and the index as trees (only
   objects are written: no ref, no file of the work tree, not the index); each patch applied to the old HEAD in a
   throw-away index (``GIT_INDEX_FILE``) must give exactly its tree, and the tarball must list exactly the
   untracked files. Any failure here removes the backup and ends the run;
5. a detached HEAD that no branch or tag contains gets a ref, ``refs/pve-gpu-recover/detached/<stamp>``, so that
   commits made on it stay reachable (a branch keeps its commits: it is never moved);
6. ``git checkout --force --detach <commit>`` (or ``git reset --hard`` when HEAD is already the commit: a branch at
   it stays checked out). Detached, because the pin is a commit, not a branch: moving a branch to it would drop the
   commits the branch had beyond it, and leaving a branch name on a tree it no longer describes would mislead;
7. remove the untracked files that were saved, exactly those (not ``git clean``: after the checkout, clean would
   read the commit's .gitignore, and a file the old .gitignore ignored, never saved, could be deleted); a
   directory they leave empty goes too.

Failure answers ``{"error": kind, "message", "cmd", "rc", "stderr_tail", "backup" (the backup directory, or None),
"touched" (whether step 5 or later had begun)}``.
"""

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
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
OPERATIONS = (
    ("MERGE_HEAD", "merge"),
    ("rebase-merge", "rebase"),
    ("rebase-apply/applying", "am"),
    ("rebase-apply", "rebase"),
    ("CHERRY_PICK_HEAD", "cherry-pick"),
    ("REVERT_HEAD", "revert"),
    ("BISECT_LOG", "bisect"),
)
SPARE = 1024 * 1024  # bytes the backup's file system keeps free beyond the backup
TAIL_LINES = 40
TAIL_CHARS = 4000
KILL_WAIT = 5


class ResetError(Exception):
    """One failure of the reset: ``kind`` for code, the message for people, the command when one ran."""

    def __init__(self, kind, message, *, cmd=None, rc=None, stderr=""):
        super().__init__(message)
        self.kind = kind
        self.cmd = cmd
        self.rc = rc
        self.stderr = stderr


def tail(text):
    """The last TAIL_LINES lines of ``text``, at most TAIL_CHARS characters."""
    return "\n".join((text or "").rstrip("\n").splitlines()[-TAIL_LINES:])[-TAIL_CHARS:]


def short(sha):
    return sha[:12] if sha else "(none)"


def shown(path):
    """A path read from git as JSON-safe text: undecodable bytes as ``\\xNN``."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def split_z(data):
    """NUL-separated git output -> paths (undecodable bytes kept as surrogates, so the file can still be opened)."""
    return [p for p in data.decode("utf-8", "surrogateescape").split("\0") if p]


def status_entries(data):
    """``git status --porcelain=v1 -z`` -> ``[(XY, path, original path or None)]`` (see pve_code.parse_status)."""
    fields = data.decode("utf-8", "surrogateescape").split("\0")
    entries, index = [], 0
    while index < len(fields):
        field = fields[index]
        index += 1
        if not field:
            continue
        code, original = field[:2], None
        if "R" in code or "C" in code:
            original = fields[index] if index < len(fields) else None
            index += 1
        entries.append((code, field[3:], original))
    return entries


def find_git(git):
    if "/" in git:
        return git if os.path.isfile(git) and os.access(git, os.X_OK) else None
    return shutil.which(git, path=os.environ.get("PATH") or DEFAULT_PATH)


def git_env(top):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        LC_ALL="C",
        LANG="C",
        GIT_TERMINAL_PROMPT="0",
        GIT_OPTIONAL_LOCKS="0",
        GIT_CEILING_DIRECTORIES=os.path.dirname(top),
    )
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def git_argv(git, top, args, config=()):
    safe = ["-c", f"safe.directory={top}", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null"]
    for setting in config:
        safe += ["-c", setting]
    return [git, *safe, "-C", top, *args]


def first_error(err):
    lines = [line.strip() for line in (err or "").splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith(("fatal:", "error:"))), lines[-1] if lines else "")
    return said or "no output"


class Git:
    """git in one repository within the reset's deadline; a command past it is killed with its process group."""

    def __init__(self, git, top, deadline, budget):
        self.git = git
        self.top = top
        self.deadline = deadline
        self.budget = budget
        self.env = git_env(top)

    def run(self, *args, config=(), env=None):
        argv = git_argv(self.git, self.top, args, config)
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ResetError("timeout", f"the reset's {self.budget:g} s (reset_timeout) ran out before `git {args[0]}`")
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(self.env, **(env or {})),
                cwd="/",
                start_new_session=True,  # so that a timeout kills what git started too (ssh, remote helpers)
            )
        except OSError as error:
            raise ResetError("no_git", f"cannot run `{self.git}`: {error.strerror}", cmd=argv) from None
        try:
            out, err = process.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            try:
                out, err = process.communicate(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                out, err = b"", b""
            raise ResetError(
                "timeout",
                f"`git {' '.join(args)}` did not finish within the reset's {self.budget:g} s (reset_timeout) and "
                f"was killed",
                cmd=argv,
                stderr=err.decode(errors="replace"),
            ) from None
        return process.returncode, out, err.decode(errors="replace")

    def must(self, *args, what, kind="git", config=(), env=None):
        rc, out, err = self.run(*args, config=config, env=env)
        if rc != 0:
            argv = git_argv(self.git, self.top, args, config)
            raise ResetError(kind, f"{what} failed (exit {rc}): {first_error(err)}", cmd=argv, rc=rc, stderr=err)
        return out


def collisions(git, commit, untracked):
    """Ignored files a checkout of ``commit`` would overwrite (see pve_probe_training_code.collisions)."""
    tracked = set(split_z(git.must("ls-files", "-z", what="listing the tracked files")))
    known = tracked | set(untracked)
    found, checked = [], set()
    for path in split_z(git.must("ls-tree", "-r", "--name-only", "-z", commit, what="listing the commit's files")):
        if path in tracked:
            continue
        parts = path.split("/")
        for depth in range(1, len(parts)):
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


def restore_text(top, directory, commit, *, head, branch, files):
    """RESTORE.txt: what was saved and the commands that put it back (run in the repository's top)."""
    lines = [
        f"Saved by pve-gpu-recover (training_code) before {top} was reset to {commit}.",
        f"HEAD was {head} ({f'branch {branch}' if branch else 'detached'}).",
        "",
        f"To put the local changes back, in {top}:",
        "",
        f"  git checkout {branch if branch else '--detach ' + head}",
    ]
    if "changes.patch" in files:
        lines += [
            f"  git apply {directory}/changes.patch          # every tracked change, staged or not",
            f"  git apply --cached {directory}/staged.patch  # optional: stage again what was staged",
        ]
    if "untracked.tar.gz" in files:
        lines.append(f"  tar -xzf {directory}/untracked.tar.gz -C {top}  # the untracked files")
    lines += [
        "",
        "To carry the changes onto the pinned commit instead (no checkout), use `git apply -3` for the patch.",
        "",
    ]
    return "\n".join(lines)


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
        self.deadline = time.monotonic() + self.budget
        self.git = None
        self.git_dir = None
        self.backup = None  # the backup directory once written
        self.touched = False  # whether anything of the repository was changed (step 5 on)
        if self.remote and self.remote.startswith("-"):
            raise ResetError("invalid", f"remote {self.remote!r} starts with '-'; give a remote's name or a URL")

    # -- 1. re-check -------------------------------------------------------------------------------------------
    def check(self):
        git = find_git(self.git_name)
        if git is None:
            raise ResetError("no_git", f"git not found in the target (`{self.git_name}`); install it there")
        if not os.path.isdir(self.top):
            raise ResetError("no_repository", f"there is no directory {self.path}")
        self.git = Git(git, self.top, self.deadline, self.budget)
        rc, out, err = self.git.run("rev-parse", "--show-toplevel", "--absolute-git-dir")
        if rc != 0:
            raise ResetError(
                "no_repository",
                f"{self.path} is not a git work tree git can use: {first_error(err)}",
                cmd=git_argv(git, self.top, ("rev-parse", "--show-toplevel", "--absolute-git-dir")),
                rc=rc,
                stderr=err,
            )
        toplevel, git_dir = out.decode("utf-8", "surrogateescape").splitlines()[:2]
        if os.path.realpath(toplevel) != self.top:
            raise ResetError("no_repository", f"the work tree of the repository at {self.path} is {toplevel}")
        self.git_dir = git_dir
        root = os.path.realpath(self.root)
        if root == self.top or root.startswith(self.top.rstrip("/") + "/"):
            raise ResetError("invalid", f"the backup directory {self.root} lies inside the repository {self.path}")
        for name, what in OPERATIONS:
            if os.path.exists(os.path.join(git_dir, name)):
                raise ResetError("operation", f"a {what} is in progress in {self.path}; finish or abort it first")
        rc, out, _ = self.git.run("rev-parse", "-q", "--verify", "HEAD^{commit}")
        head = out.decode().strip() if rc == 0 else None
        rc, out, _ = self.git.run("symbolic-ref", "-q", "--short", "HEAD")
        branch = out.decode(errors="replace").strip() if rc == 0 else None
        status = self.git.must(
            "status", "--porcelain=v1", "-z", "--untracked-files=no", what="reading the status (`git status`)"
        )
        entries = status_entries(status)
        conflicts = [shown(path) for code, path, _ in entries if code in UNMERGED]
        if conflicts:
            raise ResetError("conflict", f"{self.path} has unmerged paths: {', '.join(conflicts[:5])}; resolve them")
        listed = self.git.must(
            "ls-files", "--others", "--exclude-standard", "-z", what="listing the untracked files (`git ls-files`)"
        )
        untracked = split_z(listed)
        nested = [shown(path) for path in untracked if path.endswith("/")]
        if nested:
            raise ResetError("nested", f"{', '.join(nested[:5])} in {self.path}: untracked git repositories inside")
        tracked = entries
        if head is None and tracked:
            raise ResetError("unborn", f"{self.path} has no commit yet but files are staged; commit or unstage them")
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
            raise ResetError(
                "missing",
                f"commit {self.commit} is not in the repository at {self.path} and no remote is set to fetch it from",
            )
        args = ("fetch", "--quiet", "--no-tags", "--no-recurse-submodules", self.remote, self.commit)
        rc, _, err = self.git.run(*args)
        if rc != 0:
            raise ResetError(
                "fetch",
                f"fetching {short(self.commit)} from {self.remote} failed (exit {rc}): {first_error(err)}",
                cmd=git_argv(self.git.git, self.top, args),
                rc=rc,
                stderr=err,
            )
        if not self.present():
            raise ResetError("fetch", f"{self.remote} was fetched but it has no commit {self.commit}")
        return True

    # -- 4. save -----------------------------------------------------------------------------------------------
    def save(self, head, branch, tracked, untracked):
        """Write the backup directory and prove it restores the work tree; its description."""
        changes = staged = b""
        if tracked:
            changes = self.git.must("diff", *PATCH_ARGS, "HEAD", what="saving the changes (`git diff HEAD`)")
            staged = self.git.must("diff", "--cached", *PATCH_ARGS, "HEAD", what="saving the staged changes")
            if not changes:
                raise ResetError(
                    "backup",
                    f"`git diff HEAD` shows nothing for {len(tracked)} changed paths (changes inside a submodule? "
                    f"submodules are not managed: commit or discard them there)",
                )
        status = self.git.must(
            "status",
            "--porcelain=v1",
            "--untracked-files=all",
            what="reading the status",
            config=["core.quotePath=false"],
        )
        sizes = 0
        for path in untracked:
            with contextlib.suppress(OSError):
                sizes += os.lstat(os.path.join(self.top, path)).st_size
        need, free = len(changes) + len(staged) + sizes + SPARE, free_bytes(self.root)
        if need > free:
            raise ResetError(
                "no_space",
                f"saving the local changes needs about {need // 2**20 + 1} MiB but {self.root} has "
                f"{free // 2**20} MiB free; free space there, or add large files to .gitignore (ignored files are "
                f"never saved nor touched)",
            )
        directory = self.make_directory()
        self.backup = directory
        try:
            files = []
            if tracked:
                write_file(os.path.join(directory, "changes.patch"), changes)
                write_file(os.path.join(directory, "staged.patch"), staged)
                files += ["changes.patch", "staged.patch"]
            if untracked:
                self.write_tarball(os.path.join(directory, "untracked.tar.gz"), untracked)
                files.append("untracked.tar.gz")
            write_file(os.path.join(directory, "HEAD"), f"{head or '(no commit)'}\n{branch or '(detached)'}\n".encode())
            write_file(os.path.join(directory, "status.txt"), status)
            files += ["HEAD", "status.txt", "RESTORE.txt"]
            restore = restore_text(self.top, directory, self.commit, head=head, branch=branch, files=files)
            write_file(os.path.join(directory, "RESTORE.txt"), restore.encode())
            if tracked:
                self.prove_patches(directory, head)
            if untracked:
                self.prove_tarball(os.path.join(directory, "untracked.tar.gz"), untracked)
        except BaseException:
            _remove(directory)
            self.backup = None
            raise
        return {
            "dir": directory,
            "files": sorted(files),
            "changed": len(tracked),
            "untracked": len(untracked),
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
        raise ResetError("backup", f"{self.root} holds 99 backups named {self.stamp}*; remove some")

    def write_tarball(self, target, untracked):
        with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
            with tarfile.open(fileobj=handle, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
                for path in untracked:
                    tar.add(os.path.join(self.top, path), arcname=path, recursive=False)
            handle.flush()
            os.fsync(handle.fileno())

    def prove_tarball(self, target, untracked):
        with tarfile.open(target, "r:gz") as tar:
            names = tar.getnames()
        if sorted(names) != sorted(untracked):
            missing = sorted(set(untracked) - set(names))
            raise ResetError("backup", f"{target} does not hold every untracked file (missing: {missing[:5]})")

    def prove_patches(self, directory, head):
        """Each patch applied to the old HEAD in a throw-away index gives exactly the tree git records for the work
        tree (changes.patch) and for the index (staged.patch)."""
        with tempfile.TemporaryDirectory(prefix="pve-gpu-recover-") as scratch:
            # On a copy of the index: stash create refreshes and rewrites the index it reads.
            index = os.path.join(scratch, "index")
            if os.path.exists(os.path.join(self.git_dir, "index")):
                shutil.copyfile(os.path.join(self.git_dir, "index"), index)
            stash = self.git.must(
                "stash",
                "create",
                what="recording the work tree (`git stash create`)",
                config=IDENTITY,
                env={"GIT_INDEX_FILE": index},
            ).decode()
            if not stash.strip():
                raise ResetError("backup", "`git stash create` recorded nothing although tracked files changed")
            trees = f"{stash.strip()}^{{tree}}", f"{stash.strip()}^2^{{tree}}"
            work_tree, index_tree = self.git.must("rev-parse", *trees, what="reading its trees").decode().split()
            for name, want in (("changes.patch", work_tree), ("staged.patch", index_tree)):
                env = {"GIT_INDEX_FILE": os.path.join(scratch, f"{name}.index")}
                self.git.must("read-tree", head, what="reading the old HEAD into a scratch index", env=env)
                patch = os.path.join(directory, name)
                if os.path.getsize(patch):
                    self.git.must(
                        "apply", "--cached", patch, what=f"applying {name} to the old HEAD", kind="backup", env=env
                    )
                got = self.git.must("write-tree", what="writing the scratch tree", env=env).decode().strip()
                if got != want:
                    raise ResetError(
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
        self.git.must("update-ref", ref, head, what=f"keeping the detached HEAD as {ref}")
        return ref

    def reset(self, head):
        if head == self.commit:
            self.git.must(
                "reset", "--quiet", "--hard", what="resetting the work tree (`git reset --hard`)", kind="reset"
            )
        else:
            self.git.must(
                "checkout",
                "--quiet",
                "--force",
                "--detach",
                self.commit,
                what=f"checking out {short(self.commit)}",
                kind="reset",
            )

    def remove(self, untracked):
        """Remove the saved untracked files that the commit does not track; prune directories left empty."""
        tracked = set(split_z(self.git.must("ls-files", "-z", what="listing the tracked files")))
        removed = []
        for path in untracked:
            full = os.path.join(self.top, path)
            if path in tracked or not os.path.lexists(full) or (os.path.isdir(full) and not os.path.islink(full)):
                continue
            os.unlink(full)
            removed.append(shown(path))
            parent = os.path.dirname(full)
            while parent.startswith(self.top.rstrip("/") + "/"):
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = os.path.dirname(parent)
        return removed

    def execute(self):
        started = time.monotonic()
        head, branch, tracked, untracked = self.check()
        fetched = self.ensure_commit()
        if head != self.commit:
            in_the_way = collisions(self.git, self.commit, untracked)
            if in_the_way:
                raise ResetError(
                    "collision",
                    f"checking out {short(self.commit)} would overwrite ignored files: "
                    f"{', '.join(shown(p) for p in in_the_way[:5])}; move them out of {self.path}",
                )
        backup = kept = None
        removed = []
        if head != self.commit or tracked or untracked:
            backup = self.save(head, branch, tracked, untracked) if tracked or untracked else None
            self.touched = True
            kept = self.keep_detached(head, branch)
            self.reset(head)
            removed = self.remove(untracked)
        now = self.git.must("rev-parse", "--verify", "HEAD^{commit}", what="reading HEAD").decode().strip()
        return {
            "head_before": head,
            "branch_before": branch,
            "head": now,
            "fetched": fetched,
            "backup": backup,
            "kept_ref": kept,
            "removed": removed,
            "seconds": round(time.monotonic() - started, 3),
        }


def probe(payload):
    """ACTS: save the local changes of the repository in ``payload``, then put it at the commit; answer what was done.

    ``payload``: ``{"path", "commit" (full sha), "remote" (name, URL or None), "backup_dir", "git", "stamp"
    ("20261203T101500Z"), "timeout" (s)}``.

    Success: ``{"head_before", "branch_before", "head", "fetched", "backup" ({"dir", "files", "changed",
    "untracked", "restore"} or None: nothing was dirty), "kept_ref", "removed", "seconds"}``. Failure: ``{"error",
    "message", "cmd", "rc", "stderr_tail", "backup", "touched"}``.
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
    except ResetError as error:
        return {"error": error.kind, "message": str(error), "backup": None, "touched": False}
    try:
        return reset.execute()
    except ResetError as error:
        failure = {"error": error.kind, "message": str(error), "cmd": error.cmd, "rc": error.rc}
        failure["stderr_tail"] = tail(error.stderr)
    except OSError as error:
        kind = "no_space" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "os_error"
        where = f" ({error.filename})" if error.filename else ""
        failure = {"error": kind, "message": f"{error.strerror or error}{where}", "cmd": None, "rc": None}
        failure["stderr_tail"] = ""
    failure.update(backup=reset.backup, touched=reset.touched)
    return failure
