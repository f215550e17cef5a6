#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_info
short_description: Facts of the GPUs a Proxmox CT or bare host sees, and of the processes holding them
description:
  - Queries C(nvidia-smi) inside the target (one C(pct exec) for a CT) for every GPU it sees. The facts are
    index, name, UUID, PCI bus id, driver, memory total/used/free, utilization and temperature. Health facts
    are the uncorrected volatile ECC errors, pending retired pages, pending or failed row remaps, the recovery
    action the driver recommends, PCIe link generation and width (current and max), persistence and compute mode.
  - Lists the compute processes NVML knows on those GPUs. NVML reports HOST pids, so they are read on the node
    and mapped by UUID to the target's GPUs. For each, C(/proc/<pid>/cgroup) on the node names its owner
    (C(ct:<vmid>) for a Proxmox CT, C(host) for the node itself) and C(NSpid) gives its pid inside the CT.
  - Read-only; never changes anything.
version_added: "0.1.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - pve_gpu.recover.pve_target
  - pve_gpu.recover.pve_target.info_module
options:
  processes:
    description:
      - Also list the compute processes on the target's GPUs (one more C(nvidia-smi) call on the node).
    type: bool
    default: true
requirements:
  - C(nvidia-smi) on the node and inside the target (the NVIDIA userspace driver).
seealso:
  - module: pve_gpu.recover.target_facts
"""

EXAMPLES = r"""
- name: Read the GPU facts of CT 200 from its node
  pve_gpu.recover.gpu_info:
    vmid: 200
  delegate_to: pve1
  register: gpus

- name: Show them
  ansible.builtin.debug:
    var: gpus.summary

- name: Read the GPU facts of a bare GPU host, without processes
  pve_gpu.recover.gpu_info:
    processes: false
"""

RETURN = r"""
gpus:
  description: One dict per GPU the target sees, in the target's index order.
  returned: always
  type: list
  elements: dict
  sample:
    - index: 0
      name: NVIDIA H200
      uuid: GPU-bf580366-c11c-e730-752a-e9ca8716b7fa
      bus_id: "00000000:00:06.0"
      driver_version: "580.159.04"
      memory_total_mib: 143771
      memory_used_mib: 0
      memory_free_mib: 143156
      utilization_gpu_pct: 0
      temperature_c: 36
      persistence_mode: true
      compute_mode: Default
      ecc_uncorrected_volatile: 0
      clocks_event_reasons_active: "0x0000000000000001"
      pcie_link_gen: 5
      pcie_link_gen_max: 5
      pcie_link_width: 16
      pcie_link_width_max: 16
      power_draw_w: 123.99
      mig_mode: Disabled
      retired_pages_pending: null
      remapped_rows_pending: false
      remapped_rows_failure: false
      recovery_action: None
processes:
  description: Compute processes on the target's GPUs, one entry per process and GPU.
  returned: always
  type: list
  elements: dict
  sample:
    - pid: 516
      ns_pid: 41
      process_name: python3
      comm: python3
      state: S
      owner: "ct:200"
      used_memory_mib: 20998
      gpu_uuid: GPU-bf580366-c11c-e730-752a-e9ca8716b7fa
      gpu_index: 0
gpu_count:
  description: Number of GPUs the target sees.
  returned: always
  type: int
  sample: 8
driver_version:
  description: Driver version NVML reports in the target.
  returned: always
  type: str
  sample: "580.159.04"
memory_used_mib:
  description: Sum of memory.used over the target's GPUs.
  returned: always
  type: int
  sample: 0
summary:
  description: One line per GPU and per process, for people.
  returned: always
  type: list
  elements: str
  sample: ["GPU 0 NVIDIA H200 GPU-bf580366-c11c-e730-752a-e9ca8716b7fa 00000000:00:06.0: 0/143771 MiB, 36 C, ECC 0, PCIe 5x16, persistence on"]
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
lost_bus_ids:
  description: On failure because a GPU fell off the bus, the PCI bus ids nvidia-smi could not reach.
  returned: failure
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import NvidiaSmi, NvidiaSmiError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import read_process
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import (
    TARGET_ARGUMENT_SPEC,
    Target,
    TargetError,
)


def map_processes(apps, gpus, processes):
    """Keep the NVML processes on the target's GPUs and describe each from the node's /proc.

    ``apps`` are parsed ``--query-compute-apps`` rows (host pids), ``gpus`` the target's GPU facts, ``processes``
    a dict host pid -> ProcessInfo or None (gone, or not readable). GPUs are matched by UUID.
    """
    index_of = {g["uuid"]: g["index"] for g in gpus}
    mapped = []
    for app in apps:
        if app["gpu_uuid"] not in index_of:
            continue
        info = processes.get(app["pid"])
        mapped.append(
            {
                "pid": app["pid"],
                "ns_pid": info.ns_pid if info else None,
                "process_name": app["process_name"],
                "comm": info.comm if info else None,
                "state": info.state if info else None,
                "owner": info.owner if info else "unknown",
                "used_memory_mib": app["used_memory_mib"],
                "gpu_uuid": app["gpu_uuid"],
                "gpu_index": index_of[app["gpu_uuid"]],
            }
        )
    return sorted(mapped, key=lambda p: (p["gpu_index"], p["pid"]))


def summarize(gpus, processes):
    """Lines a person reads at a glance: one per GPU, then one per process."""
    lines = []
    for g in gpus:
        health = [f"ECC {g['ecc_uncorrected_volatile']}" if g["ecc_uncorrected_volatile"] is not None else "ECC n/a"]
        if g["remapped_rows_pending"]:
            health.append("row remap PENDING (reset needed)")
        if g["remapped_rows_failure"]:
            health.append("row remap FAILED")
        if g["recovery_action"] not in (None, "None"):
            health.append(f"recovery action {g['recovery_action']}")
        link = f"PCIe {g['pcie_link_gen']}x{g['pcie_link_width']}"
        if (g["pcie_link_gen_max"], g["pcie_link_width_max"]) not in (
            (None, None),
            (g["pcie_link_gen"], g["pcie_link_width"]),
        ):
            link += f" (max {g['pcie_link_gen_max']}x{g['pcie_link_width_max']})"
        lines.append(
            f"GPU {g['index']} {g['name']} {g['uuid']} {g['bus_id']}: {g['memory_used_mib']}/"
            f"{g['memory_total_mib']} MiB, {g['temperature_c']} C, {', '.join(health)}, {link}, "
            f"persistence {'on' if g['persistence_mode'] else 'off'}"
        )
    for p in processes:
        inside = f" (pid {p['ns_pid']} inside)" if p["ns_pid"] not in (None, p["pid"]) else ""
        lines.append(
            f"process {p['pid']}{inside} {p['process_name']} of {p['owner']} holds {p['used_memory_mib']} MiB "
            f"on GPU {p['gpu_index']}"
        )
    return lines


def main():
    module = AnsibleModule(
        argument_spec={
            **TARGET_ARGUMENT_SPEC,
            "processes": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    timeout = module.params["timeout"]
    try:
        target = Target.from_params(module.params)
    except TargetError as error:
        module.fail_json(**error.to_result())
    smi = NvidiaSmi(target.run, timeout=timeout)
    node_smi = NvidiaSmi(target.run_on_node, timeout=timeout)
    try:
        where = f"{target.label}: "
        gpus = smi.gpus()
        processes = []
        if module.params["processes"]:
            where = f"node {target.node} (listing GPU processes): " if target.is_container else where
            apps = node_smi.compute_apps()
            processes = map_processes(apps, gpus, {a["pid"]: read_process(a["pid"]) for a in apps})
    except TargetError as error:
        module.fail_json(**error.to_result())
    except NvidiaSmiError as error:
        module.fail_json(**error.to_result(prefix=where))
    for notice in smi.notices + node_smi.notices:
        module.warn(f"{target.label}: {notice['message']}")
    module.exit_json(
        changed=False,
        gpus=gpus,
        processes=processes,
        gpu_count=len(gpus),
        driver_version=gpus[0]["driver_version"] if gpus else None,
        memory_used_mib=sum(g["memory_used_mib"] or 0 for g in gpus),
        summary=summarize(gpus, processes),
    )


if __name__ == "__main__":
    main()
