# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which processes run from a directory (a venv about to be swapped), read on the node: :func:`runs_from` (one
process, cheapest read first) and :func:`processes_running_from` (every process of a target). The paths are those
of each process's own mount namespace, so a CT's paths read on the node compare with paths inside the CT."""

from __future__ import annotations

import contextlib
import fnmatch
import os

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import (
    DELETED,
    INTERPRETERS,
    list_pids,
    read_bounded,
    read_owner,
    read_process,
)

MAPS_LIMIT = 4 * 1024 * 1024  # bytes of /proc/<pid>/maps read: a big torch job maps a few thousand files (~1 MB)


def under(path, roots):
    """The first of ``roots`` (absolute directories) that ``path`` is or lies below, or None; pure.

    >>> under("/opt/venvs/train.2/lib/libtorch.so", ["/opt/venvs/train", "/opt/venvs/train.2"])
    '/opt/venvs/train.2'
    """
    if not path or not path.startswith("/"):
        return None
    path = path[: -len(DELETED)] if path.endswith(DELETED) else path
    for root in roots:
        top = root.rstrip("/") or "/"
        if path == top or path.startswith(top.rstrip("/") + "/"):
            return top
    return None


def parse_maps_paths(text):
    """The files a /proc/<pid>/maps maps (its sixth field when it is a path), in order, once each; pure.

    >>> parse_maps_paths("7f00-7f01 r-xp 00000000 00:2a 12 /opt/v/lib/x.so\\n7f02-7f03 rw-p 00000000 00:00 0 [heap]\\n")
    ['/opt/v/lib/x.so']
    """
    found = {}
    for line in (text or "").splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/"):
            found.setdefault(fields[5], None)
    return list(found)


def is_interpreter(path):
    """Whether an executable's basename is a Python interpreter's (``python3.11``, ``pypy3``)."""
    name = os.path.basename(path or "")
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in INTERPRETERS)


def runs_from(pid, roots, proc_root="/proc", cwd=False):
    """``(how, path, error)``: how process ``pid`` runs from one of ``roots`` (paths as ITS mount namespace names
    them), cheapest read first; ``how`` is None when it does not, ``error`` says what could not be read.

    1. ``exe``: /proc/<pid>/exe lies in a root (a binary of the venv). No lock is taken, nothing can block.
       ``cwd`` (only with ``cwd``): its working directory does (no lock either). A shell cd'd into a directory
       does not run from it, but removing that directory pulls it from under the shell.
    2. ``argv0``: for a Python interpreter only, argv[0] lies in a root (``/opt/venvs/train/bin/python train.py``:
       a venv's bin/python links to the base interpreter, so exe alone never names the venv).
    3. ``mapped``: a file it maps lies in a root (a C extension, ``libtorch.so``: a job activated by PATH).

    ``cmdline`` and ``maps`` take the process's mmap lock, which a thread stuck in the driver can hold for ever:
    both are read by a child process under a deadline (:func:`read_bounded`). The kernel writes these paths as the
    process's own mount namespace names them, so a CT's paths read on the node compare with paths inside the CT.
    """
    base = os.path.join(proc_root, str(pid))
    try:
        exe = os.readlink(os.path.join(base, "exe"))
    except FileNotFoundError:
        return None, None, None  # a kernel thread, a zombie or gone: it runs from no file
    except OSError as error:
        return None, None, f"could not read {os.path.join(base, 'exe')}: {error.strerror}"
    if under(exe, roots):
        return "exe", exe[: -len(DELETED)] if exe.endswith(DELETED) else exe, None
    if cwd:
        with contextlib.suppress(OSError):
            directory = os.readlink(os.path.join(base, "cwd"))
            if under(directory, roots):
                return "cwd", directory[: -len(DELETED)] if directory.endswith(DELETED) else directory, None
    errors = []
    if is_interpreter(exe[: -len(DELETED)] if exe.endswith(DELETED) else exe):
        text, error = read_bounded(os.path.join(base, "cmdline"))
        argv0 = (text or "").split("\0", 1)[0]
        if under(argv0, roots):
            return "argv0", argv0, None
        if error:
            errors.append(error)
    text, error = read_bounded(os.path.join(base, "maps"), limit=MAPS_LIMIT)
    for path in parse_maps_paths(text):
        if under(path, roots):
            return "mapped", path[: -len(DELETED)] if path.endswith(DELETED) else path, None
    if error:
        errors.append(error)
    return None, None, "; ".join(errors) or None


def processes_running_from(owner, roots, proc_root="/proc", exclude=(), cwd=False, *, rule=None):
    """Node-side: the processes of ``owner`` (``ct:<vmid>``, ``host``) that run from one of ``roots``.

    Returns ``(users, unreadable)``: ``users`` ``[(ProcessInfo, how, path)]`` (:func:`runs_from`),
    ``unreadable`` ``[(ProcessInfo, error)]`` of those whose files could not be read (gone ones are skipped): a
    caller that must not act under a user counts them as users it cannot rule out. ``cwd``: a process whose working
    directory lies in a root counts too (before removing a directory, not before swapping a link).
    The owner is told by each process's cgroup (one small read), so another CT's processes cost nothing more.
    ``rule(pid, roots, proc_root)``: how one process uses a root, in :func:`runs_from`'s answer (the training
    code's repository adds open files, command lines and imports: training_code/in_use.py).
    """
    users, unreadable = [], []
    for pid in list_pids(proc_root):
        # pid 1 is the node's (the host's) init: it runs from no venv. A CT's init has another host pid.
        if pid <= 1 or pid in exclude or pid == os.getpid() or read_owner(pid, proc_root) != owner:
            continue
        how, path, error = runs_from(pid, roots, proc_root, cwd) if rule is None else rule(pid, roots, proc_root)
        if how is None and error is None:
            continue
        info = read_process(pid, proc_root)
        if info is None:
            continue  # it ended while we looked
        if how is not None:
            users.append((info, how, path))
        else:
            unreadable.append((info, error))
    return users, unreadable
