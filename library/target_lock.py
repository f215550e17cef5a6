#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: target_lock
short_description: Take or release the run lock of a GPU target so two recovery runs never overlap
description:
  - A lock file per target on the node (C(<lock_dir>/ct-<vmid>.lock), or C(host.lock) for a bare host), created
    atomically (C(O_CREAT|O_EXCL)) with the run id, owner and start time in it.
  - I(state=present) takes the lock for I(run_id); the same run taking it again is a no-op. Another run's lock
    fails the task with who holds it, since when, and what to do. A lock older than I(ttl) seconds is taken over
    with a warning (its run died without releasing it); the stale file is renamed aside, not deleted.
  - I(state=absent) releases the lock of I(run_id); a lock of another run is left alone.
  - The lock lives on the node in C(/run/lock), so a node reboot clears it.
version_added: "0.1.0"
author: pve-gpu-recover contributors
extends_documentation_fragment:
  - action_common_attributes
attributes:
  check_mode:
    support: full
    details: In check mode nothing is written; C(changed) says whether the lock would be taken or released.
  diff_mode:
    support: none
  platform:
    platforms: posix
options:
  vmid:
    description:
      - Proxmox VE CT id of the target; omit for a bare host.
    type: int
  state:
    description:
      - C(present) takes the lock, C(absent) releases it.
    type: str
    choices: [present, absent]
    default: present
  run_id:
    description:
      - Identifies this run (recover.yml makes one per run); the lock belongs to it.
    type: str
    required: true
  owner:
    description:
      - Who runs it, shown to anyone who finds the lock held (e.g. C(alice@controller)).
    type: str
    default: unknown
  ttl:
    description:
      - Seconds after which a lock is considered stale (its run died) and may be taken over.
    type: int
    default: 7200
  lock_dir:
    description:
      - Directory on the node that holds the lock files.
    type: path
    default: /run/lock/pve-gpu-recover
notes:
  - "recover.yml takes the lock with C(check_mode: false) so a C(--check) drift run never reads a target that a
    real run is changing, and releases it in an C(always:) section so a failed run does not leave it behind."
seealso:
  - module: target_info
"""

EXAMPLES = r"""
- name: Take the run lock of CT 200
  target_lock:
    vmid: 200
    run_id: "{{ recover_run_id }}"
    owner: alice@controller
  delegate_to: pve1

- name: Release it
  target_lock:
    vmid: 200
    run_id: "{{ recover_run_id }}"
    state: absent
  delegate_to: pve1
"""

RETURN = r"""
path:
  description: The lock file.
  returned: always
  type: str
  sample: /run/lock/pve-gpu-recover/ct-200.lock
holder:
  description: Content of the lock after the task (null when released).
  returned: always
  type: dict
  sample: {"run_id": "20261202T105000Z-3f2a1c", "owner": "alice@controller", "created": 1796208600.5, "ttl": 7200}
action:
  description: What was done (C(taken), C(already_held), C(taken_over), C(released), C(not_held), C(held_by_other)).
  returned: always
  type: str
  sample: taken
"""

import json
import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.pve_target import TargetError, validate_vmid


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


def main():
    module = AnsibleModule(
        argument_spec={
            "vmid": {"type": "int"},
            "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
            "run_id": {"type": "str", "required": True},
            "owner": {"type": "str", "default": "unknown"},
            "ttl": {"type": "int", "default": 7200},
            "lock_dir": {"type": "path", "default": "/run/lock/pve-gpu-recover"},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        vmid = validate_vmid(p["vmid"])
    except TargetError as error:
        module.fail_json(**error.to_result())
    if p["ttl"] < 1:
        # ttl 0 would make every lock stale at once: two runs could both take it.
        module.fail_json(msg=f"ttl must be at least 1 second, got {p['ttl']}; fix preflight_lock_ttl")
    path = lock_path(p["lock_dir"], vmid)
    what = f"CT {vmid}" if vmid is not None else "this host"
    now = time.time()
    current = read_lock(path)
    action, changed = plan_lock(p["state"], current, p["run_id"], now, p["ttl"])
    if action == "locked":
        module.fail_json(
            msg=f"{what} is locked by {describe_holder(current, now)}: another recover run is working on it; wait "
            f"for it to finish or, if it died, remove {path} on this node (it expires after "
            f"{current.get('ttl') or p['ttl']} s)",
            path=path,
            holder=current,
            action=action,
        )
    mine = {"run_id": p["run_id"], "owner": p["owner"], "created": now, "ttl": p["ttl"], "pid": os.getpid()}
    if module.check_mode or not changed:
        holder = mine if (p["state"] == "present" and current is None) else current
        module.exit_json(changed=changed, path=path, holder=holder if p["state"] == "present" else None, action=action)
    if action == "taken_over":
        module.warn(f"taking over the stale lock of {describe_holder(current, now)} on {what}")
        os.replace(path, f"{path}.stale.{int(now)}")
    if action in ("taken", "taken_over") and not create_lock(path, mine):
        module.fail_json(
            msg=f"{what} was locked by {describe_holder(read_lock(path) or {}, now)} a moment ago; "
            f"another recover run started at the same time",
            path=path,
            action="locked",
        )
    if action == "released":
        os.unlink(path)
        mine = None
    module.exit_json(changed=True, path=path, holder=mine, action=action)


if __name__ == "__main__":
    main()
