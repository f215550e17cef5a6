# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Node side: which processes of the target use the training repository (unattended, a repository is not reset
under a live job), read from the node's /proc with node/runs_from.py, as the venv step reads who runs from a venv,
and by the rule the reset script's last look applies in the target (ct/proc.py): what runs from it, and what holds a
file of it open, names a path in it in its command line or imports from it (``PYTHONPATH``, ``-m``)."""

from __future__ import annotations

import os

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.runs_from import (
    processes_running_from,
    runs_from,
    under,
)

COMMAND_SHOWN = 120  # characters of a command line kept (twice what a sentence shows)


def uses_repository(pid, roots, proc_root="/proc"):
    """``(how, path, error)``: how process ``pid`` uses one of ``roots`` (paths as ITS mount namespace names them),
    cheapest read first; ``how`` is None when it does not.

    1. ``exe``, ``cwd``, ``argv0``, ``mapped``: it runs from a root or works in one (runs_from.runs_from with its
       working directory: ``python train.py`` started in the repository, a C extension built in place);
    2. ``open``: a file it holds open lies in a root (a log, a config it re-reads);
    3. ``argv``: an absolute path in its command line does (``python /srv/train/train.py`` started elsewhere:
       python closed the script once read);
    4. ``pythonpath``, ``module``: it imports from a root through ``PYTHONPATH`` (its environ, read bounded) or
       runs ``-m <module>`` whose top package lies in one (:func:`ct_proc.using`).
    """
    how, path, error = runs_from(pid, roots, proc_root, cwd=True)
    if how is not None:
        return how, path, None
    base = os.path.join(proc_root, str(pid))
    try:
        fds = os.listdir(os.path.join(base, "fd"))
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(os.path.join(base, "fd", fd))
        except OSError:
            continue
        if under(target, roots):
            return "open", target[: -len(pp.DELETED)] if target.endswith(pp.DELETED) else target, None
    text, read_error = pp.read_bounded(os.path.join(base, "cmdline"))
    argv = (text or "").split("\0")
    for arg in argv:
        if under(arg, roots):
            return "argv", arg, None
    if not text:
        return None, None, error or read_error  # no command line: a kernel thread or a zombie imports nothing
    environ, environ_error = pp.read_bounded(os.path.join(base, "environ"), limit=ct_proc.LIMITS["environ"])
    try:
        cwd = os.readlink(os.path.join(base, "cwd"))
    except OSError:
        cwd = "/"
    found = ct_proc.using(argv, environ or "", cwd, roots)
    if found:
        return found[0], found[1], None
    return None, None, error or read_error or environ_error


def processes_in_repository(owner, roots, proc_root="/proc", exclude=()):
    """Node-side: ``(users, unreadable)`` of the processes of ``owner`` (``ct:<vmid>``, ``host``) that use one of
    ``roots`` (:func:`uses_repository`), as runs_from.processes_running_from lists them: one it cannot read is
    listed."""
    return processes_running_from(owner, roots, proc_root, exclude, rule=uses_repository)


def user_of(info):
    command = " ".join(info.cmdline)
    return {"pid": info.pid, "ns_pid": info.ns_pid, "name": info.comm, "command": command[: COMMAND_SHOWN * 2]}
