#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: training_code
short_description: Put a target's training code at its pinned commit - every local change saved first
description:
  - Reads the git repository at I(path) inside the target - HEAD, branch, C(git status --porcelain -z) with
    untracked files, whether I(commit) is there - and compares it with the pinned commit. It reads again even when
    the fact pass of M(pve_gpu.recover.target_facts) just did, since those facts can be seconds old.
  - At I(commit) and clean (no staged, unstaged or untracked change), nothing is done, on a branch or detached alike.
    Ignored files (checkpoints, data, caches in C(.gitignore)) never count as changes and are never touched.
  - Otherwise, in ONE C(pct exec) (a script sent to the target's python on stdin), it re-checks, fetches I(commit)
    from I(remote) when the repository lacks it, saves every local change to C(<backup_dir>/<UTC stamp>/), proves
    the saved copy restores the tree, and only then checks I(commit) out, detached, and removes the untracked
    files it saved. Then it reads the repository again in the same C(pct exec); not at I(commit) and clean fails
    the task.
  - "The backup: C(changes.patch) (C(git diff --binary HEAD): every tracked change, staged or not, binary files
    included), C(staged.patch) (C(git diff --binary --cached HEAD)), C(changed.tar.gz) (the work tree's bytes of
    every changed file, and of a file a clean filter made look unchanged that the checkout rewrites),
    C(untracked.tar.gz) (untracked files that are not ignored), C(manifest.json) (the sha256 of each saved file's
    bytes), C(HEAD) (the old sha and branch), C(status.txt) and C(RESTORE.txt) (the commands that put it back,
    names shell-quoted: at the old HEAD, C(git apply changes.patch), optionally C(git apply --cached staged.patch),
    and C(tar -xzf untracked.tar.gz -C <path>))."
  - Before anything is reset, each patch is applied to the old HEAD in a throw-away index (its objects in a
    scratch directory) and must give exactly the tree C(git stash create) records for the work tree and the index,
    and each tarball must hold exactly the saved files with the bytes the work tree has then (read again). Any
    failure up to there leaves the repository exactly as it was.
  - git never runs anything the repository's owner configured - no filter, textconv, hook, fsmonitor, ssh command,
    pager or credential helper, in check mode and real runs alike. It is shown the repository through a private
    view whose config holds only an allowlist of the repository's keys (object format, file system, line endings,
    remote URLs); the system's and root's config are not read either (see code_probe).
  - A repository whose tracked paths (now or in I(commit)) have a clean/smudge C(filter) attribute (git-lfs,
    nbstripout) is read and reset by git running as its owner with the owner's own config (root's own for a
    repository of root's) - never another owner's configuration as root. The backup is still the work tree's
    bytes, read from the files. A filter whose program the target lacks stops a reset before anything changes.
  - I(path) is opened from C(/) without following a link; a link on the way is refused, naming it and who owns
    its directory. What is decided from git's objects is what I(commit)'s id says - no replace ref or graft is
    followed, and the commit, its trees and every blob the reset writes are hashed and checked against their ids.
  - Unattended (I(unattended), the scheduled drift corrector) a repository that needs a reset is not reset while a
    live process of the target uses it (its working directory, an open file, its executable or a path in its
    command line lies in the repository, or it imports from it through C(PYTHONPATH) or C(-m <package>); read on the
    node). The module then changes nothing, returns C(changed=false) and names the processes in I(needs_window). The
    reset script looks once more inside the target right before the reset - a job started while the backup was
    written is named the same way (the run's backup removed, nothing reset).
  - Detached, because the pin is a commit, not a branch. No branch is ever moved, so commits a branch had beyond
    the pin stay on it; a detached HEAD that no branch or tag holds is kept as
    C(refs/pve-gpu-recover/detached/<stamp>). When HEAD already is I(commit) (on a branch or not), only the tree is
    reset (C(git reset --hard)) and the branch stays checked out.
  - The untracked files removed are exactly those saved, not C(git clean) - after the checkout C(git clean) would
    read the commit's C(.gitignore), and a file only the old C(.gitignore) ignored (never saved) could be deleted.
    A file is removed only when it still has the saved bytes, and never through a link (a directory the checkout
    turned into a link to elsewhere is not entered).
  - Refused before anything changes, one sentence each - no repository at I(path), git missing, an unfinished
    merge/rebase/cherry-pick/revert/bisect, a conflict, an untracked git repository inside, I(commit) missing and
    no I(remote), ignored files that the checkout would overwrite, a backup that would leave less than
    I(backup_min_free_mib) on its file system.
version_added: "0.4.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - pve_gpu.recover.pve_target
  - pve_gpu.recover.pve_target.run_lock
  - pve_gpu.recover.pve_target.python
attributes:
  check_mode:
    support: full
    details: Reads and decides exactly as a real run does and changes nothing (no fetch, no backup); C(changed)
      and the diff are those of a real run.
  diff_mode:
    support: full
    details: Before is C(HEAD <sha>) and the repository's C(git status --porcelain) lines (a rename as C(old -> new),
      a name with a newline JSON-quoted); after is C(HEAD <commit>).
  platform:
    platforms: posix
options:
  state:
    description:
      - C(present) puts the repository at I(path) at I(commit), clean.
    type: str
    choices: [present]
    default: present
  path:
    description:
      - The repository inside the target, the top of its work tree. It must exist; the module never clones.
    type: path
    default: /srv/train
  commit:
    description:
      - The known-good commit, its full sha (40 hex digits, 64 in a SHA-256 repository). A branch or tag name is
        refused, since it may move and the pin must not.
    type: str
    required: true
  remote:
    description:
      - Where to fetch I(commit) from when the repository lacks it - a remote's name (C(origin)) or a URL, reached
        from inside the target with its credentials (C(git fetch --no-tags <remote> <commit>); the server must
        serve a commit by its sha, as GitHub, GitLab and git's protocol v2 do for any commit a ref holds).
      - Unset, a missing commit fails the task with what to do.
    type: str
  backup_dir:
    description:
      - Where local changes are saved, one C(<UTC stamp>) directory per run that had changes (mode 0700).
        Must lie outside I(path).
    type: path
    default: /var/backups/pve-gpu-recover/training_code
  backup_min_free_mib:
    description:
      - MiB the backup's file system keeps free beyond the backup. The read measures the file system of
        I(backup_dir) (its nearest existing directory) and estimates the backup from what would be saved (a changed
        file three times, for the two patches and the tarball; an untracked file once); a reset that would leave
        less is refused before anything changes, in check mode too, and the reset checks again before it writes.
      - C(0) keeps no margin.
    type: int
    default: 1024
  git:
    description:
      - git inside the target, a name on the PATH of a non-login root shell or a path.
    type: str
    default: git
  unattended:
    description:
      - Never reset the repository under a live process of the target; name the processes in I(needs_window)
        instead (the scheduled drift corrector). The role sets it from C(recover_unattended).
    type: bool
    default: false
  ending_pids:
    description:
      - Pids (as the target numbers them) that the GPU step ends before this step. In check mode they still run
        and do not count as users of the repository; a real run sees them gone. The role passes the fact pass's
        C(ending_pids).
    type: list
    elements: int
    default: []
  backup_keep:
    description:
      - Backups kept in I(backup_dir) after a reset, the newest ones (this run's among them); older ones are
        removed. C(0) keeps every one.
      - Unset, an attended run keeps every one and an unattended run the newest 10, so that a timer never fills
        the disk.
    type: int
  reset_timeout:
    description:
      - Seconds the fetch, the backup and the checkout may take together; a git command still running then is
        killed (with what it started) and the task fails. Before the checkout, nothing is changed then.
    type: int
    default: 600
requirements:
  - In the target, Python 3.9+ and git (2.5+, for C(GIT_COMMON_DIR)).
seealso:
  - module: pve_gpu.recover.target_facts
notes:
  - git runs as root but reads none of the repository's config beyond an allowlist - nothing the repository's
    owner names runs as root. A repository with clean/smudge filters is read and reset by git running as its owner
    with their own config instead; a file a clean filter strips (a notebook through nbstripout) is saved with its
    bytes either way.
  - A fetch reads neither root's nor the system's git config (no credential helper, no proxy); ssh still uses
    root's keys in the target.
  - Submodules are not managed - their pointers count like any tracked change, their work trees are not reset.
  - A file that only the old C(.gitignore) ignored is not saved and not removed; after the checkout it shows as
    untracked, the task fails naming it, and the next run saves and removes it.
"""

EXAMPLES = r"""
- name: Put CT 200's training code at the known-good commit
  pve_gpu.recover.training_code:
    vmid: 200
    path: /srv/train
    commit: 4f3c2a1b0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b
  delegate_to: pve1

- name: Fetch the commit from origin when the repository lacks it
  pve_gpu.recover.training_code:
    vmid: 200
    path: /srv/train
    commit: 4f3c2a1b0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b
    remote: origin
  delegate_to: pve1

- name: Only report what a reset would change (run with --check --diff)
  pve_gpu.recover.training_code:
    vmid: 200
    commit: 4f3c2a1b0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b
  delegate_to: pve1
  check_mode: true
  register: code_drift
"""

RETURN = r"""
repo:
  description:
    - The repository's path, I(path).
    - Not returned as C(path) - Ansible would add the owner, mode and size of a file of that name on the node,
      which is not the target's repository.
  returned: always
  type: str
  sample: /srv/train
commit:
  description: The pinned commit (lower case).
  returned: always
  type: str
  sample: 4f3c2a1b0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b
head:
  description: HEAD's sha (after a reset, the new one; in check mode, the one found); null without a commit.
  returned: always
  type: str
  sample: 4f3c2a1b0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b
branch:
  description: The branch HEAD is on; null when detached (after a reset to another commit, always).
  returned: always
  type: str
  sample: main
head_before:
  description: HEAD's sha before this run.
  returned: always
  type: str
  sample: 9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d
branch_before:
  description: The branch HEAD was on before this run; null when it was detached.
  returned: always
  type: str
  sample: main
dirty:
  description:
    - The local changes - C(staged), C(unstaged) and C(untracked) paths (a rename as C(old -> new)); ignored
      files never appear. After a reset, what is left (nothing); in check mode, what a reset would save.
  returned: always
  type: dict
  sample: {staged: [data.py], unstaged: [model.py], untracked: [notes.txt]}
fetched:
  description: Whether I(commit) was fetched from I(remote).
  returned: always
  type: bool
backup:
  description:
    - Where the local changes were saved - C(dir), C(files), C(changed) (tracked paths), C(untracked) (files)
      and C(restore) (its RESTORE.txt); null when nothing was dirty or nothing was done.
  returned: always
  type: dict
  sample:
    dir: /var/backups/pve-gpu-recover/training_code/20261203T101500Z
    files: [HEAD, RESTORE.txt, changed.tar.gz, changes.patch, manifest.json, staged.patch, status.txt,
      untracked.tar.gz]
    changed: 2
    untracked: 1
    filtered: []
    restore: /var/backups/pve-gpu-recover/training_code/20261203T101500Z/RESTORE.txt
needs_window:
  description:
    - Unattended, what is not done because a live process of the target uses the repository, one sentence;
      empty otherwise.
  returned: always
  type: list
  elements: str
  sample: ["CT 200 on pve1: the training code at /srv/train needs a reset (check out 4f3c2a1b0e9d (HEAD is
    9e8d7c6b5a4f on main)) but pid 516 (python3, pid 41 inside: 'python3 train.py'; cwd /srv/train) uses it: it is
    not reset under a live job; resetting it needs a window (stop the job, or run recover.yml without
    recover_unattended)"]
in_use:
  description: The processes of the target using the repository (read unattended with a reset due only).
  returned: always
  type: list
  elements: dict
pruned:
  description: The old backups removed (I(backup_keep)), oldest first.
  returned: always
  type: list
  elements: str
kept_ref:
  description: The ref that keeps a detached HEAD no branch or tag held (its commits stay reachable); null otherwise.
  returned: always
  type: str
  sample: refs/pve-gpu-recover/detached/20261203T101500Z
removed:
  description: The untracked files removed after they were saved (those the commit does not track).
  returned: always
  type: list
  elements: str
changes:
  description: What the run changes (or, in check mode, would change), one line each; empty when converged.
  returned: always
  type: list
  elements: str
  sample: ["save 2 changed and 1 untracked files to a backup, then check out 4f3c2a1b0e9d (HEAD is 9e8d7c6b5a4f on main)"]
seconds:
  description: Seconds the module took.
  returned: always
  type: float
saved_in:
  description: On a failure after the local changes were saved, the backup directory that holds them.
  returned: failure after the backup was written
  type: str
  sample: /var/backups/pve-gpu-recover/training_code/20261203T101500Z
error:
  description:
    - On failure, what kind of failure it was, stable for code. From the reset - C(fetch), C(missing) (the
      commit is nowhere), C(collision) (ignored files in the way), C(backup) (the saved copy would not restore the
      tree), C(no_space), C(timeout), C(reset) (the checkout failed), C(conflict), C(operation), C(nested),
      C(unborn), C(untrusted) (a .git file or commondir naming a git dir its owner does not own, or through a
      link, or I(path) reached through a link), C(tampered) (an object of I(commit) does not hash to its id),
      C(filter) (a clean/smudge filter whose program the target lacks, git-lfs), C(no_repository),
      C(no_git), C(git), C(os_error). From the module - C(invalid), C(problems)
      (what the read found makes a reset unsafe), C(verify) (not at the commit and clean after the reset), and the
      target's (C(stopped), C(missing), C(probe), ...).
  returned: failure
  type: str
  sample: fetch
cmd:
  description: On failure of a command, the argv that ran (the C(pct exec) wrapper included, or the git command).
  returned: failure of a command
  type: list
  elements: str
rc:
  description: On failure of a command, its exit code.
  returned: failure of a command
  type: int
stdout_tail:
  description: On failure of a command, the last 20 lines of its stdout.
  returned: failure of a command that printed
  type: str
stderr_tail:
  description: On failure of a command, the last 20 lines of its stderr.
  returned: failure of a command that printed
  type: str
"""

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import run_step_module
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.run_lock import RUN_LOCK_ARGUMENT_SPEC
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import (
    PYTHON_ARGUMENT_SPEC,
    TARGET_ARGUMENT_SPEC,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code.acting import TrainingCode
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code.facts import SPEC

ARGUMENT_SPEC = {
    **TARGET_ARGUMENT_SPEC,
    **RUN_LOCK_ARGUMENT_SPEC,
    "state": {"type": "str", "choices": ["present"], "default": "present"},
    **SPEC,
    "ending_pids": {"type": "list", "elements": "int", "default": []},
    "backup_keep": {"type": "int"},
    "reset_timeout": {"type": "int", "default": 600},
    **PYTHON_ARGUMENT_SPEC,
}


def main():
    run_step_module(TrainingCode(ARGUMENT_SPEC))


if __name__ == "__main__":
    main()
