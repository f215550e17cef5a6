# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, the venv build's layout: the names beside a venv, the plans over them, and writing there.

Shipped with the build script (its ``SHARED``; ``Target.run_probes`` sends its source in the same ``pct exec``) and
imported on a node as any module_util: standard library only, Python 3.9+, nothing of ours but the container-side
modules of its own ``SHARED``.

* every version is ``<path>.<stamp>`` (:func:`version_dir`), marked unfinished while it is built (``MARKER``);
* ``<path>.<stamp>.lock.txt`` is the lock it was built from, ``<old dir>.freeze.txt`` what an old venv held;
* ``<path>.<stamp>-previous`` is a real venv directory at ``<path>`` moved aside (made before this tool);
* which versions an interrupted run left (:func:`plan_leftovers`) and which retention removes
  (:func:`plan_retention`), never one a live process uses (:func:`processes_using`);
* ``<path>.cache`` is the build's package cache (uv's in ``uv/``, pip's in ``pip/``): root's alone (mode 0700), on
  the venv's file system so that uv hard-links a version's files from it; retention never removes it;
* files are written through a temporary file renamed over the name, or created exclusively, never through a link.
"""

import contextlib
import os
import re
import shutil
import stat
import tempfile

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc

SHARED = (ct_proc,)  # container-side modules Target.run_probes ships with this module
MARKER = ".pve-gpu-recover-building"
STAMP = re.compile(r"^\d{8}T\d{6}Z$")
STAMP_PATTERN = r"\d{8}T\d{6}Z"


def version_dir(path, stamp):
    """``/opt/venvs/train`` + ``20261203T101500Z`` -> ``/opt/venvs/train.20261203T101500Z``."""
    return f"{path}.{stamp}"


def cache_dir(path):
    """``/opt/venvs/train`` -> ``/opt/venvs/train.cache``: the build's package cache, beside the versions."""
    return f"{path}.cache"


def lock_path(version):
    return f"{version}.lock.txt"


def freeze_path(old_dir):
    return f"{old_dir}.freeze.txt"


def previous_dir(path, stamp):
    """Where a real directory at ``path`` (a venv made before this tool) is moved: ``<path>.<stamp>-previous``."""
    return f"{path}.{stamp}-previous"


def version_pattern(path):
    """The names of ``path``'s versions, exactly: ``train.20261203T101500Z`` matches, ``train.X``,
    ``train.20261203T101500Z-previous`` and ``train.20261203T101500Z.lock.txt`` do not."""
    return re.compile(rf"^{re.escape(os.path.basename(path))}\.(?P<stamp>{STAMP_PATTERN})$")


def plan_leftovers(path, entries, current):
    """The directories an interrupted run left: ``entries`` are ``(name, is_real_dir, has_marker)`` of ``path``'s
    parent; a leftover is one of our version names, a real directory, marked unfinished, not the link's target.

    ``plan_leftovers("/v/train", [("train.20261203T101500Z", True, True), ("train.20261203T091500Z", True,
    False), ("train.backup", True, True)], "/v/train.20261203T091500Z")`` -> ``["/v/train.20261203T101500Z"]``.
    """
    parent, pattern = os.path.dirname(path), version_pattern(path)
    found = []
    for name, is_real_dir, has_marker in entries:
        full = os.path.join(parent, name)
        if pattern.match(name) and is_real_dir and has_marker and full != current:
            found.append(full)
    return sorted(found)


def plan_retention(versions, current, keep, in_use):
    """Which finished versions retention removes and which it must skip.

    ``versions``: finished version directories (any order; their names sort by stamp); ``keep``: how many stay,
    the current one counted (None: keep all); ``in_use``: ``{version: [pids]}``. Returns ``(remove, skipped)``,
    ``skipped`` as ``[{"path", "pids", "reason"}]``. ``plan_retention(["/v/t.2", "/v/t.1", "/v/t.3"], "/v/t.3", 1,
    {"/v/t.1": [41]})`` -> ``(["/v/t.2"], [{"path": "/v/t.1", "pids": [41], "reason": "in use by pid 41"}])``.
    """
    if keep is None:
        return [], []
    older = [v for v in sorted(versions, reverse=True) if v != current]
    beyond = older[max(keep - (1 if current else 0), 0) :]
    remove, skipped = [], []
    for version in sorted(beyond):
        pids = sorted(in_use.get(version, []))
        if pids:
            reason = f"in use by pid {', '.join(map(str, pids))}"
            skipped.append({"path": version, "pids": pids, "reason": reason})
        else:
            remove.append(version)
    return remove, skipped


def processes_using(directories, proc="/proc", cwd=False):
    """``{directory: [pids]}``: live processes that use one of ``directories`` by the target's one rule
    (ct_proc.scan: its executable, a path in its command line, a mapped file (a loaded C extension), an open file, a
    ``PYTHONPATH`` entry or ``-m`` package, and with ``cwd`` (before a removal) its working directory), each
    directory compared as given and as its real path. A process whose files could not be read (stuck in the driver,
    its mmap lock held) counts for every one of them: nothing is swapped or removed under a process nobody can vouch
    for.

    /proc/<pid>/exe alone is not enough: a venv's bin/python is a symlink to the base interpreter, so a job's exe is
    /usr/bin/python3.X whatever venv it runs in; a job started by the venv's link (``<path>/bin/python``) is found
    when ``<path>`` is among ``directories``.
    """
    roots = {}
    for directory in directories:
        for root in (directory, os.path.realpath(directory)):
            roots.setdefault(root, directory)
    scanned = ct_proc.scan(list(roots), proc=proc)
    using = {}
    for user in scanned["users"]:
        for how, root, _path in user["uses"]:
            if cwd or how != "cwd":  # a shell cd'd into a version: removing it would pull it from under the shell
                using.setdefault(roots[root], set()).add(user["pid"])
    for user in scanned["unreadable"] + scanned["late"]:
        for directory in directories:
            using.setdefault(directory, set()).add(user["pid"])
    return {d: sorted(p) for d, p in using.items()}


def comm_of(pid, proc="/proc"):
    """The kernel's name of ``pid`` (``python3``), or ``?`` when it cannot be read."""
    try:
        with open(os.path.join(proc, str(pid), "comm"), encoding="utf-8", errors="replace") as handle:
            return handle.read().strip() or "?"
    except OSError:
        return "?"


def write_atomic(path, text):
    """Write ``text`` to ``path`` through a temporary file renamed over it (never a half-written file).

    The module refuses a venv whose parent others may write (the probe's ``venv_unsafe``) before this script
    runs; as a second line all the same, the temporary file gets a name nobody can guess
    and is created exclusively (mkstemp: O_EXCL, so a link planted there is never followed), and the rename
    replaces a link at ``path`` itself rather than writing through it."""
    directory, name = os.path.split(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600: the lock and freeze beside a venv are for every user to read
        os.replace(temporary, path)
    except BaseException:
        remove(temporary)
        raise


def create_new(path, text, mode=0o644):
    """Write ``text`` to a file that must not exist yet (O_EXCL | O_NOFOLLOW: a planted link is an error, never
    followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with os.fdopen(os.open(path, flags, mode), "w", encoding="utf-8") as stream:
        stream.write(text)


def remove(path):
    """Remove a file, a symlink or a directory tree; gone already is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(directory):
    """Make a rename in ``directory`` durable (a power cut must not bring the old link back)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(handle)
    finally:
        os.close(handle)


def own_directory(path):
    """Make ``path`` a directory of this process's user alone (mode 0700), creating it or tightening its mode; the
    reason it cannot be (one sentence) when something else is there: a link (never followed), a file, a directory
    another user owns. ``""`` when it is.

    Only a user who may write its parent could have put something there, and the module refuses a venv whose
    parents others may write; this is the second line, as :func:`create_new` is.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{path} is owned by uid {info.st_uid}"
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return ""


def own_bytes(root):
    """The bytes of the regular files under ``root`` that nothing else links (one link: the cache's own; a file a
    venv version shares with it costs no more disk), links never followed."""
    total = 0
    for directory, _subdirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile
                info = os.lstat(os.path.join(directory, name))
                if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                    total += info.st_size
    return total
