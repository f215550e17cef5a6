# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Options every module that reaches a target through plugins/module_utils/node/target.py shares."""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  vmid:
    description:
      - Proxmox VE CT id of the target. Commands run inside it with C(pct exec <vmid> --keep-env 0 -- ...) on the
        node the task runs on (delegate the task to the CT's Proxmox node).
      - Omit for a bare GPU host; commands then run on the host itself.
      - An integer from 100 to 999999999; anything else is rejected before any command is built.
    type: int
  node_name:
    description:
      - How messages name the node (C(CT 200 on <node_name>)); the roles pass the node's inventory name.
      - Defaults to the node's hostname.
    type: str
  timeout:
    description:
      - Seconds one command may run in the target before it is killed (inside the CT too, by C(timeout -k 5)).
    type: int
    default: 60
notes:
  - Run the task on the Proxmox node (C(delegate_to) its inventory name); the CT needs no Python for C(pct exec)
    itself, only for the commands a module runs there.
  - GPUs are matched by UUID between the node and a CT; indexes inside a CT may differ from the node's.
"""

    # The option of the modules that run probe parts or scripts in the target's own Python: one meaning everywhere.
    PYTHON = r"""
options:
  python:
    description:
      - The Python interpreter inside the CT that runs this module's probe parts and scripts (a name on the PATH of
        a non-login root shell, or a path; Python 3.9+). It is the fact pass's interpreter too - the roles pass
        C(preflight_python) to every module.
      - Never a venv's python - the training venv's own interpreter is the venv's business (its I(path)).
      - Ignored for a bare host, where the parts and scripts run in this module's own process.
    type: str
    default: python3
"""

    # The option of the acting modules (plugins/module_utils/node/run_lock.py): one meaning everywhere.
    RUN_LOCK = r"""
options:
  run_lock:
    description:
      - The run lock this module works under - the fact pass's C(ansible_facts.pve_gpu_recover.lock) with the run's
        C(run_id); each step's role passes it when the fact pass ran.
      - Before it changes the target, the module adds its own process (pid and start time) to that lock's record on
        the node, and, run as an async job, the async_wrapper processes of its job; it takes them off when it ends.
        While one of them lives, no other run takes the lock over, whatever its ttl (an async build outlives its
        controller). A lock that is no longer this run's (taken over after the controller went, or released) fails
        the module before it changes anything (C(error=locked)).
      - Unset, or a lock the fact pass did not keep (C(held) false), nothing is recorded (the module run alone).
    type: dict
"""

    # Attributes of the read-only *_info modules.
    INFO_MODULE = r"""
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
  platform:
    platforms: posix
"""
