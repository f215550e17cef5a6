#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The drift runner: recover.yml in check mode through ansible-runner, a JSON summary and a Prometheus textfile.

    python3 drift/runner.py --inventory inventory/proxmox \\
        --textfile /var/lib/prometheus/node-exporter/pve_gpu_recover.prom --summary /var/lib/pve-gpu-drift/summary.json

runs ``ansible-playbook recover.yml --check --diff`` with ``PVE_GPU_RECOVER_REPORT_DIR`` pointed at a fresh
directory, reads the report the recover_report callback wrote for each target and the run's events (a target that
was unreachable or failed before a report was written is named all the same), and says per target: ``in_spec``,
``drift``, ``failed``, ``busy`` or ``unreachable``. ``busy`` is a failure whose cause is another run: the fact
pass found the target's run lock on its node held by another recover run (its error kind ``locked``, or ``busy``
when that run has held the lock directory for seconds); the reason names that run and ``held_by`` carries its run
id. With ``--correct`` the drifting targets are then recovered for real with ``recover_unattended=true``: what the
roles will not do unattended comes back in each step's ``needs_window``.

Exit codes: 0 every target in spec; 2 drift (or, with --correct, something that needs a maintenance window) and
nothing failed; 1 any target failed, busy or unreachable, the run itself failed, or the runner could not start. A
failure wins over drift.

Everything that decides (events and reports to a summary, the summary to metrics, the exit code) is a pure function
of plain data below; ``main()`` wires them to ansible-runner, the lock and the files. docs/design.md, "Scheduled
drift correction", says why it is built this way.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (roles/drift_timer calls it by path): its package is the checkout's drift/, imported first
    # for what it does on import: it puts the collection on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import drift  # noqa: F401  # pylint: disable=unused-import

from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_steps import STEP_NAMES

from drift import COLLECTIONS, collections_path, unattended
from drift.errors import DriftError, LockHeld
from drift.files import (
    RUN_DIR,
    acquire_lock,
    iso,
    load_reports,
    new_dir,
    private_dir,
    prune_runs,
    write_atomic,
)
from drift.text import one_line, shown

__all__ = ["RUN_DIR", "DriftError", "LockHeld", "acquire_lock", "iso", "load_reports", "prune_runs", "write_atomic"]

PLAYBOOK = "recover.yml"
REPORT_CALLBACK = "pve_gpu.recover.recover_report"
SUMMARY_VERSION = 1
EXIT_IN_SPEC, EXIT_FAILED, EXIT_DRIFT = 0, 1, 2
STATUSES = ("in_spec", "drift", "failed", "busy", "unreachable")
# Statuses that fail the run: busy is a failure too (the target was not checked), only its cause differs.
FAILURES = ("failed", "busy", "unreachable")
# The fact pass's error kinds (plugins/module_utils/pve_lock.py) that mean another run holds the target: ``locked``
# (its run
# lock) and ``busy`` (that run has been changing the node's lock directory for seconds).
BUSY_KINDS = ("locked", "busy")
# A step's diff in the summary: at most this many lines per side (only the lines that differ when it is longer).
DIFF_LINES = 50
# The tasks whose error kinds mean the run lock: a later step's own "busy" (a compile cache in use) is a failure.
LOCK_ACTIONS = ("target_facts", "target_lock")
# The order the steps run (the registry's); a step not listed comes last, by name.
STEP_ORDER = STEP_NAMES
# The extra variable a correction run sets; the roles leave what is unsafe unattended to a window.
UNATTENDED = unattended.UNATTENDED
# At most this many seconds of --timeout for --correct's proof that the checkout runs unattended.
PROBE_TIMEOUT = 120
METRIC_PREFIX = "pve_gpu_recover"
# A run-level cause that leaves every target of the run without a report, in the words the summary uses.
RUN_ENDED = {
    "timeout": "the run timed out after {timeout:g} s",
    "canceled": "the run was canceled (SIGTERM or SIGINT)",
}


# -- pure: events and reports to a summary ----------------------------------------------------------------------
def result_message(result):
    """The sentence of a failed or unreachable task's result (``msg``, else stderr, else its return code)."""
    result = result if isinstance(result, dict) else {}
    for key in ("msg", "stderr", "reason"):
        if result.get(key):
            return one_line(result[key])
    if "rc" in result:
        return f"exited {result['rc']}"
    return "failed without a message"


def failure_of(data):
    """A failed event's ``{"task", "msg", "kind", "held_by"}``: ``kind`` is the module's error kind (None when it
    gave none), ``held_by`` the run id of the run whose lock stopped it (None unless the lock was held)."""
    res = data.get("res") if isinstance(data.get("res"), dict) else {}
    kind = res.get("error") if isinstance(res.get("error"), str) else None
    lock = res.get("lock") if isinstance(res.get("lock"), dict) else {}
    holder = lock.get("holder") if isinstance(lock.get("holder"), dict) else {}
    action = str(data.get("task_action") or "").rsplit(".", 1)[-1] or None
    held_by = holder.get("run_id") if kind in BUSY_KINDS and isinstance(holder.get("run_id"), str) else None
    return {"task": data.get("task"), "msg": result_message(res), "kind": kind, "action": action, "held_by": held_by}


def host_events(events):
    """Per host, what ansible-runner's events say: ``{host: {started, unreachable, failed, dark, failures}}``.

    ``unreachable`` is the first such event's ``{"task", "msg"}``, ``failed`` the first failure's (failures under
    ignore_errors do not count; see :func:`failure_of`); ``dark``/``failures`` come from the play recap. A host
    appears as soon as a task started on it, so a target that never got a report (a timeout, an unreachable node)
    is still named.
    """
    hosts = {}

    def entry(host):
        return hosts.setdefault(host, {"started": False, "unreachable": None, "failed": None, "dark": 0, "failures": 0})

    for event in events:
        kind = event.get("event")
        data = event.get("event_data") or {}
        if kind == "playbook_on_stats":
            for host in data.get("processed") or {}:
                entry(host)
            for key in ("dark", "failures"):
                for host, count in (data.get(key) or {}).items():
                    entry(host)[key] = int(count)
            continue
        host = data.get("host")
        if not host:
            continue
        found = entry(host)
        if kind == "runner_on_start":
            found["started"] = True
        elif kind == "runner_on_unreachable" and found["unreachable"] is None:
            found["unreachable"] = {"task": data.get("task"), "msg": result_message(data.get("res"))}
        elif kind == "runner_on_failed" and not data.get("ignore_errors") and found["failed"] is None:
            found["failed"] = failure_of(data)
    return hosts


def report_steps(report):
    """``{step: entry}`` of the steps a report holds facts for (a step that is off has none, and is left out).

    An entry is the step's facts from the fact pass overlaid with its acting module's result, as the
    recover_report callback writes it. When the fact pass itself failed there are no facts: every step the run
    reached is kept, so the step that failed is named.
    """
    before = report.get("before") or {}
    steps = report.get("steps") or {}
    names = sorted(steps, key=lambda s: (STEP_ORDER.index(s) if s in STEP_ORDER else len(STEP_ORDER), s))
    return {name: steps[name] for name in names if not before or isinstance(before.get(name), dict)}


def diff_lines(diff, limit=None):
    """``{"before": "a\\nb\\n", "after": ""}`` -> ``{"before": ["a", "b"], "after": []}``; ``{}`` for no diff.

    A long diff (a venv's whole freeze on each side) keeps only the lines that differ between the sides, each side
    cut to ``limit`` lines (DIFF_LINES) with a last line that says how many were left out: the summary names the
    items, the report keeps the whole diff.
    """
    if not isinstance(diff, dict):
        return {}
    limit = DIFF_LINES if limit is None else limit
    # Lines kept as they are (git's status columns mean something), only cut to one_line's length. Split at "\n"
    # alone: splitlines() would also split at a CT-chosen \x1e or \u2028 and forge a line; those are escaped.
    sides = {side: [shown(line.rstrip())[:500] for line in split_lines(diff.get(side))] for side in ("before", "after")}
    if len(sides["before"]) + len(sides["after"]) <= limit:
        return sides
    before, after = set(sides["before"]), set(sides["after"])
    sides = {
        "before": [x for x in sides["before"] if x not in after],
        "after": [x for x in sides["after"] if x not in before],
    }
    return {side: cut(lines, limit) for side, lines in sides.items()}


def split_lines(text):
    """``"a\\nb\\n"`` -> ``["a", "b"]``: a diff side's lines, split at newlines only."""
    lines = str(text or "").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def cut(lines, limit):
    """At most ``limit`` lines: the first ``limit - 1`` and one that counts the rest."""
    if len(lines) <= limit:
        return lines
    return [*lines[: limit - 1], f"... {len(lines) - limit + 1} more lines (the run's report has the whole diff)"]


def summarize_step(entry, corrected_run=False):
    """One step of one target: ``{drift, status, changes, diff, problems, needs_window, corrected}``.

    ``diff`` is the step's ``--diff`` as ``{"before": [...], "after": [...]}`` lines, so the summary names the
    exact item that drifted (the changed file, the extra package, the holder's pid), not only the step's verdict.

    In a check run a step drifts when the fact pass found work (``pending``), its module said it would change
    something, or something needs a window. In a correction run (``corrected_run``) it was corrected when its
    module changed something, and it still drifts when something needs a window, or when it had work and changed
    nothing. ``problems`` make the target fail; they are listed, not counted as drift.
    """
    needs_window = [one_line(line) for line in entry.get("needs_window") or []]
    pending = bool(entry.get("pending"))
    changed = bool(entry.get("changed")) or bool(entry.get("killed"))
    # After a correction: something left to a window, or work found and nothing changed (not proven in spec).
    drift = (
        bool(needs_window) or (pending and not changed) if corrected_run else pending or changed or bool(needs_window)
    )
    return {
        "drift": drift,
        "status": entry.get("status"),
        "changes": [str(line) for line in entry.get("changes") or []],
        "diff": diff_lines(entry.get("diff")) if drift or changed else {},
        "problems": [str(line) for line in entry.get("problems") or []],
        "needs_window": needs_window,
        "corrected": bool(corrected_run and changed),
    }


def report_failure(report):
    """Why a report says the run failed on its target: ``"<task>: <msg>"``, or the fact pass's problems."""
    error = report.get("error") or {}
    msg = error.get("msg")
    if not msg:
        problems = (report.get("before") or {}).get("problems") or []
        msg = " | ".join(problems) if problems else "failed without a message"
    task = error.get("task")
    return one_line(f"{task}: {msg}" if task else msg)


def lock_contention(report, events):
    """Whether the target failed because another run holds it: the report's or the failed event's error kind is
    the lock's, raised by the fact pass or the lock module (a compile cache in use is also ``busy``, but a failure)."""
    error = (report or {}).get("error") or events.get("failed") or {}
    return error.get("kind") in BUSY_KINDS and error.get("action") in LOCK_ACTIONS


def summarize_target(name, found, events, *, corrected_run=False, run_status="successful", timeout=None, log=None):
    """A target's status, reason and steps from its report (``found``: ``{path, report}`` or None) and events.

    Unreachable (the connection to it or its node failed) comes first, then a failure (the report's error, else
    the failed event; ``busy`` when another run's lock caused it), then drift; a target with neither a report nor
    a failure is failed with the run's reason.
    """
    events = events or {}
    report = (found or {}).get("report")
    steps = {step: summarize_step(entry, corrected_run) for step, entry in report_steps(report or {}).items()}
    drifting = [step for step, entry in steps.items() if entry["drift"]]
    failed = events.get("failed") or {}
    if events.get("unreachable") or events.get("dark"):
        unreachable = events.get("unreachable") or {}
        status, reason = "unreachable", unreachable.get("msg") or "unreachable (the play recap counts it)"
    elif report is not None and report.get("status") == "failed":
        # The lock's own sentence names the other run (run id, owner, since when, its controller).
        status, reason = "busy" if lock_contention(report, events) else "failed", report_failure(report)
    elif failed or events.get("failures"):
        status = "busy" if lock_contention(None, events) else "failed"
        reason = one_line(f"{failed.get('task')}: {failed.get('msg')}") if failed else "failed (the play recap)"
    elif report is None:
        status = "failed"
        why = (found or {}).get("error")
        if why:
            reason = why
        elif run_status in RUN_ENDED:
            reason = RUN_ENDED[run_status].format(timeout=timeout or 0) + f" before {name}'s report was written"
        else:
            reason = f"no report was written for {name}" + (f" (the run's log: {log})" if log else "")
    elif drifting:
        status = "drift"
        if corrected_run:
            reason = "still drifts after the correction: " + ", ".join(drifting)
        else:
            reason = "drift in " + ", ".join(drifting)
    else:
        status = "in_spec"
        corrected = [step for step, entry in steps.items() if entry["corrected"]]
        reason = ("corrected " + ", ".join(corrected)) if corrected else None
    if status == "drift" and any(entry["needs_window"] for entry in steps.values()):
        reason += "; needs a window: " + ", ".join(s for s, e in steps.items() if e["needs_window"])
    report = report or {}
    return {
        "status": status,
        "reason": reason,
        "report": (found or {}).get("path"),
        "run_id": report.get("run_id"),
        "node": report.get("node"),
        "vmid": report.get("vmid"),
        # The run that holds the target, when the event carried its lock (a report has only the sentence).
        "held_by": failed.get("held_by") if status == "busy" else None,
        "steps": steps,
        "corrected": {step: entry["changes"] for step, entry in steps.items() if entry["corrected"]},
        "needs_window": {step: entry["needs_window"] for step, entry in steps.items() if entry["needs_window"]},
    }


def summarize_phase(reports, events, *, corrected_run=False, run_status="successful", timeout=None, log=None):
    """``{target: summary}`` for every target a report or an event names (events only: still named)."""
    hosts = host_events(events)
    return {
        name: summarize_target(
            name,
            reports.get(name),
            hosts.get(name),
            corrected_run=corrected_run,
            run_status=run_status,
            timeout=timeout,
            log=log,
        )
        for name in sorted(set(reports) | set(hosts))
    }


def merge_correction(checked, corrected):
    """The targets after a correction: each corrected target's summary, with its check under ``check``.

    ``checked`` holds every target of the check; ``corrected`` those of the correction run (the drifting ones).
    A drifting target the correction run did not reach at all (it was cut off) is failed, naming why.
    """
    merged = {}
    for name, before in checked.items():
        if before["status"] != "drift":
            merged[name] = before
            continue
        after = corrected.get(name)
        if after is None:
            after = dict(before, status="failed", reason="the correction run did not reach it", corrected={})
        merged[name] = dict(
            after,
            check={key: before[key] for key in ("status", "reason", "report", "run_id")}
            | {"drift": [step for step, entry in before["steps"].items() if entry["drift"]]},
        )
    return merged


def count_statuses(targets):
    counts = dict.fromkeys(STATUSES, 0)
    for target in targets.values():
        counts[target["status"]] += 1
    return counts


def exit_code(targets, errors=()):
    """0 all in spec, 2 drift and nothing failed, 1 a failed, busy or unreachable target, a run error or no target."""
    statuses = {target["status"] for target in targets.values()}
    if errors or not targets or statuses & set(FAILURES):
        return EXIT_FAILED
    return EXIT_DRIFT if "drift" in statuses else EXIT_IN_SPEC


def overall_status(code):
    return {EXIT_IN_SPEC: "in_spec", EXIT_DRIFT: "drift"}.get(code, "failed")


def run_errors(run, targets):
    """Run-level errors of one run: it could not start, timed out or was canceled, ansible-playbook failed in a
    way no target explains (a bad inventory, a syntax error), or it reached no target at all."""
    if run.get("error"):
        return [run["error"]]
    if run["status"] in RUN_ENDED:
        return [RUN_ENDED[run["status"]].format(timeout=run.get("timeout") or 0) + f" ({run['phase']} run)"]
    if run["rc"] not in (0, None) and not any(t["status"] in FAILURES for t in targets.values()):
        return [f"the {run['phase']} run's ansible-playbook exited {run['rc']} ({run['status']}); see {run['log']}"]
    if not targets:
        return [
            f"the {run['phase']} run reached no target: the inventory's gpu_targets group is empty or --limit "
            "matched none of its hosts"
        ]
    return []


# -- pure: the Prometheus textfile ------------------------------------------------------------------------------
def escape_label(value):
    """A label value as the exposition format wants it: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text):
    return str(text).replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value):
    if isinstance(value, bool | int):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    return repr(round(float(value), 3))


def sample(name, labels, value):
    inner = ",".join(f'{key}="{escape_label(val)}"' for key, val in labels.items())
    return f"{name}{{{inner}}} {format_value(value)}" if inner else f"{name} {format_value(value)}"


def render_textfile(summary):
    """The summary as node_exporter's textfile collector reads it (every family has HELP and TYPE).

    Per target and step: ``drift`` (0|1), ``needs_window`` (how many things wait for a window), ``corrected``
    (0|1, this run changed it); per target: ``target_up`` (0 when it was unreachable or the run never got its
    facts), ``target_failed`` (1 for failed and unreachable), ``last_run_timestamp_seconds``,
    ``run_duration_seconds``; per run: ``runner_last_run_timestamp_seconds``, ``runner_exit_code`` and
    ``targets{status}``, so a run that reached no target is visible too.
    """
    targets = sorted(summary["targets"].items())
    finished = summary["finished_timestamp"]

    def per_step(value):
        return [({"target": t, "step": s}, value(e)) for t, v in targets for s, e in sorted(v["steps"].items())]

    families = [
        ("drift", "1 when the step of the target is out of spec (check: a run would change it; after --correct: "
         "it still is).", per_step(lambda e: e["drift"])),
        ("needs_window", "Things the step of the target leaves to a maintenance window (unsafe unattended).",
         per_step(lambda e: len(e["needs_window"]))),
        ("corrected", "1 when this run's --correct changed the step of the target.",
         per_step(lambda e: e["corrected"])),
        ("target_up", "1 when the run reached the target and got its report; 0 when unreachable or no report.",
         [({"target": t}, v["status"] != "unreachable" and v["report"] is not None) for t, v in targets]),
        ("target_failed", "1 when the run failed on the target (another run held it, too) or could not reach it.",
         [({"target": t}, v["status"] in FAILURES) for t, v in targets]),
        ("last_run_timestamp_seconds", "Unix time the drift run that checked the target finished.",
         [({"target": t}, finished) for t, _ in targets]),
        ("run_duration_seconds", "Seconds the ansible-playbook runs that checked (and corrected) the target took.",
         [({"target": t}, v.get("seconds", summary["duration_seconds"])) for t, v in targets]),
        ("runner_last_run_timestamp_seconds", "Unix time the drift runner last finished (whatever the outcome).",
         [({}, finished)]),
        ("runner_exit_code", "Exit code of the drift runner's last run: 0 in spec, 2 drift, 1 failure.",
         [({}, summary["exit_code"])]),
        ("targets", "Targets of the drift runner's last run by status.",
         [({"status": s}, n) for s, n in summary["counts"].items()]),
    ]  # fmt: skip
    lines = []
    for family, help_text, samples in families:
        name = f"{METRIC_PREFIX}_{family}"
        lines.append(f"# HELP {name} {escape_help(help_text)}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(sample(name, labels, value) for labels, value in samples)
    return "\n".join(lines) + "\n"


# -- ansible-runner -------------------------------------------------------------------------------------------
def import_ansible_runner():
    try:
        import ansible_runner  # noqa: PLC0415 (optional until a run: the pure functions above work without it)
    except ImportError as error:
        lock = Path(__file__).resolve().parent.parent / "requirements" / "dev.lock"
        raise DriftError(
            f"ansible-runner is not importable by {sys.executable} ({error}); run the runner with the project's "
            "venv (.venv/bin/python drift/runner.py ...; `make setup` creates it) or install the pinned one: "
            f"{sys.executable} -m pip install --require-hashes -r {lock}"
        ) from None
    return ansible_runner


class Parser(argparse.ArgumentParser):
    """Usage errors exit 1: the runner's exit 2 means drift, which a typo must never look like."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_FAILED, f"{self.prog}: error: {message}\n")


def parse_args(argv):
    root = Path(__file__).resolve().parent.parent
    parser = Parser(
        prog="drift/runner.py",
        description="Run recover.yml in check mode (--check --diff) through ansible-runner, write a JSON summary "
        "and a Prometheus textfile. Exit 0: all in spec; 2: drift; 1: a failure (wins over drift).",
    )
    parser.add_argument(
        "--inventory", "-i", action="append", required=True, help="inventory file or directory (repeatable)"
    )
    parser.add_argument(
        "--project", type=Path, default=root, help="the pve-gpu-recover checkout (default: %(default)s)"
    )
    parser.add_argument(
        "--textfile", type=Path, help="Prometheus textfile to write atomically (e.g. .../pve_gpu_recover.prom)"
    )
    parser.add_argument("--summary", default="-", help="JSON summary path, '-' for stdout (default)")
    parser.add_argument(
        "--correct",
        action="store_true",
        help=f"after the check, recover the drifting targets for real with {UNATTENDED}=true",
    )
    parser.add_argument("--limit", "-l", help="ansible --limit pattern")
    parser.add_argument("--forks", "-f", type=int, help="ansible --forks")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3000,
        help="seconds for the whole run, check and correction (default: %(default)s)",
    )
    parser.add_argument("--extra-vars", "-e", action="append", default=[], help="ansible -e (repeatable; @file works)")
    parser.add_argument(
        "--reports-dir", type=Path, help="where each run keeps its reports and logs (default: PROJECT/reports/drift)"
    )
    parser.add_argument(
        "--keep-runs", type=int, default=48, help="run directories kept under --reports-dir (default: %(default)s)"
    )
    parser.add_argument("--lock-file", type=Path, help="the runner's lock (default: REPORTS_DIR/drift.lock)")
    args = parser.parse_args(argv)
    if args.timeout < 1:
        parser.error("--timeout must be at least 1 second")
    if args.keep_runs < 1:
        parser.error("--keep-runs must be at least 1")
    if args.forks is not None and args.forks < 1:
        parser.error("--forks must be at least 1")
    return args


def check_options(args):
    """Absolute paths, and the clear errors a person meets first: no inventory, no recover.yml, --correct unsafe."""
    args.project = args.project.expanduser().resolve()
    playbook = args.project / PLAYBOOK
    if not playbook.is_file():
        raise DriftError(
            f"{playbook} not found: --project must be the pve-gpu-recover checkout that holds {PLAYBOOK} "
            f"(got {args.project})"
        )
    inventories = []
    for inventory in args.inventory:
        path = Path(inventory).expanduser()
        if not path.exists():
            raise DriftError(
                f"inventory {inventory} not found (from {Path.cwd()}): pass an inventory file or directory, "
                f"e.g. --inventory {args.project / 'inventory' / 'proxmox'}"
            )
        inventories.append(str(path.resolve()))
    args.inventory = inventories
    # Absolute, links not resolved: the runner checks the path itself (a planted link is refused, not followed).
    args.reports_dir = Path(os.path.abspath((args.reports_dir or args.project / "reports" / "drift").expanduser()))
    args.lock_file = Path(os.path.abspath((args.lock_file or args.reports_dir / "drift.lock").expanduser()))
    if args.textfile is not None:
        args.textfile = args.textfile.expanduser().resolve()
        if not args.textfile.parent.is_dir():
            raise DriftError(
                f"the textfile's directory {args.textfile.parent} does not exist: create it (node_exporter's "
                "--collector.textfile.directory) or pass another --textfile"
            )
    return args


def check_unattended(ansible_runner, project, *, timeout, cancel=lambda: False):
    """Refuse --correct unless the checkout's recover.yml hands ``recover_unattended`` to the fact pass and to each
    acting module (drift/unattended.py runs it, in check mode, with stand-in modules, in about 2 s)."""
    problems = unattended.probe(ansible_runner, project, timeout=min(timeout, PROBE_TIMEOUT), cancel=cancel)
    if problems:
        raise DriftError(
            f"--correct refused: {project}'s recover.yml, run in check mode with {UNATTENDED}=true against a "
            f"stand-in target, does not run its steps unattended ({'; '.join(one_line(p) for p in problems)}), so "
            "a real run could end a live training job or swap a venv under it; run without --correct (check only) "
            "until the roles pass it on"
        )


def host_key_checking(project):
    """What ansible-playbook alone would do: the environment's, else ansible.cfg's, else on.

    ansible-runner turns host key checking off unless ANSIBLE_HOST_KEY_CHECKING is set; ssh to the nodes as root
    must not lose it silently.
    """
    if "ANSIBLE_HOST_KEY_CHECKING" in os.environ:
        return os.environ["ANSIBLE_HOST_KEY_CHECKING"]
    config = configparser.ConfigParser(interpolation=None)
    with contextlib.suppress(OSError, configparser.Error):
        config.read(Path(project) / "ansible.cfg", encoding="utf-8")
    return config.get("defaults", "host_key_checking", fallback="True")


def environment(args, report_dir):
    """What ansible-playbook needs beyond this process's environment, whatever ansible-runner sets."""
    callbacks = [c for c in os.environ.get("ANSIBLE_CALLBACKS_ENABLED", "").split(",") if c.strip()]
    env = {
        # systemd gives a bare PATH: the venv's ansible-playbook first.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
        "PVE_GPU_RECOVER_REPORT_DIR": str(report_dir),
        # ansible-runner's environment replaces ansible.cfg's list: the collection's report callback, by its FQCN.
        "ANSIBLE_CALLBACKS_ENABLED": ",".join(dict.fromkeys([*callbacks, REPORT_CALLBACK])),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_HOST_KEY_CHECKING": host_key_checking(args.project),
    }
    if (args.project / "ansible.cfg").is_file():
        env["ANSIBLE_CONFIG"] = str(args.project / "ansible.cfg")
    # recover.yml imports pve_gpu.recover.recover: the project's own collection (a checkout's collections/), else the
    # one this runner belongs to (an installed copy: AWX, an execution environment), before any other copy.
    own = args.project / "collections"
    env["ANSIBLE_COLLECTIONS_PATH"] = collections_path(own if own.is_dir() else COLLECTIONS, args.project)
    return env


def run_playbook(
    ansible_runner, args, *, phase, run_dir, deadline, limit=None, cancel=lambda: False, clock=time.monotonic
):
    """One ansible-playbook run of recover.yml through ansible-runner: ``phase`` is ``check`` or ``correct``.

    Returns ``{phase, status, rc, seconds, timeout, run_ids, report_dir, log, error, reports, events}``.
    """
    report_dir = new_dir(run_dir / phase)
    log = run_dir / f"{phase}.log"
    events = []
    remaining = deadline - clock()
    result = {
        "phase": phase,
        "status": "timeout",
        "rc": None,
        "seconds": 0.0,
        "timeout": args.timeout,
        "report_dir": str(report_dir),
        "log": str(log),
        "error": None,
    }
    if remaining < 1:
        return dict(result, reports={}, events=[], run_ids=[])
    cmdline = ["--check", "--diff"] if phase == "check" else ["--diff"]
    for extra in args.extra_vars:
        cmdline += ["-e", extra]
    started = clock()

    def on_event(event):
        if event.get("event") in ("runner_on_start", "runner_on_failed", "runner_on_unreachable", "playbook_on_stats"):
            events.append(event)
        return True

    try:
        with tempfile.TemporaryDirectory(prefix="pve-gpu-drift-") as private:
            done = ansible_runner.run(
                private_data_dir=private,
                ident=phase,
                project_dir=str(args.project),
                playbook=str(args.project / PLAYBOOK),
                inventory=args.inventory,
                limit=limit,
                forks=args.forks,
                cmdline=shlex.join(cmdline),
                # After the user's -e on the command line: a correction is always unattended.
                extravars={UNATTENDED: True} if phase == "correct" else None,
                envvars=environment(args, report_dir),
                timeout=max(1, math.ceil(remaining)),
                event_handler=on_event,
                cancel_callback=cancel,
                quiet=True,
                settings={"pexpect_timeout": 1, "suppress_ansible_output": True},
            )
            stdout = Path(done.config.artifact_dir) / "stdout"
            if stdout.is_file():
                shutil.copyfile(stdout, log)
            result.update(status=done.status, rc=done.rc)
    except Exception as error:  # one run's failure is reported, never a traceback
        result.update(status="error", error=f"ansible-runner could not run {PLAYBOOK} ({phase}): {one_line(error)}")
    reports = load_reports(report_dir)
    result.update(
        seconds=round(clock() - started, 3),
        reports=reports,
        events=events,
        run_ids=sorted({f["report"]["run_id"] for f in reports.values() if f["report"] and f["report"].get("run_id")}),
    )
    return result


def summarize_run(run, corrected_run=False):
    targets = summarize_phase(
        run["reports"],
        run["events"],
        corrected_run=corrected_run,
        run_status=run["status"],
        timeout=run["timeout"],
        log=run["log"],
    )
    for target in targets.values():
        target["seconds"] = run["seconds"]
    return targets


def public_run(run):
    return {k: run[k] for k in ("phase", "status", "rc", "seconds", "run_ids", "report_dir", "log", "error")}


def build_summary(args, *, started, finished, runs, targets, errors, run_dir):
    code = exit_code(targets, errors)
    return {
        "version": SUMMARY_VERSION,
        "mode": "correct" if args.correct else "check",
        "started": iso(started),
        "finished": iso(finished),
        "finished_timestamp": round(finished, 3),
        "duration_seconds": round(finished - started, 3),
        "project": str(args.project),
        "inventory": args.inventory,
        "limit": args.limit,
        "run_dir": str(run_dir),
        "run_ids": [run_id for run in runs for run_id in run["run_ids"]],
        "runs": [public_run(run) for run in runs],
        "status": overall_status(code),
        "exit_code": code,
        "counts": count_statuses(targets),
        "errors": errors,
        "targets": targets,
    }


def human_lines(summary):
    """One line per target for the journal (stderr), then the run's errors."""
    lines = []
    for name, target in summary["targets"].items():
        reason = f": {target['reason']}" if target["reason"] else ""
        lines.append(
            f"{name}: {target['status']}{reason}" + (f" (report {target['report']})" if target["report"] else "")
        )
        for step, entry in target["steps"].items():
            if entry["drift"] or entry["corrected"]:
                verb = "changed" if entry["corrected"] else "would change"
                # The summary keeps a change as the module wrote it (JSON escapes it); the journal gets one line.
                lines.extend(f"  {step} {verb}: {shown(change)}" for change in entry["changes"])
            lines.extend(f"  {step} needs a window: {line}" for line in entry["needs_window"])
    lines.extend(f"error: {error}" for error in summary["errors"])
    lines.append(f"drift: {summary['status']} (exit {summary['exit_code']}), {summary['counts']}")
    return lines


def run_and_summarize(args, ansible_runner, *, cancel, clock, monotonic, deadline=None):
    """The check, then (--correct) the correction of the drifting targets: the summary, and its run directory."""
    started = clock()
    deadline = monotonic() + args.timeout if deadline is None else deadline
    run_dir = new_dir(args.reports_dir / (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started)) + f"-{os.getpid()}"))
    common = {"run_dir": run_dir, "deadline": deadline, "cancel": cancel, "clock": monotonic}
    check = run_playbook(ansible_runner, args, phase="check", limit=args.limit, **common)
    targets = summarize_run(check)
    runs, errors = [check], run_errors(check, targets)
    drifting = [name for name, target in targets.items() if target["status"] == "drift"]
    if args.correct and drifting and not errors:
        if cancel():
            errors.append("canceled before the correction run")
        else:
            # Only the drifting targets: one in spec needs nothing, a failed one would fail again.
            correct = run_playbook(ansible_runner, args, phase="correct", limit=",".join(drifting), **common)
            corrected = summarize_run(correct, corrected_run=True)
            for target in corrected.values():
                target["seconds"] = round(check["seconds"] + correct["seconds"], 3)
            targets = merge_correction(targets, corrected)
            runs.append(correct)
            errors += run_errors(correct, corrected)
    summary = build_summary(
        args, started=started, finished=clock(), runs=runs, targets=targets, errors=errors, run_dir=run_dir
    )
    return summary, run_dir


def publish(args, summary, run_dir):
    """The textfile (atomic), the summary (the run directory's copy, then --summary), one line per target."""
    if args.textfile is not None:
        try:
            write_atomic(args.textfile, render_textfile(summary))
        except OSError as error:
            # Monitoring is blind without it: the run fails, whatever the targets say.
            summary["errors"].append(f"cannot write the textfile {args.textfile}: {error}")
            summary["exit_code"] = exit_code(summary["targets"], summary["errors"])
            summary["status"] = overall_status(summary["exit_code"])
    text = json.dumps(summary, indent=2) + "\n"
    write_atomic(run_dir / "summary.json", text)
    if args.summary == "-":
        sys.stdout.write(text)
    else:
        write_atomic(Path(args.summary).expanduser(), text)
    for line in human_lines(summary):
        print(line, file=sys.stderr)


def main(argv=None, *, ansible_runner=None, clock=time.time, monotonic=time.monotonic):
    """Parse, check, take the lock, run, publish; returns the exit code (0 in spec, 2 drift, 1 failure)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    lock = None
    try:
        check_options(args)
        ansible_runner = ansible_runner or import_ansible_runner()
        private_dir(args.reports_dir)
        lock = acquire_lock(args.lock_file, clock)
    except (DriftError, OSError) as error:
        if lock is not None:
            os.close(lock)
        print(f"drift: {error}", file=sys.stderr)
        return EXIT_FAILED
    stop = []
    # systemd stops the unit with SIGTERM (KillMode=mixed: to this process only): ansible-runner cancels the
    # playbook, and the summary and the textfile still say what happened.
    previous = {
        sig: signal.signal(sig, lambda number, _frame: stop.append(number)) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    # The callback sets it to ansible-playbook's own pid; one inherited from a caller would name the wrong process.
    os.environ.pop("PVE_GPU_RECOVER_CONTROLLER_PID", None)
    deadline = monotonic() + args.timeout
    try:
        if args.correct:
            # Before anything runs on a target: refused, the run checks nothing (a person must see it).
            check_unattended(ansible_runner, args.project, timeout=deadline - monotonic(), cancel=lambda: bool(stop))
        summary, run_dir = run_and_summarize(
            args, ansible_runner, cancel=lambda: bool(stop), clock=clock, monotonic=monotonic, deadline=deadline
        )
        publish(args, summary, run_dir)
        prune_runs(args.reports_dir, args.keep_runs)
        return summary["exit_code"]
    except (DriftError, OSError) as error:
        print(f"drift: {error}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(lock)


if __name__ == "__main__":
    sys.exit(main())
