# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The run lock of a target, kept on its node: one file per target, so two recovery runs never overlap.

Used by ``target_lock`` and by the fact pass (``target_facts`` takes the lock in the same module execution that
reads the target, and releases it when nothing is left to do). The rules are in roles/preflight/README.md.
"""

from __future__ import annotations

import json
import os
import time

from ansible.module_utils.pve_errors import RecoverError

DEFAULT_LOCK_DIR = "/run/lock/pve-gpu-recover"
DEFAULT_TTL = 7200


class LockError(RecoverError):
    """The lock is held by another run, or cannot be used; ``details`` carry the path and the holder."""


def lock_path(lock_dir, vmid):
    return os.path.join(lock_dir, f"ct-{vmid}.lock" if vmid is not None else "host.lock")


def plan_lock(state, current, run_id, now, ttl=7200):
    """What to do with the lock: ``(action, changed)``; pure, so every branch is unit tested.

    ``current`` is the parsed lock file or None; a lock whose ``created + ttl`` is past ``now`` is stale (its own
    ttl, or ``ttl`` when it has none, as for an unreadable lock file).
    """
    if state == "present":
        if current is None:
            return "taken", True
        if current.get("run_id") == run_id:
            return "already_held", False
        if current.get("created", 0) + (current.get("ttl") or ttl) < now:
            return "taken_over", True
        return "locked", False
    if current is None:
        return "not_held", False
    if current.get("run_id") == run_id:
        return "released", True
    return "held_by_other", False


def describe_holder(holder, now):
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(holder.get("created", 0)))
    minutes = max(0, int((now - holder.get("created", now)) // 60))
    return f"run {holder.get('run_id')} of {holder.get('owner')} (started {started}, {minutes} min ago)"


def read_lock(path):
    """The lock's content, None when there is none; an unreadable lock counts as held by an unknown run."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except ValueError:
        return {
            "run_id": "unknown (unreadable lock file)",
            "owner": "unknown",
            "created": os.stat(path).st_mtime,
            "ttl": None,
        }


def create_lock(path, content):
    """Create the lock file with its content in one step (hard link of a temp file); False when one exists.

    A reader never sees a half-written lock: the name appears only once the content is complete.
    """
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "w", encoding="utf-8") as handle:
        json.dump(content, handle)
    try:
        os.link(temp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temp)
    return True


def what_of(vmid):
    return f"CT {vmid}" if vmid is not None else "this host"


def check_ttl(ttl):
    if ttl < 1:
        # ttl 0 would make every lock stale at once: two runs could both take it.
        raise LockError(f"ttl must be at least 1 second, got {ttl}; fix preflight_lock_ttl", kind="invalid")


def change_lock(state, *, lock_dir, vmid, run_id, owner="unknown", ttl=DEFAULT_TTL, check_mode=False, warn=None):
    """Take (``present``) or release (``absent``) the lock of ``run_id``; return ``{changed, path, holder, action}``.

    Raises LockError when another run holds it. In check mode nothing is written and ``changed`` says whether the
    lock would be taken or released.
    """
    check_ttl(ttl)
    path = lock_path(lock_dir, vmid)
    what = what_of(vmid)
    now = time.time()
    current = read_lock(path)
    action, changed = plan_lock(state, current, run_id, now, ttl)
    if action == "locked":
        raise LockError(
            f"{what} is locked by {describe_holder(current, now)}: another recover run is working on it; wait "
            f"for it to finish or, if it died, remove {path} on this node (it expires after "
            f"{current.get('ttl') or ttl} s)",
            kind="locked",
            details={"path": path, "holder": current, "action": action},
        )
    mine = {"run_id": run_id, "owner": owner, "created": now, "ttl": ttl, "pid": os.getpid()}
    if check_mode or not changed:
        holder = mine if (state == "present" and current is None) else current
        return {"changed": changed, "path": path, "holder": holder if state == "present" else None, "action": action}
    if action == "taken_over":
        if warn is not None:
            warn(f"taking over the stale lock of {describe_holder(current, now)} on {what}")
        os.replace(path, f"{path}.stale.{int(now)}")
    if action in ("taken", "taken_over") and not create_lock(path, mine):
        raise LockError(
            f"{what} was locked by {describe_holder(read_lock(path) or {}, now)} a moment ago; "
            f"another recover run started at the same time",
            kind="locked",
            details={"path": path, "action": "locked"},
        )
    if action == "released":
        os.unlink(path)
        mine = None
    return {"changed": True, "path": path, "holder": mine, "action": action}
