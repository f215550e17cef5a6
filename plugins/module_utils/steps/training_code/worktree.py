# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training code step's reading of a work tree, in the target: an unfinished operation in the git dir, the
status entries, the remotes a config defines, the clean/smudge filters tracked paths use and the ignored files a
checkout would overwrite. git runs through :mod:`ct_git` (its view, its runner).

Container side, shipped with the probe part and the reset script (their ``SHARED``): standard library only,
Python 3.9+, nothing of ours but the container-side modules of its own ``SHARED``.
"""

import os
import re
import shutil
import tempfile

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git

SHARED = (ct_git,)  # container-side modules Target.run_probes ships with this module

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


def operation(git_dir):
    """The unfinished merge, rebase, am, cherry-pick, revert or bisect in ``git_dir``, or None."""
    for name, what in OPERATIONS:
        if os.path.exists(os.path.join(git_dir, name)):
            return what
    return None


def remote_names(entries):
    """The remotes a config defines (a ``remote.<name>.url``; git writes the name as it was given), sorted:
    ``[("core.bare", "false"), ("remote.origin.url", "/srv/up"), ("remote.Team/x.url", "u")]`` -> ``["Team/x",
    "origin"]``."""
    return sorted(
        {
            key[len("remote.") : -len(".url")]
            for key, _value in entries
            if key.startswith("remote.") and key.endswith(".url")
        }
        - {""}
    )


def status_entries(data):
    """``git status --porcelain=v1 -z`` bytes -> ``[(XY, path, original path or None)]``; a rename or copy is
    followed by its original path in the next NUL-separated field. Paths come as git wrote them: no quoting at all,
    undecodable bytes kept as surrogates (see code_facts.parse_status)."""
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


FILTER_KEYS = re.compile(r"filter\.(.+)\.(?:clean|smudge|process)", re.DOTALL)
BATCH = 500  # paths per `git check-attr` call
NO_FILTER = {"unspecified", "unset", "set"}  # a `filter` attribute that names no driver
# The tracked paths whose `filter` attribute is specified and not unset, in one `git ls-files` (attr pathspecs).
HAS_FILTER = ("--", ".", ":(exclude,attr:!filter)", ":(exclude,attr:-filter)")


def filtered(must, commit=None, commit_paths=()):
    """``{driver: number of paths}`` of the tracked paths whose ``filter`` attribute names a driver (any: the
    owner's own config, global or the repository's, defines it): those tracked now with the attributes of the work
    tree and the index, and ``commit_paths`` with those of ``commit`` (read into a scratch index: git 2.39 has no
    ``check-attr --source``). Such a repository is read and reset by git running as its owner with the owner's own
    config (a checkout without the filter writes the blob, an LFS pointer, where the owner had the content).
    ``must(args, env)`` runs git and answers its stdout; ``ls-files``, ``check-attr`` and ``read-tree`` into a
    scratch index run no filter and write nothing of the repository."""
    counts = {}

    def count(paths, cached, env):
        paths = sorted(set(paths))
        for start in range(0, len(paths), BATCH):
            args = [
                "check-attr",
                "-z",
                *(["--cached"] if cached else []),
                "filter",
                "--",
                *paths[start : start + BATCH],
            ]
            fields = must(args, env).decode("utf-8", "surrogateescape").split("\0")
            for index in range(2, len(fields), 3):
                if fields[index] not in NO_FILTER:
                    counts[fields[index]] = counts.get(fields[index], 0) + 1

    count(ct_git.split_z(must(["ls-files", "-z", *HAS_FILTER], None)), False, None)
    if commit and commit_paths:
        with tempfile.TemporaryDirectory(prefix="pve-gpu-recover-", dir=ct_git.scratch_root()) as scratch:
            env = {"GIT_INDEX_FILE": os.path.join(scratch, "index")}
            must(["read-tree", commit], env)
            before = dict(counts)
            counts.clear()
            count(commit_paths, True, env)
            for name, number in before.items():
                counts[name] = max(counts.get(name, 0), number)
    return counts


def missing_filters(listing, drivers, path=None):
    """``{driver: program}`` of the drivers in ``drivers`` whose clean, smudge or process command names a program
    the target does not have on ``path`` (the PATH git runs with); ``listing``: ``git config --null --get-regexp
    ^filter\\.`` as the owner reads it."""
    path = path or ct_git.DEFAULT_PATH
    missing = {}
    for key, value in ct_git.parse_config_list(listing):
        match = FILTER_KEYS.fullmatch(key)
        if not match or match.group(1) not in drivers or not (value or "").split():
            continue
        program = value.split()[0]
        if not (os.access(program, os.X_OK) if "/" in program else shutil.which(program, path=path)):
            missing[match.group(1)] = program
    return missing


def missing_problem(path, missing):
    """The sentence of filters whose programs the target lacks (a checkout would fail halfway, or write pointers)."""
    named = ", ".join(f"{driver} runs `{program}`" for driver, program in sorted(missing.items()))
    return (
        f"the repository at {path} uses clean/smudge filters whose programs are not in the target ({named}): "
        "install them there (apt install git-lfs for lfs) and run again; nothing was reset"
    )


def collisions(top, tracked, listed, untracked):
    """Files in the way of checking out a commit that a checkout would overwrite but nothing saves: IGNORED files.

    ``tracked``: the paths tracked now (``git ls-files -z``); ``listed``: the commit's (``git ls-tree -r
    --name-only -z``); ``untracked``: the untracked paths that are not ignored. A path the commit tracks collides
    when something exists there that is neither tracked now (its changes are in the patch) nor untracked (it is in
    the tarball): an ignored file, or a directory holding ignored files, or an ignored file where the commit needs
    a directory. ``git checkout --force`` would overwrite it silently.
    """
    tracked = set(tracked)
    known = tracked | set(untracked)
    found, checked = [], set()
    for path in listed:
        if path in tracked:
            continue
        parts = path.split("/")
        for depth in range(1, len(parts)):  # a file where the commit needs a directory
            parent = "/".join(parts[:depth])
            if parent in checked:
                continue
            checked.add(parent)
            full = os.path.join(top, parent)
            if os.path.lexists(full) and (os.path.islink(full) or not os.path.isdir(full)) and parent not in known:
                found.append(parent)
        full = os.path.join(top, path)
        if path in known or not os.path.lexists(full):
            continue
        if os.path.isdir(full) and not os.path.islink(full):
            for directory, _subdirs, files in os.walk(full):
                inside = [os.path.relpath(os.path.join(directory, f), top) for f in files]
                found.extend(p for p in inside if p not in known)
        else:
            found.append(path)
    return sorted(set(found))
