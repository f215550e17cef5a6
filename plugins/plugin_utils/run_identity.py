# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Who runs the fact pass, on the controller (the target_facts action): the run's id, one for every target of one
ansible-playbook run, and the lock's record of the controller (owner, host, ansible-playbook's pid)."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import platform
import re
import secrets
import tempfile
import time

# The run's id, shared by the ansible-playbook process's workers through its own temp directory (local_tmp).
RUN_ID_FILE = "pve-gpu-recover-run-id"


# The pid of ansible-playbook, set by the recover_report callback in that process (the drift runner clears any
# value it inherited, so it never names the wrong process).
CONTROLLER_PID_ENV = "PVE_GPU_RECOVER_CONTROLLER_PID"


# A run id names report files and lock records: a path component of safe characters only.
RUN_ID_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def run_id_problem(run_id):
    """Why ``run_id`` (given by the task: ``preflight_run_id``) cannot name a run, or None."""
    if isinstance(run_id, str) and RUN_ID_SHAPE.fullmatch(run_id):
        return None
    return (
        f"run_id {json.dumps(str(run_id))} cannot name a run: it names the run's report files and lock records, so "
        "it must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(preflight_run_id, or unset to let the fact pass name the run)"
    )


def new_run_id(now=None):
    """``20261204T101500Z-3f2a1c``: the UTC time and 24 random bits (two runs in one second still differ)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def shared_run_id(directory):
    """The id of this ansible-playbook run: made by the first worker that asks, read by every other one.

    ``directory`` is the process's own temp directory (``local_tmp``), which every worker of one run shares and no
    other run does. The id is published with link(2), which fails when another worker won the race, so every
    worker reads the same complete id. Returns None when the directory cannot be used.
    """
    path = os.path.join(directory, RUN_ID_FILE)
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read()
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=".run-id-")
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(new_run_id())
        with contextlib.suppress(FileExistsError):  # another worker published first: its id is the run's
            os.link(temporary, path)
        with open(path, encoding="ascii") as handle:
            return handle.read()
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def controller_defaults(environ=None, parent_pid=None):
    """The lock's record of who runs this, for the options the task leaves out: ``owner`` (USER@host, as the
    preflight role documents it), ``controller`` (this host's name) and ``controller_pid``.

    ``controller_pid`` is CONTROLLER_PID_ENV's, else this worker's parent (``parent_pid``, default os.getppid():
    Ansible forks its workers from ansible-playbook): never absent, since two runs under one run id, owner and
    controller are told apart by it alone (plugins/module_utils/node/lock.py, "One run").
    """
    environ = os.environ if environ is None else environ
    host = platform.node() or "unknown"
    user = environ.get("USER") or _login_name() or "unknown"
    pid = environ.get(CONTROLLER_PID_ENV, "")
    return {
        "owner": f"{user}@{host}",
        "controller": host,
        "controller_pid": int(pid) if pid.isdigit() else (parent_pid or os.getppid()),
    }


def _login_name():
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None
