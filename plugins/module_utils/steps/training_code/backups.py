# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training code reset's backups (steps 4 and 8 of the reset script): every local change saved to
``<backup_dir>/<UTC stamp>/`` (the patches, the changed and untracked files' bytes in tarballs, their manifest,
HEAD, the status, RESTORE.txt) and proven to restore the work tree before anything is reset; the files a checkout
rewrites whose bytes git's stat cache hides; and the oldest backups beyond ``keep`` removed. :class:`Backup` is a
part of the script's ``Reset`` (a mixin: it works on the reset's git, work tree, view and settings).

Container side, shipped with the reset script: it is in the script's ``SHARED``, so ``Target.run_probes`` sends
its source in the same ``pct exec`` (registered under its own dotted name), and on a node it is imported as
usual. So: standard library only, Python 3.9+, nothing of ours but the container-side modules of its own
``SHARED``.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import stat
import tarfile
import tempfile
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import git_runner, nofollow

# Container-side modules Target.run_probes ships with this module (dependencies first).
SHARED = (ct_act, ct_git, git_runner, nofollow)

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


def remove_tree(path):
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


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


class Backup:
    """Steps 4 and 8 of the reset script's ``Reset``, which inherits them: it uses the reset's ``git``, ``top``,
    ``top_fd``, ``view``, ``git_dir``, ``root``, ``stamp``, ``commit``, ``deadline``, ``budget``, ``keep`` and
    ``min_free`` (bytes the backup's file system keeps free beyond it), and
    sets ``backup`` (the directory once written) and ``saved`` (the tarballs' manifest records)."""

    # -- 4. save -----------------------------------------------------------------------------------------------
    def hidden(self, head, tracked, untracked):
        """Files the checkout rewrites whose bytes differ from the index although git, trusting its stat cache,
        calls them unchanged: a file added through a clean filter (a notebook through nbstripout) keeps its outputs
        in the work tree while the blob has none. Only the files that differ between HEAD and the commit are
        rewritten by the checkout, so only those are read."""
        if head is None or head == self.commit:
            return []
        changed = {path for _, path, _ in tracked} | set(untracked)
        rewritten = ct_git.split_z(
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
        for line in ct_git.split_z(self.git.must("ls-files", "-s", "-z", what="reading the index (`git ls-files -s`)")):
            info, _, path = line.partition("\t")
            mode, sha, _ = info.split(" ", 2)
            index[path] = (mode, sha)
        object_format = (self.view.value("extensions.objectformat") or "sha1").lower()
        found = []
        for path in rewritten:
            mode, sha = index.get(path, (None, None))
            if mode in (None, "160000"):
                continue
            now = nofollow.entry_digest(self.top_fd, path, blob=object_format)
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
                raise ct_act.ActError(
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
                fd, name = nofollow.parent_fd(self.top_fd, path)
                try:
                    sizes += os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
                finally:
                    os.close(fd)
        need, free = len(changes) + len(staged) + sizes, free_bytes(self.root)
        if need + self.min_free > free:
            raise ct_act.ActError(
                "no_space",
                f"saving the local changes needs about {need // 2**20 + 1} MiB but {self.root} has "
                f"{free // 2**20} MiB free: it would leave less than {self.min_free // 2**20} MiB "
                f"(training_code_backup_min_free_mib); free space there, or add large files to .gitignore (ignored "
                f"files are never saved nor touched)",
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
            remove_tree(directory)
            self.backup = None
            raise
        self.saved = manifest
        return {
            "dir": directory,
            "files": sorted(files),
            "changed": len(tracked),
            "untracked": len(untracked),
            "filtered": [nofollow.shown(p) for p in hidden],
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
        raise ct_act.ActError("backup", f"{self.root} holds 99 backups named {self.stamp}*; remove some")

    def write_tarball(self, target, paths):
        """The entries at ``paths``, their bytes as on disk; the manifest's records of what it holds."""
        records = []
        with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
            with tarfile.open(fileobj=handle, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
                for path in paths:
                    if time.monotonic() > self.deadline:
                        raise ct_act.ActError(
                            "timeout",
                            f"the reset's {self.budget:g} s (reset_timeout) ran out while saving "
                            f"{nofollow.shown(path)}; nothing was reset: raise reset_timeout, or add large files to "
                            ".gitignore",
                        )
                    try:
                        record = nofollow.add_entry(tar, self.top_fd, path)
                    except OSError as error:
                        if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                            continue  # deleted, or a directory of it is not one now: the patch holds the deletion
                        raise ct_act.ActError(
                            "backup", f"cannot save {nofollow.shown(path)}: {error.strerror}"
                        ) from None
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
            got = {member.name: nofollow.member_digest(tar, member) for member in tar.getmembers()}
        if got != want:
            wrong = sorted(nofollow.shown(p) for p in set(got) ^ set(want) | {p for p in want if got.get(p) != want[p]})
            raise ct_act.ActError("backup", f"{target} does not hold exactly the saved files (wrong: {wrong[:5]})")
        moved = sorted(
            nofollow.shown(p) for p, digest in want.items() if nofollow.entry_digest(self.top_fd, p) != digest
        )
        if moved:
            raise ct_act.ActError(
                "backup", f"{', '.join(moved[:5])} changed while it was saved (a live job writing?); run again"
            )

    def copy_index(self, target):
        """Copy the repository's index to ``target`` (in the scratch); whether there was one. It is read through
        the git dir's fd with O_NOFOLLOW and must be a regular file with no other name, of the work tree's owner
        (as the git dir must be theirs) or, for root's git, of root (root's ``git diff`` rewrites the index): the
        owner may swap ``.git/index`` for a link to /etc/shadow while the backup is written, and with filters the
        copy goes to their git, so a link, a hard link or another user's file is ``untrusted``, never copied."""
        uid = os.fstat(self.top_fd).st_uid
        owners = {uid} if self.git.always else {uid, 0}
        name = os.path.join(ct_git.real(self.git_dir), "index")
        try:
            directory = ct_git.open_dir(self.git_dir)
        except ct_git.Untrusted as error:
            raise ct_act.ActError("untrusted", f"{error}; nothing was reset") from None
        try:
            handle = os.open("index", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
        except FileNotFoundError:
            return False
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            handle = None
        finally:
            os.close(directory)
        found = "a symlink"
        if handle is not None:
            with os.fdopen(handle, "rb") as source:
                info = os.fstat(source.fileno())
                found = None
                if not stat.S_ISREG(info.st_mode):
                    found = "no regular file"
                elif info.st_uid not in owners:
                    found = f"owned by uid {info.st_uid}"
                elif info.st_nlink != 1:
                    found = f"a file of {info.st_nlink} names (a hard link)"
                else:
                    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                    with open(os.open(target, flags, 0o600), "wb") as out:
                        shutil.copyfileobj(source, out)
                    return True
        raise ct_act.ActError(
            "untrusted",
            f"{name} is {found}; the index is copied only as a regular file of one name, the work tree's owner's "
            f"(uid {uid}), never through a link: remove it and run again; nothing was reset",
        )

    def prove_patches(self, directory, head):
        """Each patch applied to the old HEAD in a throw-away index gives exactly the tree git records for the work
        tree (changes.patch) and for the index (staged.patch). Every object git writes for this goes to a scratch
        object directory: the repository is not written."""
        # git run as the owner (a filtered repository: choose_git) works in a scratch of theirs, in /tmp.
        user = self.git.user if self.git.always else None
        with tempfile.TemporaryDirectory(
            prefix="pve-gpu-recover-", dir=ct_git.ROOT_TMP if user else ct_git.scratch_root()
        ) as scratch:
            real = self.view.common if self.git.always else self.view.dir  # the owner's git has no view
            objects = {
                "GIT_OBJECT_DIRECTORY": os.path.join(scratch, "objects"),
                "GIT_ALTERNATE_OBJECT_DIRECTORIES": os.path.join(real, "objects"),
            }
            os.mkdir(objects["GIT_OBJECT_DIRECTORY"])
            # On a copy of the index: stash create refreshes and rewrites the index it reads.
            index = os.path.join(scratch, "index")
            copied = self.copy_index(index)
            if user:
                for path in (scratch, objects["GIT_OBJECT_DIRECTORY"], *([index] if copied else [])):
                    os.chown(path, user[0], user[1])
            stash = self.git.must(
                "stash",
                "create",
                what="recording the work tree (`git stash create`)",
                config=IDENTITY,
                env=dict(objects, GIT_INDEX_FILE=index),
            ).decode()
            if not stash.strip():
                raise ct_act.ActError("backup", "`git stash create` recorded nothing although tracked files changed")
            trees = f"{stash.strip()}^{{tree}}", f"{stash.strip()}^2^{{tree}}"
            work_tree, index_tree = (
                self.git.must("rev-parse", *trees, what="reading its trees", env=objects).decode().split()
            )
            for name, want in (("changes.patch", work_tree), ("staged.patch", index_tree)):
                env = dict(objects, GIT_INDEX_FILE=os.path.join(scratch, f"{name}.index"))
                self.git.must("read-tree", head, what="reading the old HEAD into a scratch index", env=env)
                patch = os.path.join(directory, name)
                if user:  # the owner's git reads a copy: the backup directory is root's alone
                    shutil.copyfile(patch, os.path.join(scratch, name))
                    patch = os.path.join(scratch, name)
                    os.chown(patch, user[0], user[1])
                if os.path.getsize(patch):
                    self.git.must(
                        "apply", "--cached", patch, what=f"applying {name} to the old HEAD", kind="backup", env=env
                    )
                got = self.git.must("write-tree", what="writing the scratch tree", env=env).decode().strip()
                if got != want:
                    raise ct_act.ActError(
                        "backup",
                        f"{name} applied to {git_runner.short(head)} gives tree {got}, not the saved state's {want}",
                    )

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
