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

Everything that decides (events and reports to a summary, the exit code) is a pure function of plain data below;
the summary becomes metrics in drift/metrics.py (with the state that keeps each target's last success), one run of
ansible-playbook is drift/playbook.py, the options drift/cli.py; ``main()`` wires them to ansible-runner, the lock
and the files. docs/design.md, "Scheduled drift correction", says why it is built this way.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (roles/drift_timer calls it by path): its package is the checkout's drift/, imported first
    # for what it does on import: it puts the collection on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import drift  # noqa: F401  # pylint: disable=unused-import

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.registry import STEP_NAMES

from drift import metrics
from drift.cli import check_options, check_unattended, parse_args
from drift.errors import DriftError, LockHeld
from drift.failures import failure_kind
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
from drift.gpus import report_gpus
from drift.inventory import locate
from drift.playbook import host_key_checking, import_ansible_runner, public_run, run_playbook
from drift.text import one_line, shown

__all__ = [
    "RUN_DIR",
    "DriftError",
    "LockHeld",
    "acquire_lock",
    "host_key_checking",
    "iso",
    "load_reports",
    "prune_runs",
    "write_atomic",
]

SUMMARY_VERSION = 1
# The recover_report schema this runner reads (plugins/callback/recover_report.py SCHEMA_VERSION): a newer one is a
# target failure naming it, never a misread. A report without one is from before the field (the same shape).
REPORT_SCHEMA = 1
EXIT_IN_SPEC, EXIT_FAILED, EXIT_DRIFT = 0, 1, 2
STATUSES = ("in_spec", "drift", "failed", "busy", "unreachable")
# Statuses that fail the run: busy is a failure too (the target was not checked), only its cause differs.
FAILURES = ("failed", "busy", "unreachable")
# The fact pass's error kinds (plugins/module_utils/node/lock.py) that mean another run holds the target: ``locked``
# (its run
# lock) and ``busy`` (that run has been changing the node's lock directory for seconds).
BUSY_KINDS = ("locked", "busy")
# A step's diff in the summary: at most this many lines per side (only the lines that differ when it is longer).
DIFF_LINES = 50
# The tasks whose error kinds mean the run lock: a later step's own "busy" (a compile cache in use) is a failure.
LOCK_ACTIONS = ("target_facts", "target_lock")
# The order the steps run (the registry's); a step not listed comes last, by name.
STEP_ORDER = STEP_NAMES
# Seconds the inventory may take to name the nodes of targets the run never reached, after a run that used its
# whole --timeout (the timer's unit stops the runner 60 s after it).
LOCATE = 20
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
    kind = failure_kind(
        status,
        steps=STEP_ORDER,
        report=report if report is not None and report.get("status") == "failed" else None,
        event=failed or None,
        run_status=run_status,
        schema_error="schema_version" in (found or {}),
    )
    gpus = report_gpus(report)
    report = report or {}
    return {
        "status": status,
        "kind": kind,
        "reason": reason,
        "report": (found or {}).get("path"),
        "run_id": report.get("run_id"),
        "node": report.get("node"),
        "vmid": report.get("vmid"),
        # The run that holds the target, when the event carried its lock (a report has only the sentence).
        "held_by": failed.get("held_by") if status == "busy" else None,
        "steps": steps,
        # Each GPU's health as the fact pass read it (drift/gpus.py); [] when it read none.
        "gpus": gpus,
        "corrected": {step: entry["changes"] for step, entry in steps.items() if entry["corrected"]},
        "needs_window": {step: entry["needs_window"] for step, entry in steps.items() if entry["needs_window"]},
    }


def readable_report(found):
    """``found`` (``{path, report}``) when this runner reads its report's schema, else the same with ``report``
    None and an ``error`` that names both versions: a report of a newer shape fails its target, never misread."""
    report = (found or {}).get("report")
    if not isinstance(report, dict):
        return found
    version = report.get("schema_version", REPORT_SCHEMA)
    if isinstance(version, int) and not isinstance(version, bool) and 1 <= version <= REPORT_SCHEMA:
        return found
    return dict(
        found,
        report=None,
        schema_version=version,
        error=f"the report {found['path']} has schema_version {version!r} and this runner reads {REPORT_SCHEMA}: "
        "update the checkout the runner runs from (drift/) to the one the report callback comes from",
    )


def summarize_phase(reports, events, *, corrected_run=False, run_status="successful", timeout=None, log=None):
    """``{target: summary}`` for every target a report or an event names (events only: still named)."""
    hosts = host_events(events)
    return {
        name: summarize_target(
            name,
            readable_report(reports.get(name)),
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
            after = dict(
                before, status="failed", kind="no_report", reason="the correction run did not reach it", corrected={}
            )
        # What the correction read, else the check's (a correction cut off before its fact pass).
        after = dict(after, gpus=after.get("gpus") or before.get("gpus") or [])
        for key in ("node", "vmid"):
            after[key] = before.get(key) if after.get(key) is None else after[key]
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
    """The textfile and the metrics' state (atomic), the summary (the run directory's copy, then --summary), one
    line per target. The state (REPORTS_DIR/metrics-state.json) keeps each target's last success between runs."""
    state_path = args.reports_dir / metrics.STATE_FILE
    previous = metrics.load_state(state_path)
    text, state = metrics.render_textfile(summary, previous)
    if args.textfile is not None:
        try:
            write_atomic(args.textfile, text)
        except OSError as error:
            # Monitoring is blind without it: the run fails, whatever the targets say.
            summary["errors"].append(f"cannot write the textfile {args.textfile}: {error}")
            summary["exit_code"] = exit_code(summary["targets"], summary["errors"])
            summary["status"] = overall_status(summary["exit_code"])
            state = metrics.metric_targets(summary, previous)[1]
    write_atomic(state_path, metrics.state_text(state), mode=0o640)
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
        metrics.require()
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
    deadline = monotonic() + args.timeout
    try:
        if args.correct:
            # Before anything runs on a target: refused, the run checks nothing (a person must see it).
            check_unattended(ansible_runner, args.project, timeout=deadline - monotonic(), cancel=lambda: bool(stop))
        summary, run_dir = run_and_summarize(
            args, ansible_runner, cancel=lambda: bool(stop), clock=clock, monotonic=monotonic, deadline=deadline
        )
        # A target the run never reached is named with its inventory's node and vmid (its series need them):
        # after a run that used its whole --timeout too, within systemd's margin (not when stopped: it waits).
        if not stop:
            unplaced = locate(summary["targets"], ansible_runner, args, timeout=max(deadline - monotonic(), LOCATE))
            if unplaced:
                print(unplaced, file=sys.stderr)
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
