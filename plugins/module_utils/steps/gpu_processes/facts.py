# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPU processes step: which processes hold the target's GPUs, whose they are, and ending them.

The fact pass (module_utils/steps/registry) evaluates it from preflight's GPU list (read inside the target by the
preflight probe part, so this step adds no call inside the CT) and the node-side reads: NVML's compute processes
and /proc on the node. The ``gpu_processes`` module calls :func:`acting.cleanup` when the facts show holders; it
re-reads everything itself first (facts can be seconds old), so it is also correct when called alone.

Jobs restart their workers (torchrun's elastic agent, ``while true; do python train.py; done``, a systemd service
with ``Restart=always``), so the step ends the JOB: each holder's parents are walked up (host pids, on the node)
while they belong to the same target, stopping at the target's init, an interactive shell, a session or service
manager and a protected process (process_job.walk_stop); the launchers among them (``launchers`` patterns, and
shells running the job) are ended first, together with the holders. A holder in a systemd service of its own
cannot be ended by signals: the step fails naming the service and the command that stops it.

The run's own processes are never ended (:func:`run_processes`: the module and its parents, in bare mode
ansible-playbook and the shell that started it): a walk stops at them and names them (``own_run``). The parents of
a holder's job that are ended with it neither as launchers nor as shells (:func:`plan.plan_parents`: a supervisor of no
known name, a Jupyter-like server) are named and, once the memory is free, watched ``settle`` seconds: a new child
of one of them is a restart, seen when it is forked, about 4 s before a CUDA worker holds GPU memory (the H200 run
of 2026-12-04 in docs/hardware.md). Attended, that parent is ended with its new child (:class:`acting.Acting`); with
``end_launchers`` false the step fails naming it; unattended it is left running and named in ``needs_window``. A
new GPU holder nothing explains fails the step naming it and its parent.

Unattended mode (``unattended``, the scheduled drift corrector): the ``guard`` names the training job that runs as
expected (``{match: REGEX}`` searched in a process's command line, ``{pid_file: PATH}`` inside the target whose
pid is the job's main process). A holder is guarded when it or one of its parents in the same target matches
(:func:`guard.plan_guard`); unattended, a guarded holder, its launchers and any holder whose job shares a process with
it are left running and named in ``needs_window`` (the run does not fail for them); unguarded holders are ended as
usual; with no guard at all an unattended run ends no holder (each is named in ``needs_window``). Attended (the
default), the guard changes nothing: the operator asked for recovery; the facts still name the guarded holders
(``guarded``). The pid files are read inside the target by this step's probe part, which the
fact pass runs only when the guard has a ``pid_file`` entry.

The step's modules, by concern: this one (NAME, SPEC, the fact pass's node reads and evaluation, the settings
check), ``plan`` (who holds the GPUs and what a run ends; pure), ``guard`` (unattended mode's guard; pure),
``messages`` (how results and errors name processes), ``ending`` (the signals and the waits), ``acting`` (the
module's half: re-read, end, wait, watch) and ``handoff`` (what later steps read of this step's facts, imported
without the rest of it).
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import os

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import NvidiaSmi
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import (
    ancestry,
    device_holders,
    owner_of,
    process_owners,
    read_process,
    read_unit_members,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process_job import (
    program_names,
    systemd_unit,
    walk_stop,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.shared_reads import node_read
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import probe as gpu_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.guard import (
    check_guard,
    guard_pids_of,
    kept_gpus,
    pid_files_of,
    plan_guard,
    wait_uuids,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.messages import (
    as_guarded,
    as_launcher,
    as_parent,
    as_result,
    blocker_message,
    no_holder_error,
    pid_file_message,
    restarter_message,
    service_message,
    service_reason,
    window_message,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.plan import (
    MAX_PARENTS,
    busy_gpus,
    collect_holders,
    diff_cleanup,
    plan_changes,
    plan_cleanup,
    plan_jobs,
    plan_parents,
)

NAME = "gpu_processes"
# The GPUs come from preflight's probe part and the holders are read on the node; this part only reads the guard's
# pid files inside the target, and only when there are some (probe_payload is None otherwise: no part at all).
PROBE = gpu_probe
DEFAULT_PROTECTED = ["nvidia-persistenced", "nv-hostengine", "nv-fabricmanager", "nvidia-fabricmanager", "dcgm*"]
# Parents that start workers and start them again when they die: matched like protected, and also by the module
# of ``python -m`` and the script an interpreter runs (process_job.program_names).
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
    # A restarted worker is seen as a new child of a parent that survived (at once) or as a new GPU holder (a
    # CUDA worker holds GPU memory ~4 s after its exec on an H200: import torch, then CUDA init). 10 s covers a
    # supervisor that waits up to ~5 s before it restarts, and a worker something outside the job starts at once.
    "settle": {"type": "float", "default": 10},
    # The scheduled drift corrector: leave the guarded job running and name it in needs_window (module docstring).
    "unattended": {"type": "bool", "default": False},
    # The training job that runs as expected: [{match: REGEX} | {pid_file: PATH}] (guard.check_guard says the shape).
    "guard": {"type": "list", "elements": "dict", "default": []},
    # The controller's ansible-playbook when it runs on this machine (bare mode): it and its parents are never
    # ended. The module's own parents never are either (run_processes).
    "controller_pid": {"type": "int", "default": None},
}
# The settings whose role variable is not gpu_processes_<setting> (registry.settings_from_variables): the role
# computes it from the controller's environment (roles/gpu_processes/vars/main.yml).
ROLE_VARIABLES = {"controller_pid": "_gpu_processes_controller_pid"}
CONTROLLER_NAMES = ("ansible-playbook", "ansible-runner")  # what controller_pid must name to be trusted


# -- the fact pass ---------------------------------------------------------------------------------------------
def probe_payload(spec, timeout=60):
    """``{"pid_files": [...]}`` when the guard names pid files (read inside the target); None (no part) otherwise."""
    files = pid_files_of(spec.get("guard"))
    return {"pid_files": files} if files else None


# read_node looks only at the node: the fact pass runs it while the probe runs in the target (registry).
NODE_READ_NEEDS_ANSWER = False


def read_node(spec, target, answer, context):
    """Node-side reads: NVML's compute processes (host pids), their /proc entries, the device-file holders, and
    the jobs of the target's own (their parents, the members of the systemd services they run in). With a guard,
    every parent of the target's holders up to the target's init (a guard may name any of them). ``answer`` is
    not read (the guard's pid files are matched in evaluate_step)."""
    owner = owner_of(context["target"])
    # NVML's processes and every process's owner are the node's: read once for all the CTs of one execution.
    smi = NvidiaSmi(target.run_on_node, timeout=target.timeout)
    apps = node_read(context, ("compute_apps", target.timeout), smi.compute_apps)
    infos = {a["pid"]: read_process(a["pid"]) for a in apps}
    devices = device_holders(owner, owners=node_read(context, ("process_owners",), process_owners))
    holder_infos = [*infos.values(), *(info for info, _ in devices)]
    own = run_processes(spec.get("controller_pid")) if holder_infos else set()
    ancestors, units = read_jobs(holder_infos, owner, own)
    if spec.get("guard"):
        ancestors.update(read_lineage(holder_infos, owner, ancestors))
    return {"apps": apps, "infos": infos, "devices": devices, "ancestors": ancestors, "units": units, "own": own}


def evaluate_step(spec, answer, node, context):
    """Holders of the target's GPUs (preflight's list), the plan, and what a run would end; pure."""
    target = context["target"]
    gpus = context["steps"]["preflight"]["gpus"]
    holders = collect_holders(node["apps"], gpus, node["infos"], node["devices"])
    owner = owner_of(target)
    ancestors = node.get("ancestors", {})
    own = node.get("own") or set()
    to_end, protected_idle, blockers = plan_cleanup(
        holders, owner, spec["protected"], target["node"], spec["keep_idle"], own=own
    )
    guard_pids, unread = guard_pids_of(answer, spec.get("guard"))
    ending, guarded, kept = plan_guard(
        to_end,
        holders,
        ancestors,
        owner=owner,
        guard=spec.get("guard") or [],
        guard_pids=guard_pids,
        unattended=spec.get("unattended", False),
        protected=spec["protected"],
    )
    restarters, services = plan_jobs(
        ending,
        holders,
        ancestors,
        node.get("units", {}),
        owner=owner,
        launchers=spec["launchers"],
        protected=spec["protected"],
        own=own,
    )
    parents, own_run = plan_parents(
        ending, restarters, holders, ancestors, owner=owner, protected=spec["protected"], own=own
    )
    problems = []
    if blockers:
        problems.append(blocker_message(target["label"], blockers))
    if services:
        problems.append(service_message(target["label"], services, target["vmid"]))
    if restarters and not spec["end_launchers"]:
        problems.append(restarter_message(target["label"], restarters))
    if unread and spec.get("unattended"):
        problems.append(pid_file_message(target["label"], unread))
    held = busy_gpus(gpus, wait_uuids(gpus, kept), spec["memory_threshold_mib"])
    if held and not ending and not blockers:
        problems.append(str(no_holder_error(target["label"], held, spec["memory_threshold_mib"], {})))
    return {
        "processes": [as_result(e) for e in ending],
        "launchers": [as_launcher(r) for r in restarters],
        "protected": [as_result(e) for e in protected_idle],
        "blockers": [dict(as_result(e), reason=why) for e, why in blockers]
        + [dict(as_result(e), reason=service_reason(unit, e, target["vmid"])) for e, unit in services],
        "guarded": [as_guarded(e, why) for e, why in guarded],
        "needs_window": [window_message(target["label"], e, why) for e, why in kept],
        "kept_gpus": kept_gpus(kept),
        "parents": [as_parent(e) for e in parents],
        "own_run": own_run,
        "changes": plan_changes(ending, restarters),
        "problems": problems,
        "diff": diff_cleanup(ending, restarters),
        "pending": bool(ending) and not problems,
    }


# -- node reads (the fact pass's and the module's) -------------------------------------------------------------
def read_jobs(holder_infos, owner, own=()):
    """Node-side: ``(ancestors, units)`` of the target's holders.

    ``ancestors``: host pid -> ProcessInfo of every parent of a holder of ``owner``, walked up from each
    (``ppid`` of /proc/<pid>/stat) until :func:`walk_stop` stops (another owner, the init, an interactive
    shell, a process of this run: ``own``...), at most MAX_PARENTS levels. ``units``: cgroup path -> members
    (``[(pid, start_time)]``, None if unreadable) of each systemd service a holder runs in.
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
            if walk_stop(parent, owner, own=own):
                break
            pid = parent.ppid
        unit = systemd_unit(info.cgroup, owner)
        if unit is not None and unit["path"] not in units:
            units[unit["path"]] = read_unit_members(unit["path"])
    return ancestors, units


def read_lineage(holder_infos, owner, known=None):
    """Node-side: host pid -> ProcessInfo of every parent of a holder of ``owner`` up to the target's init (never
    past it, never into another owner), at most MAX_PARENTS levels; ``known`` (the walk of :func:`read_jobs`)
    is reused, not read again. Only what ``known`` lacks is returned.

    :func:`read_jobs` stops at an interactive shell or a session manager (nothing above is the holder's job); a
    guard may name a process above those (the tmux session that runs the training), so this walk goes on.
    """
    known = dict(known or {})
    found = {}
    for info in holder_infos:
        if info is None or info.owner != owner:
            continue
        pid = info.ppid
        for _ in range(MAX_PARENTS):
            if pid <= 1:
                break
            parent = known.get(pid)
            if parent is None:
                parent = read_process(pid)
                if parent is None:
                    break
                known[pid] = found[pid] = parent
            if parent.owner != owner or parent.ns_pid == 1:
                break
            pid = parent.ppid
    return found


def run_processes(controller_pid=None, proc_root="/proc"):
    """``{(pid, start_time)}`` of the processes that run this recover run on this machine: the module and its
    parents (in bare mode with a local connection they are the ansible worker, ansible-playbook, the shell and the
    session that started it), and ``controller_pid`` (the controller's ansible-playbook) and its parents when that
    pid names an ansible-playbook here (a controller elsewhere has other pids: a pid of the node that happens to
    match names some other program, and is ignored)."""
    own = set(ancestry(os.getpid(), proc_root))
    if controller_pid and controller_pid > 1:
        info = read_process(controller_pid, proc_root)
        if info is not None and program_names(info) & set(CONTROLLER_NAMES):
            own.update(ancestry(controller_pid, proc_root))
    return own


# -- settings --------------------------------------------------------------------------------------------------
def check_waits(params):
    """A sentence naming the first wait option that cannot work (negative, or a poll interval of 0), or None."""
    if params["poll_interval"] <= 0:
        return f"poll_interval must be more than 0 seconds, got {params['poll_interval']:g}"
    for name in ("grace", "kill_timeout", "memory_timeout", "memory_threshold_mib", "settle"):
        if params[name] < 0:
            return f"{name} must be 0 or more, got {params[name]:g}"
    return None


def check_spec(params):
    """A sentence naming the first setting that cannot work, or None: the waits, then the guard's shape.

    The fact pass checks the step's settings with this before anything runs (module_utils/steps/registry); the
    module checks its options with it too.
    """
    return check_waits(params) or check_guard(params.get("guard"))
