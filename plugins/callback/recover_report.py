# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
name: recover_report
type: notification
short_description: Write one JSON report per target and run of recover.yml, on the controller
description:
  - Collects, inside ansible-playbook (no module execution, no remote call), every result of the recovery roles
    for each target and writes C(<report_dir>/<target>/<run id>.json) when the playbook ends, failed runs
    included. The report holds the fact pass's facts (C(before)), each step's facts and result (what it
    changed, ended, saved, swapped, purged), the GPUs and holders after the run, and every task's timing.
  - Exports C(PVE_GPU_RECOVER_CONTROLLER_PID), the pid of ansible-playbook, which the fact pass records in the run
    lock. The run id is the one the fact pass (target_facts) names the run by.
  - Prints the path of each report at the end of the run, and says so when a step changed something before a
    real run failed (Ansible drops C(changed) from failed tasks, so the recap alone would hide it; a check changes
    nothing, so it never says so). Text a target chose (a process name, a file name) is printed as one line, its
    control characters escaped (plugins/module_utils/node/text.py).
  - Writes each report through a new temporary file (never an existing file or link) renamed over its path, into
    directories that are neither links nor another user's nor writable by every user; otherwise it warns and
    writes nothing there.
  - Only targets that ran a task of a recovery step (a role named like a step of the registry,
    plugins/module_utils/steps/registry.py, or the M(pve_gpu.recover.target_facts) fact pass) get a report; other
    playbooks are left alone.
  - Each report carries C(schema_version) (docs/reports.md documents every field). After writing a target's report,
    the oldest reports in its directory beyond O(keep_reports) are removed (regular C(*.json) files only, never a
    link), so the reports of manual runs do not pile up.
  - A long step run as an async job (the training venv's rebuild, the compile cache's warm-up) shows its progress
    while it runs (the phase, the latest line of the installer or the warm-up, the elapsed time), one line per
    target at each status call - printed by the step's action, which follows the job itself
    (plugins/plugin_utils/long_step.py). Where a playbook has Ansible poll such a module (C(poll) above 0), this
    callback prints the same line at each of Ansible's polls.
version_added: "0.2.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
requirements:
  - Enabled in ansible.cfg (C(callbacks_enabled = pve_gpu.recover.recover_report)), as this project's ansible.cfg does.
options:
  report_dir:
    description:
      - Directory on the controller for the reports. A relative path is taken from the playbook's directory, or
        from the current directory for a playbook of this collection run by its name (C(ansible-playbook
        pve_gpu.recover.recover)), so that no report is written inside an installed collection.
      - In an ephemeral execution environment (AWX, AAP) point it at storage that outlives the job (docs/awx.md).
    type: path
    default: reports
    env:
      - name: PVE_GPU_RECOVER_REPORT_DIR
    ini:
      - section: pve_gpu_recover
        key: report_dir
  keep_reports:
    description:
      - Reports kept per target in O(report_dir), the newest first (by modification time); older ones are removed
        after each run. C(0) keeps every report.
      - The drift runner gives each run a directory of its own (one report per target), pruned by its C(--keep-runs).
    type: int
    default: 48
    env:
      - name: PVE_GPU_RECOVER_REPORT_KEEP
    ini:
      - section: pve_gpu_recover
        key: keep_reports
"""

import contextlib
import json
import os
import re
import secrets
import stat
import tempfile
import time

from ansible import context
from ansible.plugins.callback import CallbackBase
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.progress import KEY as PROGRESS_KEY
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.progress import describe as describe_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.registry import STEP_NAMES

# The report's shape (docs/reports.md). Bump it when a field changes meaning or goes; a new field needs no bump.
SCHEMA_VERSION = 1

# The roles whose tasks make up a report (one per step of recover.yml).
STEP_ROLES = STEP_NAMES  # the registry's list, never a copy
# Actions that run on the controller only: no module execution, no remote call.
LOCAL_ACTIONS = {
    "assert",
    "debug",
    "fail",
    "set_fact",
    "meta",
    "validate_argument_spec",
    "include_role",
    "import_role",
    "include_tasks",
    "import_tasks",
}
# Result keys that are Ansible's own, not a step's (async_wrapper's among them: a build runs as an async job).
NOISE = (
    "invocation",
    "_ansible_no_log",
    "_ansible_verbose_always",
    "_ansible_delegated_vars",
    "ansible_facts",
    "ansible_job_id",
    "results_file",
    "started",
    "finished",
    "stdout",
    "stdout_lines",
    "stderr",
    "stderr_lines",
)
REPORT_NAME = re.compile(r"^[^.].*\.json$")


def shown(text):
    """``text`` as it is when it shows as itself on one line, else escaped (a module's own escape is never doubled)."""
    text = str(text)
    return text if text.isprintable() else printable(text)


def dir_problem(info, euid):
    """Why a report directory with ``os.lstat`` result ``info`` is unsafe to write into, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in (euid, 0):
        return f"is owned by uid {info.st_uid}, neither this user (uid {euid}) nor root"
    if info.st_mode & 0o002:
        return f"is writable by every user (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def safe_dir(path):
    """``path`` made when missing (0750) and checked with :func:`dir_problem`; raises OSError naming the problem."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o750)
    problem = dir_problem(os.lstat(path), os.geteuid())
    if problem:
        raise OSError(f"{path} {problem}; refusing to write a report there")


def write_report(directory, name, run_id, report):
    """``<directory>/<name>/<run_id>.json``, written so that no planted link is followed and a reader never sees
    half a report: both directories checked, a new temporary file (mkstemp: O_EXCL) renamed over the path."""
    os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    safe_dir(directory)
    target = os.path.join(directory, name)
    safe_dir(target)
    path = os.path.join(target, f"{run_id}.json")
    handle, temp = tempfile.mkstemp(prefix=f".{run_id}.", suffix=".tmp", dir=target)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2, sort_keys=True, default=str)
            out.write("\n")
            os.fchmod(out.fileno(), 0o644)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return path


def prune_reports(target_dir, keep):
    """Remove all but the newest ``keep`` reports (regular ``*.json`` files, newest by modification time) of one
    target's directory; ``keep`` 0 removes nothing. A link or anything else is left alone; returns what was removed."""
    if keep <= 0:
        return []
    found = []
    for entry in os.scandir(target_dir):
        if REPORT_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                found.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.name))
    removed = []
    for _mtime, name in sorted(found, reverse=True)[keep:]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(target_dir, name))
            removed.append(name)
    return removed


def short_action(action):
    return action.rsplit(".", 1)[-1]


COLLECTION = "pve_gpu.recover."
# This collection's playbooks/ (plugins/callback/ is two levels below the collection's root).
COLLECTION_PLAYBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "playbooks")


def is_inside(path, directory):
    """Whether ``path`` is ``directory`` or lies under it, links resolved (a checkout reaches itself by a link)."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory + os.sep)


def step_of(role_name):
    """The step a role runs (``pve_gpu.recover.training_venv`` or, from a checkout's roles_path, ``training_venv``)
    or None: a role of another collection is never one of ours, whatever its short name."""
    name = role_name.removeprefix(COLLECTION) if role_name else None
    return name if name in STEP_ROLES and (role_name.startswith(COLLECTION) or "." not in role_name) else None


def merge_after(before, steps):
    """The GPUs and holders after the run, from the fact pass and what the steps did (no new read)."""
    gpus = [dict(g) for g in before.get("preflight", {}).get("gpus") or []]
    cleanup = steps.get("gpu_processes", {})
    memory = {row.get("uuid"): row.get("memory_used_mib") for row in cleanup.get("memory") or []}
    for gpu in gpus:
        if gpu.get("uuid") in memory:
            gpu["memory_used_mib"] = memory[gpu["uuid"]]
    facts = before.get("gpu_processes", {})
    ended = {k["pid"] for k in cleanup.get("killed") or []}
    holders = [p for p in (facts.get("processes") or []) + (facts.get("blockers") or []) if p["pid"] not in ended]
    return gpus, holders


def unrun_status(facts):
    """A step none of whose tasks ran: ``skipped`` when its facts showed nothing to do (a converged step queues no
    task), ``not_run`` when it had work that never ran (the run stopped before it) or its facts are missing."""
    return "skipped" if facts and not facts.get("pending") and not facts.get("problems") else "not_run"


def step_status(records):
    if any(r["status"] in ("failed", "unreachable") for r in records):
        return "failed"
    # A step whose remote tasks were all skipped had nothing to do (its local asserts passed).
    acted = [r for r in records if r["remote"]] or records
    if all(r["status"] == "skipped" for r in acted):
        return "skipped"
    return "changed" if any(r["changed"] for r in records) else "ok"


def summary_lines(report):
    """What each step changed (or, in check mode, would change), one line each, for the end of the run: text a
    target chose is escaped (:func:`shown`), so it never forges a line of the run's output."""
    lines = []
    verb = "would change" if report["check_mode"] else "changed"
    for step, entry in report["steps"].items():
        if not (entry["changed"] or entry.get("killed")):
            continue
        lines.extend(f"{step} {verb}: {shown(change)}" for change in entry.get("changes") or [])
        killed = entry.get("killed") or []
        if killed:
            signals = ", ".join(f"pid {k['pid']} {k['signal']}" for k in killed)
            lines.append(f"{step}: ended {len(killed)} process(es) ({signals})")
    return lines


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "notification"
    CALLBACK_NAME = "recover_report"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self.basedir = os.getcwd()
        self.run_id = None
        self.task_started = {}
        self.hosts = {}  # host -> {"tasks": [...], "before": facts, "results": {step: {...}}, ...}

    # -- collecting --------------------------------------------------------------------------------------------
    def v2_playbook_on_start(self, playbook):
        self.basedir = playbook._basedir
        if is_inside(self.basedir, COLLECTION_PLAYBOOKS):
            # pve_gpu.recover.recover run by its name: reports beside the user, not in the installed collection.
            self.basedir = os.getcwd()
        self.started = time.time()
        # The pid of ansible-playbook itself, for the run lock (the target_facts action reads it): forks inherit
        # it, and it lives exactly as long as the run. Set, never kept: a run started from another run's task
        # inherits that run's value, which names the wrong process.
        os.environ["PVE_GPU_RECOVER_CONTROLLER_PID"] = str(os.getpid())

    def v2_playbook_on_task_start(self, task, is_conditional):
        self.task_started[task._uuid] = time.monotonic()

    def v2_playbook_on_handler_task_start(self, task):
        self.task_started[task._uuid] = time.monotonic()

    def v2_runner_on_ok(self, result):
        self._record(result, "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._record(result, "ignored" if ignore_errors else "failed")

    def v2_runner_on_skipped(self, result):
        self._record(result, "skipped")

    def v2_runner_on_unreachable(self, result):
        self._record(result, "unreachable")

    def v2_runner_on_async_poll(self, result):
        """A long step's progress at one of Ansible's polls of its async job, where a playbook polls the module
        itself (plugins/module_utils/node/progress.py); the roles' followed jobs print theirs from the action."""
        line = describe_progress(result._result.get(PROGRESS_KEY))
        if line:
            self._display.display(f"{result._host.get_name()}: {line}")

    def _record(self, result, status):
        task = result._task
        data = result._result
        facts = data.get("ansible_facts") or {}
        role = step_of(task._role.get_name()) if task._role else None
        action = short_action(task.action)
        if role not in STEP_ROLES and action != "target_facts":
            return
        host = self.hosts.setdefault(
            result._host.get_name(), {"tasks": [], "results": {}, "before": None, "error": None, "first": time.time()}
        )
        seconds = round(time.monotonic() - self.task_started.get(task._uuid, time.monotonic()), 3)
        changed = bool(data.get("changed"))
        record = {
            "step": role,
            "task": task.get_name(),
            "action": action,
            "status": status,
            "changed": changed,
            "remote": action not in LOCAL_ACTIONS,
            "seconds": seconds,
        }
        host["tasks"].append(record)
        if status in ("failed", "unreachable") and host["error"] is None:
            host["error"] = {"step": role, "task": task.get_name(), "action": action, "msg": data.get("msg")}
            if isinstance(data.get("error"), str):
                # The module's error kind (node/errors.py), e.g. "locked": the drift runner tells another run's lock
                # from a broken target by it.
                host["error"]["kind"] = data["error"]
        if action == "target_facts" and isinstance(data.get("run_id"), str):
            # The fact pass's action names the run, on success and failure alike: one id for every target.
            self.run_id = self.run_id or data["run_id"]
        if action == "target_facts" and "pve_gpu_recover" in facts:
            host["before"] = facts["pve_gpu_recover"]
            self.run_id = self.run_id or host["before"].get("run_id")
        elif record["remote"] and status != "skipped" and action not in ("target_lock", "target_facts"):
            host["results"][role] = {k: v for k, v in data.items() if k not in NOISE}
        elif action == "target_lock" and status != "skipped":
            host["lock_released"] = {"action": data.get("action"), "status": status}

    # -- writing -----------------------------------------------------------------------------------------------
    def report_of(self, name, host, check_mode):
        before = host["before"] or {}
        steps = {}
        for step in [s for s in STEP_ROLES if s in before or any(t["step"] == s for t in host["tasks"])]:
            records = [t for t in host["tasks"] if t["step"] == step]
            facts = before.get(step) if isinstance(before.get(step), dict) else {}
            entry = dict(facts, **host["results"].get(step, {}))
            if step == "gpu_processes":
                entry.setdefault("killed", [])  # nothing ended when the step had no work
            steps[step] = dict(
                entry,
                status=step_status(records) if records else unrun_status(facts),
                changed=any(r["changed"] for r in records),
                seconds=round(sum(r["seconds"] for r in records), 3),
            )
        gpus, holders = merge_after(before, steps)
        target = before.get("target") or {}
        failed = host["error"] is not None
        return {
            "schema_version": SCHEMA_VERSION,
            "target": name,
            "run_id": self.run_id,
            "check_mode": check_mode,
            "node": target.get("node"),
            "vmid": target.get("vmid"),
            "status": "failed" if failed else ("changed" if any(s["changed"] for s in steps.values()) else "ok"),
            "error": host["error"],
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.time() - self.started, 3),
            "before": before,
            "steps": steps,
            "gpus": gpus,
            "processes": holders,
            "lock": dict(before.get("lock") or {}, released_by=host.get("lock_released")),
            "tasks": host["tasks"],
        }

    def v2_playbook_on_stats(self, stats):
        if not self.hosts:
            return
        self.run_id = self.run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{secrets.token_hex(3)}"
        check_mode = bool(context.CLIARGS.get("check", False))
        directory = os.path.join(self.basedir, os.path.expanduser(self.get_option("report_dir")))
        for name, host in sorted(self.hosts.items()):
            report = self.report_of(name, host, check_mode)
            try:
                path = write_report(directory, name, self.run_id, report)
            except OSError as error:
                self._display.warning(f"recover_report: cannot write {name}'s report under {directory}: {error}")
                continue
            try:
                prune_reports(os.path.dirname(path), int(self.get_option("keep_reports") or 0))
            except OSError as error:
                self._display.warning(f"recover_report: cannot prune {name}'s old reports: {error}")
            changed = [s for s, v in report["steps"].items() if v["changed"] or v.get("killed")]
            # A check changes nothing: its steps' changed is what they would change (summary_lines says so).
            if report["status"] == "failed" and changed and not check_mode:
                self._display.warning(
                    f"{name}: the run failed after {', '.join(changed)} changed the target; see the report"
                )
            self._display.display(f"{name}: {report['status']}, report {path}")
            for line in summary_lines(report):
                self._display.display(f"  {line}")
