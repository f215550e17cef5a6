# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""An acting module's part in its run's lock: the processes that change the target are named in the lock's record
on the node while they work, so no other run takes the lock over under them (plugins/module_utils/node/lock.py,
"Never under a live module").

A venv build or a warm-up runs as an Ansible async job: async_wrapper daemonizes, runs the module and outlives the
controller (Ctrl-C, a runner timeout). The fact pass's own pid in the lock is long gone by then, so the acting module
adds itself (and, run as an async job, the async_wrapper processes of its job above it: the job's runner and its
watcher, same job id) right before it acts, and takes them off when it is done. The option ``run_lock`` is the fact
pass's ``lock`` facts with the run's id (each step role's acting task passes it); a module run alone
gets none and records nothing.
"""

from __future__ import annotations

import contextlib
import os

from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock as node_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock_record import LockError, lock_path, shown

# The option of every acting module (doc fragment pve_target.run_lock).
RUN_LOCK_ARGUMENT_SPEC = {"run_lock": {"type": "dict"}}
# async_wrapper's processes above the module: the job's runner (its parent) and the watcher that kills it at the
# time limit (the runner's parent), both started with async_wrapper's argv and job id.
ASYNC_DEPTH = 2


def run_of(option, vmid):
    """``(lock_dir, run)``: the directory of the lock ``option`` names and its run's identity (run_id, owner,
    controller, controller_pid); None when the module works under no lock it holds. LockError ``invalid`` for a
    lock file that is not this target's."""
    if not option or not option.get("held"):
        return None
    path, who = option.get("path"), option.get("who")
    expected = os.path.basename(lock_path("/", vmid))
    if not (isinstance(path, str) and os.path.isabs(path) and os.path.basename(path) == expected):
        raise LockError(
            f"run_lock.path must be this target's lock file (.../{expected}), got {shown(path)}", kind="invalid"
        )
    if not isinstance(who, dict) or not isinstance(option.get("run_id"), str):
        raise LockError(
            f"run_lock must name its run_id and who took it (the fact pass's lock facts), got {shown(option)}",
            kind="invalid",
        )
    run = {key: who.get(key) for key in ("owner", "controller", "controller_pid")}
    return os.path.dirname(path), dict(run, run_id=option["run_id"])


def stat_fields(pid, proc="/proc"):
    """The fields of ``/proc/<pid>/stat`` after the command name, or None when it is gone or unreadable."""
    try:
        with open(os.path.join(proc, str(pid), "stat"), "rb") as handle:
            return handle.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def async_job(pid, proc="/proc"):
    """The job id of async_wrapper's argv that ``pid`` runs with, or None."""
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as handle:
            argv = [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return None
    for index, arg in enumerate(argv[:-1]):
        if os.path.basename(arg) == "async_wrapper.py":
            return argv[index + 1]
    return None


def working_processes(step, pid=None, proc="/proc"):
    """``[{pid, pid_start, what}]``: this module's process (``pid``) and, run as an async job, async_wrapper's
    processes of that job above it; one whose start time cannot be read is left out."""
    pid = os.getpid() if pid is None else pid
    found = []
    fields = stat_fields(pid, proc)
    if fields is None:
        return found
    found.append({"pid": pid, "pid_start": int(fields[19]), "what": f"the {step} module"})
    job = None
    for _level in range(ASYNC_DEPTH):
        parent = int(fields[1])
        fields = stat_fields(parent, proc) if parent > 1 else None
        this = async_job(parent, proc) if fields is not None else None
        if this is None or (job is not None and this != job):
            break
        job = this
        found.append({"pid": parent, "pid_start": int(fields[19]), "what": f"the {step} module's async job {job}"})
    return found


@contextlib.contextmanager
def working_on(option, vmid, step):
    """Name this module (and its async job) in its run's lock while the block runs (see the docstring); nothing
    when ``option`` names no lock this run holds. LockError ``locked`` before the block when the lock is no longer
    this run's."""
    found = run_of(option, vmid)
    if found is None:
        yield
        return
    lock_dir, run = found
    processes = working_processes(step)
    node_lock.join_run(lock_dir, vmid, run, processes)
    try:
        yield
    finally:
        with contextlib.suppress(LockError, OSError):  # a record left behind names processes that are gone
            node_lock.leave_run(lock_dir, vmid, run, processes)
