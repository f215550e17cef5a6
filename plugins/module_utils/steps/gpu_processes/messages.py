# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""How the GPU processes step names processes: in its results (``as_*``), its change lines, its problems and
its errors (GpuProcessesError, raised with what was already done). Everything a process says of itself (its
comm, its command line) is shown through text.printable; nothing here reads the node."""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import shown, valid_uuid
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import describe_state
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable

COMMAND_SHOWN = 120  # characters of a parent's command line a message quotes
MAY_RESTART = "may start workers again: not ended"


class GpuProcessesError(RecoverError):
    """The GPUs cannot be freed (blockers, survivors, memory the driver keeps); details carry what was done."""

    def __init__(self, message, **details):
        super().__init__(message, kind="gpu_processes", details=details)


# -- processes as results and messages name them ---------------------------------------------------------------
def short_command(info):
    return printable(" ".join(info.cmdline), COMMAND_SHOWN)


def shown_command(info):
    """A process's command line as messages quote it: quoted, control characters escaped (text.printable), at
    most COMMAND_SHOWN characters."""
    return f"'{short_command(info)}'"


def describe_process(info):
    """``pid 500 (torchrun, pid 12 inside: 'torchrun train.py')``: how messages name a parent."""
    inside = f", pid {info.ns_pid} inside" if info.ns_pid != info.pid else ""
    command = f": {shown_command(info)}" if info.cmdline else ""
    return f"pid {info.pid} ({printable(info.comm)}{inside}{command})"


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
    return f"pid {info.pid} ({printable(info.comm)}{inside}) on {gpus}" + (f", {memory} MiB" if memory else "")


def as_result(entry):
    info = entry["info"]
    return {
        "pid": info.pid,
        "ns_pid": info.ns_pid,
        "name": printable(info.comm),
        "owner": info.owner,
        "gpus": sorted(entry["gpus"]),
        "memory_mib": sum(entry["gpus"].values()),
        "found_by": sorted(entry["found_by"]),
    }


def as_launcher(restarter):
    info = restarter["info"]
    return {
        "pid": info.pid,
        "ns_pid": info.ns_pid,
        "name": printable(info.comm),
        "owner": info.owner,
        "command": short_command(info),
        "reason": restarter["why"],
        "restarts": sorted(restarter["restarts"]),
    }


def as_parent(parent, note=MAY_RESTART):
    """A parent of ended holders that was not ended with them (:func:`plan.plan_parents`), as results name it."""
    info = parent["info"]
    return {
        "pid": info.pid,
        "ns_pid": info.ns_pid,
        "name": printable(info.comm),
        "command": short_command(info),
        "parent_of": sorted(parent["of"]),
        "note": note,
    }


def as_guarded(entry, why):
    return dict(as_result(entry), command=short_command(entry["info"]), reason=why)


# -- problems --------------------------------------------------------------------------------------------------
def window_message(label, entry, why):
    """One sentence per holder an unattended run leaves running: pid, command (shortened), why."""
    command = f", running {shown_command(entry['info'])}," if entry["info"].cmdline else ""
    return (
        f"{label}: {describe(entry)}{command} is left running: {why}; ending it needs a window (run recover.yml "
        "without recover_unattended)"
    )


def pid_file_message(label, unread):
    return (
        f"{label}: cannot tell which process the guard's pid file names: "
        + "; ".join(f"{path}: {why}" for path, why in unread)
        + ". Nothing was ended: an unattended run ends nothing it cannot tell from the guarded job. Fix the pid "
        "file or gpu_processes_guard"
    )


def blocker_message(label, blockers):
    return (
        f"{label}: cannot free its GPUs: "
        + "; ".join(f"{describe(e)} {why}" for e, why in blockers)
        + ". Nothing was ended. Stop those processes yourself, or give this target GPUs of its own"
    )


def unit_stop_advice(unit, info, vmid):
    """How a person stops the service ``unit`` (a command only for a name that passed process_job.UNIT_NAME)."""
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


# -- errors ----------------------------------------------------------------------------------------------------
def restart_error(target, restarted, result):
    """Parents seen restarting their workers when ``end_launchers`` is false: named with the fix, not ended."""
    parts = []
    for parent, children in restarted:
        ended = ", ".join(f"pid {pid}" for pid in sorted(parent["of"]))
        started = ", ".join(describe_process(c) for c in children)
        parts.append(f"{describe_process(parent['info'])} started {started} after the step ended {ended}")
    pids = " ".join(str(parent["info"].pid) for parent, _ in restarted)
    return GpuProcessesError(
        f"{target.label}: a parent of the processes the step ended starts new ones: "
        + "; ".join(parts)
        + f". It was not ended (end_launchers is false): stop it (`kill {pids}` on the node), or set "
        "gpu_processes_end_launchers to true (a run then ends it with its new worker) or add its name to "
        "gpu_processes_launchers",
        restarted=[dict(as_parent(parent), started=[c.pid for c in children]) for parent, children in restarted],
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
