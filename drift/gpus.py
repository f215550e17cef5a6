# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPUs of a target as the drift check read them: the report's ``gpus`` (preflight's nvidia-smi query of the
fact pass, with the memory the GPU step read after ending holders) made into the summary's ``gpus``.

nvidia-smi ran inside the target, so what it printed is untrusted even after the node's parser checked it: each
value is kept only in the shape a label or a sample can take (an index, a GPU UUID, a model name of plain
characters, a count, a flag), anything else is dropped (a sample is left out, never written as 0). The recovery
action becomes NVML's code (``nvmlDeviceGpuRecoveryAction_t``, DCGM's ``DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION``).
"""

from __future__ import annotations

import re

# At most this many GPUs of one target are kept (an H200 host has 8; a CT passes some of them through).
MAX_GPUS = 64
GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F-]{1,64}$")
# A model name as a label: plain characters only (nvidia-smi prints "NVIDIA H200"); anything else is "unknown".
MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._()/+-]{0,79}$")
# nvidia-smi's gpu_recovery_action text -> NVML's nvmlDeviceGpuRecoveryAction_t (0 none, 1 reset, 2 reboot,
# 3 drain P2P, 4 drain and reset); a text this list lacks is -1 (an action all the same: not "none").
RECOVERY_ACTIONS = {"None": 0, "Reset": 1, "Reboot": 2, "Drain P2P": 3, "Drain and Reset": 4}
UNKNOWN_ACTION = -1
# The report's keys kept per GPU, as counts (int) or flags (bool).
COUNTS = (
    "memory_used_mib",
    "memory_total_mib",
    "ecc_uncorrected_volatile",
    "ecc_uncorrected_aggregate",
    "pcie_link_gen",
    "pcie_link_gen_max",
    "pcie_link_width",
    "pcie_link_width_max",
)
FLAGS = ("remapped_rows_pending", "remapped_rows_failure", "retired_pages_pending", "persistence_mode")
MAX_XIDS = 32  # distinct Xid codes kept per GPU (node/xid.py keeps as many)
LARGEST = 2**53  # a count beyond any GPU's (and beyond a float's exact integers) is not one


def count(value):
    """``3`` -> ``3``; ``True``, ``-1``, ``"3"``, ``2**60`` -> None: only a plain count is kept."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < LARGEST else None


def flag(value):
    return value if isinstance(value, bool) else None


def recovery_code(value):
    """``"None"`` -> ``0``, ``"Reboot"`` -> ``2``, ``"Drain and Reset"`` -> ``4``, another text -> ``-1``,
    no value (the driver does not know the field, ``[N/A]``) -> None."""
    if not isinstance(value, str) or not value.strip():
        return None
    return RECOVERY_ACTIONS.get(value.strip(), UNKNOWN_ACTION)


def xid_events(value):
    """``[{xid, count, last_timestamp}]`` as the node read them (a code, a count, a time or None); None when the
    node's kernel log was not read; anything else is dropped."""
    if not isinstance(value, list):
        return None
    events = []
    for event in value[:MAX_XIDS]:
        if not isinstance(event, dict):
            continue
        code, seen, last = count(event.get("xid")), count(event.get("count")), event.get("last_timestamp")
        if code is None or seen is None:
            continue
        last = last if isinstance(last, (int, float)) and not isinstance(last, bool) and 0 < last < LARGEST else None
        events.append({"xid": code, "count": seen, "last_timestamp": last})
    return events


def gpu_entry(gpu):
    """One GPU of a report as the summary keeps it, or None when it has no index and GPU UUID to be named by."""
    if not isinstance(gpu, dict):
        return None
    index, uuid, name = count(gpu.get("index")), gpu.get("uuid"), gpu.get("name")
    if index is None or not isinstance(uuid, str) or not GPU_UUID.match(uuid):
        return None
    entry = {"index": index, "uuid": uuid, "name": name if isinstance(name, str) and MODEL.match(name) else "unknown"}
    entry.update({key: count(gpu.get(key)) for key in COUNTS})
    entry.update({key: flag(gpu.get(key)) for key in FLAGS})
    entry["recovery_action"] = recovery_code(gpu.get("recovery_action"))
    entry["xid_events"] = xid_events(gpu.get("xid_events"))
    return entry


def report_gpus(report):
    """``[{index, uuid, name, memory_used_mib, ..., recovery_action}]`` of a report's GPUs, by index; ``[]`` when
    it read none (the fact pass did not run, or nvidia-smi failed)."""
    gpus = (report or {}).get("gpus")
    entries = [entry for entry in map(gpu_entry, gpus if isinstance(gpus, list) else []) if entry]
    unique = {entry["uuid"]: entry for entry in entries}  # one entry per GPU, whatever the CT printed
    return sorted(unique.values(), key=lambda entry: (entry["index"], entry["uuid"]))[:MAX_GPUS]
