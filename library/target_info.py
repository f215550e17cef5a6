#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: target_info
short_description: Preflight facts of a GPU target (Proxmox CT or bare host) and what is wrong with it
description:
  - Reads, in one C(pct exec) for a CT, everything the recovery needs to be safe to start. The CT exists and
    runs. Its C(/dev/nvidia*) device nodes are there. The NVIDIA driver that NVML reports inside equals the
    kernel module loaded on the node (a mismatch is NVML's "Driver/library version mismatch"). There is enough
    free disk for a new venv beside the old one.
  - Returns the facts and a list of I(problems), one sentence each, that say what was found, what was expected
    and what to do. The module itself fails only when it cannot look at all (CT missing or stopped, no C(pct)).
  - Changes nothing.
version_added: "0.1.0"
author: pve-gpu-recover contributors
extends_documentation_fragment:
  - action_common_attributes
  - pve_target
  - pve_target.info_module
options:
  space_path:
    description:
      - Directory that will hold the training venvs in the target; free space is measured on its filesystem
        (its first existing ancestor when it does not exist yet).
    type: path
    default: /opt
  min_free_gib:
    description:
      - Free GiB needed at I(space_path). A CUDA torch venv takes 6 to 8 GiB and the old venv is kept beside it.
    type: float
    default: 20
  expected_gpu_count:
    description:
      - Number of C(/dev/nvidiaN) GPU device nodes the target must have. Omit to only require at least one.
    type: int
  kernel_version_file:
    description:
      - The NVIDIA kernel module's version file, read on the node and inside the target.
    type: path
    default: /proc/driver/nvidia/version
  library_globs:
    description:
      - Where the NVIDIA userspace library C(libnvidia-ml.so.<version>) is looked for inside the target.
    type: list
    elements: str
    default:
      - /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.*
      - /usr/lib/aarch64-linux-gnu/libnvidia-ml.so.*
      - /usr/lib64/libnvidia-ml.so.*
      - /usr/lib/libnvidia-ml.so.*
  python:
    description:
      - Python interpreter inside the CT that runs the probe (ignored for a bare host).
    type: str
    default: python3
requirements:
  - On the node, C(pct) (for a CT) and coreutils C(timeout).
  - In the target, Python 3.9+ and C(nvidia-smi).
seealso:
  - module: gpu_info
  - module: target_lock
"""

EXAMPLES = r"""
- name: Read the preflight facts of CT 200 from its node
  target_info:
    vmid: 200
    space_path: /opt/venvs
    min_free_gib: 20
    expected_gpu_count: 8
  delegate_to: pve1
  register: preflight

- name: Stop when the target is not fit for recovery
  ansible.builtin.assert:
    that: preflight.problems | length == 0
    fail_msg: "{{ preflight.problems | join('; ') }}"
"""

RETURN = r"""
target:
  description: Which target was probed.
  returned: always
  type: dict
  sample: {"label": "CT 200 on pve1", "vmid": 200, "node": "pve1", "hostname": "ct200"}
node_driver_version:
  description: Version of the NVIDIA kernel module loaded on the node, or null when none is loaded.
  returned: always
  type: str
  sample: "580.159.04"
target_driver_version:
  description: Driver version NVML reports inside the target (null when nvidia-smi fails there).
  returned: always
  type: str
  sample: "580.159.04"
nvml_library_versions:
  description: Versions of the C(libnvidia-ml.so.<version>) files found inside the target.
  returned: always
  type: list
  elements: str
  sample: ["580.159.04"]
devices:
  description: NVIDIA device nodes inside the target.
  returned: always
  type: list
  elements: dict
  sample: [{"path": "/dev/nvidia0", "char": true, "major": 195, "minor": 0, "mode": "0o666"}]
gpu_uuids:
  description: UUIDs of the GPUs nvidia-smi lists inside the target.
  returned: always
  type: list
  elements: str
space:
  description: Free and total bytes of the filesystem holding I(space_path).
  returned: always
  type: dict
  sample: {"path": "/opt/venvs", "existing": "/opt", "free_bytes": 53687091200, "total_bytes": 107374182400}
python_version:
  description: Version of the target's Python that ran the probe.
  returned: always
  type: str
  sample: "3.11.2"
checks:
  description: Each preflight check with its verdict.
  returned: always
  type: list
  elements: dict
  sample: [{"name": "driver", "ok": true, "detail": "NVML in CT 200 on pve1 reports 580.159.04, the node's kernel module"}]
problems:
  description: One sentence per failed check; empty when the target is fit for recovery.
  returned: always
  type: list
  elements: str
  sample: ["CT 200 on pve1 has 3.2 GiB free at /opt (its filesystem at /); a new venv needs 20 GiB: free space there or lower preflight_min_free_gib"]
"""

from ansible.module_utils import pve_probe_preflight
from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_smi import NvidiaSmiError
from ansible.module_utils.pve_preflight import (
    LIBRARY_GLOBS,
    evaluate,
    parse_kernel_driver_version,  # noqa: F401  (tests read the node's version file through it)
    parse_probe,
    probe_payload,
    read_node_driver_version,
)
from ansible.module_utils.pve_target import TARGET_ARGUMENT_SPEC, Target, TargetError


def main():
    module = AnsibleModule(
        argument_spec={
            **TARGET_ARGUMENT_SPEC,
            "space_path": {"type": "path", "default": "/opt"},
            "min_free_gib": {"type": "float", "default": 20},
            "expected_gpu_count": {"type": "int"},
            "kernel_version_file": {"type": "path", "default": "/proc/driver/nvidia/version"},
            "library_globs": {
                "type": "list",
                "elements": "str",
                "default": list(LIBRARY_GLOBS),
            },
            "python": {"type": "str", "default": "python3"},
        },
        supports_check_mode=True,
    )
    params = module.params
    try:
        target = Target.from_params(params)
        answer = target.run_probe(
            pve_probe_preflight, probe_payload(params, params["timeout"]), python=params["python"]
        )
        facts = parse_probe(answer)
    except TargetError as error:
        module.fail_json(**error.to_result())
    except NvidiaSmiError as error:
        module.fail_json(**error.to_result(prefix=f"{target.label}: "))
    node_driver = read_node_driver_version(params["kernel_version_file"])
    checks = evaluate(
        target.label,
        target.node,
        facts,
        container=target.is_container,
        node_driver_version=node_driver,
        min_free_gib=params["min_free_gib"],
        expected_gpu_count=params["expected_gpu_count"],
        space_path=params["space_path"],
    )
    failure = facts.pop("nvidia_smi_failure")
    facts.pop("gpus")
    module.exit_json(
        changed=False,
        target={"label": target.label, "vmid": target.vmid, "node": target.node, "hostname": facts.pop("hostname")},
        node_driver_version=node_driver,
        nvidia_smi_error=failure.to_result() if failure else None,
        checks=checks,
        problems=[c["detail"] for c in checks if not c["ok"]],
        **facts,
    )


if __name__ == "__main__":
    main()
