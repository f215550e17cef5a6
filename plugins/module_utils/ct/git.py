# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: how git is run on a repository the CT's users own, without running anything they chose.

The training code's probe part and its reset script both import it (``SHARED``): ``Target.run_probes`` ships its
source with theirs in the same ``pct exec``, and on a node it is imported as usual. So: standard library only,
Python 3.9+, nothing of ours but :mod:`ct_run` (its own ``SHARED``), whose runner kills a git read that
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
* a repository whose tracked paths use clean/smudge filters (git-lfs) is read and reset by git running as its
  owner with the owner's own config instead (:func:`own_env`, :func:`identity`; the code step's worktree.filtered
  decides): without the filter a checkout writes the filtered blobs (LFS pointers) over the content;
* objects are what their ids say: no replace ref or graft is followed (:func:`git_env`), and what is read as a
  commit, a tree or a blob is hashed and checked (:func:`verify_commit`, :func:`read_at_commit`);
* the repository's path is opened from ``/`` without following a link, nor through a directory another user than
  root and its owner could have put there (:func:`open_top`, ct/git_paths.py, with ct/fs.py's opener), and git
  works on the opened directory (``-C``, ``GIT_WORK_TREE`` and the git dir below ``/proc/self/fd/<fd>``,
  :func:`at`; the fd kept for every git call): a path swapped for a link after it was opened is never followed;
* with ``GIT_DIR`` given, git does not look for a repository (a directory that is not one is never mistaken for
  one further up) nor check its owner (``safe.directory`` is given all the same, for a git that would);
* submodules are not entered (``--ignore-submodules=dirty``): git would run a submodule's own config;
* every ``GIT_*`` variable of the environment dropped (``GIT_INDEX_FILE``... would point git elsewhere),
  ``LC_ALL=C`` (messages are matched), ``GIT_TERMINAL_PROMPT=0`` (nothing ever waits for a password).
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=disallowed-name,ansible-bad-function

import hashlib
import os
import pwd
import re
import shutil
import tempfile
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git_paths as ct_git_paths
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run

# Where the repository lies (opened without following a link, its git dir located), named here as ct_git's own.
Untrusted, Refused, open_top, open_dir, at, real, locate, looks_bare = (
    ct_git_paths.Untrusted,
    ct_git_paths.Refused,
    ct_git_paths.open_top,
    ct_git_paths.open_dir,
    ct_git_paths.at,
    ct_git_paths.real,
    ct_git_paths.locate,
    ct_git_paths.looks_bare,
)

SHARED = (ct_fs, ct_git_paths, ct_run)  # container-side modules Target.run_probes ships with this module

# Bytes of each stream a git read keeps: its listing of a large tree is MBs (a million paths about 60 MB); more
# than this is no repository the probe can judge, and must not grow the CT's python without end.
READ_CAP = 256 * 1024 * 1024
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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
        # Objects are what their ids say: no replace ref (`git replace <pinned> <other>`) and no graft stands in.
        GIT_NO_REPLACE_OBJECTS="1",
        GIT_GRAFT_FILE=os.devnull,
    )
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def git_argv(git, top, args, config=()):
    """``git -c core.fsmonitor=false -c core.hooksPath=/dev/null ... [-c <config>...] -C <top> <args...>``."""
    fixed = [part for setting in (*FIXED, *config) for part in ("-c", setting)]
    return [git, *fixed, "-C", top, *args]


class Unfinished(Exception):
    """A git read that gave no answer: ``timed_out`` (it was killed at its deadline, or the time was up before it
    started), ``missing`` (git could not be started), else it printed more than a read keeps."""

    def __init__(self, message, *, timed_out, missing=False):
        super().__init__(message)
        self.timed_out = timed_out
        self.missing = missing


def own_env(top, git_dir, home, environ=None):
    """The environment of git run as the repository's owner with the owner's own config (a repository whose
    tracked paths have clean/smudge filters: git-lfs): the real git dir, no view, the system's and the owner's
    global config (``home``); still no ``GIT_*`` of the caller and no replace object."""
    env = git_env(top, environ)
    for key in ("GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_GLOBAL", "GIT_ATTR_NOSYSTEM"):
        env.pop(key)
    env.update(HOME=home, GIT_DIR=git_dir, GIT_WORK_TREE=top)
    return env


def identity(uid, gid):
    """``((uid, gid, groups), home)`` of the owner ``uid``: who git runs as with their own config (their groups and
    home from the target's passwd; none: their own gid, and a home that does not exist)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return (uid, gid, (gid,)), "/nonexistent"
    return (uid, gid, tuple(os.getgrouplist(entry.pw_name, gid))), entry.pw_dir


def read(argv, env, deadline, user=None, fds=()):
    """``(rc, stdout bytes, stderr text)`` of a git call that only reads (root's, in a :class:`View`'s ``env``; or
    as ``user``, ``(uid, gid, groups)``, in :func:`own_env`),
    within ``deadline`` (``time.monotonic()``): past it, git and whatever it started are killed (its own session,
    :func:`ct_run.run`) and :class:`Unfinished` says so; so it does when git cannot be started. ``fds``: the fds
    git keeps (an opened top's, :func:`at`).

    Its output is kept whole up to :data:`READ_CAP` a stream (a listing of a large tree is MBs); a git that prints
    more is an :class:`Unfinished` too, never a cut listing read as whole. git starts in ``/``: ``-C`` (every argv
    here has one) is where it works.
    """
    shown = " ".join(["git", *map(real, argv[argv.index("-C") + 2 :])]) if "-C" in argv else " ".join(argv)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Unfinished(f"the time was up before `{shown}`", timed_out=True)
    try:
        done = ct_run.run(argv, remaining, env=env, user=user, cap=READ_CAP, text=False, fds=fds)
    except OSError as error:
        raise Unfinished(f"cannot run `{argv[0]}`: {error.strerror or error}", timed_out=False, missing=True) from None
    if done.get("missing"):
        why = done["stderr"].decode(errors="replace").partition("cannot run it: ")[2] or "it is not there"
        raise Unfinished(f"cannot run `{argv[0]}`: {why}", timed_out=False, missing=True)
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
    allowed keys (see the module's docstring). ``env`` is what every git call runs with, keeping ``fds`` (those of
    an opened top, :func:`at`, that its paths name); ``close()`` removes it."""

    def __init__(self, git, top, git_dir, common, environ=None, *, owner=None, deadline=None):
        self.top = top
        self.git_dir = git_dir
        self.common = common
        self.fds = tuple({fd for fd in map(ct_git_paths.fd_of, (top, git_dir, common)) if fd is not None})
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
            fds=self.fds,
        )
        if rc != 0 and os.path.exists(os.path.join(common, "config")):
            said = err.strip().splitlines()
            raise ViewError(f"`git config --file {real(common)}/config` failed: {said[-1] if said else 'no output'}")
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


def first_error(err):
    """What git's stderr says went wrong: its first ``fatal:`` or ``error:`` line, else its last line."""
    lines = [line.strip() for line in (err or "").splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith(("fatal:", "error:"))), lines[-1] if lines else "")
    return said or "no output"


# -- objects checked against their ids ------------------------------------------------------------------------
class Tampered(Exception):
    """An object whose bytes do not hash to its id: the object database was changed (or is corrupt)."""


def object_id(object_format, kind, data):
    """The id git gives ``data`` as an object of ``kind`` in a repository of ``object_format`` (``sha1``,
    ``sha256``): the hash of ``<kind> <len>\\0<data>``. ``object_id("sha1", "blob", b"")`` ->
    ``"e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"``."""
    digest = hashlib.sha256() if object_format == "sha256" else hashlib.sha1(usedforsecurity=False)
    digest.update(b"%s %d\0" % (kind.encode(), len(data)))
    digest.update(data)
    return digest.hexdigest()


def checked(object_format, kind, oid, data):
    """``data``, when it hashes to ``oid``; :class:`Tampered` else."""
    if object_id(object_format, kind, data) != oid:
        raise mismatch(oid)
    return data


def mismatch(oid):
    return Tampered(
        f"object {oid} does not hash to its id: the repository's object database was changed or is corrupt "
        "(git fsck names it); nothing read from it is used"
    )


def unreadable(oid, err):
    """The :class:`Tampered` of an object git could not read (git checks some hashes itself)."""
    return mismatch(oid) if "hash mismatch" in err else Tampered(f"object {oid} cannot be read: {first_error(err)}")


def parse_ls_tree(data):
    """``git ls-tree -z`` output -> ``[(mode, kind, oid, path bytes)]`` in git's order."""
    entries = []
    for record in data.split(b"\0"):
        if record:
            meta, _, path = record.partition(b"\t")
            mode, kind, oid = meta.decode("ascii").split(" ")
            entries.append((mode, kind, oid, path))
    return entries


def tree_bytes(entries):
    """A tree object's bytes from its entries ``[(mode, name bytes, oid)]`` in order (ls-tree pads a directory's
    mode to 040000; the object writes 40000)."""
    return b"".join(
        (b"40000" if mode == "040000" else mode.encode()) + b" " + name + b"\0" + bytes.fromhex(oid)
        for mode, name, oid in entries
    )


def tree_of(run, commit, object_format):
    """The root tree of ``commit``, read from the commit object checked against its id. ``run(*args)`` runs git
    (:func:`read`) and answers ``(rc, stdout bytes, stderr)``."""
    rc, out, err = run("cat-file", "commit", commit)
    if rc != 0:
        raise unreadable(commit, err)
    first = checked(object_format, "commit", commit, out).split(b"\n", 1)[0]
    if not first.startswith(b"tree "):
        raise Tampered(f"commit {commit} names no tree")
    return first[5:].decode("ascii")


def listing(run, tree, object_format, *, recursive=False):
    """``{path bytes: (mode, kind, oid)}`` of ``tree`` (``recursive``: every entry below it, one ``git ls-tree -r
    -t``), each tree listed checked against its id: its entries, in git's order, must make the bytes of its id."""
    rc, out, err = run("ls-tree", "-z", "--full-tree", *(["-r", "-t"] if recursive else []), tree)
    if rc != 0:
        raise unreadable(tree, err)
    found, children, trees = {}, {b"": []}, {b"": tree}
    for mode, kind, oid, path in parse_ls_tree(out):
        parent, _, name = path.rpartition(b"/")
        children.setdefault(parent, []).append((mode, name, oid))
        if kind == "tree" and recursive:
            trees[path] = oid
            children.setdefault(path, [])
        found[path] = (mode, kind, oid)
    for path, oid in trees.items():
        checked(object_format, "tree", oid, tree_bytes(children[path]))
    return found


def verify_commit(run, commit, object_format):
    """The entries of ``commit``'s whole tree (:func:`listing`), the commit and every tree checked: what git's
    status and checkout compare the work tree with is what the commit's id says. :class:`Tampered` else."""
    return listing(run, tree_of(run, commit, object_format), object_format, recursive=True)


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
    try:
        fd = open_top(ct_fs.clean(top))  # never through a link nor a directory another user could change (Refused)
    except Untrusted as error:
        return dict(found, error=str(error))
    except OSError:
        return dict(found, error=f"{top} is not a directory")
    where = f"{path} in commit {commit[:12]} of {top}"
    view = None

    def run(*args):
        return read(git_argv(executable, at(fd), args), view.env, deadline, fds=(fd,))

    try:
        git_dir, common = locate(at(fd))
        if git_dir is None:
            return dict(found, error=f"{top} is not a git work tree (it has no .git)")
        view = View(executable, at(fd), git_dir, common, deadline=deadline)
        if run("cat-file", "-e", f"{commit}^{{commit}}")[0] != 0:
            return dict(found, missing="commit")
        object_format = (view.value("extensions.objectformat") or "sha1").lower()
        return dict(found, **_blob_at(run, commit, path, where, limit=limit, object_format=object_format))
    except Untrusted as error:
        return dict(found, error=str(error))
    except UnicodeDecodeError:
        return dict(found, error=f"{where} is not UTF-8 text: it is no lock")
    except Unfinished as error:
        if error.timed_out:
            return dict(found, error=f"reading {where} did not finish within the probe's time: {error}")
        return dict(found, error=f"cannot read {where}: {error}")
    except (OSError, ValueError, ViewError, Tampered) as error:
        return dict(found, error=f"cannot read {where}: {error}")
    finally:
        if view is not None:
            view.close()
        os.close(fd)


def _blob_at(run, commit, path, where, *, limit, object_format):
    """``{"text"}``, ``{"missing": "path"}`` or ``{"error"}`` of ``path`` in ``commit``; ``run(*args)`` runs git
    (:func:`read`). Each object on the way (the commit, each tree, the blob) is checked against its id."""
    tree = tree_of(run, commit.lower(), object_format)
    parts = path.strip("/").split("/")
    for depth, name in enumerate(parts):
        entry = listing(run, tree, object_format).get(name.encode("utf-8", "surrogateescape"))
        if entry is None:
            return {"missing": "path"}
        mode, kind, oid = entry
        if depth < len(parts) - 1:
            if kind != "tree":
                return {"missing": "path"}
            tree = oid
    if kind != "blob" or mode not in ("100644", "100755"):
        return {"error": f"{where} is {_NOT_A_FILE.get(mode, kind)}, not a regular file"}
    rc, out, _ = run("cat-file", "-s", oid)
    if rc != 0 or int(out or b"0") > limit:
        return {"error": f"{where} is larger than {limit} bytes: it is no lock"}
    rc, out, err = run("cat-file", "blob", oid)
    if rc != 0:
        return {"error": f"cannot read {where}: {first_error(err)}"}
    return {"text": checked(object_format, "blob", oid, out).decode("utf-8")}
