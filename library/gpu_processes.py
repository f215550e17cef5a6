#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_processes
short_description: End every process holding a target's GPUs and wait until their memory is really free
description:
  - Finds every process of the target that holds its GPUs. NVML's compute processes on the target's GPUs are
    listed by HOST pid on the node and mapped to the target by C(/proc/<pid>/cgroup) (C(/lxc/<vmid>/)) and
    C(NSpid). Processes of the target holding C(/dev/nvidia*) are found too, by the devices of their open
    files, as C(fuser) does; NVML may not list those.
  - Never touches processes of other containers or of the node itself (for a CT target), nor protected
    daemons (I(protected)). When such a process holds memory on one of the target's GPUs, the GPUs cannot be
    freed, so the module fails before ending anything and names it.
  - Sends SIGTERM, waits up to I(grace) seconds for each process to exit, sends SIGKILL to the survivors, then
    polls C(memory.used) of the target's GPUs until every one is at or below I(memory_threshold_mib). It polls
    every I(poll_interval) seconds and never sleeps a fixed time.
  - Fails naming each process that survives SIGKILL and its state (C(D), uninterruptible sleep, means a GPU
    reset or a node reboot is needed). When no process holds the memory, it says exactly that.
  - Only the GPUs passed to the target count. For a CT they are the ones C(nvidia-smi) lists inside it, one
    C(pct exec); everything else happens on the node.
version_added: "0.1.0"
author: pve-gpu-recover contributors
extends_documentation_fragment:
  - action_common_attributes
  - pve_target
attributes:
  check_mode:
    support: full
    details: Lists what would be ended (I(processes)) and ends nothing; C(changed) is true exactly when a real
      run would end a process.
  diff_mode:
    support: full
    details: Before is one line per process holding the target's GPUs, after is what would be left (nothing).
  platform:
    platforms: posix
options:
  state:
    description:
      - C(absent) ends every process of the target holding its GPUs.
    type: str
    choices: [absent]
    default: absent
  protected:
    description:
      - Processes never ended, matched (shell patterns) against C(/proc/<pid>/comm), argv[0] and its basename.
        comm is cut to 15 characters by the kernel; patterns are compared cut the same way.
    type: list
    elements: str
    default: [nvidia-persistenced, nv-hostengine, nv-fabricmanager, nvidia-fabricmanager, "dcgm*"]
  grace:
    description:
      - Seconds a process gets to exit after SIGTERM before it gets SIGKILL.
    type: float
    default: 10
  kill_timeout:
    description:
      - Seconds a process gets to exit after SIGKILL before it counts as a survivor.
    type: float
    default: 10
  memory_timeout:
    description:
      - Seconds to wait, once every holder has exited, for the memory of the target's GPUs to be released.
    type: float
    default: 30
  memory_threshold_mib:
    description:
      - A GPU counts as free when its C(memory.used) is at or below this many MiB (an idle H200 shows 0 MiB).
    type: int
    default: 0
  poll_interval:
    description:
      - Seconds between two checks while waiting (one C(nvidia-smi --query-gpu) on the node takes about 25 ms).
    type: float
    default: 0.05
requirements:
  - Runs as root on the node (or the bare host); C(nvidia-smi) on the node and inside the CT.
seealso:
  - module: gpu_info
notes:
  - Processes are signalled from the node by host pid, after checking the pid still names the same process
    (its start time), so a pid reused in the meantime is never hit.
"""

EXAMPLES = r"""
- name: End every process holding CT 200's GPUs and wait until their memory is free
  gpu_processes:
    vmid: 200
    state: absent
  delegate_to: pve1
  register: cleanup

- name: Show what was ended and how long the GPUs took to be free
  ansible.builtin.debug:
    msg: "{{ cleanup.killed | length }} processes ended; GPUs free after {{ cleanup.seconds_to_free }} s"

- name: On a bare GPU host, keep a monitoring daemon alive too
  gpu_processes:
    protected: [nvidia-persistenced, nv-hostengine, "dcgm*", my-gpu-exporter]
"""

RETURN = r"""
processes:
  description: Processes of the target that hold its GPUs (those ended, or that check mode would end).
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 516, ns_pid: 41, name: python3, owner: "ct:200", gpus: [0], memory_mib: 20998, found_by: [nvml, device]}
killed:
  description: What each ended process needed (empty in check mode).
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 516, name: python3, signal: SIGTERM, exited_after: 0.21}
    - {pid: 517, name: python3, signal: SIGKILL, exited_after: 10.06}
protected:
  description: Protected processes found holding the target's GPUs without GPU memory; left alone.
  returned: always
  type: list
  elements: dict
seconds_to_free:
  description: Seconds from the first signal until every GPU of the target was verified free (0 when nothing was ended).
  returned: always
  type: float
  sample: 0.38
memory:
  description: Final memory.used of each GPU of the target.
  returned: always
  type: list
  elements: dict
  sample: [{index: 0, uuid: GPU-bf580366-c11c-e730-752a-e9ca8716b7fa, memory_used_mib: 0}]
polls:
  description: Number of nvidia-smi memory queries made while waiting.
  returned: always
  type: int
"""

import contextlib
import os
import signal
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_smi import NvidiaSmi, NvidiaSmiError
from ansible.module_utils.pve_process import (
    describe_state,
    device_holders,
    matches_name,
    owner_label,
    read_process,
    still_there,
)
from ansible.module_utils.pve_target import TARGET_ARGUMENT_SPEC, Target, TargetError


class GpuProcessesError(Exception):
    """One line for fail_json's msg; ``details`` become separate keys of the result."""

    def __init__(self, message, **details):
        super().__init__(message)
        self.details = details


# -- pure logic ----------------------------------------------------------------------------------------------
def collect_holders(apps, gpus, infos, devices):
    """Every process holding the target's GPUs, by host pid.

    ``apps``: NVML compute processes (host pids) of the node; only those on the target's ``gpus`` (dicts with
    index, uuid) count. ``infos``: host pid -> ProcessInfo (None: gone). ``devices``: [(ProcessInfo, [(major,
    minor)])] of the target's processes holding NVIDIA device files. Returns
    ``{pid: {"info", "gpus": {index: MiB}, "found_by": set}}``.
    """
    index_of = {g["uuid"]: g["index"] for g in gpus}
    holders = {}
    for app in apps:
        info = infos.get(app["pid"])
        if app["gpu_uuid"] not in index_of or info is None:
            continue
        entry = holders.setdefault(info.pid, {"info": info, "gpus": {}, "found_by": set()})
        entry["gpus"][index_of[app["gpu_uuid"]]] = app["used_memory_mib"] or 0
        entry["found_by"].add("nvml")
    for info, _ in devices:
        entry = holders.setdefault(info.pid, {"info": info, "gpus": {}, "found_by": set()})
        entry["found_by"].add("device")
    return holders


def plan_cleanup(holders, owner, protected, node):
    """Sort holders into ``(to_end, protected_idle, blockers)``; pure, so every verdict is unit tested.

    ``to_end``: the target's own processes. ``protected_idle``: protected ones holding no GPU memory (a
    persistence daemon), left alone. ``blockers``: processes whose memory on the target's GPUs can never be
    freed by this module (another CT's, the node's, or a protected one), each with the reason.
    """
    to_end, protected_idle, blockers = [], [], []
    for pid in sorted(holders):
        entry = holders[pid]
        info = entry["info"]
        if info.owner != owner:
            blockers.append((entry, f"belongs to {owner_label(info.owner, node)}, not to this target"))
            continue
        pattern = matches_name(info, protected)
        if pattern is not None:
            if sum(entry["gpus"].values()):
                blockers.append((entry, f"is protected (matches {pattern!r})"))
            else:
                protected_idle.append(entry)
            continue
        to_end.append(entry)
    return to_end, protected_idle, blockers


def describe(entry):
    """``pid 516 (python3, pid 41 inside) on GPU 0, 20998 MiB``: how every message names a process."""
    info = entry["info"]
    inside = f", pid {info.ns_pid} inside" if info.ns_pid != info.pid else ""
    gpus = ", ".join(f"GPU {i}" for i in sorted(entry["gpus"])) or "GPU device files only"
    memory = sum(entry["gpus"].values())
    return f"pid {info.pid} ({info.comm}{inside}) on {gpus}" + (f", {memory} MiB" if memory else "")


def as_result(entry):
    info = entry["info"]
    return {
        "pid": info.pid,
        "ns_pid": info.ns_pid,
        "name": info.comm,
        "owner": info.owner,
        "gpus": sorted(entry["gpus"]),
        "memory_mib": sum(entry["gpus"].values()),
        "found_by": sorted(entry["found_by"]),
    }


def diff_cleanup(to_end):
    """Before: one line per process holding the target's GPUs; after: what stays (nothing)."""
    return {"before": "".join(describe(e) + "\n" for e in to_end), "after": ""}


def busy_gpus(memory, uuids, threshold):
    """The target's GPUs above the threshold, from a memory query's rows."""
    return [row for row in memory if row["uuid"] in uuids and (row["memory_used_mib"] or 0) > threshold]


def check_waits(params):
    """A sentence naming the first wait option that cannot work (negative, or a poll interval of 0), or None."""
    if params["poll_interval"] <= 0:
        return f"poll_interval must be more than 0 seconds, got {params['poll_interval']:g}"
    for name in ("grace", "kill_timeout", "memory_timeout", "memory_threshold_mib"):
        if params[name] < 0:
            return f"{name} must be 0 or more, got {params[name]:g}"
    return None


# -- waiting ---------------------------------------------------------------------------------------------------
def end_processes(entries, *, grace, kill_timeout, poll_interval, alive, send, clock=time.monotonic, sleep=time.sleep):
    """SIGTERM every entry, SIGKILL what outlives ``grace``; return ``(killed, survivors)``.

    ``alive(info)`` and ``send(info, signum)`` are injected so the escalation is unit tested without processes.
    ``killed`` items say which signal was needed and after how many seconds the process was gone.
    """
    started = clock()
    pending = {e["info"].pid: e for e in entries}
    killed = []

    def reap(signal_name):
        for pid, entry in list(pending.items()):
            if not alive(entry["info"]):
                killed.append(
                    {
                        "pid": pid,
                        "name": entry["info"].comm,
                        "signal": signal_name,
                        "exited_after": round(clock() - started, 3),
                    }
                )
                del pending[pid]

    for signum, signal_name, wait in ((signal.SIGTERM, "SIGTERM", grace), (signal.SIGKILL, "SIGKILL", kill_timeout)):
        for entry in pending.values():
            send(entry["info"], signum)
        deadline = clock() + wait
        reap(signal_name)
        while pending and clock() < deadline:
            sleep(poll_interval)
            reap(signal_name)
        if not pending:
            break
    return killed, list(pending.values())


def wait_for_memory(query, uuids, *, threshold, timeout, poll_interval, clock=time.monotonic, sleep=time.sleep):
    """Poll ``query()`` (memory rows) until the target's GPUs are free; return ``(rows, polls, free)``."""
    deadline = clock() + timeout
    polls = 0
    while True:
        rows = query()
        polls += 1
        if not busy_gpus(rows, uuids, threshold):
            return rows, polls, True
        if clock() >= deadline:
            return rows, polls, False
        sleep(poll_interval)


# -- wiring ----------------------------------------------------------------------------------------------------
def find(target, node_smi, protected):
    """Read the target's GPUs (in the target), NVML's processes and device holders (on the node); plan.

    Returns ``(gpus, (to_end, protected_idle, blockers))``.
    """
    gpus = NvidiaSmi(target.run, timeout=target.timeout).memory()
    apps = node_smi.compute_apps()
    infos = {a["pid"]: read_process(a["pid"]) for a in apps}
    owner = f"ct:{target.vmid}" if target.is_container else "host"
    holders = collect_holders(apps, gpus, infos, device_holders(owner))
    return gpus, plan_cleanup(holders, owner, protected, target.node)


def signal_process(info, signum):
    """Signal the process of ``info`` only if its pid still names it (same start time)."""
    now = read_process(info.pid)
    if now is not None and now.start_time == info.start_time:
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signum)


def cleanup(module, target, node_smi):
    p = module.params
    gpus, (to_end, protected_idle, blockers) = find(target, node_smi, p["protected"])
    uuids = {g["uuid"] for g in gpus}
    result = {
        "processes": [as_result(e) for e in to_end],
        "protected": [as_result(e) for e in protected_idle],
        "killed": [],
        "memory": gpus,
        "polls": 0,
        "seconds_to_free": 0.0,
    }
    if blockers:
        raise GpuProcessesError(
            f"{target.label}: cannot free its GPUs: "
            + "; ".join(f"{describe(e)} {why}" for e, why in blockers)
            + ". Nothing was ended. Stop those processes yourself, or give this target GPUs of its own",
            blockers=[dict(as_result(e), reason=why) for e, why in blockers],
            **result,
        )
    result.update(changed=bool(to_end), diff=diff_cleanup(to_end))
    held = busy_gpus(gpus, uuids, p["memory_threshold_mib"])
    if held and not to_end:
        # Nothing to end and nothing to wait for: the same verdict in check mode and in a real run.
        raise no_holder_error(target, held, p["memory_threshold_mib"], result)
    if module.check_mode:
        for entry in to_end:
            if entry["info"].state == "D":
                module.warn(
                    f"{target.label}: {describe(entry)} is in state D (stuck in the driver); a real run is "
                    f"likely to find it outliving SIGKILL"
                )
    if module.check_mode or not to_end:
        return result
    started = time.monotonic()
    killed, survivors = end_processes(
        to_end,
        grace=p["grace"],
        kill_timeout=p["kill_timeout"],
        poll_interval=p["poll_interval"],
        alive=still_there,
        send=signal_process,
    )
    result["killed"] = killed
    if survivors:
        raise survivor_error(target, [(e, state_of(e)) for e in survivors], p["kill_timeout"], result)
    rows, polls, free = wait_for_memory(
        node_smi.memory,
        uuids,
        threshold=p["memory_threshold_mib"],
        timeout=p["memory_timeout"],
        poll_interval=p["poll_interval"],
    )
    # The node numbers GPUs its own way; report them as the target numbers them.
    index_of = {g["uuid"]: g["index"] for g in gpus}
    rows = [dict(r, index=index_of[r["uuid"]]) for r in rows if r["uuid"] in uuids]
    result.update(memory=rows, polls=polls)
    if not free:
        raise no_holder_error(
            target,
            busy_gpus(rows, uuids, p["memory_threshold_mib"]),
            p["memory_threshold_mib"],
            result,
            waited=p["memory_timeout"],
        )
    result["seconds_to_free"] = round(time.monotonic() - started, 3)
    return result


def survivor_error(target, survivors, kill_timeout, result):
    """The processes that outlived SIGKILL, each with its state; D means stuck in the driver."""
    stuck = "; ".join(f"{describe(e)} is in state {state} ({describe_state(state)})" for e, state in survivors)
    advice = (
        ". A process in uninterruptible sleep (D) is stuck in the driver: reset the GPU or reboot the node"
        if any(state == "D" for _, state in survivors)
        else ". Look at what it waits for (cat /proc/<pid>/stack) before rebooting"
    )
    return GpuProcessesError(
        f"{target.label}: {len(survivors)} process(es) outlived SIGKILL for {kill_timeout:g} s: {stuck}{advice}",
        survivors=[dict(as_result(e), state=state) for e, state in survivors],
        **result,
    )


def state_of(entry):
    now = read_process(entry["info"].pid)
    return now.state if now is not None else "gone"


def no_holder_error(target, held, threshold, result, waited=None):
    gpus = "; ".join(f"GPU {r['index']} ({r['uuid']}) has {r['memory_used_mib']} MiB used" for r in held)
    after = f" {waited:g} s after its last holder exited" if waited is not None else ""
    reset = " ".join(f"`nvidia-smi --gpu-reset -i {r['uuid']}`" for r in held)
    return GpuProcessesError(
        f"{target.label}: {gpus}{after}, above {threshold} MiB, and no process holds it: the driver did not release "
        f"it. Reset the GPU on the node with nothing using it ({reset}) or reboot the node",
        held=held,
        **result,
    )


def main():
    module = AnsibleModule(
        argument_spec={
            **TARGET_ARGUMENT_SPEC,
            "state": {"type": "str", "choices": ["absent"], "default": "absent"},
            "protected": {
                "type": "list",
                "elements": "str",
                "default": [
                    "nvidia-persistenced",
                    "nv-hostengine",
                    "nv-fabricmanager",
                    "nvidia-fabricmanager",
                    "dcgm*",
                ],
            },
            "grace": {"type": "float", "default": 10},
            "kill_timeout": {"type": "float", "default": 10},
            "memory_timeout": {"type": "float", "default": 30},
            "memory_threshold_mib": {"type": "int", "default": 0},
            "poll_interval": {"type": "float", "default": 0.05},
        },
        supports_check_mode=True,
    )
    wrong = check_waits(module.params)
    if wrong:
        module.fail_json(msg=f"{wrong}; fix the gpu_processes_* variable of that name")
    try:
        target = Target.from_params(module.params)
        node_smi = NvidiaSmi(target.run_on_node, timeout=module.params["timeout"])
        result = cleanup(module, target, node_smi)
    except TargetError as error:
        module.fail_json(**error.to_result())
    except NvidiaSmiError as error:
        module.fail_json(**error.to_result(prefix=f"{target.label}: "))
    except GpuProcessesError as error:
        module.fail_json(msg=str(error), **error.details)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
