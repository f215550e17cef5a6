# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The run lock of a target, kept on its node: one file per target, so two recovery runs never overlap.

Used by ``target_lock`` and by the fact pass (``target_facts`` takes the lock in the same module execution that
reads the target, and releases it when nothing is left to do).

Rules (the role README copies them):

* **Where.** One file per target in the lock directory on the node (default ``/run/lock/pve-gpu-recover``, a
  tmpfs that a reboot empties): ``ct-<vmid>.lock``, or ``host.lock`` for a bare GPU host.
* **The directory must be safe.** It must be a real directory (not a symlink), owned by the user the module runs
  as (root), and writable by nobody else (no group or world write bit). A missing one is created with mode 0755.
  Anything else is refused with ``LockError(kind="unsafe")`` naming what was found and how to fix it, in check
  mode too: whoever can write there could forge or remove locks, or plant a symlink for root to follow.
* **The lock file.** A JSON object ``{run_id, owner, created, ttl, pid, pid_start}`` (``pid`` and ``pid_start``:
  the node-side module that wrote it and its start time, field 22 of /proc/<pid>/stat, which tells a reused pid
  apart), plus ``controller`` (host name) and ``controller_pid`` when the caller gives them, and ``workers``
  (``[{pid, pid_start, what}]``, at most 16) once an acting module joined the run. It is written to a
  new temporary file (``O_CREAT|O_EXCL|O_NOFOLLOW``) and hard-linked to its name, so the name appears with its
  whole content or not at all, and only if no lock exists. It is read with ``O_NOFOLLOW|O_NONBLOCK`` and must be
  a regular file of at most 64 KiB. All names are opened relative to the checked directory (no path is resolved
  twice).
* **Not a lock file.** A symlink, directory, FIFO, socket or device at the lock's name is ``LockError(kind=
  "unsafe")``: never read through, never taken over; a person removes it.
* **Unreadable content.** A regular file that is not such an object (not JSON, a JSON list or string, NaN or
  Infinity, run_id not a string, created not a time from 1970 to 9999, ttl not 1 s to 30 days...) counts as held
  by an unknown run since the file's modification time; the ``locked`` error says what was found. It expires
  like any lock, after the ttl of the run that finds it.
* **Stale.** A lock of another run is stale, and is taken over (with a warning), when

  - ``created + ttl`` is in the past (its own ttl, or the finding run's when it has none), or
  - ``created`` is more than 60 s in the future: this clock never wrote it (a clock set back by more than a
    minute, or a forged file), so its age cannot be known; it is not allowed to hold for ever, or
  - it names this machine as ``controller`` (same host name) and ``controller_pid`` no longer exists: the run
    that took it is provably gone, whatever its ttl. A reused pid only makes the lock live until its ttl.

* **One run.** A lock is this run's only when ``run_id``, ``owner``, ``controller`` and ``controller_pid`` all
  match: two runs that share a run id (a ticket or pipeline id, a retried CI job) are two runs, and the second is
  refused as ``locked`` like any other. Release compares the same four, so the first run's release never
  removes the second's lock.
* **Never under a live module.** Before a stale lock is taken over, its ``pid`` is checked: while that process
  runs on this node with the same start time (the module of a run whose controller was stopped by Ctrl-C or a
  runner timeout, still working), the lock holds, whatever its ttl says. So do its ``workers``: each acting module
  of the run adds itself (pid, start time, what) before it changes the target, with the async_wrapper processes of
  its job when it runs as one (a venv build or a warm-up outlives its controller), and takes itself off when it
  ends (:func:`join_run`, plugins/module_utils/node/run_lock.py). A module that finds the lock no longer its run's
  (taken over, released) changes nothing (``locked``). The run's own release keeps the lock while one of them
  still lives (``kept_for_worker``).
* **One taker.** Every change (take, take over, release) runs under ``flock`` of the lock directory, so two runs
  on the node never interleave. A takeover also renames the stale file to a unique name first and checks that
  what it moved is the very file it read (same inode and bytes); if not, it puts that file back without
  replacing anything and fails as ``locked``. The stale file stays aside as ``<lock>.stale.<time>``.
* **Release** removes the lock only when it is the caller's run's (see "One run"); another run's lock is left
  alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shlex
import socket
import stat
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock_record import (
    DEFAULT_TTL,
    MAX_LOCK_BYTES,
    MAX_PID,
    MAX_WORKERS,
    LockError,
    check_texts,
    check_ttl,
    describe_holder,
    described,
    dir_problem,
    file_kind,
    joined,
    left,
    live_workers,
    lock_path,
    parse_lock,
    plan_lock,
    same_run,
    shown,
    stale_reason,
    what_of,
    why_held,
)

GUARD_TIMEOUT = 5.0  # seconds to wait for another run's change of the lock directory (a few ms each)
GUARD_POLL = 0.02


# -- the lock directory and its files ------------------------------------------------------------------------
def unsafe(message, path, hint=None):
    return LockError(message, kind="unsafe", hint=hint, details={"path": path})


def open_lock_dir(lock_dir, *, create):
    """A file descriptor of the checked lock directory (see the rules), or None when it is missing and not
    ``create``. Raises LockError(kind="unsafe") for a directory that must not be used.
    """
    hint = (
        f"remove it (`rm -rf {shlex.quote(lock_dir)}` as root on this node, if no run uses it) or fix it "
        f"(`chown root:root` and `chmod 755`), or set another lock directory"
    )
    try:
        os.lstat(lock_dir)
    except FileNotFoundError:
        if not create:
            return None
        try:
            os.makedirs(os.path.dirname(lock_dir.rstrip("/")) or "/", mode=0o755, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(lock_dir, 0o755)
        except OSError as error:
            raise LockError(
                f"cannot create the lock directory {lock_dir}: {error.strerror}",
                kind="failed",
                details={"path": lock_dir},
            ) from None
    try:
        fd = os.open(lock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        info = os.lstat(lock_dir) if os.path.lexists(lock_dir) else None
        found = (
            dir_problem(info, os.geteuid()) if info is not None else None
        ) or f"cannot be opened ({error.strerror})"
        raise unsafe(
            f"the lock directory {lock_dir} {found}: it must be a directory only root can write", lock_dir, hint
        ) from None
    problem = dir_problem(os.fstat(fd), os.geteuid())
    if problem:
        os.close(fd)
        raise unsafe(
            f"the lock directory {lock_dir} {problem}: it must be a directory only root can write", lock_dir, hint
        )
    return fd


def read_entry(dir_fd, name, path):
    """``(holder, identity)`` of the lock file ``name`` in the directory ``dir_fd``; ``(None, None)`` when there
    is none. ``identity`` (device, inode, bytes) tells later whether a file is still the one read here.

    Opened with O_NOFOLLOW|O_NONBLOCK and checked to be a regular file before it is read, so a symlink, a FIFO or a
    directory at that name is a clear LockError(kind="unsafe"), never a hang.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, None
    except OSError as error:
        found = "a symbolic link" if error.errno == errno.ELOOP else f"a file that cannot be opened ({error.strerror})"
        raise unsafe(f"{path} is {found}, not a lock file; remove it as root on this node", path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise unsafe(f"{path} is {file_kind(info.st_mode)}, not a lock file; remove it as root on this node", path)
        raw = os.read(fd, MAX_LOCK_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_LOCK_BYTES:
        holder = parse_lock(b"", info.st_mtime)
        holder["problem"] = f"more than {MAX_LOCK_BYTES} bytes"
    else:
        holder = parse_lock(raw, info.st_mtime)
    return holder, (info.st_dev, info.st_ino, raw)


def create_entry(dir_fd, name, content):
    """Create the lock file ``name`` with ``content`` in one step (hard link of a new temp file); False when one
    exists. The temp file is created O_CREAT|O_EXCL|O_NOFOLLOW under a random name: never a file someone made.
    """
    temp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    except FileExistsError:
        # Nobody else can write in a checked lock directory; a file under a fresh random name means someone can.
        raise LockError(
            f"the temporary lock file {temp} already exists in the lock directory; something else writes there",
            kind="unsafe",
            details={"path": temp},
        ) from None
    try:
        try:
            os.write(fd, json.dumps(content).encode())
        finally:
            os.close(fd)
        os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        return False
    finally:
        os.unlink(temp, dir_fd=dir_fd)
    return True


@contextlib.contextmanager
def guard(dir_fd, lock_dir, clock=time.monotonic, sleep=time.sleep):
    """Hold ``flock`` of the lock directory while the lock changes, so two runs never interleave (see the rules)."""
    deadline = clock() + GUARD_TIMEOUT
    while True:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if clock() >= deadline:
                raise LockError(
                    f"another run has been changing a lock in {lock_dir} for more than {GUARD_TIMEOUT:g} s (flock "
                    f"of the directory held); try again, and look for a hung recover run on this node",
                    kind="busy",
                    details={"path": lock_dir},
                ) from None
            sleep(GUARD_POLL)
    try:
        yield
    finally:
        fcntl.flock(dir_fd, fcntl.LOCK_UN)


def take_over(dir_fd, name, identity, now):
    """Move the stale lock ``name`` aside, but only the very file read (``identity``); the aside name, or None when
    the file is no longer the one read (then it is back in place, or kept aside when a new lock took its name).
    """
    aside = f"{name}.stale.{int(now)}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        fd = os.open(aside, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            info = os.fstat(fd)
            moved = (info.st_dev, info.st_ino, os.read(fd, MAX_LOCK_BYTES + 1))
        finally:
            os.close(fd)
    except OSError:
        moved = None
    if moved == identity:
        return aside
    # Another run's lock, not the stale one: put it back, never over a lock that appeared meanwhile.
    with contextlib.suppress(OSError):
        os.link(aside, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        os.unlink(aside, dir_fd=dir_fd)
    return None


def keep_aside(dir_fd, aside, name, now):
    """Give the stale file its plain name ``<lock>.stale.<time>`` unless one exists; keep the unique one then."""
    with contextlib.suppress(OSError):
        os.link(aside, f"{name}.stale.{int(now)}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        os.unlink(aside, dir_fd=dir_fd)


def read_lock(path):
    """The lock's content, None when there is none; an unreadable lock counts as held by an unknown run."""
    dir_fd = open_lock_dir(os.path.dirname(path) or ".", create=False)
    if dir_fd is None:
        return None
    try:
        return read_entry(dir_fd, os.path.basename(path), path)[0]
    finally:
        os.close(dir_fd)


def create_lock(path, content):
    """Create the lock file with its content in one step (hard link of a temp file); False when one exists.

    A reader never sees a half-written lock: the name appears only once the content is complete.
    """
    dir_fd = open_lock_dir(os.path.dirname(path) or ".", create=True)
    try:
        return create_entry(dir_fd, os.path.basename(path), content)
    finally:
        os.close(dir_fd)


def pid_exists(pid):
    """Whether a process ``pid`` exists on this machine (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid, proc_root="/proc"):
    """Start time of ``pid`` (clock ticks after boot, field 22 of /proc/<pid>/stat), or None when it is gone."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as handle:
            text = handle.read().decode(errors="replace")
        return int(text.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def module_alive(pid, start):
    """Whether process ``pid`` of this node, not this one, runs with start time ``start`` (a reused pid has
    another); this very process wrote no other run's lock."""
    return pid != os.getpid() and process_start(pid) == start


def change_lock(
    state,
    *,
    lock_dir,
    vmid,
    run_id,
    owner="unknown",
    ttl=DEFAULT_TTL,
    check_mode=False,
    warn=None,
    controller=None,
    controller_pid=None,
):
    """Take (``present``) or release (``absent``) the lock of ``run_id``; return ``{changed, path, holder, action}``.

    Raises LockError when another run holds it (``locked``) or the lock cannot be used safely (``unsafe``,
    ``busy``, ``invalid``). In check mode nothing is written and ``changed`` says whether the lock would be taken
    or released. ``controller`` (the controller's host name) and ``controller_pid`` (the pid of the run on it,
    e.g. ansible-playbook's) are recorded, so that a run on the same machine can tell a lock of a dead run.
    """
    check_ttl(ttl)
    check_texts(run_id=run_id, owner=owner, controller=controller)
    if controller_pid is not None and not (
        isinstance(controller_pid, int) and not isinstance(controller_pid, bool) and 0 < controller_pid <= MAX_PID
    ):
        raise LockError(f"controller_pid must be a process id, got {shown(controller_pid)}", kind="invalid")
    path = lock_path(lock_dir, vmid)
    name = os.path.basename(path)
    dir_fd = open_lock_dir(lock_dir, create=state == "present" and not check_mode)
    try:
        with guard(dir_fd, lock_dir) if dir_fd is not None and not check_mode else contextlib.nullcontext():
            return change_in_dir(
                state,
                dir_fd,
                path,
                name,
                vmid=vmid,
                run_id=run_id,
                owner=owner,
                ttl=ttl,
                check_mode=check_mode,
                warn=warn,
                extra={
                    k: v for k, v in (("controller", controller), ("controller_pid", controller_pid)) if v is not None
                },
            )
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def change_in_dir(state, dir_fd, path, name, *, vmid, run_id, owner, ttl, check_mode, warn, extra):
    """change_lock's work once the directory is checked (and, unless check mode, guarded)."""
    what = what_of(vmid)
    now = time.time()
    current, identity = read_entry(dir_fd, name, path) if dir_fd is not None else (None, None)
    hostname = socket.gethostname()
    who = {"owner": owner, **extra}
    action, changed = plan_lock(
        state, current, run_id, now, ttl, hostname=hostname, pid_exists=pid_exists, who=who, module_alive=module_alive
    )
    if action == "locked":
        shared = (
            " under this run's own run id (a run id given twice: each run needs its own)"
            if current.get("run_id") == run_id
            else ""
        )
        raise LockError(
            f"{what} is locked by {describe_holder(current, now)}: another recover run is working on it{shared} "
            f"({why_held(current, now, ttl, hostname, pid_exists, module_alive=module_alive)}); wait for it to "
            f"finish or, if you know it is gone, remove {path} on this node",
            kind="locked",
            details={"path": path, "holder": current, "action": action},
        )
    pid = os.getpid()
    mine = {"run_id": run_id, "owner": owner, "created": now, "ttl": ttl, "pid": pid, **extra}
    start = process_start(pid)
    if start is not None:
        mine["pid_start"] = start
    if action == "kept_for_worker" and warn is not None and not check_mode:
        warn(
            f"the run lock of {what} is kept: {described(live_workers(current, module_alive))} of this run still "
            f"work on it; the lock goes with them, and a next run waits for them"
        )
    if check_mode or not changed:
        holder = mine if (state == "present" and current is None) else current
        kept = state == "present" or action == "kept_for_worker"
        return {"changed": changed, "path": path, "holder": holder if kept else None, "action": action}
    aside = None
    if action == "taken_over":
        aside = take_over(dir_fd, name, identity, now)
        if aside is None:
            raise taken_meanwhile(what, dir_fd, name, path, now)
        if warn is not None:
            reason = stale_reason(current, now, ttl, hostname=hostname, pid_exists=pid_exists)
            warn(f"taking over the stale lock of {describe_holder(current, now)} on {what}: {reason}")
    if action in ("taken", "taken_over"):
        if not create_entry(dir_fd, name, mine):
            raise taken_meanwhile(what, dir_fd, name, path, now)
        if aside is not None:
            keep_aside(dir_fd, aside, name, now)
    if action == "released":
        os.unlink(name, dir_fd=dir_fd)
        mine = None
    return {"changed": True, "path": path, "holder": mine, "action": action}


def taken_meanwhile(what, dir_fd, name, path, now):
    """The error for a lock another run took between this run's read and its write."""
    try:
        holder = read_entry(dir_fd, name, path)[0] or {}
    except LockError:
        holder = {}
    return LockError(
        f"{what} was locked by {describe_holder(holder, now)} a moment ago; another recover run started at the "
        f"same time",
        kind="locked",
        details={"path": path, "action": "locked", "holder": holder or None},
    )


# -- the processes that work for a run (an acting module, its async job) ---------------------------------------
def join_run(lock_dir, vmid, run, processes):
    """Add ``processes`` (``[{pid, pid_start, what}]``: an acting module and its async job) to the lock of ``run``
    (IDENTITY's keys) before they change the target: while one of them lives, no other run takes the lock over
    (live_workers). Raises LockError ``locked`` when the lock is not this run's any more (another run took it over
    after this run's controller went, or it was released): the module must then change nothing."""
    return change_workers(lock_dir, vmid, run, processes, join=True)


def leave_run(lock_dir, vmid, run, processes):
    """Take ``processes`` off the lock of ``run`` once they are done; nothing when the lock is not this run's."""
    return change_workers(lock_dir, vmid, run, processes, join=False)


def change_workers(lock_dir, vmid, run, processes, *, join):
    path = lock_path(lock_dir, vmid)
    name = os.path.basename(path)
    dir_fd = open_lock_dir(lock_dir, create=False)
    try:
        with guard(dir_fd, lock_dir) if dir_fd is not None else contextlib.nullcontext():
            current = read_entry(dir_fd, name, path)[0] if dir_fd is not None else None
            if current is None or not same_run(current, run):
                if not join:
                    return None
                now = time.time()
                found = "it is gone" if current is None else f"it is held by {describe_holder(current, now)}"
                raise LockError(
                    f"{what_of(vmid)}: the run lock {path} is no longer this run's ({found}): another recover run "
                    f"took it over, or it was released, so this step changes nothing; run recover.yml again",
                    kind="locked",
                    details={"path": path, "holder": current, "action": "lost"},
                )
            updated = joined(current, processes, module_alive) if join else left(current, processes)
            if updated is None:
                raise LockError(
                    f"{what_of(vmid)}: the run lock {path} already names {MAX_WORKERS} processes of this run that "
                    f"still work on it; wait for them to end",
                    kind="busy",
                    details={"path": path, "holder": current},
                )
            replace_entry(dir_fd, name, updated)
            return updated
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def replace_entry(dir_fd, name, content):
    """Write the lock ``name`` anew with ``content``: a new file renamed over it (the caller holds the guard), so a
    reader sees the old record or the new one, whole."""
    temp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        try:
            os.write(fd, json.dumps(content).encode())
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
