# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPU processes step's guard (unattended mode): which holders belong to the training job that runs as expected.

``guard`` entries are ``{match: REGEX}`` (searched in a process's command line) or ``{pid_file: PATH}`` (inside the
target, read by the step's probe part). A holder is guarded when it or one of its parents in the same target is
named; an unattended run leaves it, and what shares its job, running (:func:`plan_guard`). Pure: the pid files'
contents come in as the probe's answer, the parents as the node reads of facts.py."""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.messages import (
    GpuProcessesError,
    describe,
    describe_process,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.plan import MAX_PARENTS, job_chain

GUARD_KEYS = ("match", "pid_file")


def pid_files_of(guard):
    """The pid files the guard names, in its order, once each."""
    files = (item["pid_file"] for item in guard or [] if isinstance(item, dict) and "pid_file" in item)
    return list(dict.fromkeys(files))


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

    ``ancestors``: host pid -> ProcessInfo (:func:`facts.read_jobs`, :func:`facts.read_lineage`).
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
