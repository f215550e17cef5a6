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

import re

from ansible.module_utils import pve_probe_preflight
from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_smi import (
    DRIVER_FIELDS,
    NvidiaSmiError,
    classify_failure,
    parse_gpus,
    parse_kernel_driver_version,
    parse_library_version,
    query_gpu_argv,
)
from ansible.module_utils.pve_target import TARGET_ARGUMENT_SPEC, Target, TargetError

GPU_DEVICE = re.compile(r"^/dev/nvidia(\d+)$")
REQUIRED_CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
DEVICE_GLOBS = ("/dev/nvidia[0-9]*", *REQUIRED_CONTROL_DEVICES)
GIB = 1024**3


def probe_payload(params):
    """What the probe is asked to read inside the target (argv shapes come from module_utils/nvidia_smi)."""
    return {
        "device_globs": list(DEVICE_GLOBS),
        "kernel_version_file": params["kernel_version_file"],
        "library_globs": params["library_globs"],
        "nvidia_smi_argv": query_gpu_argv(DRIVER_FIELDS),
        "space_path": params["space_path"],
        "timeout": params["timeout"],
    }


def parse_probe(answer):
    """Facts from the probe's raw answer: driver versions, GPU uuids, the nvidia-smi failure if any."""
    smi = answer["nvidia_smi"]
    failure = None
    gpus = []
    if smi.get("missing"):
        failure = NvidiaSmiError("nvidia-smi is not installed", kind="missing")
    else:
        failure = classify_failure(smi["rc"], smi["stdout"], smi["stderr"])
        if failure is None:
            try:
                gpus = parse_gpus(smi["stdout"], DRIVER_FIELDS)
            except NvidiaSmiError as error:
                failure = error
    versions = sorted({v for v in map(parse_library_version, answer["nvml_libraries"]) if v})
    return {
        "hostname": answer["hostname"],
        "python_version": answer["python"],
        "devices": answer["devices"],
        "space": answer["space"],
        "nvml_library_versions": versions,
        "target_kernel_version": parse_kernel_driver_version(answer["kernel_version_text"]),
        "target_driver_version": gpus[0]["driver_version"] if gpus else None,
        "gpu_uuids": [g["uuid"] for g in gpus],
        "nvidia_smi_failure": failure,
    }


def evaluate(label, node, facts, *, container, node_driver_version, min_free_gib, expected_gpu_count, space_path):
    """Preflight checks as ``[{name, ok, detail}]``: pure, so every verdict and message is unit tested."""
    checks = []

    def check(name, ok, detail):
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    # 1. The node's kernel module: what everything else is compared with.
    node = f"node {node}" if container else f"host {node}"
    check(
        "node_driver",
        node_driver_version,
        f"{node} runs NVIDIA kernel module {node_driver_version}"
        if node_driver_version
        else f"{node} has no NVIDIA kernel module loaded (its /proc/driver/nvidia/version is missing): load it "
        f"with `modprobe nvidia`, or reboot it after a driver update",
    )
    # 2. Device nodes: GPUs passed through, plus the control and UVM devices CUDA opens.
    devices = {d["path"]: d for d in facts["devices"]}
    gpu_nodes = sorted(int(m.group(1)) for m in map(GPU_DEVICE.match, devices) if m)
    missing = [p for p in REQUIRED_CONTROL_DEVICES if p not in devices]
    not_char = sorted(p for p, d in devices.items() if not d["char"])
    want = f"{expected_gpu_count} GPU device nodes" if expected_gpu_count is not None else "at least one GPU"
    count_ok = len(gpu_nodes) == expected_gpu_count if expected_gpu_count is not None else bool(gpu_nodes)
    found = [", ".join(f"/dev/nvidia{n}" for n in gpu_nodes) or "no /dev/nvidiaN"]
    if missing:
        found.append(f"no {', '.join(missing)}")
    if not_char:
        found.append(f"{', '.join(not_char)} not character devices")
    if count_ok and not missing and not not_char:
        check("devices", True, f"{label} has {found[0]} and {', '.join(REQUIRED_CONTROL_DEVICES)}")
    else:
        fix = (
            "pass the GPUs through in /etc/pve/lxc/<vmid>.conf (lxc.cgroup2.devices.allow: c 195:* rwm, plus "
            "one lxc.mount.entry per /dev/nvidia* node) and restart the CT"
            if container
            else "load the driver (`modprobe nvidia nvidia-uvm`; `nvidia-modprobe -u -c=0` creates the nodes)"
        )
        check(
            "devices",
            False,
            f"{label} has {'; '.join(found)}; expected {want} and {', '.join(REQUIRED_CONTROL_DEVICES)}: {fix}",
        )
    # 3. The driver NVML reports inside must be the node's kernel module.
    failure = facts["nvidia_smi_failure"]
    libraries = facts["nvml_library_versions"]
    if failure is not None and failure.kind == "driver_mismatch":
        library = ", ".join(libraries) or "an unknown version"
        check(
            "driver",
            False,
            f"{label}: NVML says Driver/library version mismatch: the NVIDIA userspace library inside is "
            f"{library}, the node's kernel module is {node_driver_version or 'not loaded'}; install driver "
            f"{node_driver_version or '<node version>'} in the target without its kernel module "
            f"(NVIDIA-Linux-x86_64-{node_driver_version or '<version>'}.run --no-kernel-module), or reboot the "
            f"node if its driver was just updated",
        )
    elif failure is not None and failure.kind == "missing":
        check(
            "driver",
            False,
            f"{label}: nvidia-smi is not installed; install the NVIDIA userspace driver "
            f"{node_driver_version or ''} (without kernel module) in the target".replace("  ", " "),
        )
    elif failure is not None:
        check("driver", False, f"{label}: nvidia-smi failed: {failure}" + (f"; {failure.hint}" if failure.hint else ""))
    elif node_driver_version and facts["target_driver_version"] != node_driver_version:
        check(
            "driver",
            False,
            f"{label}: NVML reports driver {facts['target_driver_version']}, the node's kernel module is "
            f"{node_driver_version}; install the node's driver version in the target",
        )
    elif [v for v in libraries if v != node_driver_version] and node_driver_version:
        check(
            "driver",
            False,
            f"{label}: userspace library {', '.join(libraries)} differs from the node's kernel module "
            f"{node_driver_version}; NVML will fail after the next library load: install "
            f"{node_driver_version} in the target",
        )
    else:
        check(
            "driver",
            True,
            f"NVML in {label} reports {facts['target_driver_version']}, the node's kernel module"
            + (f", with {len(facts['gpu_uuids'])} GPUs visible" if facts["gpu_uuids"] else ""),
        )
    # 4. Disk: the new venv is built beside the old one, which is kept.
    space = facts["space"]
    free_gib = space["free_bytes"] / GIB
    check(
        "disk",
        free_gib >= min_free_gib,
        f"{label} has {free_gib:.1f} GiB free at {space_path} (its filesystem at {space['existing']}); "
        + (
            "enough for a new venv"
            if free_gib >= min_free_gib
            else f"a new venv needs {min_free_gib:g} GiB: free space there or lower preflight_min_free_gib"
        ),
    )
    return checks


def read_node_driver_version(path):
    """Version of the NVIDIA kernel module loaded on this node (the module runs there), or None."""
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_kernel_driver_version(handle.read())
    except OSError:
        return None


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
                "default": [
                    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.*",
                    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.*",
                    "/usr/lib64/libnvidia-ml.so.*",
                    "/usr/lib/libnvidia-ml.so.*",
                ],
            },
            "python": {"type": "str", "default": "python3"},
        },
        supports_check_mode=True,
    )
    params = module.params
    try:
        target = Target.from_params(params)
        answer = target.run_probe(pve_probe_preflight, probe_payload(params), python=params["python"])
    except TargetError as error:
        module.fail_json(**error.to_result())
    node_driver = read_node_driver_version(params["kernel_version_file"])
    facts = parse_probe(answer)
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
