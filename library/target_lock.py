#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: target_lock
short_description: Take or release the run lock of a GPU target so two recovery runs never overlap
description:
  - A lock file per target on the node (C(<lock_dir>/ct-<vmid>.lock), or C(host.lock) for a bare host) with the
    run id, owner, start time and, when given, the controller's host name and ansible-playbook pid in it. It is
    written to a new temporary file (C(O_CREAT|O_EXCL|O_NOFOLLOW)) and then hard-linked to its name (C(link(2))
    fails when the name exists), so no reader ever sees a half-written lock and two runs cannot both create it.
  - The lock directory must be owned by root and writable by nobody else, and nothing in it is followed through a
    symlink; a FIFO, a directory or unreadable content at the lock's name is reported as found, never waited on.
    Every change happens under C(flock) of the directory, so two runs that find the same stale lock cannot both
    take it.
  - A lock is a run's only when I(run_id), I(owner), I(controller) and I(controller_pid) all match the lock
    file; two runs sharing a run id (a ticket id, a retried CI job) are two runs.
  - I(state=present) takes the lock for the run; the same run taking it again is a no-op. Another run's lock
    fails the task with who holds it, since when, from which controller, why it still holds and what to do. A lock
    older than I(ttl) seconds, dated more than a minute in the future, or whose controller is this machine and
    whose pid is gone, is taken over with a warning; the stale file is renamed aside, not deleted. Never while the
    node-side module that wrote it still runs (its pid and start time are in the lock), nor while one of its
    C(workers) does (each acting module of the run and its async job add themselves while they change the target;
    see the option C(run_lock) of the step modules).
  - I(state=absent) releases the lock of the run; a lock of another run is left alone. While a worker of the run
    still lives (an async build whose polling gave up), the lock is kept (C(action=kept_for_worker), a warning).
  - The lock lives on the node in C(/run/lock), so a node reboot clears it.
version_added: "0.1.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
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
  controller:
    description:
      - Host name of the controller that runs the play, recorded in (or compared with) the lock.
      - To release the lock the fact pass took, give what it recorded (C(ansible_facts.pve_gpu_recover.lock.who)).
    type: str
  controller_pid:
    description:
      - Pid of the process that runs the play on the controller, recorded in (or compared with) the lock.
    type: int
notes:
  - "recover.yml takes the lock in its fact pass (M(pve_gpu.recover.target_facts), same rules, same file), which also releases it
    when a run has nothing to do or a step found a problem. Otherwise this module releases it after the last
    step, in the C(always:) section of the steps, whether they succeeded or failed."
seealso:
  - module: pve_gpu.recover.target_facts
"""

EXAMPLES = r"""
- name: Take the run lock of CT 200 for a maintenance run of your own
  pve_gpu.recover.target_lock:
    vmid: 200
    run_id: ops-4711
    owner: alice@controller
  delegate_to: pve1

- name: Release the lock the fact pass kept for this run
  pve_gpu.recover.target_lock:
    vmid: 200
    run_id: "{{ ansible_facts.pve_gpu_recover.run_id }}"
    owner: "{{ ansible_facts.pve_gpu_recover.lock.who.owner }}"
    controller: "{{ ansible_facts.pve_gpu_recover.lock.who.controller | default(omit, true) }}"
    controller_pid: "{{ ansible_facts.pve_gpu_recover.lock.who.controller_pid | default(omit, true) }}"
    state: absent
  delegate_to: pve1
"""

RETURN = r"""
lock_file:
  description: The lock file.
  returned: always
  type: str
  sample: /run/lock/pve-gpu-recover/ct-200.lock
holder:
  description: Content of the lock after the task (null when released).
  returned: always
  type: dict
  sample: {"run_id": "20261202T105000Z-3f2a1c", "owner": "alice@controller", "created": 1796208600.5, "ttl": 7200}
lock:
  description: On failure because another run holds the lock, the lock file (C(path)), its C(holder) and C(action=locked).
  returned: failure
  type: dict
action:
  description: What was done (C(taken), C(already_held), C(taken_over), C(released), C(kept_for_worker), C(not_held),
    C(held_by_other)).
  returned: always
  type: str
  sample: taken
error:
  description: On failure, what kind of failure it was, stable for code (e.g. C(stopped), C(missing), C(timeout), C(locked)).
  returned: failure
  type: str
  sample: stopped
cmd:
  description: On failure of a command, the argv that ran (the C(pct exec) wrapper included).
  returned: failure of a command
  type: list
  elements: str
rc:
  description: On failure of a command, its exit code.
  returned: failure of a command
  type: int
stdout_tail:
  description: On failure of a command, the last 20 lines of its stdout.
  returned: failure of a command that printed
  type: str
stderr_tail:
  description: On failure of a command, the last 20 lines of its stderr.
  returned: failure of a command that printed
  type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock import change_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock_record import DEFAULT_LOCK_DIR, DEFAULT_TTL
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import validate_vmid


def main():
    module = AnsibleModule(
        argument_spec={
            "vmid": {"type": "int"},
            "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
            "run_id": {"type": "str", "required": True},
            "owner": {"type": "str", "default": "unknown"},
            "ttl": {"type": "int", "default": DEFAULT_TTL},
            "lock_dir": {"type": "path", "default": DEFAULT_LOCK_DIR},
            "controller": {"type": "str"},
            "controller_pid": {"type": "int"},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        result = change_lock(
            p["state"],
            lock_dir=p["lock_dir"],
            vmid=validate_vmid(p["vmid"]),
            run_id=p["run_id"],
            owner=p["owner"],
            ttl=p["ttl"],
            check_mode=module.check_mode,
            warn=module.warn,
            controller=p["controller"],
            controller_pid=p["controller_pid"],
        )
    except RecoverError as error:
        # Under one key: a top-level `path` makes Ansible add that file's attributes to the failed result.
        error.details = {"lock": error.details} if error.details else {}
        module.fail_json(**error.to_result())
    # Not `path`: Ansible would add that file's owner, mode and size to the result.
    result["lock_file"] = result.pop("path")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
