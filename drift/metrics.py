# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The drift runner's Prometheus textfile: the summary (and the state of the runs before it) as metric families.

Prometheus' conventions for batch jobs decide its shape:

* every series a run wrote once stays present while its target is in the inventory: a target that fails, is busy or
  unreachable keeps the drift and needs_window values of its last successful check (the steps this run did read are
  overlaid), so a drift alert never resolves because the target got worse; ``target_status`` says why and
  ``last_success_timestamp_seconds`` how old those values are;
* ``last_success_timestamp_seconds`` is only moved by a run that checked the target (in spec or drift); it survives
  between runs in a state file (``STATE_FILE`` in the reports directory), so a failing target keeps its old value;
* ``target_status`` tells in_spec, drift, failed, busy and unreachable apart (one series per status, 1 for the
  target's own), ``target_info`` carries the node, vmid and run id;
* a run that failed before it named a target (a broken inventory, the timeout) still writes every target the state
  knows, as failed: the file never goes silent.

The families are rendered by prometheus_client (``generate_latest``: HELP, TYPE, escaping); the file itself is
written by :func:`drift.files.write_atomic` rather than ``write_to_textfile``, which opens a predictable temporary
name without O_EXCL (a link planted there is written through), leaves the mode to the umask (0600 under
``UMask=0077``: node_exporter, another user, cannot read it) and never fsyncs
(tests/unit/drift/test_metrics.py measures each).

Everything here but :func:`load_state` is pure: plain data in, text or data out.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from drift.errors import DriftError

try:
    from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest
except ImportError as error:  # require() says how to install it, before the runner runs anything
    MISSING = str(error)
else:
    MISSING = None

PREFIX = "pve_gpu_recover"
STATE_VERSION = 1
STATE_FILE = "metrics-state.json"
# A target the runs have not named for this long leaves the state (it left the inventory, or --limit skips it).
STATE_TTL = 14 * 86400
STATUSES = ("in_spec", "drift", "failed", "busy", "unreachable")
CHECKED = ("in_spec", "drift")  # a run that got these checked the target: its values are current
FAILURES = ("failed", "busy", "unreachable")
# Every family the runner writes: name (without the prefix) -> (type, labels, help). The dashboard's and the alert
# rules' tests check every query against this list.
FAMILIES = {
    "drift": (
        "gauge",
        ("target", "step"),
        "1 when the step of the target is out of spec (check: a run would change it; after --correct: it still is). "
        "A target not checked this run keeps the value of its last successful check.",
    ),
    "needs_window": (
        "gauge",
        ("target", "step"),
        "Things the step of the target leaves to a maintenance window (unsafe unattended); kept like drift.",
    ),
    "corrected": ("gauge", ("target", "step"), "1 when this run's --correct changed the step of the target."),
    "target_status": (
        "gauge",
        ("target", "status"),
        "1 for the target's status in the last run (in_spec, drift, failed, busy, unreachable), 0 for the others.",
    ),
    "target_up": (
        "gauge",
        ("target",),
        "1 when the last run reached the target and got its report; 0 when unreachable, cut off or not reached.",
    ),
    "target_failed": (
        "gauge",
        ("target",),
        "1 when the last run failed on the target, another run held it, or it could not be reached.",
    ),
    "target_info": ("info", ("target", "node", "vmid", "run_id"), "The target's node, vmid and last run id."),
    "last_run_timestamp_seconds": (
        "gauge",
        ("target",),
        "Unix time the last drift run meant to check the target finished, whatever its outcome.",
    ),
    "last_success_timestamp_seconds": (
        "gauge",
        ("target",),
        "Unix time of the last drift run that checked the target (in spec or drift); 0 when none did yet.",
    ),
    "run_duration_seconds": (
        "gauge",
        ("target",),
        "Seconds the ansible-playbook runs that checked (and corrected) the target took in the last run.",
    ),
    "runner_last_run_timestamp_seconds": ("gauge", (), "Unix time the drift runner last finished (any outcome)."),
    "runner_last_success_timestamp_seconds": (
        "gauge",
        (),
        "Unix time the drift runner last finished with exit 0 or 2 (every target checked); 0 when never.",
    ),
    "runner_exit_code": ("gauge", (), "Exit code of the drift runner's last run: 0 in spec, 2 drift, 1 failure."),
    "runner_duration_seconds": ("gauge", (), "Seconds the drift runner's last run took, check and correction."),
    "targets": ("gauge", ("status",), "Targets of the drift runner's last run by status."),
}


def require():
    """Raise DriftError with the fix when prometheus_client cannot be imported (a venv older than the lock)."""
    if MISSING:
        lock = Path(__file__).resolve().parent.parent / "requirements" / "dev.lock"
        raise DriftError(
            f"prometheus_client is not importable by {sys.executable} ({MISSING}); run the runner with the project's "
            "venv (.venv/bin/python drift/runner.py ...; `make setup` updates it) or install the pinned one: "
            f"{sys.executable} -m pip install --require-hashes -r {lock}"
        )


def metric_name(family):
    """``drift`` -> ``pve_gpu_recover_drift``; an info family gets its ``_info`` suffix from the client."""
    return f"{PREFIX}_{family}"


def names():
    """Every metric name the runner writes, as queries name them."""
    return sorted(metric_name(family) for family in FAMILIES)


# -- pure: the state of the runs before this one ---------------------------------------------------------------
def empty_state():
    return {"version": STATE_VERSION, "runner": {"last_success": None}, "targets": {}}


def step_values(steps):
    """``{step: {"drift": 0|1, "needs_window": n}}``: what a later failed run carries of a target's steps."""
    return {
        step: {"drift": int(bool(entry.get("drift"))), "needs_window": len(entry.get("needs_window") or [])}
        for step, entry in steps.items()
    }


def metric_targets(summary, state):
    """``(targets, new_state)``: each target as the textfile shows it, and the state the next run starts from.

    A target of the summary that was checked (in spec or drift) shows this run's values and moves its last success;
    a failed, busy or unreachable one shows its last successful check's step values with this run's own readings
    over them, and keeps its last success. When the run has run-level errors, a target the state knows and the run
    never named is shown too, as failed, so its series stay. ``targets``: ``{name: {"status", "up", "node",
    "vmid", "run_id", "seconds", "last_success", "steps": {step: {"drift", "needs_window", "corrected"}}}}``.
    """
    state = state if isinstance(state, dict) and state.get("version") == STATE_VERSION else empty_state()
    known = state.get("targets") or {}
    finished = summary["finished_timestamp"]
    run_id = summary["run_ids"][-1] if summary.get("run_ids") else ""
    shown, kept = {}, {}
    for name, target in summary["targets"].items():
        before = known.get(name) or {}
        current = {
            step: dict(values, corrected=int(bool(target["steps"][step].get("corrected"))))
            for step, values in step_values(target["steps"]).items()
        }
        checked = target["status"] in CHECKED
        carried = {} if checked else {s: dict(v, corrected=0) for s, v in (before.get("steps") or {}).items()}
        last_success = finished if checked else before.get("last_success")
        node = target.get("node") if target.get("node") is not None else before.get("node")
        vmid = target.get("vmid") if target.get("vmid") is not None else before.get("vmid")
        shown[name] = {
            "status": target["status"],
            "up": target["status"] != "unreachable" and target.get("report") is not None,
            "node": node,
            "vmid": vmid,
            "run_id": target.get("run_id") or run_id,
            "seconds": target.get("seconds", summary["duration_seconds"]),
            "last_success": last_success,
            "steps": {**carried, **current},
        }
        kept[name] = {
            "node": node,
            "vmid": vmid,
            "seen": finished,
            "last_success": last_success,
            "steps": step_values(target["steps"]) if checked else before.get("steps") or {},
        }
    for name, before in known.items():
        if name in kept or not isinstance(before, dict):
            continue
        if summary.get("errors"):
            # The run failed before it named this target: shown failed with what was last known, never dropped.
            shown[name] = {
                "status": "failed",
                "up": False,
                "node": before.get("node"),
                "vmid": before.get("vmid"),
                "run_id": run_id,
                "seconds": summary["duration_seconds"],
                "last_success": before.get("last_success"),
                "steps": {s: dict(v, corrected=0) for s, v in (before.get("steps") or {}).items()},
            }
        if finished - float(before.get("seen") or 0) < STATE_TTL:
            kept[name] = before  # not named (--limit, or left the inventory): remembered a while, not shown
    runner_success = finished if summary["exit_code"] in (0, 2) else (state.get("runner") or {}).get("last_success")
    return shown, {"version": STATE_VERSION, "runner": {"last_success": runner_success}, "targets": kept}


# -- pure: the families ------------------------------------------------------------------------------------------
def registry_of(summary, targets):
    """A prometheus_client registry holding every family of FAMILIES for ``summary`` and its ``targets``."""
    registry = CollectorRegistry(auto_describe=True)
    metrics = {}
    for family, (kind, labels, help_text) in FAMILIES.items():
        if kind == "info":
            metrics[family] = Info(
                metric_name(family).removesuffix("_info"), help_text, labelnames=("target",), registry=registry
            )
        else:
            metrics[family] = Gauge(metric_name(family), help_text, labelnames=labels, registry=registry)
    for name, target in sorted(targets.items()):
        for step, values in sorted(target["steps"].items()):
            for family in ("drift", "needs_window", "corrected"):
                metrics[family].labels(target=name, step=step).set(values[family])
        for status in STATUSES:
            metrics["target_status"].labels(target=name, status=status).set(int(target["status"] == status))
        metrics["target_up"].labels(target=name).set(int(target["up"]))
        metrics["target_failed"].labels(target=name).set(int(target["status"] in FAILURES))
        info = {key: "" if target[key] is None else str(target[key]) for key in ("node", "vmid", "run_id")}
        metrics["target_info"].labels(target=name).info(info)
        metrics["last_run_timestamp_seconds"].labels(target=name).set(summary["finished_timestamp"])
        metrics["last_success_timestamp_seconds"].labels(target=name).set(number(target["last_success"]))
        metrics["run_duration_seconds"].labels(target=name).set(number(target["seconds"]))
    metrics["runner_last_run_timestamp_seconds"].set(summary["finished_timestamp"])
    metrics["runner_exit_code"].set(summary["exit_code"])
    metrics["runner_duration_seconds"].set(number(summary.get("duration_seconds")))
    counts = dict.fromkeys(STATUSES, 0)
    for target in targets.values():
        counts[target["status"]] += 1
    for status, count in counts.items():
        metrics["targets"].labels(status=status).set(count)
    return registry, metrics


def number(value):
    """A sample's value: a number, 0 for none (a last success that never happened)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


def render_textfile(summary, state=None):
    """``(text, new_state)``: the textfile for node_exporter's textfile collector, and the state to keep.

    ``summary`` is the runner's; ``state`` what :func:`metric_targets` returned last run (None: none yet).
    """
    targets, new_state = metric_targets(summary, state)
    registry, metrics = registry_of(summary, targets)
    metrics["runner_last_success_timestamp_seconds"].set(number(new_state["runner"]["last_success"]))
    return generate_latest(registry).decode(), new_state


# -- the state file ------------------------------------------------------------------------------------------------
def load_state(path):
    """The state a previous run left at ``path``; an empty one when there is none or it cannot be read (a lost
    state costs the last-success values only, never the run)."""
    try:
        # Never through a link planted at its name (the reports directory is checked, the file is not).
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(handle, encoding="utf-8") as stream:
            state = json.load(stream)
    except (OSError, ValueError):
        return empty_state()
    return state if isinstance(state, dict) and state.get("version") == STATE_VERSION else empty_state()


def state_text(state):
    return json.dumps(state, indent=2, sort_keys=True) + "\n"
