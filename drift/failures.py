# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Why a target failed, as one word of a fixed set: the summary's ``kind`` and the textfile's ``kind`` label.

The modules' error kinds are many (each step has its own) and a new one may come with any release; a label must
stay bounded, so each is mapped here onto :data:`KINDS`, and anything unknown is ``other``. The summary's
``reason`` keeps the sentence; the kind is what an alert routes on.
"""

from __future__ import annotations

# Every value the ``kind`` label takes (README.md, "Monitoring", documents each).
KINDS = (
    "none",  # the target did not fail (in spec or drift)
    "unreachable",  # its node did not answer over ssh
    "busy",  # another recover run held its run lock
    "problems",  # the fact pass found something that stops a recovery (CT stopped, driver mismatch, low disk)
    "verify",  # the known-good spec was not proven: the verify step's checks failed
    "step",  # a step's acting task failed (a venv build, a reset, a purge)
    "timeout",  # a command past its deadline, or the run's --timeout cut the target off
    "wedged",  # a node-side read never answered (a hung mount, a process stuck in the kernel)
    "stopped",  # the CT is not running
    "missing",  # no such CT on its node
    "moved",  # the CT lives on another node of the cluster now
    "no_pct",  # pve_node is not a Proxmox VE node (no pct)
    "probe",  # the CT's answer to the fact pass was not what the probe prints
    "nvidia_smi",  # nvidia-smi failed in a way it names (a lost GPU, a driver mismatch)
    "inventory",  # pve_node / pve_vmid name the target wrongly
    "invalid",  # a setting of a step is invalid
    "canceled",  # the run was stopped (SIGTERM, SIGINT)
    "no_report",  # no readable report for the target, and nothing else says why
    "schema",  # the report has a schema_version this runner does not read
    "other",  # anything else (a kind this runner does not know)
)
# A module's error kind (the report's error.kind, a failed event's res.error) -> its label.
MODULE_KINDS = {
    "problems": "problems",
    "verify": "verify",
    "timeout": "timeout",
    "wedged": "wedged",
    "stopped": "stopped",
    "missing": "missing",
    "moved": "moved",
    "no_pct": "no_pct",
    "probe": "probe",
    "inventory": "inventory",
    "invalid": "invalid",
    "invalid_step": "invalid",
}
# How a run that ended early explains a target it left without a report (runner.RUN_ENDED's keys).
RUN_KINDS = {"timeout": "timeout", "canceled": "canceled"}


def module_kind(kind, step, steps):
    """``("nvidia_smi_lost", None)`` -> ``"nvidia_smi"``; ``("tls", "training_venv")`` -> ``"step"``.

    ``kind`` is the module's error kind (or None), ``step`` the step whose task failed (the report's
    ``error.step``, or the failed task's action: the acting modules are named like their steps), ``steps`` the
    registry's list of steps. A kind of the fixed set keeps its name; another kind raised by the verify step is
    ``verify``, by another step but preflight ``step``; the rest (an ``assert``, a ``fail`` of the user's) is
    ``other``.
    """
    kind = kind if isinstance(kind, str) else None
    if kind in MODULE_KINDS:
        return MODULE_KINDS[kind]
    if kind and kind.startswith("nvidia_smi_"):
        return "nvidia_smi"
    if step == "verify":
        return "verify"
    if step in steps and step != "preflight":
        return "step"
    return "other"


def problem_kind(report):
    """``verify`` when the fact pass's problems are all the verify step's, else ``problems``: a run that stops on
    problems says whether the spec was not proven or the target is unfit for a recovery."""
    before = report.get("before") if isinstance(report.get("before"), dict) else {}
    having = [step for step, facts in before.items() if isinstance(facts, dict) and facts.get("problems")]
    return "verify" if having == ["verify"] else "problems"


def report_kind(report, event, steps):
    """The kind of a target whose report says ``failed``: its error's kind (``event``: the failed event's
    ``{kind, action}`` when the report has none), a failed task with problems in the fact pass counted as such."""
    error = report.get("error") if isinstance(report.get("error"), dict) else {}
    kind = error.get("kind") or (event or {}).get("kind")
    step = error.get("step") or error.get("action") or (event or {}).get("action")
    found = module_kind(kind, step, steps)
    if found == "problems" or (found == "other" and not kind and (report.get("before") or {}).get("problems")):
        return problem_kind(report)
    return found


def failure_kind(status, *, steps, report=None, event=None, run_status=None, schema_error=False):
    """A target's kind from its status and what explains it (see :data:`KINDS`).

    ``steps`` is the registry's list of steps, ``report`` the target's failed report (None: none was written, it
    could not be read, or it did not fail), ``event`` the first failed event's ``{kind, action}``, ``run_status``
    how the run ended (``timeout``, ``canceled``, ...), ``schema_error`` whether its report was refused for its
    schema_version.
    """
    if status in ("in_spec", "drift"):
        return "none"
    if status in ("unreachable", "busy"):
        return status
    if report is not None:
        return report_kind(report, event, steps)
    if schema_error:
        return "schema"
    if event:
        return module_kind(event.get("kind"), event.get("action"), steps)
    return RUN_KINDS.get(run_status, "no_report")


def label(kind):
    """A summary's kind as the label shows it: one of :data:`KINDS`, ``other`` for anything else (an older or
    hand-edited summary, a state file of another version)."""
    return kind if kind in KINDS else "other"
