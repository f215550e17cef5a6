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
cannot be ended by signals: the step fails naming the service and the command that stops it.

The run's own processes are never ended (:func:`run_processes`: the module and its parents, in bare mode
ansible-playbook and the shell that started it): a walk stops at them and names them (``own_run``). The parents of
a holder's job that are ended with it neither as launchers nor as shells (:func:`plan_parents`: a supervisor of no
known name, a Jupyter-like server) are named and, once the memory is free, watched ``settle`` seconds: a new child
of one of them is a restart, seen when it is forked, about 4 s before a CUDA worker holds GPU memory (the H200 run
of 2026-12-04 in docs/hardware.md). Attended, that parent is ended with its new child (:class:`Acting`); with
``end_launchers`` false the step fails naming it; unattended it is left running and named in ``needs_window``. A
new GPU holder nothing explains fails the step naming it and its parent.

Unattended mode (``unattended``, the scheduled drift corrector): the ``guard`` names the training job that runs as
expected (``{match: REGEX}`` searched in a process's command line, ``{pid_file: PATH}`` inside the target whose
pid is the job's main process). A holder is guarded when it or one of its parents in the same target matches
(:func:`plan_guard`); unattended, a guarded holder, its launchers and any holder whose job shares a process with
it are left running and named in ``needs_window`` (the run does not fail for them); unguarded holders are ended as
usual; with no guard at all an unattended run ends no holder (each is named in ``needs_window``). Attended (the
default), the guard changes nothing: the operator asked for recovery; the facts still name the guarded holders
(``guarded``). The pid files are read inside the target by this step's probe part, which the
fact pass runs only when the guard has a ``pid_file`` entry.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.nvidia_smi import NvidiaSmi, shown, valid_uuid
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_process import (
    ancestry,
    children_of,
    describe_state,
    device_holders,
    is_shell,
    matches_launcher,
    matches_name,
    owner_label,
    program_names,
    read_process,
    read_stat,
    read_unit_members,
    still_there,
    systemd_unit,
    unit_is_job,
    walk_stop,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import probe as gpu_probe

NAME = "gpu_processes"
# The GPUs come from preflight's probe part and the holders are read on the node; this part only reads the guard's
# pid files inside the target, and only when there are some (probe_payload is None otherwise: no part at all).
PROBE = gpu_probe
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
    # A restarted worker is seen as a new child of a parent that survived (at once) or as a new GPU holder (a
    # CUDA worker holds GPU memory ~4 s after its exec on an H200: import torch, then CUDA init). 10 s covers a
    # supervisor that waits up to ~5 s before it restarts, and a worker something outside the job starts at once.
    "settle": {"type": "float", "default": 10},
    # The scheduled drift corrector: leave the guarded job running and name it in needs_window (module docstring).
    "unattended": {"type": "bool", "default": False},
    # The training job that runs as expected: [{match: REGEX} | {pid_file: PATH}] (check_guard says the shape).
    "guard": {"type": "list", "elements": "dict", "default": []},
    # The controller's ansible-playbook when it runs on this machine (bare mode): it and its parents are never
    # ended. The module's own parents never are either (run_processes).
    "controller_pid": {"type": "int", "default": None},
}
GUARD_KEYS = ("match", "pid_file")
MAX_PARENTS = 32  # how far up a holder's parents are walked (a real job is a few levels deep)
COMMAND_SHOWN = 120  # characters of a parent's command line a message quotes
CONTROLLER_NAMES = ("ansible-playbook", "ansible-runner")  # what controller_pid must name to be trusted
MAY_RESTART = "may start workers again: not ended"


class GpuProcessesError(RecoverError):
    """The GPUs cannot be freed (blockers, survivors, memory the driver keeps); details carry what was done."""

    def __init__(self, message, **details):
        super().__init__(message, kind="gpu_processes", details=details)


def owner_of(target):
    """How /proc ownership names the target's processes: ``ct:<vmid>``, or ``host`` for a bare host."""
    return f"ct:{target['vmid']}" if target["vmid"] is not None else "host"


def ending_pids_of(context):
    """Pids (as the target numbers them) that this step ends before a later step runs: its facts' ``processes``
    and ``launchers`` when it has work (``context["steps"]`` of the fact pass), else none."""
    facts = context["steps"].get(NAME) or {}
    if not facts.get("pending"):
        return []
    found = [p.get("ns_pid") for p in (facts.get("processes") or []) + (facts.get("launchers") or [])]
    return sorted({pid for pid in found if isinstance(pid, int)})


# -- the fact pass ---------------------------------------------------------------------------------------------
def pid_files_of(guard):
    """The pid files the guard names, in its order, once each."""
    files = (item["pid_file"] for item in guard or [] if isinstance(item, dict) and "pid_file" in item)
    return list(dict.fromkeys(files))


def probe_payload(spec, timeout=60):
    """``{"pid_files": [...]}`` when the guard names pid files (read inside the target); None (no part) otherwise."""
    files = pid_files_of(spec.get("guard"))
    return {"pid_files": files} if files else None


# read_node looks only at the node: the fact pass runs it while the probe runs in the target (pve_steps).
NODE_READ_NEEDS_ANSWER = False


def read_node(spec, target, answer, context):
    """Node-side reads: NVML's compute processes (host pids), their /proc entries, the device-file holders, and
    the jobs of the target's own (their parents, the members of the systemd services they run in). With a guard,
    every parent of the target's holders up to the target's init (a guard may name any of them). ``answer`` is
    not read (the guard's pid files are matched in evaluate_step)."""
    owner = owner_of(context["target"])
    apps = NvidiaSmi(target.run_on_node, timeout=target.timeout).compute_apps()
    infos = {a["pid"]: read_process(a["pid"]) for a in apps}
    devices = device_holders(owner)
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


def plan_cleanup(holders, owner, protected, node, keep_idle=(), *, own=()):
    """Sort holders into ``(to_end, protected_idle, blockers)``; pure, so every verdict is unit tested.

    ``to_end``: the target's own processes. ``protected_idle``: protected ones and ``keep_idle`` ones (a display
    server, a monitoring exporter) holding no GPU memory, left alone. ``blockers``: processes whose memory on the
    target's GPUs can never be freed by this module (another CT's, the node's, another container runtime's, or a
    protected one, or a process of this recover run: ``own``), each with the reason. A ``keep_idle`` process
    holding memory is ended like any other.
    """
    to_end, protected_idle, blockers = [], [], []
    for pid in sorted(holders):
        entry = holders[pid]
        info = entry["info"]
        if (info.pid, info.start_time) in own:
            blockers.append((entry, "runs this recover run (the module, ansible-playbook or a parent of theirs)"))
            continue
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


def job_chain(info, holders, ancestors, owner, protected, *, own=()):
    """The parents of holder ``info`` that are part of its job, nearest first; pure.

    Walks ``ancestors`` (host pid -> ProcessInfo) up from ``info.ppid`` and stops before a process where
    :func:`walk_stop` says the job ends (a process of this run included: ``own``), and at another holder (whose
    own chain covers what is above it).
    """
    chain, pid = [], info.ppid
    while pid in ancestors and pid not in holders and len(chain) < MAX_PARENTS:
        parent = ancestors[pid]
        if walk_stop(parent, owner, protected, own) or parent in chain:
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


def plan_jobs(to_end, holders, ancestors, units, *, owner, launchers, protected, own=()):
    """The restarters to end with the holders, and the systemd services that would start them again; pure.

    Returns ``(restarters, services)``. ``restarters``: entries like a holder's (``info``, ``gpus``,
    ``found_by``) plus ``why`` and ``restarts`` (the holder pids they are parents of), the farthest parent
    first, so that a loop is ended before the launcher it restarts. ``services``: ``(entry, unit)`` of each
    holder in a systemd service that is its job's (pve_process.unit_is_job).
    """
    restarters, services = {}, []
    for entry in to_end:
        info = entry["info"]
        chain = job_chain(info, holders, ancestors, owner, protected, own=own)
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


def plan_parents(to_end, restarters, holders, ancestors, *, owner, protected, own=()):
    """``(parents, own_run)`` of the holders a run ends; pure.

    ``parents``: the processes of each holder's job (:func:`job_chain`) that are not ended with it (no launcher,
    no shell): ``{"info", "of": [holder pids]}``, nearest first. They may start workers again, so a run watches
    them for new children during the settle window. ``own_run``: one sentence per process of this recover run
    (``own``) where a holder's walk stopped: never ended, named.
    """
    ending = {r["info"].pid for r in restarters}
    parents, own_run = {}, []
    for entry in to_end:
        info = entry["info"]
        chain = job_chain(info, holders, ancestors, owner, protected, own=own)
        for parent in chain:
            if parent.pid not in ending:
                parents.setdefault(parent.pid, {"info": parent, "of": []})["of"].append(info.pid)
        above = ancestors.get(chain[-1].ppid if chain else info.ppid)
        if above is not None and (above.pid, above.start_time) in own:
            sentence = f"{describe_process(above)} also runs this recover run: not ended"
            if sentence not in own_run:
                own_run.append(sentence)
    return list(parents.values()), own_run


# -- the guard (unattended mode) -------------------------------------------------------------------------------
def guard_pids_of(answer, guard):
    """``({pid file: pid inside the target}, [(pid file, why unreadable)])`` from the probe part's answer.

    A missing pid file names no process (its job does not run); one that exists but holds no pid, or cannot be
    read, is in the second list. The answer comes from inside a CT: anything that is not its shape is a
    GpuProcessesError (the fact pass then names the step as unreadable).
    """
    files = pid_files_of(guard)
    if not files:
        return {}, []
    read = answer.get("pid_files") if isinstance(answer, dict) else None
    if not isinstance(read, dict):
        raise GpuProcessesError("the gpu_processes probe answered no 'pid_files' object")
    pids, unread = {}, []
    for path in files:
        one = read.get(path)
        if not isinstance(one, dict) or one.get("state") not in ("ok", "missing", "unreadable"):
            raise GpuProcessesError(f"the gpu_processes probe answered nothing usable for the pid file {path}")
        pid = one.get("pid")
        if one["state"] == "ok" and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
            pids[path] = pid
        elif one["state"] != "missing":
            unread.append((path, str(one.get("reason") or "it holds no pid")))
    return pids, unread


def lineage(info, ancestors, owner):
    """``info`` and its parents in the same target, nearest first, up to (not including) the target's init; pure.

    ``ancestors``: host pid -> ProcessInfo (:func:`read_jobs`, :func:`read_lineage`).
    """
    chain, current = [], info
    while (
        current is not None
        and current.owner == owner
        and current.pid > 1
        and current.ns_pid != 1
        and current not in chain
        and len(chain) <= MAX_PARENTS
    ):
        chain.append(current)
        current = ancestors.get(current.ppid)
    return chain


def guard_hit(info, guard, guard_pids):
    """How the guard names process ``info`` (words for messages), or None; pure.

    ``{match: REGEX}`` is searched (re.search) in its command line joined with spaces; ``{pid_file: PATH}`` names it
    when the pid the file holds (``guard_pids``) is its pid inside the target.
    """
    command = " ".join(info.cmdline)
    for item in guard:
        if "match" in item and command and re.search(item["match"], command):
            return f"matches gpu_processes_guard {{match: {item['match']!r}}}"
        if "pid_file" in item and guard_pids.get(item["pid_file"]) == info.ns_pid:
            return f"is the pid in {item['pid_file']} (gpu_processes_guard)"
    return None


def guard_reason(info, ancestors, owner, guard, guard_pids):
    """``(guarded process, why)`` when holder ``info`` or one of its parents in the target is guarded, else None."""
    for depth, process in enumerate(lineage(info, ancestors, owner)):
        hit = guard_hit(process, guard, guard_pids)
        if hit is not None:
            if depth == 0:
                return process, f"it {hit}"
            kin = "parent" if depth == 1 else "ancestor"
            return process, f"its {kin} {describe_process(process)} {hit}"
    return None


def plan_guard(to_end, holders, ancestors, *, owner, guard, guard_pids, unattended, protected):
    """Split the target's own holders by the guard: ``(ending, guarded, kept)``; pure.

    ``guarded``: ``[(entry, why)]`` of the holders that are, or descend from, a process the guard names (told in
    attended mode too). ``kept`` (unattended only, else ``[]``): the holders left running, each with why: the
    guarded ones, then, until none is added, every holder that is a parent of a kept one, a child of a kept one,
    or whose job (:func:`job_chain`) shares a process with a kept one's line, since ending it would end or restart
    what is kept. ``ending``: ``to_end`` without ``kept``; the launchers planned from it are never the kept job's.
    """
    reasons = [(entry, guard_reason(entry["info"], ancestors, owner, guard, guard_pids)) for entry in to_end]
    guarded = [(entry, found[1]) for entry, found in reasons if found is not None]
    if unattended and not guard:
        # Nothing tells a healthy training job from a stray process: an unattended run ends none (issue 25).
        why = "no gpu_processes_guard names the training job, so an unattended run cannot tell it from a stray process"
        return [], guarded, [(entry, why) for entry in to_end]
    if not unattended or not guarded:
        return list(to_end), guarded, []
    kept = {entry["info"].pid: (entry, why) for entry, why in guarded}
    lines = {entry["info"].pid: lineage(entry["info"], ancestors, owner) for entry in to_end}

    guarded_pids = set(kept)

    def named(entry):
        if entry["info"].pid in guarded_pids:
            return f"the guarded {describe(entry)}"
        return f"{describe(entry)}, which is left running"

    added = True
    while added:
        added = False
        job = {}  # host pid of every process in a kept holder's line -> that holder
        for entry, _ in kept.values():
            for process in lines[entry["info"].pid]:
                job.setdefault(process.pid, entry)
        for entry in to_end:
            info = entry["info"]
            if info.pid in kept:
                continue
            above = [p for p in lines[info.pid][1:] if p.pid in kept]
            shared = [p for p in job_chain(info, holders, ancestors, owner, protected) if p.pid in job]
            if info.pid in job:
                why = f"it is a parent of {named(job[info.pid])}"
            elif above:
                why = f"it descends from {named(kept[above[0].pid][0])}"
            elif shared:
                why = f"its job shares {describe_process(shared[0])} with {named(job[shared[0].pid])}"
            else:
                continue
            kept[info.pid] = (entry, why)
            added = True
    ordered = [kept[e["info"].pid] for e in to_end if e["info"].pid in kept]
    return [e for e in to_end if e["info"].pid not in kept], guarded, ordered


def kept_gpus(kept):
    """The indexes of the GPUs a holder left running (unattended, guarded) uses: they stay busy after the step."""
    return sorted({index for entry, _ in kept for index in entry["gpus"]})


def wait_uuids(gpus, kept):
    """The UUIDs of the target's GPUs that must be free after the step: all but those a kept holder uses."""
    busy = set(kept_gpus(kept))
    return {g["uuid"] for g in gpus if g["index"] not in busy}


def as_guarded(entry, why):
    return dict(as_result(entry), command=short_command(entry["info"]), reason=why)


def short_command(info):
    return printable(" ".join(info.cmdline), COMMAND_SHOWN)


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


def shown_command(info):
    """A process's command line as messages quote it: quoted, control characters escaped (pve_text.printable), at
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
    """A parent of ended holders that was not ended with them (:func:`plan_parents`), as results name it."""
    info = parent["info"]
    return {
        "pid": info.pid,
        "ns_pid": info.ns_pid,
        "name": printable(info.comm),
        "command": short_command(info),
        "parent_of": sorted(parent["of"]),
        "note": note,
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


def check_guard(guard):
    """A sentence naming the first ``guard`` entry that cannot work (it names the role variable), or None.

    Each entry is a dict with exactly one of ``match`` (a regular expression, searched in a process's command line
    joined with spaces) or ``pid_file`` (an absolute path inside the target).
    """
    shape = "each entry is {match: REGEX} (searched in the command line) or {pid_file: /absolute/path} (in the target)"
    for number, item in enumerate(guard or []):
        where = f"gpu_processes_guard[{number}]"
        if not isinstance(item, dict):
            return f"{where} is {item!r}, not a dict; {shape}"
        unknown = sorted(str(k) for k in item if k not in GUARD_KEYS)
        if unknown:
            return f"{where} has {', '.join(unknown)}; {shape}"
        present = [key for key in GUARD_KEYS if key in item]
        if len(present) != 1:
            return f"{where} has {' and '.join(present) or 'neither match nor pid_file'}; give one per entry: {shape}"
        key, value = present[0], item[present[0]]
        if not isinstance(value, str) or not value:
            return f"{where}.{key} is {value!r}; give a non-empty string"
        if key == "match":
            try:
                re.compile(value)
            except re.error as error:
                return f"{where}.match {value!r} is not a regular expression: {error}"
        elif not value.startswith("/") or "\0" in value:
            return f"{where}.pid_file {value!r} is not an absolute path (the pid file's path inside the target)"
    return None


def check_spec(params):
    """A sentence naming the first setting that cannot work, or None: the waits, then the guard's shape.

    The fact pass checks the step's settings with this before anything runs (module_utils/pve_steps); the
    module checks its options with it too.
    """
    return check_waits(params) or check_guard(params.get("guard"))


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
                        "name": printable(entry["info"].comm),
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


def read_guard_pids(target, p):
    """The guard's pid files, read inside the target by the probe part: one more command, made only when the
    guard names pid files. Returns :func:`guard_pids_of`'s ``(pids, unread)``."""
    payload = probe_payload(p)
    if payload is None:
        return {}, []
    return guard_pids_of(target.run_probe(gpu_probe, payload), p["guard"])


def find(target, node_smi, p):
    """Read the target's GPUs (in the target), NVML's processes, device holders and their jobs (on the node); plan.

    Returns a dict: ``gpus``, ``owner``, ``to_end`` (what a run ends: the guard's ``kept`` left out),
    ``protected_idle``, ``blockers``, ``restarters``, ``services``, ``jobs`` (``(pid, start_time)`` of every
    parent that is part of a holder's job), ``guarded``, ``kept``, ``unread`` (pid files that could not be read),
    ``guard_pids``, ``ancestors``, ``parents`` (those the run leaves running: watched for restarts) and
    ``own_run`` (sentences naming this run's processes among the holders' parents).
    """
    gpus = NvidiaSmi(target.run, timeout=target.timeout).memory()
    guard_pids, unread = read_guard_pids(target, p)
    owner = owner_of({"vmid": target.vmid if target.is_container else None})
    apps = node_smi.compute_apps()
    infos = {a["pid"]: read_process(a["pid"]) for a in apps}
    devices = device_holders(owner)
    holders = collect_holders(apps, gpus, infos, devices)
    run = run_processes(p.get("controller_pid")) if holders else set()
    own, protected_idle, blockers = plan_cleanup(holders, owner, p["protected"], target.node, p["keep_idle"], own=run)
    ancestors, units = read_jobs([e["info"] for e in own], owner, run)
    if p["guard"]:
        ancestors.update(read_lineage([e["info"] for e in own], owner, ancestors))
    to_end, guarded, kept = plan_guard(
        own,
        holders,
        ancestors,
        owner=owner,
        guard=p["guard"],
        guard_pids=guard_pids,
        unattended=p["unattended"],
        protected=p["protected"],
    )
    restarters, services = plan_jobs(
        to_end, holders, ancestors, units, owner=owner, launchers=p["launchers"], protected=p["protected"], own=run
    )
    parents, own_run = plan_parents(
        to_end, restarters, holders, ancestors, owner=owner, protected=p["protected"], own=run
    )
    jobs = {
        (parent.pid, parent.start_time)
        for entry in to_end
        for parent in job_chain(entry["info"], holders, ancestors, owner, p["protected"], own=run)
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
        "guarded": guarded,
        "kept": kept,
        "unread": unread,
        "guard_pids": guard_pids,
        "ancestors": ancestors,
        "parents": parents,
        "own_run": own_run,
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


def relist(node_smi, gpus, owner, known, p, *, keep=None):
    """The holders of the target's GPUs now (NVML and device files) that are not in ``known`` (pid, start time),
    not :func:`left_alone` and not what ``keep(entry)`` says an unattended run leaves running (the guarded job)."""
    apps = node_smi.compute_apps()
    holders = collect_holders(apps, gpus, {a["pid"]: read_process(a["pid"]) for a in apps}, device_holders(owner))
    return [
        e
        for pid, e in sorted(holders.items())
        if (pid, e["info"].start_time) not in known and not left_alone(e, p) and not (keep and keep(e))
    ]


def new_device_holders(owner, known, p, *, keep=None):
    """The target's processes holding NVIDIA device files that are not in ``known``, not :func:`left_alone` and
    not kept (``keep``, see :func:`relist`): a /proc scan, no command."""
    found = [{"info": info, "gpus": {}, "found_by": {"device"}} for info, _ in device_holders(owner)]
    return [
        e
        for e in found
        if (e["info"].pid, e["info"].start_time) not in known and not left_alone(e, p) and not (keep and keep(e))
    ]


def guarded_now(found, p):
    """``keep`` for :func:`relist` in an unattended run: a new holder that is the guarded job's (it or a parent of
    it is guarded: a job that runs as expected starts workers), read on the node when it appears."""
    owner, ancestors = found["owner"], dict(found["ancestors"])

    def keep(entry):
        ancestors.update(read_lineage([entry["info"]], owner, ancestors))
        return guard_reason(entry["info"], ancestors, owner, p["guard"], found["guard_pids"]) is not None

    return keep


def refuse_unsafe(target, found, p, result):
    """Raise, before anything is ended, when the plan cannot free the GPUs: blockers (other owners', protected),
    holders in a systemd service of their own, restarters that ``end_launchers: false`` forbids ending, or (in
    an unattended run) a guard pid file that cannot be read."""
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
    if found["unread"] and p["unattended"]:
        raise GpuProcessesError(pid_file_message(target.label, found["unread"]), **result)


def cleanup(target, node_smi, p, *, check_mode=False, warn=lambda message: None):
    """Re-read and plan, then (unless ``check_mode``) end the restarters and the holders, wait until the memory is
    free, and watch ``settle`` seconds for restarts: a new child of a parent left running (:func:`plan_parents`),
    or a new holder of the target's GPUs.

    ``p`` holds the SPEC settings; ``warn`` receives warnings for the module's result. Raises GpuProcessesError
    carrying what was already done.
    """
    clock, sleep = time.monotonic, time.sleep  # looked up now, so a test can give the module a clock of its own
    started = clock()
    found = find(target, node_smi, p)
    gpus, to_end, restarters = found["gpus"], found["to_end"], found["restarters"]
    result = {
        "processes": [as_result(e) for e in to_end],
        "launchers": [as_launcher(r) for r in restarters],
        "protected": [as_result(e) for e in found["protected_idle"]],
        "guarded": [as_guarded(e, why) for e, why in found["guarded"]],
        "needs_window": [window_message(target.label, e, why) for e, why in found["kept"]],
        "kept_gpus": kept_gpus(found["kept"]),
        "parents": [as_parent(e) for e in found["parents"]],
        "own_run": found["own_run"],
        "changes": plan_changes(to_end, restarters),
        "killed": [],
        "memory": gpus,
        "polls": 0,
        "seconds_to_free": 0.0,
        "watched": 0.0,
    }
    for sentence in found["own_run"]:
        warn(f"{target.label}: {sentence}")
    refuse_unsafe(target, found, p, result)
    result.update(changed=bool(to_end), diff=diff_cleanup(to_end, restarters))
    # The GPUs that must be free afterwards: those a holder left running (unattended, guarded) uses stay busy.
    held = busy_gpus(gpus, wait_uuids(gpus, found["kept"]), p["memory_threshold_mib"])
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
    if not check_mode and to_end:
        Acting(target, node_smi, p, found, result, clock=clock, sleep=sleep).run(started)
    result["seconds"] = round(clock() - started, 3)
    return result


class Acting:
    """A real run's acting half, on what :func:`find` planned: end, wait for the memory, watch for restarts.

    Everything it learns goes into ``result`` (the module's), so an error raised on the way carries it.
    """

    def __init__(self, target, node_smi, p, found, result, *, clock, sleep):
        self.target, self.node_smi, self.p, self.found, self.result = target, node_smi, p, found, result
        self.clock, self.sleep = clock, sleep
        self.uuids = wait_uuids(found["gpus"], found["kept"])
        # What may still hold the GPUs after this: only what was left alone (protected or idle, or the guarded job
        # of an unattended run, which may start new workers of its own).
        kept = [e for e, _ in found["kept"]]
        self.known = {(e["info"].pid, e["info"].start_time) for e in [*found["protected_idle"], *kept]}
        self.deferred = set()  # parents an unattended run saw restarting: their new workers wait for a window
        self.guarded = guarded_now(found, p) if p["unattended"] and p["guard"] else None
        # The parents left running, and their children before anything ends: a child beyond those is a restart.
        self.watched = {e["info"].pid: e for e in found["parents"]}
        self.before = children_of(list(self.watched))

    def keep(self, entry):
        """A new holder an unattended run leaves running: the guarded job's, or a deferred parent's new worker."""
        return entry["info"].ppid in self.deferred or bool(self.guarded and self.guarded(entry))

    def run(self, started):
        found, result = self.found, self.result
        # The restarters first: a launcher is gone before its worker ends.
        result["killed"] = self.end([*found["restarters"], *found["to_end"]])
        self.free()
        result["seconds_to_free"] = round(self.clock() - started, 3)
        # Each round ends what restarted (attended) and watches again, or stops: at most one per parent.
        for _ in range(len(self.watched) + 1):
            if self.p["settle"] <= 0 or not self.settle():
                break
            self.free()

    def end(self, entries):
        """SIGTERM, grace, SIGKILL ``entries`` in their order; the ``killed`` list, or a survivor error."""
        p = self.p
        killed, survivors = end_processes(
            entries,
            grace=p["grace"],
            kill_timeout=p["kill_timeout"],
            poll_interval=p["poll_interval"],
            alive=still_there,
            send=signal_process,
            clock=self.clock,
            sleep=self.sleep,
        )
        if survivors:
            raise survivor_error(self.target, [(e, state_of(e)) for e in survivors], p["kill_timeout"], self.result)
        return killed

    def new_holders(self):
        return new_device_holders(self.found["owner"], self.known, self.p, keep=self.keep)

    def free(self):
        """Poll until the GPUs are free (``memory``, ``polls`` in the result). A new holder while the memory stays
        used is named with its parent; memory no process holds is the driver's (reset advice)."""
        p, found, gpus, result = self.p, self.found, self.found["gpus"], self.result
        appeared = []

        def interrupt():
            appeared[:] = self.new_holders()
            return bool(appeared)

        waiting = self.clock()
        while True:
            rows, more, free = wait_for_memory(
                self.node_smi.memory,
                self.uuids,
                threshold=p["memory_threshold_mib"],
                timeout=max(0.0, p["memory_timeout"] - (self.clock() - waiting)),
                poll_interval=p["poll_interval"],
                clock=self.clock,
                sleep=self.sleep,
                interrupt=interrupt,
            )
            result.update(memory=target_rows(rows, gpus), polls=result["polls"] + more)
            if free:
                return
            # Before blaming the driver: memory that came back may be a new worker's (a restarted job).
            new = relist(self.node_smi, gpus, found["owner"], self.known, p, keep=self.keep)
            if new:
                when = (
                    "while the step waited for their memory to be released"
                    if appeared
                    else f"after the step ended the holders (the memory stayed used for {p['memory_timeout']:g} s)"
                )
                raise new_holder_error(self.target, new, found, when, result)
            if not appeared or self.clock() - waiting >= p["memory_timeout"]:
                raise no_holder_error(
                    self.target.label,
                    busy_gpus(rows, self.uuids, p["memory_threshold_mib"]),
                    p["memory_threshold_mib"],
                    result,
                    waited=p["memory_timeout"],
                )
            appeared.clear()  # the new holder was gone again by the time the holders were listed: wait on

    def settle(self):
        """Watch ``settle`` seconds; True when a parent restarted and was ended (watch again), False when the
        window ended quietly or the restart was left to a window. Raises on a new holder nothing explains."""
        p, result = self.p, self.result
        window_started = self.clock()
        restarts, new = watch_jobs(
            lambda: new_children(self.watched, self.before, self.deferred, [*p["protected"], *p["keep_idle"]]),
            self.new_holders,
            window=p["settle"],
            poll_interval=p["poll_interval"],
            clock=self.clock,
            sleep=self.sleep,
        )
        result["watched"] = round(result["watched"] + self.clock() - window_started, 3)
        if not restarts:
            new = new or relist(self.node_smi, self.found["gpus"], self.found["owner"], self.known, p, keep=self.keep)
            if new:
                when = f"within the {p['settle']:g} s the step watched after their memory was free"
                raise new_holder_error(self.target, new, self.found, when, result)
            return False
        restarted = [(self.watched.pop(pid), children) for pid, children in sorted(restarts.items())]
        if not p["end_launchers"]:
            raise restart_error(self.target, restarted, result)
        ended = False
        for parent, children in restarted:
            entry = note_restart(self.target.label, parent, children, self.found, result, unattended=p["unattended"])
            if entry is None:
                self.deferred.add(parent["info"].pid)
                continue
            kids = [{"info": c, "gpus": {}, "found_by": {"parent"}} for c in children]
            result["killed"] += self.end([entry, *kids])
            ended = True
        return ended


def new_children(watched, before, deferred=(), ignore=()):
    """``{parent pid: [ProcessInfo]}`` of the children the watched parents have now and did not have before the
    holders were ended (a restart); a parent whose pid was reused (start time) or that is deferred is left out, and
    so is a child named by ``ignore`` (protected and keep_idle: a supervisor's ``nvidia-smi`` health check)."""
    now = children_of([pid for pid in watched if pid not in deferred])
    found = {}
    for pid, children in now.items():
        parent = read_stat(pid)
        if parent is None or parent[2] != watched[pid]["info"].start_time:
            continue
        infos = [read_process(child) for child, _ in sorted(children - before.get(pid, set()))]
        infos = [i for i in infos if i is not None and not matches_name(i, ignore)]
        if infos:
            found[pid] = infos
    return found


def watch_jobs(restarts, new_holders, *, window, poll_interval, clock=time.monotonic, sleep=time.sleep):
    """Ask ``restarts()`` (new children of the parents left running), then ``new_holders()``, every
    ``poll_interval`` for ``window`` seconds; return ``(restarts, holders)`` at the first non-empty answer, or
    ``({}, [])`` when the window ends with none (the last ask is at or after its end)."""
    deadline = clock() + window
    while True:
        found = restarts()
        if found:
            return found, []
        holders = new_holders()
        if holders or clock() >= deadline:
            return {}, holders
        sleep(poll_interval)


def note_restart(label, parent, children, found, result, *, unattended):
    """Record a parent seen starting ``children`` after the holders ended. Attended: the entry to end (like a
    launcher, before its children), added to ``launchers`` and ``changes``; unattended: None, the parent and the
    fix named in ``needs_window`` and the GPUs of the holders it restarts in ``kept_gpus``."""
    info = parent["info"]
    started = ", ".join(describe_process(c) for c in children)
    ended = ", ".join(f"pid {pid}" for pid in sorted(parent["of"]))
    why = f"restarted its worker: it started {started} after the step ended {ended}"
    note = dict(as_parent(parent), note=f"started {started} after the step ended {ended}")
    result["parents"] = [note if r["pid"] == info.pid else r for r in result["parents"]]
    if unattended:
        result["needs_window"].append(
            f"{label}: {describe_process(info)} {why}; it is left running: ending it needs a window (run "
            f"recover.yml without recover_unattended), or add its name to gpu_processes_launchers"
        )
        gpus = {i for e in found["to_end"] if e["info"].pid in parent["of"] for i in e["gpus"]}
        result["kept_gpus"] = sorted(set(result["kept_gpus"]) | gpus)
        return None
    restarter = {"info": info, "gpus": {}, "found_by": {"parent"}, "why": why, "restarts": list(parent["of"])}
    result["launchers"].append(as_launcher(restarter))
    result["changes"].append(f"end launcher {describe_restarter(restarter)}")
    return restarter


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
        new_holders=[dict(as_result(e), parent=e["info"].ppid, command=short_command(e["info"])) for e in new],
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
