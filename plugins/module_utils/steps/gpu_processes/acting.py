# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPU processes step's acting half, for the ``gpu_processes`` module: :func:`cleanup` re-reads and plans
(:func:`find`: facts can be seconds old), refuses what it cannot free, then ends the restarters and the holders,
waits until the memory is free and watches ``settle`` seconds for restarts (:class:`Acting`).

The node reads it shares with the fact pass (a holder's parents and service: facts.read_jobs, facts.read_lineage,
facts.run_processes) look their /proc readers up in facts.py, the rest here: a test that fakes the node's
processes patches both modules (tests/unit/library/test_gpu_processes.py, FakeProcesses)."""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import ActingStep
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import NvidiaSmi
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import (
    children_of,
    device_holders,
    matches_name,
    owner_label,
    owner_of,
    read_process,
    read_stat,
    still_there,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process_job import systemd_unit
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import probe as gpu_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.ending import (
    end_processes,
    signal_process,
    wait_for_memory,
    watch_jobs,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.facts import (
    probe_payload,
    read_jobs,
    read_lineage,
    run_processes,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.guard import (
    guard_pids_of,
    guard_reason,
    kept_gpus,
    plan_guard,
    wait_uuids,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.messages import (
    GpuProcessesError,
    as_guarded,
    as_launcher,
    as_parent,
    as_result,
    blocker_message,
    describe,
    describe_process,
    describe_restarter,
    no_holder_error,
    pid_file_message,
    restart_error,
    restarter_message,
    service_message,
    service_reason,
    short_command,
    survivor_error,
    unit_stop_advice,
    unit_words,
    window_message,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.plan import (
    busy_gpus,
    collect_holders,
    diff_cleanup,
    job_chain,
    plan_changes,
    plan_cleanup,
    plan_jobs,
    plan_parents,
)


# -- reading again and planning --------------------------------------------------------------------------------
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


# -- acting ----------------------------------------------------------------------------------------------------
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
    free, and, when a parent of a holder is left running (:func:`plan_parents`), watch ``settle`` seconds for
    restarts: a new child of that parent, or a new holder of the target's GPUs. (The module runs the same two
    halves, :func:`survey` and :func:`end_planned`, through the acting modules' runner, node/act_runner.py.)

    ``p`` holds the SPEC settings; ``warn`` receives warnings for the module's result. Raises GpuProcessesError
    carrying what was already done.
    """
    found, result = survey(target, node_smi, p, check_mode=check_mode, warn=warn)
    if not check_mode and found["to_end"]:
        end_planned(target, node_smi, p, found, result)
    result["seconds"] = round(time.monotonic() - found["started"], 3)
    return result


def survey(target, node_smi, p, *, check_mode=False, warn=lambda message: None):
    """The reading half of :func:`cleanup`: re-read and plan; raise before anything is ended when the plan cannot
    free the GPUs. Returns ``(found, result)``: the plan (``found["started"]``: when the read began, on this
    module's clock) and the result so far (``changed``, ``changes``, ``diff`` and what was found)."""
    started = time.monotonic()  # looked up now, so a test can give the module a clock of its own
    found = find(target, node_smi, p)
    found["started"] = started
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
    return found, result


def end_planned(target, node_smi, p, found, result):
    """The acting half of :func:`cleanup`, on what :func:`survey` planned: end the restarters and the holders,
    wait for the memory, watch for restarts; everything learnt goes into ``result``."""
    Acting(target, node_smi, p, found, result, clock=time.monotonic, sleep=time.sleep).run(found["started"])
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
        # Each round ends what restarted (attended) and watches again, or stops: at most one per parent. With no
        # parent left running nothing can restart what was ended, and the cleanup ends when the memory is free.
        for _ in range(len(self.watched) + 1):
            if self.p["settle"] <= 0 or not self.watched or not self.settle():
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


def target_rows(rows, gpus):
    """The memory rows of the target's GPUs, numbered as the target numbers them (the node has its own order)."""
    index_of = {g["uuid"]: g["index"] for g in gpus}
    return [dict(r, index=index_of[r["uuid"]]) for r in rows if r["uuid"] in index_of]


# -- errors that read the node ---------------------------------------------------------------------------------
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


def state_of(entry):
    now = read_process(entry["info"].pid)
    return now.state if now is not None else "gone"


class GpuProcesses(ActingStep):
    """Read the target's GPU holders on the node and plan; a real run ends them, waits until their memory is free
    and watches for restarts, proving the GPUs free as it goes (it fails naming what outlived it)."""

    facts = gpu_facts

    def read(self, run):
        node_smi = NvidiaSmi(run.target.run_on_node, timeout=run.params["timeout"])
        found, result = survey(run.target, node_smi, run.params, check_mode=run.check_mode, warn=run.warn)
        plan = {"pending": result["changed"], "problems": [], "changes": result["changes"], "diff": result["diff"]}
        return dict(plan, found=found, node_smi=node_smi, result=result)

    def act(self, run, before):
        return end_planned(run.target, before["node_smi"], run.params, before["found"], before["result"]), None

    def result(self, run, before, after, done):
        return before["result"]  # what acting learnt is in it (changes, killed, memory, watched...)
