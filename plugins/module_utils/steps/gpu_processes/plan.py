# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPU processes step's plan: who holds the target's GPUs, which of them a run ends, which of their parents
it ends with them (launchers, shells running the job) and which it watches for restarts, and the changes and diff
that say so. Pure, so every verdict is unit tested; the reads that feed it are facts.py's (the fact pass) and
acting.py's (the module)."""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import matches_name, owner_label
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process_job import (
    is_shell,
    matches_launcher,
    systemd_unit,
    unit_is_job,
    walk_stop,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.messages import (
    describe,
    describe_process,
    describe_restarter,
)

MAX_PARENTS = 32  # how far up a holder's parents are walked (a real job is a few levels deep)


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
    holder in a systemd service that is its job's (process_job.unit_is_job).
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
