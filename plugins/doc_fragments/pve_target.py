# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Options every module that reaches a target through plugins/module_utils/pve_target.py shares."""


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
