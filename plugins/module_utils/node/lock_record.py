# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a run lock file says and what to do with it: the pure half of the run lock (plugins/module_utils/node/lock.py
has the rules and the files). No I/O, no clock: every branch is unit tested with plain values."""

from __future__ import annotations

import json
import math
import os
import stat
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError

DEFAULT_LOCK_DIR = "/run/lock/pve-gpu-recover"
DEFAULT_TTL = 7200
MAX_TTL = 30 * 86400  # a ttl beyond 30 days is not believed (it would make a lock of a dead run hold for ever)
FUTURE_SLACK = 60  # seconds a lock's `created` may be ahead of this clock before it counts as stale
MAX_CREATED = 253402300799  # 9999-12-31T23:59:59Z: the last time a lock may name
MAX_LOCK_BYTES = 65536
MAX_TEXT = 1000  # characters of run_id, owner and controller
MAX_PID = 4194304  # the kernel's largest pid_max
MAX_WORKERS = 16  # processes that joined one run's lock (an acting module and its async job's two)
UNREADABLE = "unknown (unreadable lock file)"
SHOWN = 60


class LockError(RecoverError):
    """The lock is held by another run, or cannot be used; ``details`` carry the path and the holder."""


def lock_path(lock_dir, vmid):
    return os.path.join(lock_dir, f"ct-{vmid}.lock" if vmid is not None else "host.lock")


def shown(value):
    """A found value as messages quote it: repr, at most SHOWN characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."


# -- pure logic ----------------------------------------------------------------------------------------------
def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def in_range(value, low, high):
    """True when ``value`` is a JSON number (not a bool, NaN or infinity) from ``low`` to ``high``; pure."""
    return is_number(value) and (isinstance(value, int) or math.isfinite(value)) and low <= value <= high


def content_problem(data):
    """What is wrong with a lock file's parsed JSON, or None when it is a lock this module wrote; pure.

    >>> content_problem(["a"])
    'a JSON list, not an object'
    >>> content_problem({"run_id": "r", "created": 1e308, "ttl": 60})
    'created 1e+308 is not a time from 1970 to 9999'
    """
    if not isinstance(data, dict):
        kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
        return f"a JSON {kinds.get(type(data), type(data).__name__)}, not an object"
    run_id = data.get("run_id")
    if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_TEXT:
        return f"run_id {shown(run_id)} is not a non-empty string"
    created = data.get("created")
    if not in_range(created, 0, MAX_CREATED):
        return f"created {shown(created)} is not a time from 1970 to 9999"
    ttl = data.get("ttl")
    if ttl is not None and not in_range(ttl, 1, MAX_TTL):
        return f"ttl {shown(ttl)} is not a number of seconds from 1 to {MAX_TTL}"
    for key in ("owner", "controller"):
        if key in data and not (isinstance(data[key], str) and len(data[key]) <= MAX_TEXT):
            return f"{key} {shown(data[key])} is not a string"
    for key in ("controller_pid", "pid"):
        pid = data.get(key)
        if pid is not None and not is_pid(pid):
            return f"{key} {shown(pid)} is not a process id"
    start = data.get("pid_start")
    if start is not None and not is_start(start):
        return f"pid_start {shown(start)} is not a start time"
    return workers_problem(data.get("workers", []))


def is_start(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def workers_problem(workers):
    """What is wrong with a lock's ``workers`` (the processes that still work for its run: :func:`live_workers`),
    or None; pure.

    >>> workers_problem([{"pid": 7, "pid_start": 12, "what": "the training_venv module"}]) is None
    True
    """
    if not isinstance(workers, list) or len(workers) > MAX_WORKERS:
        return f"workers {shown(workers)} is not a list of at most {MAX_WORKERS} processes"
    for worker in workers:
        if not (
            isinstance(worker, dict)
            and is_pid(worker.get("pid"))
            and is_start(worker.get("pid_start"))
            and isinstance(worker.get("what"), str)
            and len(worker["what"]) <= MAX_TEXT
        ):
            return f"workers holds {shown(worker)}, not a process (pid, pid_start, what)"
    return None


def is_pid(value):
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_PID


IDENTITY = ("run_id", "owner", "controller", "controller_pid")


def same_run(current, mine):
    """Whether the lock ``current`` is the run ``mine`` (both dicts with IDENTITY's keys; absent is None); pure.

    >>> same_run({"run_id": "r", "owner": "a", "controller_pid": 7}, {"run_id": "r", "owner": "a", "controller_pid": 8})
    False
    """
    return all(current.get(key) == mine.get(key) for key in IDENTITY)


def module_runs(current, alive):
    """Whether the node-side module that wrote ``current`` still runs (``alive(pid, start)``, injected); pure."""
    pid, start = current.get("pid"), current.get("pid_start")
    return is_pid(pid) and is_start(start) and bool(alive(pid, start))


def live_workers(current, alive):
    """The processes of ``current``'s run that still work on its target, ``[(pid, what)]``: the module that wrote
    the lock (the fact pass), and each acting module and its async job that joined the run (``workers``, added by
    :func:`joined`); ``alive(pid, start)`` injected, so a reused pid (another start time) is not one of them; pure.

    >>> live_workers({"pid": 7, "pid_start": 1, "workers": [{"pid": 9, "pid_start": 2, "what": "the x module"}]},
    ...              lambda pid, start: pid == 9)
    [(9, 'the x module')]
    """
    found = [(current["pid"], "its node-side module")] if module_runs(current, alive) else []
    workers = current.get("workers") if workers_problem(current.get("workers", [])) is None else []
    return found + [(w["pid"], w["what"]) for w in workers or () if alive(w["pid"], w["pid_start"])]


def joined(current, processes, alive):
    """``current`` with ``processes`` (``[{pid, pid_start, what}]``) among its ``workers``, the dead ones dropped; pure.
    None when they would be more than MAX_WORKERS (the caller refuses)."""
    workers = [w for w in current.get("workers") or () if alive(w["pid"], w["pid_start"]) and w not in processes]
    workers += processes
    return dict(current, workers=workers) if len(workers) <= MAX_WORKERS else None


def left(current, processes):
    """``current`` without ``processes`` among its ``workers``; pure."""
    return dict(current, workers=[w for w in current.get("workers") or () if w not in processes])


def described(live):
    """``[(pid, what)]`` as a message names them: ``pid 4242 (the training_venv module)``; pure."""
    return ", ".join(f"pid {pid} ({what})" for pid, what in live)


def reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def parse_lock(raw, mtime):
    """The holder a lock file's bytes describe; pure. Anything but a lock this module wrote is an unknown holder
    since ``mtime`` (the file's modification time) with ``problem`` saying what was found.
    """
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
        problem = content_problem(data)
    except (ValueError, RecursionError) as error:
        problem = f"not JSON ({str(error)[:SHOWN]})"
    if problem is None:
        return data
    return {
        "run_id": UNREADABLE,
        "owner": "unknown",
        "created": min(max(mtime, 0), MAX_CREATED),
        "ttl": None,
        "problem": problem,
    }


def stale_reason(current, now, ttl, *, hostname=None, pid_exists=None):
    """Why the lock ``current`` of another run is stale, or None while it holds; pure (``pid_exists`` injected).

    >>> stale_reason({"created": 1000, "ttl": 10}, 1030, 7200)
    'it expired 20 s ago (ttl 10 s)'
    >>> stale_reason({"created": 5000, "ttl": 10}, 1030, 7200)
    'its created time is 3970 s in the future'
    """
    created = current.get("created", 0)
    limit = current.get("ttl") or ttl
    if created > now + FUTURE_SLACK:
        return f"its created time is {created - now:.0f} s in the future"
    if created + limit < now:
        return f"it expired {now - created - limit:.0f} s ago (ttl {limit:g} s)"
    pid = current.get("controller_pid")
    if (
        hostname
        and pid_exists is not None
        and current.get("controller") == hostname
        and isinstance(pid, int)
        and not isinstance(pid, bool)
        and 0 < pid <= MAX_PID
        and not pid_exists(pid)
    ):
        return f"its controller (pid {pid} on {hostname}) is gone"
    return None


def plan_lock(state, current, run_id, now, ttl=7200, *, hostname=None, pid_exists=None, who=None, module_alive=None):
    """What to do with the lock: ``(action, changed)``; pure, so every branch is unit tested.

    ``current`` is the parsed lock file or None; it is this run's when :func:`same_run` says so for ``run_id`` and
    ``who`` (``owner``, ``controller``, ``controller_pid``). Another run's lock is taken over when
    :func:`stale_reason` gives a reason (its own ttl, or ``ttl`` when it has none, as for an unreadable lock file)
    and no process of its run still works on the target (:func:`live_workers`: its node-side module, an acting
    module or its async job; ``module_alive(pid, start)``, injected). This run's own lock is kept, not released,
    while one of its workers still lives (``kept_for_worker``).
    """
    mine = dict(who or {}, run_id=run_id)
    if state == "present":
        if current is None:
            return "taken", True
        if same_run(current, mine):
            return "already_held", False
        if stale_reason(current, now, ttl, hostname=hostname, pid_exists=pid_exists) and not (
            module_alive is not None and live_workers(current, module_alive)
        ):
            return "taken_over", True
        return "locked", False
    if current is None:
        return "not_held", False
    if same_run(current, mine):
        # A worker of this run still changing the target (an async build whose poll gave up) keeps the lock.
        if module_alive is not None and live_workers(current, module_alive):
            return "kept_for_worker", False
        return "released", True
    return "held_by_other", False


def describe_holder(holder, now):
    created = holder.get("created", 0)
    created = created if in_range(created, 0, MAX_CREATED) else 0
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    minutes = max(0, int((now - created) // 60))
    problem = f"; the lock file holds {holder['problem']}" if holder.get("problem") else ""
    where = ""
    if holder.get("controller"):
        pid = f" pid {holder['controller_pid']}" if holder.get("controller_pid") else ""
        where = f", controller {holder['controller']}{pid}"
    return f"run {holder.get('run_id')} of {holder.get('owner')} (started {started}, {minutes} min ago{where}{problem})"


def why_held(holder, now, ttl, hostname, alive, *, module_alive=None):
    """Why another run's lock still holds, and when it stops: what a person needs before removing it by hand.

    ``alive(pid)`` says whether a pid of this machine lives. A run whose controller is this machine and alive is
    still working; one whose controller is elsewhere may have been cut off (the node became unreachable, the
    controller died), which nothing here can see, so the lock holds until its ttl. A lock whose node-side module
    still runs (``module_alive(pid, start)``) holds whatever its ttl: that module is still changing the target.
    """
    created = holder.get("created", now)
    created = created if in_range(created, 0, MAX_CREATED) else now
    left = max(0, int((created + (holder.get("ttl") or ttl) - now) // 60))
    stale = stale_reason(holder, now, ttl, hostname=hostname, pid_exists=alive)
    live = live_workers(holder, module_alive) if stale and module_alive is not None else []
    if live:
        if live[0][1] == "its node-side module":
            return (
                f"{stale}, but its node-side module, pid {live[0][0]} on this node, still runs: its controller may "
                f"be gone (Ctrl-C, a runner timeout), its work is not; wait for that process to end"
            )
        return (
            f"{stale}, but {described(live)} of that run still work on the target on this node: its controller may "
            f"be gone (Ctrl-C, a runner timeout), its work is not; wait for {'it' if len(live) == 1 else 'them'} to end"
        )
    pid = holder.get("controller_pid")
    if holder.get("controller") == hostname and isinstance(pid, int) and alive(pid):
        return f"that run is still working (its controller pid {pid} lives on this machine)"
    if holder.get("controller") and holder.get("controller") != hostname:
        return (
            f"if that run was cut off (its node unreachable, its controller {holder['controller']} gone), nothing "
            f"here can tell: the lock expires in {left} min"
        )
    return f"the lock expires in {left} min"


def dir_problem(info, euid):
    """Why a lock directory with lstat ``info`` must not be used by user ``euid``, or None; pure."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return f"is not a directory ({file_kind(info.st_mode)})"
    if info.st_uid != euid:
        return f"is owned by uid {info.st_uid}, not by uid {euid} that runs this module"
    if info.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def file_kind(mode):
    for test, word in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return word
    return f"a file of mode {mode:o}"


def what_of(vmid):
    return f"CT {vmid}" if vmid is not None else "this host"


def check_ttl(ttl):
    if ttl < 1:
        # ttl 0 would make every lock stale at once: two runs could both take it.
        raise LockError(f"ttl must be at least 1 second, got {ttl}; fix preflight_lock_ttl", kind="invalid")
    if ttl > MAX_TTL:
        # A lock this long would be refused as unreadable when read back (see the rules).
        raise LockError(
            f"ttl must be at most {MAX_TTL} seconds (30 days), got {ttl}; fix preflight_lock_ttl", kind="invalid"
        )


def check_texts(**values):
    for key, value in values.items():
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_TEXT):
            raise LockError(
                f"{key} must be a non-empty string of at most {MAX_TEXT} characters, got {shown(value)}", kind="invalid"
            )
