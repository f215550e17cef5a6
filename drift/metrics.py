# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The drift runner's Prometheus textfile: the summary (and the state of the runs before it) as metric families.

Prometheus' conventions for batch jobs decide its shape:

* every series a run wrote once stays present while its target is in the inventory: a target that fails, is busy or
  unreachable keeps the drift and needs_window values of its last successful check (the steps this run did read are
  overlaid), and its GPUs' last readings (those this run read overlaid), so an alert never resolves because the
  target got worse; ``target_status`` says why and ``last_success_timestamp_seconds`` how old those values are;
* ``last_success_timestamp_seconds`` is only moved by a run that checked the target (in spec or drift); it survives
  between runs in a state file (``STATE_FILE`` in the reports directory), so a failing target keeps its old value;
* ``target_status`` tells in_spec, drift, failed, busy and unreachable apart (one series per status, 1 for the
  target's own); ``target_failed``'s ``kind`` says why, from a fixed set (drift/failures.py);
* labels stay bounded: every series of a target carries its ``node`` and ``vmid`` (the report's, else the
  inventory's, else the last known), ``target_info`` adds ``id`` (``lxc/<vmid>``, as prometheus-pve-exporter names
  the CT), a GPU's series its ``index``, ``uuid`` and model ``name``; no label changes from one run to the next
  (the run id is the summary's alone);
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

from drift.errors import DriftError, missing_package
from drift.failures import label as kind_label
from drift.gpus import xid_events

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
TARGET = ("target", "node", "vmid")  # the labels of every series of a target
GPU = (*TARGET, "index", "uuid", "name")  # ... and of every series of one of its GPUs
XID = (*GPU, "xid")  # ... and of its Xid errors, one series per code the node's kernel logged for it
MIB = 1024 * 1024
# Every family the runner writes: name (without the prefix) -> (type, labels, help). The dashboard's and the alert
# rules' tests check every query against the textfile rendered from these.
FAMILIES = {
    "drift": (
        "gauge",
        (*TARGET, "step"),
        "1 when the step of the target is out of spec (check: a run would change it; after --correct: it still is). "
        "A target not checked this run keeps the value of its last successful check.",
    ),
    "needs_window": (
        "gauge",
        (*TARGET, "step"),
        "Things the step of the target leaves to a maintenance window (unsafe unattended); kept like drift.",
    ),
    "corrected": ("gauge", (*TARGET, "step"), "1 when this run's --correct changed the step of the target."),
    "target_status": (
        "gauge",
        (*TARGET, "status"),
        "1 for the target's status in the last run (in_spec, drift, failed, busy, unreachable), 0 for the others.",
    ),
    "target_up": (
        "gauge",
        TARGET,
        "1 when the last run reached the target and got its report; 0 when unreachable, cut off or not reached.",
    ),
    "target_failed": (
        "gauge",
        (*TARGET, "kind"),
        "1 when the last run failed on the target, another run held it, or it could not be reached; kind says why "
        "(none when it did not fail).",
    ),
    "target_info": (
        "info",
        (*TARGET, "id"),
        "The target's node and vmid, and its id as prometheus-pve-exporter names the CT (lxc/<vmid>).",
    ),
    "last_run_timestamp_seconds": (
        "gauge",
        TARGET,
        "Unix time the last drift run meant to check the target finished, whatever its outcome.",
    ),
    "last_success_timestamp_seconds": (
        "gauge",
        TARGET,
        "Unix time of the last drift run that checked the target (in spec or drift); 0 when none did yet.",
    ),
    "run_duration_seconds": (
        "gauge",
        TARGET,
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
    "gpu_info": (
        "gauge",
        GPU,
        "1 for each GPU of the target: joins other exporters' series of the same GPU (dcgm-exporter's by UUID).",
    ),
    "gpu_read_timestamp_seconds": (
        "gauge",
        GPU,
        "Unix time of the run whose fact pass read the GPU's values below (older than the last run when it failed).",
    ),
    "gpu_memory_used_bytes": ("gauge", GPU, "GPU memory in use (nvidia-smi memory.used), after the run."),
    "gpu_memory_total_bytes": ("gauge", GPU, "GPU memory in all (nvidia-smi memory.total)."),
    "gpu_ecc_uncorrected_volatile_errors": (
        "gauge",
        GPU,
        "Uncorrected ECC errors since the driver loaded (ecc.errors.uncorrected.volatile.total); a reset clears it.",
    ),
    "gpu_ecc_uncorrected_aggregate_errors": (
        "gauge",
        GPU,
        "Uncorrected ECC errors in the GPU's life (ecc.errors.uncorrected.aggregate.total); no reset clears it.",
    ),
    "gpu_remapped_rows_pending": (
        "gauge",
        GPU,
        "1 when a row remapping waits for a GPU reset to take effect (remapped_rows.pending).",
    ),
    "gpu_remapped_rows_failure": (
        "gauge",
        GPU,
        "1 when a row remapping has failed in the GPU's life (remapped_rows.failure): no spare rows left.",
    ),
    "gpu_retired_pages_pending": (
        "gauge",
        GPU,
        "1 when memory pages wait for retirement at the next reset or reboot (retired_pages.pending; pre-Ampere).",
    ),
    "gpu_recovery_action": (
        "gauge",
        GPU,
        "The recovery the driver asks for (gpu_recovery_action as NVML's code): 0 none, 1 GPU reset, 2 node "
        "reboot, 3 drain peer-to-peer, 4 drain and reset, -1 another action.",
    ),
    "gpu_pcie_link_generation": ("gauge", GPU, "Current PCIe link generation (lower when idle, by design)."),
    "gpu_pcie_link_generation_max": ("gauge", GPU, "Highest PCIe link generation of the GPU in its slot."),
    "gpu_pcie_link_width": ("gauge", GPU, "Current PCIe link width (lanes)."),
    "gpu_pcie_link_width_max": ("gauge", GPU, "Widest PCIe link of the GPU in its slot (lanes)."),
    "gpu_persistence_mode": ("gauge", GPU, "1 when persistence mode is on (the driver stays loaded between jobs)."),
    "gpu_xid_errors": (
        "gauge",
        XID,
        "Xid errors of the GPU with this code in the node's kernel log (since its boot, as far as the log reaches).",
    ),
    "gpu_xid_last_timestamp_seconds": (
        "gauge",
        XID,
        "Unix time the node's kernel last logged an Xid error of the GPU with this code.",
    ),
}
# A GPU family -> (the summary's key, how its value becomes the sample's).
GPU_VALUES = {
    "gpu_memory_used_bytes": ("memory_used_mib", MIB),
    "gpu_memory_total_bytes": ("memory_total_mib", MIB),
    "gpu_ecc_uncorrected_volatile_errors": ("ecc_uncorrected_volatile", 1),
    "gpu_ecc_uncorrected_aggregate_errors": ("ecc_uncorrected_aggregate", 1),
    "gpu_remapped_rows_pending": ("remapped_rows_pending", 1),
    "gpu_remapped_rows_failure": ("remapped_rows_failure", 1),
    "gpu_retired_pages_pending": ("retired_pages_pending", 1),
    "gpu_recovery_action": ("recovery_action", 1),
    "gpu_pcie_link_generation": ("pcie_link_gen", 1),
    "gpu_pcie_link_generation_max": ("pcie_link_gen_max", 1),
    "gpu_pcie_link_width": ("pcie_link_width", 1),
    "gpu_pcie_link_width_max": ("pcie_link_width_max", 1),
    "gpu_persistence_mode": ("persistence_mode", 1),
}


def require():
    """Raise DriftError with the fix when prometheus_client cannot be imported."""
    if MISSING:
        raise DriftError(missing_package("prometheus_client", MISSING))


def metric_name(family):
    """``drift`` -> ``pve_gpu_recover_drift``; an info family gets its ``_info`` suffix from the client."""
    return f"{PREFIX}_{family}"


def names():
    """Every metric name the runner writes, as queries name them."""
    return sorted(metric_name(family) for family in FAMILIES)


def target_id(vmid):
    """``200`` -> ``lxc/200``: the CT as prometheus-pve-exporter's ``id`` label names it; ``""`` for a bare host."""
    return f"lxc/{vmid}" if vmid not in (None, "") else ""


# -- pure: the state of the runs before this one ---------------------------------------------------------------
def empty_state():
    return {"version": STATE_VERSION, "runner": {"last_success": None}, "targets": {}}


def step_values(steps):
    """``{step: {"drift": 0|1, "needs_window": n}}``: what a later failed run carries of a target's steps."""
    return {
        step: {"drift": int(bool(entry.get("drift"))), "needs_window": len(entry.get("needs_window") or [])}
        for step, entry in steps.items()
    }


def gpu_values(gpus, before, read, *, checked):
    """A target's GPUs as shown, each with the time its values were ``read``: this run's (all of them when the run
    checked the target); when it did not, the GPUs it knew before (their values and read times) with whatever this
    run did read over them, by UUID, so a GPU the failing run could not read keeps its last values."""
    current = {gpu["uuid"]: dict(gpu, read=read) for gpu in gpus or [] if isinstance(gpu, dict) and gpu.get("uuid")}
    known = (
        {}
        if checked
        else {g["uuid"]: g for g in before or [] if isinstance(g, dict) and isinstance(g.get("uuid"), str)}
    )
    return sorted({**known, **current}.values(), key=by_index)


def by_index(gpu):
    """A GPU's place in the file: its index, then its UUID (a state file edited by hand sorts all the same)."""
    index = gpu.get("index")
    return (index if isinstance(index, int) else -1, str(gpu.get("uuid")))


def metric_targets(summary, state):
    """``(targets, new_state)``: each target as the textfile shows it, and the state the next run starts from.

    A target of the summary that was checked (in spec or drift) shows this run's values and moves its last success;
    a failed, busy or unreachable one shows its last successful check's step values with this run's own readings
    over them (its GPUs likewise), and keeps its last success. When the run has run-level errors, a target the
    state knows and the run never named is shown too, as failed, so its series stay. ``targets``: ``{name:
    {"status", "kind", "up", "node", "vmid", "seconds", "last_success", "steps": {step: {"drift", "needs_window",
    "corrected"}}, "gpus": [...]}}``.
    """
    state = state if isinstance(state, dict) and state.get("version") == STATE_VERSION else empty_state()
    known = state.get("targets") or {}
    finished = summary["finished_timestamp"]
    shown, kept = {}, {}
    for name, target in summary["targets"].items():
        before = known.get(name) if isinstance(known.get(name), dict) else {}
        current = {
            step: dict(values, corrected=int(bool(target["steps"][step].get("corrected"))))
            for step, values in step_values(target["steps"]).items()
        }
        checked = target["status"] in CHECKED
        carried = {} if checked else {s: dict(v, corrected=0) for s, v in (before.get("steps") or {}).items()}
        last_success = finished if checked else before.get("last_success")
        node = target.get("node") if target.get("node") is not None else before.get("node")
        vmid = target.get("vmid") if target.get("vmid") is not None else before.get("vmid")
        gpus = gpu_values(target.get("gpus"), before.get("gpus"), finished, checked=checked)
        shown[name] = {
            "status": target["status"],
            "kind": kind_label(target.get("kind") or ("none" if checked else "other")),
            "up": target["status"] != "unreachable" and target.get("report") is not None,
            "node": node,
            "vmid": vmid,
            "seconds": target.get("seconds", summary["duration_seconds"]),
            "last_success": last_success,
            "steps": {**carried, **current},
            "gpus": gpus,
        }
        kept[name] = {
            "node": node,
            "vmid": vmid,
            "seen": finished,
            "last_success": last_success,
            "steps": step_values(target["steps"]) if checked else before.get("steps") or {},
            "gpus": gpus,
        }
    for name, before in known.items():
        if name in kept or not isinstance(before, dict):
            continue
        if summary.get("errors"):
            # The run failed before it named this target: shown failed with what was last known, never dropped.
            shown[name] = {
                "status": "failed",
                "kind": "no_report",
                "up": False,
                "node": before.get("node"),
                "vmid": before.get("vmid"),
                "seconds": summary["duration_seconds"],
                "last_success": before.get("last_success"),
                "steps": {s: dict(v, corrected=0) for s, v in (before.get("steps") or {}).items()},
                "gpus": before.get("gpus") or [],
            }
        if finished - float(before.get("seen") or 0) < STATE_TTL:
            kept[name] = before  # not named (--limit, or left the inventory): remembered a while, not shown
    runner_success = finished if summary["exit_code"] in (0, 2) else (state.get("runner") or {}).get("last_success")
    return shown, {"version": STATE_VERSION, "runner": {"last_success": runner_success}, "targets": kept}


# -- pure: the families ------------------------------------------------------------------------------------------
def text(value):
    return "" if value is None else str(value)


def set_gpu(metrics, where, gpu):
    """The samples of one GPU of a target (``where``: its labels)."""
    labels = dict(where, index=text(gpu.get("index")), uuid=gpu["uuid"], name=text(gpu.get("name")))
    metrics["gpu_info"].labels(**labels).set(1)
    metrics["gpu_read_timestamp_seconds"].labels(**labels).set(number(gpu.get("read")))
    for family, (key, scale) in GPU_VALUES.items():
        value = gpu.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):  # no value: no sample, never 0
            metrics[family].labels(**labels).set(int(value) * scale)
    for event in xid_events(gpu.get("xid_events")) or []:  # the state file's too, as the report's
        xid = dict(labels, xid=str(event["xid"]))
        metrics["gpu_xid_errors"].labels(**xid).set(event["count"])
        if event["last_timestamp"] is not None:
            metrics["gpu_xid_last_timestamp_seconds"].labels(**xid).set(event["last_timestamp"])


def registry_of(summary, targets):
    """A prometheus_client registry holding every family of FAMILIES for ``summary`` and its ``targets``."""
    registry = CollectorRegistry(auto_describe=True)
    metrics = {}
    for family, (kind, labels, help_text) in FAMILIES.items():
        if kind == "info":
            metrics[family] = Info(
                metric_name(family).removesuffix("_info"), help_text, labelnames=TARGET, registry=registry
            )
        else:
            metrics[family] = Gauge(metric_name(family), help_text, labelnames=labels, registry=registry)
    for name, target in sorted(targets.items()):
        where = {"target": name, "node": text(target["node"]), "vmid": text(target["vmid"])}
        for step, values in sorted(target["steps"].items()):
            for family in ("drift", "needs_window", "corrected"):
                metrics[family].labels(**where, step=step).set(values[family])
        for status in STATUSES:
            metrics["target_status"].labels(**where, status=status).set(int(target["status"] == status))
        metrics["target_up"].labels(**where).set(int(target["up"]))
        metrics["target_failed"].labels(**where, kind=target["kind"]).set(int(target["status"] in FAILURES))
        metrics["target_info"].labels(**where).info({"id": target_id(target["vmid"])})
        metrics["last_run_timestamp_seconds"].labels(**where).set(summary["finished_timestamp"])
        metrics["last_success_timestamp_seconds"].labels(**where).set(number(target["last_success"]))
        metrics["run_duration_seconds"].labels(**where).set(number(target["seconds"]))
        for gpu in target["gpus"]:
            set_gpu(metrics, where, gpu)
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
