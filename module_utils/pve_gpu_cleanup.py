# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPU processes step: which processes hold the target's GPUs, whose they are, and ending them.

The fact pass (module_utils/pve_steps) evaluates it from preflight's GPU list (read inside the target by the
preflight probe part, so this step adds no call inside the CT) and the node-side reads: NVML's compute processes
and /proc on the node. The ``gpu_processes`` module calls :func:`cleanup` when the facts show holders; it
re-reads everything itself first (facts can be seconds old), so it is also correct when called alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from ansible.module_utils.nvidia_smi import NvidiaSmi, shown, valid_uuid
from ansible.module_utils.pve_errors import RecoverError
from ansible.module_utils.pve_process import (
    describe_state,
    device_holders,
    matches_name,
    owner_label,
    read_process,
    read_stat,
    still_there,
)

NAME = "gpu_processes"
PROBE = None  # the GPUs come from preflight's probe part; the holders are read on the node
DEFAULT_PROTECTED = ["nvidia-persistenced", "nv-hostengine", "nv-fabricmanager", "nvidia-fabricmanager", "dcgm*"]
SPEC = {
    "protected": {"type": "list", "elements": "str", "default": DEFAULT_PROTECTED},
    "grace": {"type": "float", "default": 10},
    "kill_timeout": {"type": "float", "default": 10},
    "memory_timeout": {"type": "float", "default": 30},
    "memory_threshold_mib": {"type": "int", "default": 0},
    "poll_interval": {"type": "float", "default": 0.05},
}


class GpuProcessesError(RecoverError):
    """The GPUs cannot be freed (blockers, survivors, memory the driver keeps); details carry what was done."""

    def __init__(self, message, **details):
        super().__init__(message, kind="gpu_processes", details=details)


def owner_of(target):
    """How /proc ownership names the target's processes: ``ct:<vmid>``, or ``host`` for a bare host."""
    return f"ct:{target['vmid']}" if target["vmid"] is not None else "host"


# -- the fact pass ---------------------------------------------------------------------------------------------
def probe_payload(spec, timeout=60):
    return None


def read_node(spec, target, answer, context):
    """Node-side reads: NVML's compute processes (host pids), their /proc entries, the device-file holders."""
    apps = NvidiaSmi(target.run_on_node, timeout=target.timeout).compute_apps()
    return {
        "apps": apps,
        "infos": {a["pid"]: read_process(a["pid"]) for a in apps},
        "devices": device_holders(owner_of(context["target"])),
    }


def evaluate_step(spec, answer, node, context):
    """Holders of the target's GPUs (preflight's list), the plan, and what a run would end; pure."""
    target = context["target"]
    gpus = context["steps"]["preflight"]["gpus"]
    holders = collect_holders(node["apps"], gpus, node["infos"], node["devices"])
    to_end, protected_idle, blockers = plan_cleanup(holders, owner_of(target), spec["protected"], target["node"])
    problems = []
    if blockers:
        problems.append(blocker_message(target["label"], blockers))
    held = busy_gpus(gpus, {g["uuid"] for g in gpus}, spec["memory_threshold_mib"])
    if held and not to_end and not blockers:
        problems.append(str(no_holder_error(target["label"], held, spec["memory_threshold_mib"], {})))
    return {
        "processes": [as_result(e) for e in to_end],
        "protected": [as_result(e) for e in protected_idle],
        "blockers": [dict(as_result(e), reason=why) for e, why in blockers],
        "changes": [f"end {describe(e)}" for e in to_end],
        "problems": problems,
        "diff": diff_cleanup(to_end),
        "pending": bool(to_end) and not problems,
    }


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
    """The target's GPUs above the threshold, from a memory query's rows.

    A GPU whose memory use nvidia-smi could not give (``[N/A]``, ``[GPU requires reset]``: None) is busy too: a
    value nobody knows is never taken for 0 MiB, i.e. free.
    """
    return [
        row
        for row in memory
        if row["uuid"] in uuids and (row["memory_used_mib"] is None or row["memory_used_mib"] > threshold)
    ]


def check_waits(params):
    """A sentence naming the first wait option that cannot work (negative, or a poll interval of 0), or None."""
    if params["poll_interval"] <= 0:
        return f"poll_interval must be more than 0 seconds, got {params['poll_interval']:g}"
    for name in ("grace", "kill_timeout", "memory_timeout", "memory_threshold_mib"):
        if params[name] < 0:
            return f"{name} must be 0 or more, got {params[name]:g}"
    return None


# The fact pass checks the step's settings with this before anything runs (module_utils/pve_steps).
check_spec = check_waits


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


def blocker_message(label, blockers):
    return (
        f"{label}: cannot free its GPUs: "
        + "; ".join(f"{describe(e)} {why}" for e, why in blockers)
        + ". Nothing was ended. Stop those processes yourself, or give this target GPUs of its own"
    )


def signal_process(info, signum):
    """Signal the process of ``info`` only if its pid still names it (same start time).

    The signal goes to the whole thread group, so a zombie leader whose threads still run is ended too. Only
    ``stat`` is read (never the cmdline, which a process stuck in the driver can block).
    """
    now = read_stat(info.pid)
    if now is not None and now[2] == info.start_time:
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signum)


def cleanup(target, node_smi, p, *, check_mode=False, warn=lambda message: None):
    """Re-read and plan, then (unless ``check_mode``) end the holders and wait until the memory is free.

    ``p`` holds the SPEC settings; ``warn`` receives warnings for the module's result. Raises GpuProcessesError
    carrying what was already done.
    """
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
            blocker_message(target.label, blockers),
            blockers=[dict(as_result(e), reason=why) for e, why in blockers],
            **result,
        )
    result.update(changed=bool(to_end), diff=diff_cleanup(to_end))
    held = busy_gpus(gpus, uuids, p["memory_threshold_mib"])
    if held and not to_end:
        # Nothing to end and nothing to wait for: the same verdict in check mode and in a real run.
        raise no_holder_error(target.label, held, p["memory_threshold_mib"], result)
    if check_mode:
        for entry in to_end:
            if entry["info"].state == "D":
                warn(
                    f"{target.label}: {describe(entry)} is in state D (stuck in the driver); a real run is "
                    f"likely to find it outliving SIGKILL"
                )
    if check_mode or not to_end:
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
            target.label,
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


def no_holder_error(label, held, threshold, result, waited=None):
    """Memory on the target's GPUs that no process holds: the driver keeps it (or will not say how much is used).

    The reset advice is a command a person copies into a root shell on the node, so it names a GPU only by a
    UUID that :func:`valid_uuid` accepts (parse_gpus refuses any other); a GPU without one is named by its index
    and left out of the command.
    """

    def gpu_name(row):  # its UUID, or a note that it had none that could be trusted
        return row["uuid"] if valid_uuid(row["uuid"]) else f"no valid UUID: {shown(row['uuid'])}"

    after = f" {waited:g} s after its last holder exited" if waited is not None else ""
    reset = " ".join(f"`nvidia-smi --gpu-reset -i {r['uuid']}`" for r in held if valid_uuid(r["uuid"]))
    unknown = [r for r in held if r["memory_used_mib"] is None]
    if not unknown:
        gpus = "; ".join(f"GPU {r['index']} ({gpu_name(r)}) has {r['memory_used_mib']} MiB used" for r in held)
        message = (
            f"{label}: {gpus}{after}, above {threshold} MiB, and no process holds it: the driver did not release it"
        )
    else:
        gpus = "; ".join(
            f"GPU {r['index']} ({gpu_name(r)}) has {r['memory_used_mib']} MiB used (above {threshold} MiB)"
            if r["memory_used_mib"] is not None
            else f"GPU {r['index']} ({gpu_name(r)}) reports memory.used as "
            f"{shown((r.get('unreadable') or {}).get('memory_used_mib', 'no value'))}"
            for r in held
        )
        message = (
            f"{label}: {gpus}{after}, and no process holds it: a GPU whose memory use cannot be read is not "
            f"counted as free (the driver cannot say it released it)"
        )
    return GpuProcessesError(
        f"{message}. Reset the GPU on the node with nothing using it "
        f"({reset or 'find its UUID with `nvidia-smi -L` on the node, then `nvidia-smi --gpu-reset -i <UUID>`'}) "
        f"or reboot the node",
        held=held,
        **result,
    )
