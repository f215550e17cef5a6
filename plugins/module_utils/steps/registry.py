# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The step registry and the fact pass: what every step needs to decide, read in ONE ``pct exec`` per target.

A step is a module in module_utils that exposes (docs/design.md, "Adding a step"):

* ``NAME``: the step's name, the key of its facts under ``pve_gpu_recover.steps`` and of its spec;
* ``PROBE``: its probe part (a stdlib-only module with ``probe(payload)``, run inside the target), or None;
* ``SPEC``: the typed argument spec of the step's settings; the acting module takes the same options. The fact pass
  reads setting ``s`` from the role variable ``<step>_s`` (:func:`settings_from_variables`);
* ``ROLE_VARIABLES`` (optional): the settings read from another variable (one the role computes, ``_<step>_...``)
  or from none (None);
* ``probe_payload(spec, timeout)``: what the probe part is asked to read (JSON), within ``timeout`` seconds;
  None leaves the part out of this pass (its ``answer`` is then None);
* ``read_node(spec, target, answer, context)``: the node-side reads (the module already runs on the node);
  ``answer`` is None when the probe part failed;
* ``NODE_READ_NEEDS_ANSWER`` (optional, True when absent): False when ``read_node`` needs neither ``answer`` nor
  the facts of other steps. The fact pass then runs it in a thread while the probe runs in the target, with
  ``answer`` None and a ``context`` of ``target`` and ``check_mode`` only, so the node's reads (an ``nvidia-smi``
  query) take no time of their own. They run even when preflight then finds problems, and the pass waits for
  them before it releases the lock, but never longer than :func:`node_read_budget` of the target's timeout: a
  read stuck in the kernel (a /proc read of a process on a hung mount) becomes the step's problem, of kind
  ``wedged``, and the thread is left behind (a daemon, ended with the module);
* ``evaluate_step(spec, answer, node, context)``: pure; the step's facts, with at least ``changes`` (one line per
  thing a run would change), ``problems`` (one sentence per thing that makes the step fail), ``diff``
  (``{before, after}``) and ``pending`` (the acting task has work: it runs only then).

``context`` carries ``target`` (label, vmid, node), ``check_mode``, ``shared`` (a :class:`SharedReads`: node-side
reads that every target of one module execution shares, such as NVML's compute processes) and ``steps``: the facts
of the steps evaluated before this one (the order of ``STEP_NAMES``), so a later step builds on an earlier one's
facts (the GPUs that preflight found, the venv that the venv step found).
"""

from __future__ import annotations

import threading
import time

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.module_utils.parsing.convert_bool import boolean
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock as node_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.shared_reads import SharedReads
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import KILL_GRACE, probe_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts


class StepSpecError(RecoverError):
    """A step's settings are unknown or do not fit its SPEC (the role variables are wrong)."""


# Each step's module is imported only when the step is in the pass: on a node every import is paid on every run,
# and a converged run with the later steps off should not pay for them. (Ansible's module finder sees these
# function-level imports and ships the modules all the same.)
def _gpu_processes():
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts  # noqa: PLC0415 (imported when the step is in the pass)

    return gpu_facts


def _training_code():
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import facts as code_facts  # noqa: PLC0415 (imported when the step is in the pass)

    return code_facts


def _training_venv():
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts  # noqa: PLC0415 (imported when the step is in the pass)

    return venv_facts


def _compile_cache():
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts  # noqa: PLC0415 (imported when the step is in the pass)

    return cache_facts


def _verify():
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import facts as verify_facts  # noqa: PLC0415 (imported when the step is in the pass)

    return verify_facts


# In the order the steps run; a step's evaluate sees the facts of those before it.
LOADERS = {
    preflight_facts.NAME: lambda: preflight_facts,
    "gpu_processes": _gpu_processes,
    "training_code": _training_code,
    "training_venv": _training_venv,
    "compile_cache": _compile_cache,
    "verify": _verify,
}
STEP_NAMES = tuple(LOADERS)


def load_step(name):
    """The step module of ``name`` (imported on first use)."""
    return LOADERS[name]()


# Keys of the fact pass's answer beside the steps' own (no step may take one of these names).
RESERVED = ("run_id", "target", "lock", "pending", "problems", "seconds")
# The key of an item of the fact pass's batch (one node's other targets, read in one module execution) that names
# the options whose value is the same as the task's own: the action sends those once, the module takes them from
# its own options.
BATCH_SAME_AS_TASK = "same_as_task"


def steps_in(specs):
    """The step modules of the steps in ``specs``, in the order the steps run (STEP_NAMES)."""
    return [load_step(name) for name in STEP_NAMES if name in specs]


def validate_specs(steps):
    """Each step's settings checked against its SPEC, defaults filled in; ``preflight`` is always there.

    ``validate_specs({"gpu_processes": {"grace": "5"}})`` returns ``{"preflight": {...defaults}, "gpu_processes":
    {"grace": 5.0, ...}}``; an unknown step or a wrong value raises StepSpecError naming the role variable.
    """
    unknown = sorted(set(steps) - set(STEP_NAMES))
    if unknown:
        raise StepSpecError(
            f"unknown step(s) {', '.join(unknown)}; the steps are {', '.join(STEP_NAMES)}", kind="invalid_step"
        )
    specs = {}
    for name in STEP_NAMES:
        if name not in steps and name != preflight_facts.NAME:
            continue
        step = load_step(name)
        settings = dict(steps.get(step.NAME) or {})
        unknown = sorted(set(settings) - set(step.SPEC))
        result = ArgumentSpecValidator(step.SPEC).validate(settings)
        wrong = (
            f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(step.SPEC))}"
            if unknown
            else "; ".join(result.error_messages)
        )
        if not wrong and hasattr(step, "check_spec"):
            wrong = step.check_spec(result.validated_parameters)
        if wrong:
            raise StepSpecError(
                f"settings of step {step.NAME}: {wrong} (the role variables are named {step.NAME}_<setting>)",
                kind="invalid_step",
            )
        specs[step.NAME] = result.validated_parameters
    return specs


def settings_from_variables(names, variable):
    """The settings of each step in ``names`` read from its role's variables, in the order the steps run (pure).

    Setting ``s`` of step ``x`` is the variable ``x_s`` (the role's default, or the inventory's), or the one the
    step's ``ROLE_VARIABLES`` names for it (a value the role computes, such as the venv step's lock text; None: no
    role variable gives it, it is never read); one that is not set keeps the SPEC's default. ``x_enabled`` false
    leaves the step out, and it must be set: a step whose role's variables were not loaded would be read on its
    defaults, whether on or off (preflight, the fact pass itself, is never off). ``variable(name)`` returns the
    variable's templated value, raises KeyError when it is not set and StepSpecError when it cannot be templated.
    This is the fact pass's reading of the roles' variables on the controller: in Python, once per target, where a
    Jinja mapping of every setting cost each of Ansible's workers a template compile per step (docs/benchmarks.md,
    the fleet).
    """
    unknown = sorted(set(names) - set(STEP_NAMES))
    if unknown:
        raise StepSpecError(
            f"unknown step(s) {', '.join(unknown)} in steps_from_variables (the preflight role's "
            f"preflight_steps_from_variables); the steps are {', '.join(STEP_NAMES)}",
            kind="invalid_step",
        )
    steps = {}
    for name in STEP_NAMES:
        if name not in names or not _enabled(name, variable):
            continue
        step = load_step(name)
        renamed = getattr(step, "ROLE_VARIABLES", {})
        settings = {}
        for key in step.SPEC:
            found = variable_value(variable, renamed.get(key, f"{name}_{key}"), f"{name}'s {key}")
            if found is not UNSET:
                settings[key] = found
        steps[name] = settings
    return steps


UNSET = object()


def variable_value(variable, name, what):
    """``variable(name)`` (settings_from_variables' reader), or UNSET when ``name`` is None or the variable is not set;
    a template error names the variable and ``what`` it gives."""
    if name is None:
        return UNSET
    try:
        return variable(name)
    except KeyError:
        return UNSET
    except StepSpecError as error:
        raise StepSpecError(f"the variable {name} ({what}) cannot be templated: {error}", kind="invalid_step") from (
            error
        )


def _enabled(name, variable):
    """Whether step ``name`` is on (``<name>_enabled``); preflight always is."""
    if name == preflight_facts.NAME:
        return True
    enabled = variable_value(variable, f"{name}_enabled", "whether the step is on")
    if enabled is UNSET:
        raise StepSpecError(
            f"the variables of role pve_gpu.recover.{name} are not loaded ({name}_enabled is not set): import the "
            f"role statically in the play (import_role), as recover.yml does, or set preflight_steps for it",
            kind="invalid_step",
        )
    try:
        return boolean(enabled)
    except TypeError as error:
        raise StepSpecError(f"{name}_enabled: {error}", kind="invalid_step") from error


def target_context(target, check_mode, shared=None):
    """What a step's evaluation gets besides its own settings and reads: whose target it is, check mode, the node
    reads it shares (``shared``: this execution's :class:`SharedReads`, a new one when it is read alone) and the
    facts of the steps before it (``steps``, filled in as the pass goes)."""
    return {
        "target": {"label": target.label, "vmid": target.vmid, "node": target.node},
        "check_mode": bool(check_mode),
        "shared": SharedReads() if shared is None else shared,
        "steps": {},
    }


def probe_parts(specs, timeout):
    """``{part name: (probe module, payload)}`` of the steps in ``specs`` that read inside the target."""
    parts = {}
    for step in steps_in(specs):
        if step.PROBE is not None:
            payload = step.probe_payload(specs[step.NAME], timeout)
            if payload is not None:  # nothing to read inside this time (gpu_processes without guard pid files)
                parts[probe_name(step.PROBE)] = (step.PROBE, payload)
    return parts


def failed_step(step, target_label, why, kind=None):
    """The facts of a step that could not be read: a problem that names it, nothing pending, nothing found that
    needs a window (``needs_window`` is in every step's facts that has an unattended mode). ``kind`` (``wedged``:
    a read that never answered) goes in ``error_kind``."""
    facts = {
        "changes": [],
        "problems": [f"{target_label}: the {step.NAME} facts could not be read: {why}"],
        "diff": {"before": "", "after": ""},
        "pending": False,
        "error": why,
    }
    if kind:
        facts["error_kind"] = kind
    if "unattended" in step.SPEC:
        facts["needs_window"] = []
    return facts


def node_read_budget(timeout):
    """Seconds the pass waits for node reads run beside the probe: their commands' deadline (``timeout`` +
    KILL_GRACE, plus run_local's reaping) and as long again for their /proc reads."""
    return 2 * timeout + KILL_GRACE + 10


class NodeRead(threading.Thread):
    """A step's ``read_node`` run in a thread, beside the probe (``NODE_READ_NEEDS_ANSWER`` False), waited for
    ``budget`` seconds after it started at most."""

    def __init__(self, step, spec, target, context, clock=time.monotonic, *, budget=None):
        super().__init__(name=f"read_node {step.NAME}", daemon=True)
        self.step, self.spec, self.target, self.context, self.clock = step, spec, target, context, clock
        self.node = self.error = None
        self.seconds = 0.0
        self.budget = node_read_budget(target.timeout) if budget is None else budget
        self.deadline = None

    def start(self):
        self.deadline = self.clock() + self.budget
        super().start()

    def finish(self):
        """Wait for the read until its deadline; whether it ended (False: it is wedged and left behind)."""
        self.join(max(0.0, self.deadline - self.clock()))
        return not self.is_alive()

    def wedged_reason(self):
        return (
            f"wedged: its node-side reads gave no answer within {self.budget:g} s (something on node "
            f"{self.target.node} is stuck: a process in state D, a hung NFS/FUSE mount); they were abandoned"
        )

    def run(self):
        started = self.clock()
        try:
            self.node = self.step.read_node(self.spec, self.target, None, self.context)
        except BaseException as error:  # re-raised in the pass's thread by outcome()
            self.error = error
        self.seconds = self.clock() - started

    def outcome(self):
        """The node reads (the thread has ended: :meth:`finish` said so); what they raised, raised here."""
        if self.error is not None:
            raise self.error
        return self.node


def start_node_reads(specs, target, context, reads, clock=time.monotonic, *, budget=None):
    """Start a NodeRead for each step in ``specs`` whose node reads need no probe answer, into ``reads`` (by step
    name) as each starts, so a caller that fails half-way still joins every one that started.

    Each gets a context of its own without ``steps``: the other steps' facts do not exist yet.
    """
    alone = {"target": context["target"], "check_mode": context["check_mode"], "shared": context["shared"]}
    for step in steps_in(specs):
        if not getattr(step, "NODE_READ_NEEDS_ANSWER", True):
            read = NodeRead(step, specs[step.NAME], target, dict(alone), clock, budget=budget)
            read.start()
            reads[step.NAME] = read


def evaluate_steps(specs, target, answers, context, *, clock=time.monotonic, node_reads=None):
    """Each step's facts in STEP_NAMES order, from the probe answers (``{part: {"answer"|"error"}}``) and node reads.

    ``node_reads`` are the reads :func:`start_node_reads` started beside the probe (waited for here, each until its
    deadline). A step whose probe part failed or never answered, whose node reads are wedged, or whose preflight
    found problems (its node reads, if it ran any beside the probe, are not looked at), gets facts that say so
    instead of raising: the fact pass fails with every reason at once.
    """
    node_reads = node_reads or {}
    for step in steps_in(specs):
        early = node_reads.get(step.NAME)
        wedged = early is not None and not early.finish()
        started = clock()
        spec = specs[step.NAME]
        # A step without a part this time (no probe, or a payload of None) reads nothing inside: its answer is None.
        part = answers.get(probe_name(step.PROBE)) if step.PROBE is not None else None
        part = {"answer": None} if part is None else part
        preflight = context["steps"].get(preflight_facts.NAME)
        if step is not preflight_facts and preflight is not None and preflight["problems"]:
            facts = dict(failed_step(step, context["target"]["label"], "preflight found problems"), skipped=True)
            facts["problems"] = []
        elif wedged:
            facts = failed_step(step, context["target"]["label"], early.wedged_reason(), kind="wedged")
        elif "error" in part:
            kind = "wedged" if part.get("wedged") else None
            facts = failed_step(step, context["target"]["label"], part["error"], kind=kind)
        else:
            try:
                node = early.outcome() if early else step.read_node(spec, target, part["answer"], context)
                facts = step.evaluate_step(spec, part["answer"], node, context)
            except RecoverError as error:  # one step's unreadable facts must not hide the others'
                facts = failed_step(step, context["target"]["label"], str(error))
        # The step's own time: its evaluation, its probe part and its node reads (which overlapped the probe).
        facts["seconds"] = round(clock() - started + part.get("seconds", 0) + (early.seconds if early else 0), 3)
        context["steps"][step.NAME] = facts
    return context["steps"]


def lock_who(lock):
    """The lock's record of who runs this run, beside its run id: ``{owner, controller, controller_pid}``."""
    return {key: lock.get(key) for key in ("owner", "controller", "controller_pid")}


def fact_pass(target, specs, *, lock, python=None, check_mode=False, warn=None, clock=time.monotonic, shared=None):
    """The fact pass of one target: take its run lock, read every step's facts in ONE probe, decide the lock.

    ``specs`` come from :func:`validate_specs`; ``lock`` holds ``lock_dir``, ``run_id``, ``owner`` and ``ttl``
    (module_utils/node_lock). The lock is kept only while a step has work and no step found a problem: a converged
    target (or one that is about to fail its asserts) is released in this same module execution, so a converged
    run makes no further remote call. Any failure after the lock was taken releases it before it propagates.
    ``shared``: the :class:`SharedReads` of the module execution's other passes (a pass of its own when None).
    Returns the facts published as ``ansible_facts.pve_gpu_recover``.
    """
    started = clock()
    # The lock is run bookkeeping on the node: taken in check mode too, so a drift check never reads a target
    # that a real run is changing.
    try:
        taken = node_lock.change_lock("present", vmid=target.vmid, warn=warn, **lock)
    except node_lock.LockError as error:
        # Under one key: a top-level `path` makes Ansible add that file's attributes to the failed result.
        error.details = {"lock": error.details} if error.details else {}
        raise
    context = target_context(target, check_mode, shared)
    node_reads = {}
    try:
        # The node reads that need no probe answer run while the probe runs in the target.
        start_node_reads(specs, target, context, node_reads, clock=clock, budget=node_read_budget(target.timeout))
        answers = target.run_probes(probe_parts(specs, target.timeout), python=python)
        steps = evaluate_steps(specs, target, answers, context, clock=clock, node_reads=node_reads)
    except BaseException:
        for read in node_reads.values():
            read.finish()  # nothing of this pass is left running once it has failed, but a wedged read
        node_lock.change_lock("absent", vmid=target.vmid, **lock)  # released as the very run that took it
        raise
    problems = [problem for facts in steps.values() for problem in facts["problems"]]
    pending = [name for name, facts in steps.items() if facts["pending"]]
    keep = bool(pending) and not problems
    if not keep:
        node_lock.change_lock("absent", vmid=target.vmid, **lock)
    preflight = steps[preflight_facts.NAME]
    return {
        "run_id": lock["run_id"],
        "target": dict(context["target"], hostname=preflight.get("hostname")),
        # `who`: what the release must name besides the run id (module_utils/node_lock: "One run").
        "lock": {"path": taken["path"], "held": keep, "action": taken["action"], "who": lock_who(lock)},
        "pending": pending,
        "problems": problems,
        "seconds": round(clock() - started, 3),
        **steps,
    }
