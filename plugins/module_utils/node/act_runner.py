# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one runner of the acting modules (gpu_processes, training_code, training_venv, compile_cache, verify).

An acting module is its documentation, its ``ARGUMENT_SPEC`` and an :class:`ActingStep`: what it reads, how it
acts, and the keys of its own result. The runner (:func:`run_step_module`) owns the rest, once::

    options -> target -> read + evaluate (before) -> problems? -> [check mode stops here]
            -> act, re-read in the same pct exec (after) -> prove -> result -> verdict

* Options: the step's ``check_spec`` on its settings, then the minimums of ``at_least``; a wrong one fails before
  any command with error ``invalid`` and ``fix the <step>_* variable of that name``.
* ``changed`` is ``before["pending"]``: the same read and the same evaluation in check mode and in a real run. Check
  mode stops after the first read; it never acts in order to predict.
* A real run with work acts and re-reads in ONE ``pct exec`` (the acting script's part, then the probe part again
  with the first read's payload), so a converged target costs one ``pct exec`` and a repaired one two. The re-read
  must find nothing left to do (:func:`leftover`), or the module fails with error ``verify``.
* A long acting script (a step whose ``progress`` names its first phase: the venv build, the compile cache
  warm-up) run as an Ansible async job tells what it is at while it acts: :meth:`Run.act_and_reread` asks the
  script for progress lines and hands them to the job's status file (``node_progress``); run otherwise, nothing.
* The result: ``changed``, ``changes`` (one line per change, from the first read: identical in check mode),
  ``diff`` (when the step plans one), the step's own keys, and ``seconds`` (the module's wall time).
* A failure is one :class:`RecoverError` (``node/errors.py``): ``msg`` starts with the target's label (unless it
  already names it), ``error`` is its kind - ``invalid``, ``problems`` (what the first read found makes acting
  unsafe), ``verify`` (still out of spec after acting, or a read-only step's checks failed), or the step's and the
  target's own kinds - and its details go along in their own keys.

The step hooks take plain values and a :class:`Run`; the pure functions they call (``parse_*``, ``plan_*``,
``*_of``) stay in the module or the step's facts, where unit tests call them.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import progress as node_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import run_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.shared_reads import SharedReads
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target, TargetError


def utc_stamp():
    """The name of what a run writes (a backup, a venv version): ``20261203T101500Z`` (UTC, so names sort by time
    on every target)."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def part_answer(parts, name, label):
    """The answer of one part of a ``run_probes`` call; a part that raised is a TargetError naming it."""
    part = parts[name]
    if "error" in part:
        raise TargetError(f"{label}: the {name} part failed: {part['error']}", kind="probe")
    return part["answer"]


def wrong_option(step, params):
    """Why the options cannot work (one sentence), or ``""``: the step's ``check_spec`` on its settings, then each
    minimum of ``at_least`` (an option left unset, None, is not checked), then the step's ``check_params``.

    ``at_least = {"build_timeout": (1, "give the build at least 1 second")}`` and ``build_timeout: 0`` ->
    ``"build_timeout is 0; give the build at least 1 second"``."""
    wrong = step.check_spec({name: params.get(name) for name in step.spec})
    if wrong:
        return wrong
    for name, (least, what) in step.at_least.items():
        if params.get(name) is not None and params[name] < least:
            return f"{name} is {params[name]}; {what}"
    return step.check_params(params)


def leftover(facts, ignore=()):
    """What a re-read still finds to do or to refuse: its problems, then its changes less ``ignore``; empty when
    the target is in spec."""
    return facts["problems"] + [change for change in facts["changes"] if change not in ignore]


class Run:
    """One execution of an acting module: its options, the step's settings, the target, check mode."""

    def __init__(self, module, step):
        self.module = module
        self.name = step.name
        self.progress = step.progress
        self.params = module.params
        self.spec = {name: module.params[name] for name in step.spec}
        self.check_mode = module.check_mode
        self.target = None  # set once the options are checked
        self.read_part = None  # (probe module, payload): the first read, made again after acting
        self.answer = None  # what the first read answered

    @property
    def context(self):
        """The context a step's evaluation gets (the fact pass's, without the other steps' facts): its node reads
        are its own (a fresh SharedReads each time: a re-read after acting reads the node again)."""
        target = self.target
        vmid = target.vmid if target.is_container else None
        target_of = {"label": target.label, "vmid": vmid, "node": target.node}
        return {"target": target_of, "shared": SharedReads(), "steps": {}}

    def ending_pids(self):
        """The pids the GPU step ends before this step: in check mode they still run and count as gone; a real
        run sees them gone."""
        return self.params["ending_pids"] if self.check_mode else []

    def warn(self, message):
        self.module.warn(message)

    def part(self, parts, name):
        return part_answer(parts, name, self.target.label)

    def act_and_reread(self, part, script, payload, timeout):
        """ONE pct exec: ``script`` acts (the part ``part``), then the probe part reads again what the first read
        read. Returns ``run_probes``' answer; take each part's with :meth:`part`, the script's first (its error
        explains a re-read that failed).

        A step with ``progress`` run as an async job: the payload asks the script for progress
        (``"progress": true``) and what it tells goes to the job's status file as it comes (``node_progress``)."""
        on_output = (
            node_progress.follow(self.name, self.target.label, payload, self.progress) if self.progress else None
        )
        followed = {} if on_output is None else {"on_output": on_output}  # not followed: the call as ever
        return self.target.run_probes({part: (script, payload), self.name: self.read_part}, timeout=timeout, **followed)


class ActingStep:
    """What one acting module adds to the runner. Every hook has a default made from the step's ``facts`` module
    (the fact pass's interface: ``NAME``, ``SPEC``, ``PROBE``, ``check_spec``, ``probe_payload``, ``read_node``,
    ``evaluate_step``); a module overrides what differs.

    Facts (``before``, ``after``) hold at least ``pending``, ``problems``, ``changes`` and ``diff`` (None: the
    step plans none).
    """

    facts = None  # the step's facts module (plugins/module_utils/steps/<step>/facts.py)
    argument_spec = {}  # the module's options
    error = RecoverError  # the step's exception family, for the runner's own failures
    at_least = {}  # {option: (minimum, what to give)}: checked after check_spec
    script = None  # the acting script (a module with ``probe(payload)``, run in the target like a probe part)
    act_part = "act"  # the acting script's part name
    # A long acting script's first phase ("starting the build"): run as an async job, what the script is at while
    # it acts goes to the job's status file (Run.act_and_reread, node_progress); None: never followed.
    progress = None

    def __init__(self, argument_spec=None):
        if argument_spec is not None:  # the module's options: library/<step>.py declares them with its docs
            self.argument_spec = argument_spec

    @property
    def name(self):
        """The step: its probe part's name, its facts' key, and the prefix of its role's variables."""
        return self.facts.NAME

    @property
    def spec(self):
        """The options that are the step's settings (the fact pass's ``SPEC``)."""
        return self.facts.SPEC

    def check_spec(self, spec):
        return self.facts.check_spec(spec)

    def check_params(self, params):
        """Why the module's other options (not settings of the step) cannot work, or ``""``."""
        return ""

    # -- read ----------------------------------------------------------------------------------------------------
    def payload(self, run):
        """What the probe part is asked to read."""
        return self.facts.probe_payload(run.spec, run.params["timeout"])

    def read(self, run):
        """The first read and its evaluation: ``before``. Default: the probe part in ONE pct exec."""
        run.read_part = (self.facts.PROBE, self.payload(run))
        run.answer = run.target.run_probe(*run.read_part)
        return self.evaluate(run, run.answer)

    def evaluate(self, run, answer, done=None):
        """The facts of a probe answer: the first read's (``done`` None), with the node-side reads and the pids the
        GPU step ends first, or the re-read after acting (``done``: what the script did)."""
        if done is None:
            node = dict(self.facts.read_node(run.spec, run.target, answer, run.context), ending=run.ending_pids())
            return self.facts.evaluate_step(run.spec, answer, node, dict(run.context, check_mode=run.check_mode))
        return self.facts.evaluate_step(run.spec, answer, {}, dict(run.context, check_mode=False))

    def problem_details(self, before):
        """Keys a failure for the first read's problems carries."""
        return {}

    # -- act -----------------------------------------------------------------------------------------------------
    def act_payload(self, run, before):
        """``(payload, timeout)`` of the acting script's part."""
        raise NotImplementedError

    def act(self, run, before):
        """``(done, after)``: act and re-read in ONE pct exec. ``after`` None: nothing to prove (the script found
        it must not act after all)."""
        payload, timeout = self.act_payload(run, before)
        parts = run.act_and_reread(self.act_part, self.script, payload, timeout)
        done = self.done(run, run.part(parts, self.act_part))
        return done, self.evaluate(run, run.part(parts, self.name), done)

    def done(self, run, answer):
        """The acting script's answer when it acted; its structured error as the step's error otherwise."""
        return answer

    def prove(self, run, after, done):
        """``(why, details)``: why the re-read is still not the spec (one sentence; ``""``: proven) and the keys
        the failure carries."""
        return "", {}

    # -- result --------------------------------------------------------------------------------------------------
    def result(self, run, before, after, done):
        """The step's own keys of the result (they may override ``changed``, ``changes`` and ``diff``)."""
        return {}

    def verdict(self, run, before, result):
        """Why the run fails after all, with its whole result (a read-only step's failed checks), or ``""``."""
        return ""


def run_step(step, run, started):
    """The sequence, on an AnsibleModule's ``run``; returns the result or raises a RecoverError."""
    wrong = wrong_option(step, run.params)
    if wrong:
        raise step.error(f"{wrong}; fix the {step.name}_* variable of that name", kind="invalid")
    run.target = Target.from_params(run.params)
    before = step.read(run)
    if before["problems"]:
        raise step.error("; ".join(before["problems"]), kind="problems", details=step.problem_details(before))
    done = after = None
    if before["pending"] and not run.check_mode:
        # Named in the run's lock while it acts (an async job outlives its controller): never taken over under it.
        with run_lock.working_on(run.params.get("run_lock"), run.target.vmid, step.name):
            done, after = step.act(run, before)
        why, details = step.prove(run, after, done) if after is not None else ("", {})
        if why:
            raise step.error(why, kind="verify", details=details)
    result = {"changed": before["pending"], "changes": before["changes"]}
    if before.get("diff") is not None:
        result["diff"] = before["diff"]
    result.update(step.result(run, before, after, done))
    result["seconds"] = round(time.monotonic() - started, 3)
    why = step.verdict(run, before, result)
    if why:
        raise step.error(why, kind="verify", details=result)
    return result


def failure(error, target):
    """``fail_json``'s arguments for ``error``: the target's label first, unless the message already names it
    (``CT 200 on pve1 is not running``)."""
    named = target is None or str(error).startswith(target.label)
    return error.to_result(prefix="" if named else f"{target.label}: ")


def run_step_module(step):
    """An acting module's ``main()``: build the AnsibleModule, run the sequence, exit once."""
    module = AnsibleModule(argument_spec=step.argument_spec, supports_check_mode=True)
    started = time.monotonic()
    run = Run(module, step)
    try:
        result = run_step(step, run, started)
    except RecoverError as error:
        module.fail_json(**failure(error, run.target))
    module.exit_json(**result)
