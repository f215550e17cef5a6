# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: how git is run on a repository the CT's users own, without running anything they chose.

The training code's probe part and its reset script both import it (``SHARED``): ``Target.run_probes`` ships its
source with theirs in the same ``pct exec``, and on a node it is imported as usual. So: standard library only,
Python 3.9+, nothing of ours but :mod:`pve_ct_lean` (its own ``SHARED``), whose runner kills a git read that
outlives its deadline with everything it started (:func:`read`). The training venv's probe reads its lock from a
commit through it too (:func:`read_at_commit`).

* git never reads a configuration the repository's owner wrote, so nothing they name runs as root (filters,
  textconv, an fsmonitor, hooks, ssh commands, pagers, credential helpers, includes...). git has no switch to skip
  a repository's own config, so it is given a VIEW of the repository instead (:class:`View`): ``GIT_DIR`` is the
  real git dir (HEAD and the index are written there), ``GIT_COMMON_DIR`` a private scratch directory whose entries
  are links to the real common dir's (objects, refs, packed-refs...) except ``config`` and ``hooks``, and whose
  ``config`` holds only the keys of :data:`ALLOWED` copied from the real one (none of them names a program): an
  allowlist, so a setting git adds tomorrow is left out too. ``GIT_CONFIG_NOSYSTEM``, ``GIT_CONFIG_GLOBAL=/dev/null``
  and an empty ``HOME`` leave out the system's and root's config, so every run reads the same. The real config is
  read with ``git config --file`` (a parser: it follows no include and runs nothing). The view lives in a 0700 temp
  directory that is removed at the end;
* :func:`locate` reads ``.git`` and ``commondir`` without following a link and accepts only a git dir and common
  dir of the work tree's owner reached through no link (:class:`Untrusted` else: a ``.git`` file naming another
  user's repository, or /etc/.git, is never used);
* the reset's writes run as the repository's owner in a copy of the view they own (``View(owner=...)``); reads run
  as root in the view only root can change; ``core.logAllRefUpdates=false``: a reflog that exists is appended to,
  none is created;
* a repository whose config defines clean/smudge filters that tracked paths use is not reset (:func:`filtered`):
  without the filter a checkout writes the filtered blobs (git-lfs pointers) over the content;
* with ``GIT_DIR`` given, git does not look for a repository (a directory that is not one is never mistaken for
  one further up) nor check its owner (``safe.directory`` is given all the same, for a git that would);
* submodules are not entered (``--ignore-submodules=dirty``): git would run a submodule's own config;
* every ``GIT_*`` variable of the environment dropped (``GIT_INDEX_FILE``... would point git elsewhere),
  ``LC_ALL=C`` (messages are matched), ``GIT_TERMINAL_PROMPT=0`` (nothing ever waits for a password).
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=disallowed-name,ansible-bad-function

import os
import re
import shutil
import stat
import tempfile
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_lean

SHARED = (pve_ct_lean,)  # container-side modules Target.run_probes ships with this module

# Bytes of each stream a git read keeps: its listing of a large tree is MBs (a million paths about 60 MB); more
# than this is no repository the probe can judge, and must not grow the CT's python without end.
READ_CAP = 256 * 1024 * 1024
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
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


class ViewError(Exception):
    """The repository's config could not be read to build the view git is shown."""


def find_git(git):
    """The git executable: ``git`` itself when it is a path, else looked up on PATH; None when there is none."""
    if "/" in git:
        return git if os.path.isfile(git) and os.access(git, os.X_OK) else None
    return shutil.which(git, path=os.environ.get("PATH") or DEFAULT_PATH)


# The keys of the repository's own config that git is given (section and key lower case, as `git config --list`
# writes them): how to read the object database, the work tree's file system, line endings and a remote's URL.
# None of them names a program to run; everything else (filter.*, diff.*.textconv, core.fsmonitor, core.hooksPath,
# core.sshCommand, core.pager, credential.*, remote.*.uploadpack, include.*, url.*.insteadOf...) is left out.
ALLOWED = re.compile(
    r"(?:core\.(?:repositoryformatversion|filemode|symlinks|ignorecase|precomposeunicode|autocrlf|eol|safecrlf"
    r"|checkstat|trustctime|sparsecheckout|sparsecheckoutcone)|extensions\.(?:objectformat|refstorage)"
    r"|remote\..+\.url)",
    re.DOTALL,
)


# What the view's common dir does not link: the config (the view writes its own) and the hooks.
NOT_LINKED = ("config", "config.worktree", "hooks")


# Set on every call, over anything else: no program of git's own either (no fsmonitor, no hook, no auto gc, which
# would pack refs into the view), and no submodule (git would read its config).
FIXED = (
    "core.fsmonitor=false",
    "core.hooksPath=/dev/null",
    "gc.auto=0",
    "maintenance.auto=false",
    "submodule.recurse=false",
    "diff.ignoreSubmodules=dirty",
    "protocol.ext.allow=never",
    "core.logAllRefUpdates=false",  # reflogs that exist are appended to; none is created (no logs/ in the view)
)


def git_env(top, environ=None):
    """The environment of every git call: no ``GIT_*`` of the caller, the C locale, no prompt, no optional lock,
    no system or global config, and a ceiling at the repository's parent."""
    env = {
        k: v
        for k, v in (os.environ if environ is None else environ).items()
        if not k.startswith("GIT_") and k not in ("XDG_CONFIG_HOME", "HOME")
    }
    env.update(
        LC_ALL="C",
        LANG="C",
        GIT_TERMINAL_PROMPT="0",
        GIT_OPTIONAL_LOCKS="0",
        GIT_CEILING_DIRECTORIES=os.path.dirname(top),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_ATTR_NOSYSTEM="1",
    )
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def git_argv(git, top, args, config=()):
    """``git -c core.fsmonitor=false -c core.hooksPath=/dev/null ... [-c <config>...] -C <top> <args...>``."""
    fixed = [part for setting in (*FIXED, *config) for part in ("-c", setting)]
    return [git, *fixed, "-C", top, *args]


class Unfinished(Exception):
    """A git read that gave no answer: ``timed_out`` (it was killed at its deadline, or the time was up before it
    started), else git could not be started."""

    def __init__(self, message, *, timed_out):
        super().__init__(message)
        self.timed_out = timed_out


def read(argv, env, deadline):
    """``(rc, stdout bytes, stderr text)`` of a git call that only reads (root's, in a :class:`View`'s ``env``),
    within ``deadline`` (``time.monotonic()``): past it, git and whatever it started are killed (its own session,
    :func:`pve_ct_lean.run`) and :class:`Unfinished` says so; so it does when git cannot be started.

    Its output is kept whole up to :data:`READ_CAP` a stream (a listing of a large tree is MBs); a git that prints
    more is an :class:`Unfinished` too, never a cut listing read as whole. The reset's writes run as the
    repository's owner, which ``posix_spawn`` cannot do: they go through ``git_runner.Git`` (``subprocess``, a
    session of its own, its group killed too). git starts in this process's directory: ``-C`` (every argv here has
    one) is where it works.
    """
    shown = " ".join(["git", *argv[argv.index("-C") + 2 :]]) if "-C" in argv else " ".join(argv)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Unfinished(f"the time was up before `{shown}`", timed_out=True)
    try:
        done = pve_ct_lean.run(argv, remaining, env=env, cap=READ_CAP, text=False)
    except OSError as error:
        raise Unfinished(f"cannot run `{argv[0]}`: {error.strerror or error}", timed_out=False) from None
    if done.get("missing"):
        raise Unfinished(f"cannot run `{argv[0]}`: it is not there", timed_out=False)
    if done.get("timed_out"):
        said = f"`{shown}` did not finish in time and was killed with what it started"
        if done.get("abandoned"):
            said += "; it did not exit after SIGKILL (stuck in the kernel) and was left behind"
        raise Unfinished(said, timed_out=True)
    if done.get("truncated"):
        raise Unfinished(
            f"`{shown}` printed more than {READ_CAP >> 20} MiB: more than a repository read here may be",
            timed_out=False,
        )
    return done["rc"], done["stdout"], done["stderr"].decode(errors="replace")


class Untrusted(Exception):
    """The work tree's git dir or common dir lies where its owner does not control it: never used."""


def owner(top):
    """``(uid, gid)`` of the work tree's top: who git's writes run as (root's repositories: root)."""
    info = os.stat(top)
    return info.st_uid, info.st_gid


def _owned_dir(path, uid, what, top):
    """``path`` as a directory of ``uid`` (or root's, for a work tree of root's) reached through no link."""
    clean = os.path.normpath(path)
    if os.path.realpath(clean) != clean:
        raise Untrusted(
            f"the {what} of {top} is {clean}, reached through a symlink (to {os.path.realpath(clean)}): a git dir is "
            "used only where no link leads; move the repository's git dir into place"
        )
    try:
        info = os.lstat(clean)
    except FileNotFoundError:
        raise Untrusted(f"the {what} of {top} is {clean}, which does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise Untrusted(f"the {what} of {top} is {clean}, which is not a directory")
    if info.st_uid != uid:
        raise Untrusted(
            f"the {what} of {top} is {clean}, owned by uid {info.st_uid}, not by the work tree's owner (uid {uid}): "
            "another user's repository is never reset through a .git file or commondir naming it"
        )
    return clean


def _read_small(path):
    """The first 4 KiB of the regular file ``path``, never through a link; None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise Untrusted(f"{path} cannot be read without following a link: {error.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise Untrusted(f"{path} is not a regular file")
        return handle.read(4096).decode("utf-8", "surrogateescape")


def locate(top):
    """``(git_dir, common_dir)`` of the work tree at ``top``, read from its ``.git`` (a directory, or a file
    ``gitdir: <path>``) and the git dir's ``commondir``, without running git; ``(None, None)`` when ``top`` has no
    ``.git``. Both must be directories of the top's owner reached through no link (a ``.git`` file naming another
    user's repository, /etc/.git, is :class:`Untrusted`), and ``.git`` itself no link."""
    uid = os.stat(top).st_uid
    dotgit = os.path.join(top, ".git")
    try:
        info = os.lstat(dotgit)
    except FileNotFoundError:
        return None, None
    if stat.S_ISLNK(info.st_mode):
        raise Untrusted(f"{dotgit} is a symlink (to {os.readlink(dotgit)}); a git dir is used only where no link leads")
    if stat.S_ISDIR(info.st_mode):
        git_dir = dotgit
    elif stat.S_ISREG(info.st_mode):
        if info.st_uid != uid:
            raise Untrusted(f"{dotgit} is owned by uid {info.st_uid}, not by the work tree's owner (uid {uid})")
        text = _read_small(dotgit) or ""
        if not text.startswith("gitdir: "):
            return None, None
        git_dir = os.path.join(top, text[len("gitdir: ") :].strip())
    else:
        return None, None
    git_dir = _owned_dir(git_dir, uid, "git dir", top)
    common = git_dir
    text = _read_small(os.path.join(git_dir, "commondir"))
    if text is not None:
        common = _owned_dir(os.path.join(git_dir, text.strip()), uid, "common git dir", top)
    return git_dir, common


def looks_bare(top):
    """Whether ``top`` itself is a git dir (a bare repository): HEAD, objects and refs, no work tree."""
    return all(os.path.exists(os.path.join(top, name)) for name in ("HEAD", "objects", "refs"))


def parse_config_list(data):
    """``git config --list --null`` output -> ``[(key, value)]`` in file order; a key without ``=`` has None.

    ``b"core.bare\nfalse\0remote.origin.url\n/srv/up\0"`` -> ``[("core.bare", "false"), ("remote.origin.url",
    "/srv/up")]``."""
    entries = []
    for item in data.decode("utf-8", "surrogateescape").split("\0"):
        if item:
            key, _, value = item.partition("\n")
            entries.append((key, value if "\n" in item else None))
    return entries


def remote_names(entries):
    """The remotes a config defines (a ``remote.<name>.url``; git writes the name as it was given), sorted:
    ``[("core.bare", "false"), ("remote.origin.url", "/srv/up"), ("remote.Team/x.url", "u")]`` -> ``["Team/x",
    "origin"]``."""
    return sorted(
        {key[len("remote.") : -len(".url")] for key, _ in entries if key.startswith("remote.") and key.endswith(".url")}
        - {""}
    )


def config_text(entries):
    """The view's config: the allowed keys of ``entries``, the last value of each (git's rule for one value),
    quoted so that no value can open a section of its own."""

    def quoted(text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'

    chosen = {}
    for key, value in entries:
        if value is not None and ALLOWED.fullmatch(key):
            chosen[key] = value
    lines = []
    for key, value in chosen.items():
        section, _, rest = key.partition(".")
        subsection, _, name = rest.rpartition(".")
        header = f"[{section} {quoted(subsection)}]" if subsection else f"[{section}]"
        lines += [header, f"\t{name} = {quoted(value)}"]
    return "\n".join(lines) + "\n"


# The fallback scratch directory: root's, sticky, and mkdtemp makes a 0700 directory of its own in it.
ROOT_TMP = "/tmp"  # noqa: S108


def scratch_root():
    """Where the view and other scratch go: the temp directory when only root can replace what is in it (owned by
    root, and not writable by others unless sticky), else /tmp. A TMPDIR a user owns would let them swap the view's
    config under git."""
    candidate = tempfile.gettempdir()
    try:
        info = os.stat(candidate)
    except OSError:
        return ROOT_TMP
    shared = info.st_mode & 0o022 and not info.st_mode & 0o1000
    return candidate if info.st_uid == os.geteuid() == 0 and not shared else ROOT_TMP


class View:
    """The repository as git is shown it: the real git dir, a common dir of links whose config is only the
    allowed keys (see the module's docstring). ``env`` is what every git call runs with; ``close()`` removes it."""

    def __init__(self, git, top, git_dir, common, environ=None, *, owner=None, deadline=None):
        self.top = top
        self.git_dir = git_dir
        self.common = common
        # A view the owner's git enters lies in /tmp (root's, sticky): a temp directory of root's (a module's own,
        # 0700) may be one the owner cannot pass through.
        owned_by_user = owner is not None and owner[0] != 0
        self.scratch = tempfile.mkdtemp(
            prefix="pve-gpu-recover-git-", dir=ROOT_TMP if owned_by_user else scratch_root()
        )
        try:
            self._fill(git, environ, owner, deadline)
        except BaseException:
            self.close()  # a view that could not be made is not left in the temp directory
            raise

    def _fill(self, git, environ, owner, deadline):
        top, git_dir, common = self.top, self.git_dir, self.common
        self.dir = os.path.join(self.scratch, "common")
        home = os.path.join(self.scratch, "home")
        os.mkdir(self.dir, 0o700)
        os.mkdir(home, 0o700)
        base = git_env(top, environ)
        # Read the real config with git's parser alone: no repository (GIT_DIR names none), no include followed;
        # within the caller's deadline (60 s when it gives none).
        rc, out, err = read(
            [git, "-C", self.scratch, "config", "--file", os.path.join(common, "config"), "--list", "--null"],
            dict(base, HOME=home, GIT_DIR=os.path.join(self.scratch, "none")),
            time.monotonic() + 60 if deadline is None else deadline,
        )
        if rc != 0 and os.path.exists(os.path.join(common, "config")):
            said = err.strip().splitlines()
            raise ViewError(f"`git config --file {common}/config` failed: {said[-1] if said else 'no output'}")
        self.config = parse_config_list(out)
        for name in os.listdir(common):
            if name not in NOT_LINKED:
                os.symlink(os.path.join(common, name), os.path.join(self.dir, name))
        with open(os.open(os.path.join(self.dir, "config"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(config_text(self.config))
        self.env = dict(base, HOME=home, GIT_DIR=git_dir, GIT_COMMON_DIR=self.dir, GIT_WORK_TREE=top)
        # git checks no owner with GIT_DIR given; should a later one, the repository is safe to read: its config is
        # not read at all. (GIT_CONFIG_COUNT is command-line config, which git takes safe.directory from.)
        self.env.update(
            GIT_CONFIG_COUNT="2",
            GIT_CONFIG_KEY_0="safe.directory",
            GIT_CONFIG_VALUE_0=top,
            GIT_CONFIG_KEY_1="safe.directory",
            GIT_CONFIG_VALUE_1=git_dir,
        )
        # git's writes run as the repository's owner (``owner``: ``(uid, gid)``, not root): their own links in .git
        # can then only hurt them. They get a common dir of their own (git writes a lock next to ``shallow`` when a
        # fetch deepens it) with the same links and a copy of the allowed config: were they to swap it during the
        # run, what they name runs as they, never as root; root's own git calls never read it.
        self.owner = owner if owner is not None and owner[0] != 0 else None
        self.owned = None
        self.owner_env = self.env
        if self.owner is not None:
            uid, gid = self.owner
            os.chmod(self.scratch, 0o711)  # noqa: S103 (the owner may pass through to their own directory, not list)
            self.owned = os.path.join(self.scratch, "owned")
            owned_home = os.path.join(self.scratch, "owned-home")
            os.mkdir(self.owned, 0o700)
            os.mkdir(owned_home, 0o700)
            for name in os.listdir(self.dir):
                if name != "config":
                    os.symlink(os.readlink(os.path.join(self.dir, name)), os.path.join(self.owned, name))
            with open(
                os.open(os.path.join(self.owned, "config"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w"
            ) as f:
                f.write(config_text(self.config))
            os.chown(self.owned, uid, gid)
            os.chown(owned_home, uid, gid)
            self.owner_env = dict(self.env, GIT_COMMON_DIR=self.owned, HOME=owned_home)

    def value(self, key):
        """The last value of ``key`` in the real config (read, never given to git unless allowed), or None."""
        found = [value for name, value in self.config if name == key]
        return found[-1] if found else None

    def close(self):
        # The links are removed, never followed (rmtree does not follow a link).
        shutil.rmtree(self.scratch, ignore_errors=True)


def split_z(data):
    """NUL-separated git output -> paths (undecodable bytes kept as surrogates, so the file can still be opened)."""
    return [p for p in data.decode("utf-8", "surrogateescape").split("\0") if p]


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


def filter_drivers(entries):
    """The clean/smudge filter drivers the repository's config defines: ``{"lfs", ...}`` from its entries."""
    return {match.group(1) for key, value in entries if value and (match := FILTER_KEYS.fullmatch(key))}


def filtered(must, entries, paths, commit=None, commit_paths=()):
    """``{driver: number of paths}`` of the paths whose ``filter`` attribute names a driver the config defines (a
    checkout without it writes the blob, an LFS pointer, where the owner had the content): ``paths`` with the
    attributes of the work tree and the index, ``commit_paths`` with those of ``commit`` (read into a scratch index:
    git 2.39 has no ``check-attr --source``). ``must(args, env)`` runs git and answers its stdout; ``git check-attr``
    and ``read-tree`` into a scratch index run no filter and write nothing of the repository. Nothing is run when
    the config defines no driver."""
    drivers = filter_drivers(entries)
    counts = {}
    if not drivers:
        return counts

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
                if fields[index] in drivers:
                    counts[fields[index]] = counts.get(fields[index], 0) + 1

    count(paths, False, None)
    if commit and commit_paths:
        with tempfile.TemporaryDirectory(prefix="pve-gpu-recover-", dir=scratch_root()) as scratch:
            env = {"GIT_INDEX_FILE": os.path.join(scratch, "index")}
            must(["read-tree", commit], env)
            before = dict(counts)
            counts.clear()
            count(commit_paths, True, env)
            for name, number in before.items():
                counts[name] = max(counts.get(name, 0), number)
    return counts


def filter_problem(path, commit, counts):
    """The sentence that refuses a reset of a repository whose filters would be skipped."""
    named = ", ".join(f"{name} ({count} paths)" for name, count in sorted(counts.items()))
    return (
        f"the repository at {path} uses the clean/smudge filter {named} (git-lfs?); this step never runs a "
        f"repository's filters, and a checkout without them would write the filtered blobs (LFS pointers) over the "
        f"content: reset it by hand as its owner (git -C {path} stash -u && git -C {path} checkout --detach "
        f"{commit}), or drop the filter attribute, and run again; nothing was reset"
    )


def first_error(err):
    """What git's stderr says went wrong: its first ``fatal:`` or ``error:`` line, else its last line."""
    lines = [line.strip() for line in (err or "").splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith(("fatal:", "error:"))), lines[-1] if lines else "")
    return said or "no output"


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
            for directory, _, files in os.walk(full):
                inside = [os.path.relpath(os.path.join(directory, f), top) for f in files]
                found.extend(p for p in inside if p not in known)
        else:
            found.append(path)
    return sorted(set(found))


# The most a file read from a commit may weigh (a CUDA torch lock with every hash is about 100 KB).
BLOB_LIMIT = 4 * 1024 * 1024
# What ``git ls-tree`` says of a path that is no regular file: a link, a directory, a submodule.
_NOT_A_FILE = {"120000": "a symlink", "040000": "a directory", "160000": "a submodule"}


def read_at_commit(git, top, commit, path, *, deadline, limit=BLOB_LIMIT):
    """The text of ``path`` (relative to the work tree's top ``top``) in ``commit``, read from git's object
    database: the work tree, its local changes and HEAD do not matter. ``{"text": str or None, "missing": None,
    "commit" (not in the repository) or "path" (not in that commit), "error": None or one sentence}``.

    git runs as the code step's probe runs it, in a :class:`View` (none of the owner's config, no hook;
    ``cat-file blob`` applies no filter) and as root, reading only; every call within ``deadline``
    (``time.monotonic()``). Only a regular file of at most ``limit`` bytes of UTF-8 is read: a link, a directory or
    a submodule at ``path`` is an error. ``read_at_commit("git", "/srv/train", "0123...", "env/train.lock",
    deadline=time.monotonic() + 60)`` -> ``{"text": "six==1.17.0 ...", "missing": None, "error": None}``.
    """
    found = {"text": None, "missing": None, "error": None}
    executable = find_git(git)
    if executable is None:
        return dict(found, error=f"{git} is not found in the target (it reads the lock from the repository)")
    real = os.path.realpath(top)
    if not os.path.isdir(real):
        return dict(found, error=f"{top} is not a directory")
    try:
        git_dir, common = locate(real)
    except Untrusted as error:
        return dict(found, error=str(error))
    if git_dir is None:
        return dict(found, error=f"{top} is not a git work tree (it has no .git)")
    where = f"{path} in commit {commit[:12]} of {top}"
    view = None

    def run(*args):
        return read(git_argv(executable, real, args), view.env, deadline)

    try:
        view = View(executable, real, git_dir, common, deadline=deadline)
        if run("cat-file", "-e", f"{commit}^{{commit}}")[0] != 0:
            return dict(found, missing="commit")
        return dict(found, **_blob_at(run, commit, path, where, limit))
    except UnicodeDecodeError:
        return dict(found, error=f"{where} is not UTF-8 text: it is no lock")
    except Unfinished as error:
        if error.timed_out:
            return dict(found, error=f"reading {where} did not finish within the probe's time: {error}")
        return dict(found, error=f"cannot read {where}: {error}")
    except (OSError, ValueError, ViewError) as error:
        return dict(found, error=f"cannot read {where}: {error}")
    finally:
        if view is not None:
            view.close()


def _blob_at(run, commit, path, where, limit):
    """``{"text"}``, ``{"missing": "path"}`` or ``{"error"}`` of ``path`` in ``commit``; ``run(*args)`` runs git
    (:func:`read`)."""
    rc, out, err = run("ls-tree", "-z", "--full-tree", commit, "--", path)
    if rc != 0:
        return {"error": f"cannot list {where}: {first_error(err)}"}
    entry = out.decode("utf-8", "surrogateescape").split("\0")[0]
    meta, _, name = entry.partition("\t")
    if not entry or name != path:
        return {"missing": "path"}
    mode, _, rest = meta.partition(" ")
    kind, _, blob = rest.partition(" ")
    if kind != "blob" or mode not in ("100644", "100755"):
        return {"error": f"{where} is {_NOT_A_FILE.get(mode, kind)}, not a regular file"}
    rc, out, _ = run("cat-file", "-s", blob)
    if rc != 0 or int(out or b"0") > limit:
        return {"error": f"{where} is larger than {limit} bytes: it is no lock"}
    rc, out, err = run("cat-file", "blob", blob)
    if rc != 0:
        return {"error": f"cannot read {where}: {first_error(err)}"}
    return {"text": out.decode("utf-8")}
