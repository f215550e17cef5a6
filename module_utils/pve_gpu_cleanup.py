# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPU processes step: which processes hold the target's GPUs, whose they are, and ending them.

The fact pass (module_utils/pve_steps) evaluates it from preflight's GPU list (read inside the target by the
preflight probe part, so this step adds no call inside the CT) and the node-side reads: NVML's compute processes
and /proc on the node. The ``gpu_processes`` module calls :func:`cleanup` when the facts show holders; it
re-reads everything itself first (facts can be seconds old), so it is also correct when called alone.

Jobs restart their workers (torchrun's elastic agent, ``while true; do python train.py; done``, a systemd service
with ``Restart=always``), so the step ends the JOB: each holder's parents are walked up (host pids, on the node)
while they belong to the same target, stopping at the target's init, an interactive shell, a session or service
manager and a protected process (pve_process.walk_stop); the launchers among them (``launchers`` patterns, and
shells running the job) are ended first, together with the holders. A holder in a systemd service of its own
cannot be ended by signals: the step fails naming the service and the command that stops it. Once the memory is
free, the step watches ``settle`` seconds for new holders, so a restarter it could not recognise is named instead
of passing unnoticed.
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
    is_shell,
    matches_launcher,
    matches_name,
    owner_label,
    read_process,
    read_stat,
    read_unit_members,
    still_there,
    systemd_unit,
    unit_is_job,
    walk_stop,
)

NAME = "gpu_processes"
PROBE = None  # the GPUs come from preflight's probe part; the holders are read on the node
DEFAULT_PROTECTED = ["nvidia-persistenced", "nv-hostengine", "nv-fabricmanager", "nvidia-fabricmanager", "dcgm*"]
# Parents that start workers and start them again when they die: matched like protected, and also by the module
# of ``python -m`` and the script an interpreter runs (pve_process.program_names).
DEFAULT_LAUNCHERS = [
    "torchrun",
    "torch.distributed.run",
    "torch.distributed.launch",
    "torch.distributed.elastic*",
    "accelerate",
    "accelerate.commands.launch",
    "deepspeed",
    "deepspeed.launcher*",
]
# Left alone while they hold only device files (no GPU memory): display servers and monitoring exporters.
DEFAULT_KEEP_IDLE = [
    "Xorg",
    "X",
    "Xwayland",
    "gnome-shell",
    "kwin_wayland",
    "kwin_x11",
    "sway",
    "weston",
    "mutter",
    "nvidia_gpu_exporter",
    "nvidia-gpu-exporter",
    "node_exporter",
    "prometheus-node-exporter",
    "prometheus",
    "telegraf",
    "nvidia-smi",
]
SPEC = {
    "protected": {"type": "list", "elements": "str", "default": DEFAULT_PROTECTED},
    "keep_idle": {"type": "list", "elements": "str", "default": DEFAULT_KEEP_IDLE},
    "launchers": {"type": "list", "elements": "str", "default": DEFAULT_LAUNCHERS},
    "end_launchers": {"type": "bool", "default": True},
    "grace": {"type": "float", "default": 10},
    "kill_timeout": {"type": "float", "default": 10},
    "memory_timeout": {"type": "float", "default": 30},
    "memory_threshold_mib": {"type": "int", "default": 0},
    "poll_interval": {"type": "float", "default": 0.05},
    "settle": {"type": "float", "default": 3},
}
MAX_PARENTS = 32  # how far up a holder's parents are walked (a real job is a few levels deep)
COMMAND_SHOWN = 120  # characters of a parent's command line a message quotes


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
    """Node-side reads: NVML's compute processes (host pids), their /proc entries, the device-file holders, and
    the jobs of the target's own (their parents, the members of the systemd services they run in)."""
    owner = owner_of(context["target"])
    apps = NvidiaSmi(target.run_on_node, timeout=target.timeout).compute_apps()
    infos = {a["pid"]: read_process(a["pid"]) for a in apps}
    devices = device_holders(owner)
    ancestors, units = read_jobs([*infos.values(), *(info for info, _ in devices)], owner)
    return {"apps": apps, "infos": infos, "devices": devices, "ancestors": ancestors, "units": units}


def evaluate_step(spec, answer, node, context):
    """Holders of the target's GPUs (preflight's list), the plan, and what a run would end; pure."""
    target = context["target"]
    gpus = context["steps"]["preflight"]["gpus"]
    holders = collect_holders(node["apps"], gpus, node["infos"], node["devices"])
    owner = owner_of(target)
    to_end, protected_idle, blockers = plan_cleanup(
        holders, owner, spec["protected"], target["node"], spec["keep_idle"]
    )
    restarters, services = plan_jobs(
        to_end,
        holders,
        node.get("ancestors", {}),
        node.get("units", {}),
        owner=owner,
        launchers=spec["launchers"],
        protected=spec["protected"],
    )
    problems = []
    if blockers:
        problems.append(blocker_message(target["label"], blockers))
    if services:
        problems.append(service_message(target["label"], services, target["vmid"]))
    if restarters and not spec["end_launchers"]:
        problems.append(restarter_message(target["label"], restarters))
    held = busy_gpus(gpus, {g["uuid"] for g in gpus}, spec["memory_threshold_mib"])
    if held and not to_end and not blockers:
        problems.append(str(no_holder_error(target["label"], held, spec["memory_threshold_mib"], {})))
    return {
        "processes": [as_result(e) for e in to_end],
        "launchers": [as_launcher(r) for r in restarters],
        "protected": [as_result(e) for e in protected_idle],
        "blockers": [dict(as_result(e), reason=why) for e, why in blockers]
        + [dict(as_result(e), reason=service_reason(unit, e, target["vmid"])) for e, unit in services],
        "changes": plan_changes(to_end, restarters),
        "problems": problems,
        "diff": diff_cleanup(to_end, restarters),
        "pending": bool(to_end) and not problems,
    }


def read_jobs(holder_infos, owner):
    """Node-side: ``(ancestors, units)`` of the target's holders.

    ``ancestors``: host pid -> ProcessInfo of every parent of a holder of ``owner``, walked up from each
    (``ppid`` of /proc/<pid>/stat) until :func:`walk_stop` stops (another owner, the init, an interactive
    shell...), at most MAX_PARENTS levels. ``units``: cgroup path -> members (``[(pid, start_time)]``, None if
    unreadable) of each systemd service a holder runs in.
    """
    ancestors, units = {}, {}
    for info in holder_infos:
        if info is None or info.owner != owner:
            continue
        pid = info.ppid
        for _ in range(MAX_PARENTS):
            if pid <= 1 or pid in ancestors:
                break
            parent = read_process(pid)
            if parent is None:
                break
            ancestors[pid] = parent
            if walk_stop(parent, owner):
                break
            pid = parent.ppid
        unit = systemd_unit(info.cgroup, owner)
        if unit is not None and unit["path"] not in units:
            units[unit["path"]] = read_unit_members(unit["path"])
    return ancestors, units


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


def plan_cleanup(holders, owner, protected, node, keep_idle=()):
    """Sort holders into ``(to_end, protected_idle, blockers)``; pure, so every verdict is unit tested.

    ``to_end``: the target's own processes. ``protected_idle``: protected ones and ``keep_idle`` ones (a display
    server, a monitoring exporter) holding no GPU memory, left alone. ``blockers``: processes whose memory on the
    target's GPUs can never be freed by this module (another CT's, the node's, another container runtime's, or a
    protected one), each with the reason. A ``keep_idle`` process holding memory is ended like any other.
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
        if not sum(entry["gpus"].values()) and matches_name(info, keep_idle) is not None:
            protected_idle.append(entry)
            continue
        to_end.append(entry)
    return to_end, protected_idle, blockers


def job_chain(info, holders, ancestors, owner, protected):
    """The parents of holder ``info`` that are part of its job, nearest first; pure.

    Walks ``ancestors`` (host pid -> ProcessInfo) up from ``info.ppid`` and stops before a process where
    :func:`walk_stop` says the job ends, and at another holder (whose own chain covers what is above it).
    """
    chain, pid = [], info.ppid
    while pid in ancestors and pid not in holders and len(chain) < MAX_PARENTS:
        parent = ancestors[pid]
        if walk_stop(parent, owner, protected) or parent in chain:
            break
        chain.append(parent)
        pid = parent.ppid
    return chain


def restarter_reason(info, launchers):
    """Why a parent in a holder's job starts workers again (a launcher, a shell running the job), or None."""
    pattern = matches_launcher(info, launchers)
    if pattern is not None:
        return f"a launcher (matches {pattern!r})"
    if is_shell(info):  # an interactive one stopped the walk already: this one runs a command or a script
        return "a shell running the job"
    return None


def plan_jobs(to_end, holders, ancestors, units, *, owner, launchers, protected):
    """The restarters to end with the holders, and the systemd services that would start them again; pure.

    Returns ``(restarters, services)``. ``restarters``: entries like a holder's (``info``, ``gpus``,
    ``found_by``) plus ``why`` and ``restarts`` (the holder pids they are parents of), the farthest parent
    first, so that a loop is ended before the launcher it restarts. ``services``: ``(entry, unit)`` of each
    holder in a systemd service that is its job's (pve_process.unit_is_job).
    """
    restarters, services = {}, []
    for entry in to_end:
        info = entry["info"]
        chain = job_chain(info, holders, ancestors, owner, protected)
        for depth, parent in enumerate(chain):
            why = restarter_reason(parent, launchers)
            if why is None:
                continue
            found = restarters.setdefault(
                parent.pid,
                {"info": parent, "gpus": {}, "found_by": {"parent"}, "why": why, "restarts": [], "depth": depth},
            )
            found["restarts"].append(info.pid)
            found["depth"] = max(found["depth"], depth)
        unit = systemd_unit(info.cgroup, owner)
        if unit is not None and unit_is_job(units.get(unit["path"]), [info, *chain]):
            services.append((entry, unit))
    return sorted(restarters.values(), key=lambda r: (-r["depth"], r["info"].pid)), services


def shown_command(info):
    """A process's command line as messages quote it: repr (inert), at most COMMAND_SHOWN characters."""
    text = " ".join(info.cmdline)
    return repr(text if len(text) <= COMMAND_SHOWN else text[:COMMAND_SHOWN] + "...")


def describe_process(info):
    """``pid 500 (torchrun, pid 12 inside: 'torchrun train.py')``: how messages name a parent."""
    inside = f", pid {info.ns_pid} inside" if info.ns_pid != info.pid else ""
    command = f": {shown_command(info)}" if info.cmdline else ""
    return f"pid {info.pid} ({info.comm}{inside}{command})"


def describe_restarter(restarter):
    """``launcher pid 500 (...), a launcher (matches 'torchrun'), parent of pid 516``."""
    restarts = ", ".join(f"pid {p}" for p in sorted(restarter["restarts"]))
    return f"{describe_process(restarter['info'])}, {restarter['why']}, parent of {restarts}"


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


def as_launcher(restarter):
    info = restarter["info"]
    command = " ".join(info.cmdline)
    return {
        "pid": info.pid,
        "ns_pid": info.ns_pid,
        "name": info.comm,
        "owner": info.owner,
        "command": command if len(command) <= COMMAND_SHOWN else command[:COMMAND_SHOWN] + "...",
        "reason": restarter["why"],
        "restarts": sorted(restarter["restarts"]),
    }


def plan_changes(to_end, restarters=()):
    """One line per process a run would end: the restarters first (they are signalled first), then the holders."""
    return [f"end launcher {describe_restarter(r)}" for r in restarters] + [f"end {describe(e)}" for e in to_end]


def diff_cleanup(to_end, restarters=()):
    """Before: one line per process holding the target's GPUs or restarting one; after: what stays (nothing)."""
    lines = [f"launcher {describe_restarter(r)}" for r in restarters] + [describe(e) for e in to_end]
    return {"before": "".join(line + "\n" for line in lines), "after": ""}


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
    for name in ("grace", "kill_timeout", "memory_timeout", "memory_threshold_mib", "settle"):
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


def wait_for_memory(
    query, uuids, *, threshold, timeout, poll_interval, clock=time.monotonic, sleep=time.sleep, interrupt=None
):
    """Poll ``query()`` (memory rows) until the target's GPUs are free; return ``(rows, polls, free)``.

    ``interrupt()``, when given, is asked after each poll that found memory still used: a truthy answer (a new
    holder took the GPUs: waiting longer cannot help) ends the wait at once, not free.
    """
    deadline = clock() + timeout
    polls = 0
    while True:
        rows = query()
        polls += 1
        if not busy_gpus(rows, uuids, threshold):
            return rows, polls, True
        if clock() >= deadline or (interrupt is not None and interrupt()):
            return rows, polls, False
        sleep(poll_interval)


def watch_settle(new_holders, *, window, poll_interval, clock=time.monotonic, sleep=time.sleep):
    """Ask ``new_holders()`` every ``poll_interval`` for ``window`` seconds; return the first non-empty answer, or
    ``[]`` when the window ends with none (the last ask is at or after its end)."""
    deadline = clock() + window
    while True:
        found = new_holders()
        if found or clock() >= deadline:
            return found
        sleep(poll_interval)


# -- wiring ----------------------------------------------------------------------------------------------------
def find(target, node_smi, p):
    """Read the target's GPUs (in the target), NVML's processes, device holders and their jobs (on the node); plan.

    Returns a dict: ``gpus``, ``owner``, ``to_end``, ``protected_idle``, ``blockers``, ``restarters``,
    ``services`` and ``jobs`` (``(pid, start_time)`` of every parent that is part of a holder's job).
    """
    gpus = NvidiaSmi(target.run, timeout=target.timeout).memory()
    owner = owner_of({"vmid": target.vmid if target.is_container else None})
    apps = node_smi.compute_apps()
    infos = {a["pid"]: read_process(a["pid"]) for a in apps}
    devices = device_holders(owner)
    holders = collect_holders(apps, gpus, infos, devices)
    to_end, protected_idle, blockers = plan_cleanup(holders, owner, p["protected"], target.node, p["keep_idle"])
    ancestors, units = read_jobs([e["info"] for e in to_end], owner)
    restarters, services = plan_jobs(
        to_end, holders, ancestors, units, owner=owner, launchers=p["launchers"], protected=p["protected"]
    )
    jobs = {
        (parent.pid, parent.start_time)
        for entry in to_end
        for parent in job_chain(entry["info"], holders, ancestors, owner, p["protected"])
    }
    return {
        "gpus": gpus,
        "owner": owner,
        "to_end": to_end,
        "protected_idle": protected_idle,
        "blockers": blockers,
        "restarters": restarters,
        "services": services,
        "jobs": jobs,
    }


def blocker_message(label, blockers):
    return (
        f"{label}: cannot free its GPUs: "
        + "; ".join(f"{describe(e)} {why}" for e, why in blockers)
        + ". Nothing was ended. Stop those processes yourself, or give this target GPUs of its own"
    )


def unit_stop_advice(unit, info, vmid):
    """How a person stops the service ``unit`` (a command only for a name that passed pve_process.UNIT_NAME)."""
    inside = f"pct exec {vmid} -- " if vmid is not None else ""
    if not unit["valid"]:
        return (
            f"its name is not a plain unit name, so no command is given: find it with "
            f"`{inside}systemctl status {info.ns_pid}` and stop it"
        )
    if unit["user"] is not None:
        where = f" inside CT {vmid}" if vmid is not None else ""
        return f"stop it as user {unit['user']}{where} with `systemctl --user stop {unit['name']}`"
    return f"stop it with `{inside}systemctl stop {unit['name']}`"


def unit_words(unit):
    kind = "systemd user service" if unit["user"] is not None else "systemd service"
    return f"{kind} {unit['name'] if unit['valid'] else shown(unit['name'])}"


def service_reason(unit, entry, vmid):
    return (
        f"runs in {unit_words(unit)}, which starts it again when it ends; {unit_stop_advice(unit, entry['info'], vmid)}"
    )


def service_message(label, services, vmid):
    return (
        f"{label}: cannot free its GPUs: "
        + "; ".join(f"{describe(e)} {service_reason(unit, e, vmid)}" for e, unit in services)
        + ". Nothing was ended. Stop the service, then run again"
    )


def restarter_message(label, restarters):
    return (
        f"{label}: the processes holding its GPUs are restarted when they end: "
        + "; ".join(f"{describe_restarter(r)} (stop it with `kill {r['info'].pid}` on the node)" for r in restarters)
        + ". Nothing was ended (end_launchers is false). Stop them yourself, or set gpu_processes_end_launchers to "
        "true so that a run ends them with the holders"
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


def left_alone(entry, p):
    """A holder the step leaves alone: protected or ``keep_idle``, without GPU memory (a monitoring agent's
    ``nvidia-smi`` that opens the device files for a moment is no restarted worker)."""
    return not sum(entry["gpus"].values()) and matches_name(entry["info"], [*p["protected"], *p["keep_idle"]])


def relist(node_smi, gpus, owner, known, p):
    """The holders of the target's GPUs now (NVML and device files) that are not in ``known`` (pid, start time)
    and not :func:`left_alone`."""
    apps = node_smi.compute_apps()
    holders = collect_holders(apps, gpus, {a["pid"]: read_process(a["pid"]) for a in apps}, device_holders(owner))
    return [
        e for pid, e in sorted(holders.items()) if (pid, e["info"].start_time) not in known and not left_alone(e, p)
    ]


def new_device_holders(owner, known, p):
    """The target's processes holding NVIDIA device files that are not in ``known`` and not :func:`left_alone`:
    a /proc scan, no command."""
    found = [{"info": info, "gpus": {}, "found_by": {"device"}} for info, _ in device_holders(owner)]
    return [e for e in found if (e["info"].pid, e["info"].start_time) not in known and not left_alone(e, p)]


def refuse_unsafe(target, found, p, result):
    """Raise, before anything is ended, when the plan cannot free the GPUs: blockers (other owners', protected),
    holders in a systemd service of their own, or restarters that ``end_launchers: false`` forbids ending."""
    vmid = target.vmid if target.is_container else None
    if found["blockers"]:
        raise GpuProcessesError(
            blocker_message(target.label, found["blockers"]),
            blockers=[dict(as_result(e), reason=why) for e, why in found["blockers"]],
            **result,
        )
    if found["services"]:
        raise GpuProcessesError(
            service_message(target.label, found["services"], vmid),
            blockers=[dict(as_result(e), reason=service_reason(u, e, vmid)) for e, u in found["services"]],
            **result,
        )
    if found["restarters"] and not p["end_launchers"]:
        raise GpuProcessesError(restarter_message(target.label, found["restarters"]), **result)


def cleanup(target, node_smi, p, *, check_mode=False, warn=lambda message: None):
    """Re-read and plan, then (unless ``check_mode``) end the restarters and the holders, wait until the memory is
    free, and watch ``settle`` seconds for new holders.

    ``p`` holds the SPEC settings; ``warn`` receives warnings for the module's result. Raises GpuProcessesError
    carrying what was already done.
    """
    clock, sleep = time.monotonic, time.sleep  # looked up now, so a test can give the module a clock of its own
    found = find(target, node_smi, p)
    gpus, to_end, restarters = found["gpus"], found["to_end"], found["restarters"]
    uuids = {g["uuid"] for g in gpus}
    result = {
        "processes": [as_result(e) for e in to_end],
        "launchers": [as_launcher(r) for r in restarters],
        "protected": [as_result(e) for e in found["protected_idle"]],
        "killed": [],
        "memory": gpus,
        "polls": 0,
        "seconds_to_free": 0.0,
    }
    refuse_unsafe(target, found, p, result)
    result.update(changed=bool(to_end), diff=diff_cleanup(to_end, restarters))
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
    started = clock()
    killed, survivors = end_processes(
        restarters + to_end,  # the restarters first: a launcher is gone before its worker ends
        grace=p["grace"],
        kill_timeout=p["kill_timeout"],
        poll_interval=p["poll_interval"],
        alive=still_there,
        send=signal_process,
        clock=clock,
        sleep=sleep,
    )
    result["killed"] = killed
    if survivors:
        raise survivor_error(target, [(e, state_of(e)) for e in survivors], p["kill_timeout"], result)
    # What may still hold the GPUs after this: only what was left alone (protected or idle).
    known = {(e["info"].pid, e["info"].start_time) for e in found["protected_idle"]}
    owner = found["owner"]
    appeared = []

    def interrupt():
        appeared[:] = new_device_holders(owner, known, p)
        return bool(appeared)

    waiting, polls = clock(), 0
    while True:
        rows, more, free = wait_for_memory(
            node_smi.memory,
            uuids,
            threshold=p["memory_threshold_mib"],
            timeout=max(0.0, p["memory_timeout"] - (clock() - waiting)),
            poll_interval=p["poll_interval"],
            clock=clock,
            sleep=sleep,
            interrupt=interrupt,
        )
        polls += more
        if free:
            break
        # Before blaming the driver: memory that came back may be a new worker's (a restarted job).
        new = relist(node_smi, gpus, owner, known, p)
        if new:
            when = (
                "while the step waited for their memory to be released"
                if appeared
                else f"after the step ended the holders (the memory stayed used for {p['memory_timeout']:g} s)"
            )
            raise new_holder_error(target, new, found, when, dict(result, memory=target_rows(rows, gpus), polls=polls))
        if not appeared or clock() - waiting >= p["memory_timeout"]:
            result.update(memory=target_rows(rows, gpus), polls=polls)
            raise no_holder_error(
                target.label,
                busy_gpus(rows, uuids, p["memory_threshold_mib"]),
                p["memory_threshold_mib"],
                result,
                waited=p["memory_timeout"],
            )
        appeared.clear()  # the new holder was gone again by the time the holders were listed: wait on
    result.update(memory=target_rows(rows, gpus), polls=polls)
    result["seconds_to_free"] = round(clock() - started, 3)
    if p["settle"] > 0:
        new = watch_settle(
            lambda: new_device_holders(owner, known, p),
            window=p["settle"],
            poll_interval=p["poll_interval"],
            clock=clock,
            sleep=sleep,
        ) or relist(node_smi, gpus, owner, known, p)
        if new:
            raise new_holder_error(
                target, new, found, f"within the {p['settle']:g} s the step watched after their memory was free", result
            )
    return result


def target_rows(rows, gpus):
    """The memory rows of the target's GPUs, numbered as the target numbers them (the node has its own order)."""
    index_of = {g["uuid"]: g["index"] for g in gpus}
    return [dict(r, index=index_of[r["uuid"]]) for r in rows if r["uuid"] in index_of]


def new_holder_error(target, new, found, when, result):
    """Processes that took the target's GPUs after the step ended their holders, each named with its parent (the
    restarter) and the systemd service it runs in."""
    vmid = target.vmid if target.is_container else None
    parts = []
    for entry in new:
        info = entry["info"]
        text = describe(entry)
        parent = read_process(info.ppid) if info.ppid > 1 else None
        if parent is not None and (parent.pid, parent.start_time) in found["jobs"]:
            text += (
                f", started by {describe_process(parent)}, a parent of the processes the step ended, which starts "
                f"new ones: add its name to gpu_processes_launchers so that a run ends it first, or stop it "
                f"(`kill {parent.pid}` on the node)"
            )
        elif parent is not None:
            text += f", started by {describe_process(parent)}"
        unit = systemd_unit(info.cgroup, found["owner"]) if info.owner == found["owner"] else None
        if unit is not None:
            text += f"; it runs in {unit_words(unit)}: {unit_stop_advice(unit, info, vmid)}"
        elif info.owner != found["owner"]:
            text += f"; it belongs to {owner_label(info.owner, target.node)}, not to this target"
        parts.append(text)
    advice = (
        "Something restarts what the step ends: stop it, then run again"
        if any(e["info"].owner == found["owner"] for e in new)
        else "Stop those processes yourself, or give this target GPUs of its own"
    )
    return GpuProcessesError(
        f"{target.label}: {len(new)} new process(es) took its GPUs {when}: " + "; ".join(parts) + f". {advice}",
        new_holders=[
            dict(as_result(e), parent=e["info"].ppid, command=" ".join(e["info"].cmdline)[:COMMAND_SHOWN]) for e in new
        ],
        **result,
    )


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
