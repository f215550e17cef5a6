# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The step registry and the fact pass: what every step needs to decide, read in ONE ``pct exec`` per target.

A step is a module in module_utils that exposes (docs/design.md, "Adding a step"):

* ``NAME``: the step's name, the key of its facts under ``pve_gpu_recover.steps`` and of its spec;
* ``PROBE``: its probe part (a stdlib-only module with ``probe(payload)``, run inside the target), or None;
* ``SPEC``: the typed argument spec of the step's settings; the acting module takes the same options;
* ``probe_payload(spec, timeout)``: what the probe part is asked to read (JSON), within ``timeout`` seconds;
* ``read_node(spec, target, answer, context)``: the node-side reads (the module already runs on the node);
  ``answer`` is None when the probe part failed;
* ``evaluate_step(spec, answer, node, context)``: pure; the step's facts, with at least ``changes`` (one line per
  thing a run would change), ``problems`` (one sentence per thing that makes the step fail), ``diff``
  (``{before, after}``) and ``pending`` (the acting task has work: it runs only then).

``context`` carries ``target`` (label, vmid, node), ``check_mode`` and ``steps``: the facts of the steps evaluated
before this one (the order of ``STEPS``), so a later step builds on an earlier one's facts (the GPUs that
preflight found, the venv that the venv step found).
"""

from __future__ import annotations

import time

from ansible.module_utils import pve_gpu_cleanup, pve_preflight
from ansible.module_utils.pve_target import probe_name

# In the order the steps run; a step's evaluate sees the facts of those before it.
STEPS = (pve_preflight, pve_gpu_cleanup)
BY_NAME = {step.NAME: step for step in STEPS}


def target_context(target, check_mode):
    return {
        "target": {"label": target.label, "vmid": target.vmid, "node": target.node},
        "check_mode": bool(check_mode),
        "steps": {},
    }


def probe_parts(specs, timeout):
    """``{part name: (probe module, payload)}`` of the steps in ``specs`` that read inside the target."""
    parts = {}
    for step in STEPS:
        if step.NAME in specs and step.PROBE is not None:
            parts[probe_name(step.PROBE)] = (step.PROBE, step.probe_payload(specs[step.NAME], timeout))
    return parts


def failed_step(step, target_label, why):
    """The facts of a step that could not be read: a problem that names it, nothing pending."""
    return {
        "changes": [],
        "problems": [f"{target_label}: the {step.NAME} facts could not be read: {why}"],
        "diff": {"before": "", "after": ""},
        "pending": False,
        "error": why,
    }


def evaluate_steps(specs, target, answers, context, clock=time.monotonic):
    """Each step's facts in STEPS order, from the probe answers (``{part: {"answer"|"error"}}``) and node reads.

    A step whose probe part failed, or whose preflight found problems (nothing else is safe to read then), gets
    facts that say so instead of raising: the run stops at preflight's assert with every reason at once.
    """
    for step in STEPS:
        if step.NAME not in specs:
            continue
        started = clock()
        spec = specs[step.NAME]
        part = answers.get(probe_name(step.PROBE)) if step.PROBE is not None else {"answer": None}
        preflight = context["steps"].get(pve_preflight.NAME)
        if step is not pve_preflight and preflight is not None and preflight["problems"]:
            facts = dict(failed_step(step, context["target"]["label"], "preflight found problems"), skipped=True)
            facts["problems"] = []
        elif "error" in part:
            facts = failed_step(step, context["target"]["label"], part["error"])
        else:
            node = step.read_node(spec, target, part["answer"], context)
            facts = step.evaluate_step(spec, part["answer"], node, context)
        facts["seconds"] = round(clock() - started + part.get("seconds", 0), 3)
        context["steps"][step.NAME] = facts
    return context["steps"]
