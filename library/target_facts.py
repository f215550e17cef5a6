#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: target_facts
short_description: The fact pass of a GPU target - take its run lock and read what every recovery step needs
description:
  - Runs on the Proxmox node (or the bare GPU host) once per target and run. It takes the target's run lock
    (the rules of M(pve_gpu.recover.target_lock)), then reads, in ONE C(pct exec) probe inside the CT plus reads on the node,
    everything the steps of recover.yml need to decide whether they have work.
  - Each step contributes its own probe part and node-side reads (C(plugins/module_utils/steps/registry.py)). C(preflight)
    reads that the CT runs, its C(/dev/nvidia*), the driver inside against the node's kernel module, free disk
    and every GPU's facts from one C(nvidia-smi) query. C(gpu_processes) reads the processes holding the
    target's GPUs, by host pid, on the node.
  - The facts are returned as C(ansible_facts.pve_gpu_recover), the one interface between the roles. Each step's
    facts say what a run would change (C(changes), C(diff)), what stops it (C(problems)) and whether its acting
    task has work (C(pending)).
  - When no step has work, or a step found a problem, the lock is released in this same execution, so a converged
    run makes no further remote call. Otherwise C(lock.held) is true and the run releases it after its last step.
  - Changes nothing in the target; the lock file on the node is run bookkeeping and C(changed) is always false.
version_added: "0.2.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.facts
  - pve_gpu.recover.pve_target
  - pve_gpu.recover.pve_target.python
attributes:
  check_mode:
    support: full
    details: Reads the same in check mode; the run lock is taken in check mode too (a drift check must not read
      a target that a real run is changing).
  diff_mode:
    support: none
  facts:
    support: full
  platform:
    platforms: posix
options:
  run_id:
    description:
      - Identifies this run; the run lock and the run's reports belong to it. 1 to 64 letters, digits, C(.), C(_)
        or C(-), starting with a letter or digit.
      - The task may leave it out; the action then names the run on the controller (UTC time and 6 random hex
        digits), one id for every target of one ansible-playbook run, shared by its workers through Ansible's own
        temp directory. The module itself always gets one.
    type: str
    required: true
  owner:
    description:
      - Who runs it, shown to anyone who finds the target locked (e.g. C(alice@controller)).
      - Unset, the action records C($USER@<controller host name>); the module alone records C(unknown).
    type: str
    default: unknown
  controller:
    description:
      - Host name of the controller that runs this play, recorded in the lock. With I(controller_pid), a lock whose
        controller is this very machine (a bare host run locally) and whose pid is gone is taken over at once.
      - A lock of a controller elsewhere holds until its ttl, and a run that finds it says so.
      - Unset, the action records the controller's host name.
    type: str
  controller_pid:
    description:
      - Pid of the process that runs the play on the controller, recorded in the lock.
      - Unset, the action records C(PVE_GPU_RECOVER_CONTROLLER_PID) from the environment, which the
        C(recover_report) callback sets to the pid of ansible-playbook (the drift runner clears any value it
        inherited), else the pid of the worker's parent (ansible-playbook, which forks its workers).
      - With I(run_id), I(owner) and I(controller) it makes the run's identity in the lock; two runs under one
        run id are told apart by it.
    type: int
  lock_ttl:
    description:
      - Seconds after which a lock is considered stale (its run died) and may be taken over.
    type: int
    default: 7200
  lock_dir:
    description:
      - Directory on the node that holds the lock files.
    type: path
    default: /run/lock/pve-gpu-recover
  steps:
    description:
      - The settings of each step whose facts are read, by step name; each is checked against the step's own
        options (the role variables C(<step>_<setting>) without the prefix) and takes its defaults.
      - C(preflight) is always read. The steps and their order are the registry's
        (plugins/module_utils/steps/registry.py); each one's settings are the options of its module that are not
        the target's.
    type: dict
    default: {}
  steps_from_variables:
    description:
      - Steps whose settings the action reads from their roles' variables on the controller, in Python, and puts in
        I(steps). Setting C(s) of step C(x) is the variable C(x_s) (for the few the role computes, the one the
        step's C(ROLE_VARIABLES) names); a variable that is not set keeps the setting's default; C(x_enabled) false
        leaves the step out. A step that I(steps) names keeps the settings given there.
      - The roles' variables must be loaded (C(import_role) with C(tasks_from=settings), as recover.yml does); a step
        whose C(x_enabled) is not set fails the task. So do an unknown step and a variable that fails to template,
        with C(error=invalid_step), before any connection. A variable that templates to C(omit) is not set.
      - A Jinja mapping of every setting cost each of Ansible's workers a template compile per step; this is the
        fact pass's cheaper way to the same settings. The module itself ignores it.
    type: list
    elements: str
    default: []
  options_from_variables:
    description:
      - Read the options this task leaves out from the preflight role's variables, on the controller, in Python, as
        the role's task templated them before 2.4.0. I(vmid) is C(pve_vmid); I(node_name) is C(pve_node), else the
        inventory host's name; I(run_id) is C(preflight_run_id) and I(owner) is C(preflight_lock_owner), each left
        out when false or empty (the action fills them in); I(lock_ttl), I(lock_dir), I(python), I(timeout),
        I(per_node) and I(steps) are C(preflight_<option>); I(steps_from_variables) is C(preflight) and the steps
        C(preflight_steps_from_variables) names; I(check_run) is the run's check mode.
      - A variable that is not set or templates to C(omit) leaves its option out; an option the task gives keeps
        its value. A variable that fails to template fails the task with C(error=invalid), naming the variable,
        before any connection.
      - The preflight role's task sets it. A Jinja template for each option cost every target a template compile
        and render in its worker; this reads the same variables. The module itself ignores it.
    type: bool
    default: false
  fail_on_problems:
    description:
      - Fail when a step found a problem, with every problem in one message (the run stops here, before anything
        changes); the facts are returned all the same, so a report still shows them.
      - Set it to false to read the facts of a target that has problems without failing.
    type: bool
    default: true
  check_run:
    description:
      - Whether the run is a C(--check) run. The fact pass's task runs with check mode off (it must take the lock
        and read real facts), so the module cannot tell a check run from its own check mode; the steps plan with
        this instead (verify does not import torch after a check run's planned changes, which were not made).
      - Either this or the module's own check mode makes the pass plan for a check run.
    type: bool
    default: false
  per_node:
    description:
      - Whether the action reads the targets of one node that run this task at the same time in one execution of
        this module on the node (I(batch)), instead of one execution each. Every target keeps its own result,
        report, lock and failure. The module itself ignores it.
      - The preflight role's task reads it from C(preflight_per_node) (I(options_from_variables)).
    type: bool
    default: true
  batch:
    description:
      - Other targets of the same node to read in this same execution, beside the task's own. Each item holds
        this module's options for one target (what its own task would pass, I(batch), I(steps_from_variables) and
        I(options_from_variables) aside; the keys are the options above), and is checked as a task's options are;
        an item that fails the check fails alone.
      - An item may list, in C(same_as_task), the names of options whose value is the same as the task's own; the
        module takes those from the task's options. The action sends each target's options so, and what every
        target shares, such as a hashed lock of over 100 KB, travels once, not once per target. Options are
        compared whole, so a target whose step settings differ in one setting carries all of its C(steps). An
        option an item neither gives nor lists has its default, as in a task; a name in C(same_as_task) that is
        not one of the task's options fails the item.
      - The passes run side by side; each target takes its own lock and has its own result in RV(batch), and one
        target's failure is its own. The action fills it in (I(per_node)); a task does not set it.
      - What is the node's is read once for all of them (the compute processes C(nvidia-smi) lists, the owner of
        every process); a read that fails is then the C(gpu_processes) problem of every target that asked for it,
        each named in its own result.
    type: list
    elements: dict
    default: []
requirements:
  - On the node, C(pct) (for a CT), coreutils C(timeout) and C(nvidia-smi).
  - In the target, Python 3.9+ and C(nvidia-smi).
seealso:
  - module: pve_gpu.recover.target_lock
  - module: pve_gpu.recover.gpu_processes
  - module: pve_gpu.recover.gpu_info
notes:
  - Its action plugin (C(plugins/action/target_facts.py)) runs on the controller first, with no remote call. It
    fails the task, before any connection, with C(error=inventory) when the inventory names the target wrongly
    (C(pve_vmid) set but not a CT id, null included, or set without C(pve_node)), and with C(error=invalid) when
    I(run_id) cannot name a run. It fills in I(run_id), I(owner), I(controller) and I(controller_pid) when the task leaves
    them out, and keeps the module's AnsiballZ payload between runs.
  - Run it with C(delegate_to) the CT's node; the facts attach to the CT's inventory host (not the node) unless
    C(delegate_facts) is set.
"""

EXAMPLES = r"""
- name: Read what every step needs, in one pct exec, holding the run lock
  pve_gpu.recover.target_facts:
    vmid: 200
    steps:
      preflight: {expected_gpu_count: 8, min_free_gib: 20}
      gpu_processes: {}
  delegate_to: pve1

- name: Read the settings of the steps from their roles' variables (the roles' settings loaded before)
  pve_gpu.recover.target_facts:
    vmid: 200
    steps_from_variables: [preflight, gpu_processes, verify]
  delegate_to: pve1

- name: Read the options and the steps' settings from the roles' variables, as the preflight role's task does
  pve_gpu.recover.target_facts:
    options_from_variables: true
  delegate_to: "{{ pve_node | default(inventory_hostname) }}"

- name: Read the facts of a target even when a step found a problem
  pve_gpu.recover.target_facts:
    vmid: 200
    fail_on_problems: false
  delegate_to: pve1

- name: End the GPU holders only when the facts show some
  pve_gpu.recover.gpu_processes:
    vmid: 200
  delegate_to: pve1
  when: ansible_facts.pve_gpu_recover.gpu_processes.pending
"""

RETURN = r"""
ansible_facts:
  description: The facts of the target, under C(pve_gpu_recover).
  returned: always
  type: complex
  contains:
    pve_gpu_recover:
      description:
        - C(run_id), C(target) (label, vmid, node, hostname), C(lock) (path, held, action, and C(who), the owner,
          controller and controller_pid the lock was taken with, which its release must name), C(pending) (the steps
          with work, in order), C(problems) (every step's, in order), C(seconds) (the whole pass).
        - Then one key per step read. Every step has C(changes) (one line per thing a run would change),
          C(problems) (one sentence per thing that stops the step), C(diff) (before/after), C(pending) (its acting
          task has work) and C(seconds); a step whose facts could not be read has C(error) instead of its own keys,
          and C(error_kind=wedged) when a read never answered within the target's budget (a hung mount, a process
          stuck in the driver; the pass goes on without it and releases the lock).
        - C(preflight) adds C(checks) (name, ok, detail), C(gpus) (every field of the GPU query, as the target
          numbers them, and C(xid_events), the Xids the node's kernel log holds for the GPU's PCI address, each
          with xid, count and last_timestamp, or None when the node's log cannot be read), C(gpu_uuids),
          C(devices), C(node_driver_version), C(target_driver_version), C(nvml_library_versions), C(space),
          C(python_version), C(hostname) and C(nvidia_smi_error).
        - C(gpu_processes) adds C(processes) (what a run would end), C(protected) (left alone) and C(blockers)
          (other owners' or protected processes holding memory on the target's GPUs, with the reason),
          C(guarded) (the holders C(gpu_processes_guard) names, told attended too), C(kept_gpus) (the GPUs the
          holders in C(needs_window) use, whose memory the verify step leaves out), C(launchers), C(parents) (the
          parents of the holders' jobs a run leaves running and watches for restarts) and C(own_run) (processes of
          this recover run where a holder's walk stopped - never ended).
        - C(gpu_processes), C(training_code), C(training_venv) and C(compile_cache) add C(needs_window) (always;
          one sentence per piece of work an unattended run, C(recover_unattended), leaves for a maintenance window
          - a job's GPU processes, a repository, a venv or a cache a live process uses; empty when attended).
          That work is in neither C(changes) nor C(pending), and it is no problem. C(training_code) and
          C(training_venv) also add C(in_use) and C(ending_pids); C(training_venv) also C(rebuild) (a build is
          due), C(uv_installed) (a build is due and finds the uv of C(training_venv_uv_wheel) in the target, so
          the role copies no wheel and the module installs no uv), C(keep), C(prune) (old versions retention
          removes, each a line of C(changes)) and C(prune_kept) (beyond keep but in use).
        - C(compile_cache) adds C(roots) (each root's verdict and reason), C(expected), C(refused) (C(path),
          C(reason), C(problem) - false for a root refused for what was found at its path - a symlink, a directory
          others may write, a squatted C(/tmp) root - which is left alone while the others are handled, true for a
          root refused by its setting, a problem) and C(warnings) (the roots refused alone, shown as this task's
          warnings).
        - C(verify) adds C(checks) (name, ok, severity, expected, found, detail; ok null when a step with work in
          this run decides it), C(warnings) (shown as this task's warnings), C(torch) (from C(torch/version.py),
          no import), C(expected), C(health), C(deferred) and C(steps_with_work); it is pending only when torch
          must be imported (C(verify_import_torch)).
      type: dict
      sample:
        run_id: 20261203T101500Z-3f2a1c
        target: {label: CT 200 on pve1, vmid: 200, node: pve1, hostname: ct200}
        lock: {path: /run/lock/pve-gpu-recover/ct-200.lock, held: false, action: taken,
               who: {owner: alice@controller, controller: controller, controller_pid: 4242}}
        pending: []
        problems: []
        seconds: 0.21
        preflight: {problems: [], changes: [], pending: false, gpu_uuids: [GPU-bf580366-c11c-e730-752a-e9ca8716b7fa]}
        gpu_processes: {processes: [], protected: [], blockers: [], guarded: [], needs_window: [], kept_gpus: [],
                        changes: [], problems: [], pending: false}
error:
  description:
    - On failure, what kind of failure it was, stable for code (e.g. C(stopped), C(missing), C(timeout), C(locked)).
    - C(inventory) (the action, before any connection) when C(pve_vmid) or C(pve_node) in the inventory name the
      target wrongly; C(invalid) when I(run_id) cannot name a run.
    - C(problems) when a step found a problem (I(fail_on_problems)); the facts are returned with it.
  returned: failure
  type: str
  sample: stopped
cmd:
  description: On failure of a command, the argv that ran (the C(pct exec) wrapper included).
  returned: failure of a command
  type: list
  elements: str
rc:
  description: On failure of a command, its exit code.
  returned: failure of a command
  type: int
stdout_tail:
  description: On failure of a command, the last 20 lines of its stdout.
  returned: failure of a command that printed
  type: str
stderr_tail:
  description: On failure of a command, the last 20 lines of its stderr.
  returned: failure of a command that printed
  type: str
lock:
  description: On failure because another run holds the lock, the lock file, its holder and C(action=locked).
  returned: failure
  type: dict
batch:
  description:
    - One result per item of I(batch), in its order, each what that target's own task would have returned
      (C(changed), C(ansible_facts), and on failure C(failed), C(msg), C(error) and the failure's keys; C(warnings)
      when any). The action hands each to its target's task.
  returned: when I(batch) is not empty
  type: list
  elements: dict
  sample:
    - changed: false
      ansible_facts: {pve_gpu_recover: {run_id: 20261203T101500Z-3f2a1c, pending: [], problems: []}}
    - failed: true
      changed: false
      error: stopped
      msg: "CT 201 on pve1 is not running (pct: container '201' not running!); start it with `pct start 201` on pve1"
run_id:
  description: The run's id (I(run_id), or the one the action named), added by the action on success and failure
    alike, so a report is named by it even when the pass failed.
  returned: always
  type: str
  sample: 20261203T101500Z-3f2a1c
"""

import threading
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock_record import DEFAULT_LOCK_DIR, DEFAULT_TTL
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.shared_reads import SharedReads
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import (
    KILL_GRACE,
    PYTHON_ARGUMENT_SPEC,
    TARGET_ARGUMENT_SPEC,
    Target,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.registry import (
    BATCH_SAME_AS_TASK,
    STEP_NAMES,
    fact_pass,
    node_read_budget,
    validate_specs,
)

# The options of one target's pass: the task's own, and each item of I(batch).
PASS_ARGUMENT_SPEC = {
    **TARGET_ARGUMENT_SPEC,
    **PYTHON_ARGUMENT_SPEC,
    "run_id": {"type": "str", "required": True},
    "owner": {"type": "str", "default": "unknown"},
    "controller": {"type": "str"},
    "controller_pid": {"type": "int"},
    "lock_ttl": {"type": "int", "default": DEFAULT_TTL},
    "lock_dir": {"type": "path", "default": DEFAULT_LOCK_DIR},
    "steps": {"type": "dict", "default": {}},
    "fail_on_problems": {"type": "bool", "default": True},
    "check_run": {"type": "bool", "default": False},
    "per_node": {"type": "bool", "default": True},
}
# The module's options: one pass's, and the batch of the node's other targets.
ARGUMENT_SPEC = {
    **PASS_ARGUMENT_SPEC,
    "batch": {"type": "list", "elements": "dict", "default": []},
    # The action's own (it reads the settings and takes the option off): never a batch item's.
    "steps_from_variables": {"type": "list", "elements": "str", "default": []},
    "options_from_variables": {"type": "bool", "default": False},
}
# Targets of one node read at once: each pass mostly waits on its pct exec, so they run side by side.
MAX_PARALLEL = 32


def read_target(params, check_mode, shared=None):
    """The fact pass of one target (``params``: PASS_ARGUMENT_SPEC's options, validated), as its task's result:
    ``changed``, ``ansible_facts``, and on failure ``failed``, ``msg``, ``error``; ``warnings`` when any.
    ``shared``: the node reads of this execution's other passes (shared_reads.SharedReads)."""
    warnings = []
    try:
        specs = validate_specs(params["steps"])
        target = Target.from_params(params)
        facts = fact_pass(
            target,
            specs,
            lock={
                "lock_dir": params["lock_dir"],
                "run_id": params["run_id"],
                "owner": params["owner"],
                "ttl": params["lock_ttl"],
                "controller": params["controller"],
                "controller_pid": params["controller_pid"],
            },
            python=params["python"],
            check_mode=check_mode or params["check_run"],
            warn=warnings.append,
            shared=shared,
        )
    except RecoverError as error:
        # Every error of the pass already names its target.
        return {"failed": True, "changed": False, **error.to_result(), **({"warnings": warnings} if warnings else {})}
    # A step's findings set to warn (verify's health checks) are shown at no cost: no task of their own.
    for name in STEP_NAMES:
        warnings += (facts.get(name) or {}).get("warnings") or []
    result = {"changed": False, "ansible_facts": {"pve_gpu_recover": facts}}
    if facts["problems"] and params["fail_on_problems"]:
        # Every problem at once, before anything changes (each already names its target).
        result.update(failed=True, msg=" | ".join(facts["problems"]), error="problems")
    if warnings:
        result["warnings"] = warnings
    return result


def read_batch_item(item, check_mode, shared=None, own=None):
    """One item of I(batch): its options, with those it names under BATCH_SAME_AS_TASK taken from the task's own
    (``own``), checked as a task's would be, then its pass (read_target)."""
    options = dict(item)
    same = options.pop(BATCH_SAME_AS_TASK, [])
    problems = []
    if not isinstance(same, list) or not all(isinstance(name, str) and name in (own or {}) for name in same):
        problems.append(f"{BATCH_SAME_AS_TASK} must be a list of the task's own options, not {same!r}")
        same = []
    checked = ArgumentSpecValidator(PASS_ARGUMENT_SPEC).validate({**{name: own[name] for name in same}, **options})
    problems += checked.error_messages
    if problems:
        return {
            "failed": True,
            "changed": False,
            "msg": f"batch item for CT {options.get('vmid', (own or {}).get('vmid'))}: {'; '.join(problems)}",
            "error": "invalid",
        }
    return read_target(checked.validated_parameters, check_mode, shared)


def read_targets(own, batch, check_mode, *, parallel=MAX_PARALLEL):
    """This task's target and every item of ``batch``, side by side: (own result, [batch results in order]).
    A pass that raised anything else is that target's failure alone. The passes share their node-side reads
    (one NVML query and one /proc walk for the node, not one per target)."""

    def guarded(read, *args):
        try:
            return read(*args)
        except Exception as error:  # by design: one target's bug never costs the others their facts
            return {"failed": True, "changed": False, "msg": f"{type(error).__name__}: {error}", "error": "failed"}

    if not batch:
        return read_target(own, check_mode), []
    results = [None] * (len(batch) + 1)
    slots = threading.BoundedSemaphore(parallel)
    shared = SharedReads()

    def work(index, read, *args):
        with slots:
            results[index] = guarded(read, *args)

    threads = [threading.Thread(target=work, args=(0, read_target, own, check_mode, shared), daemon=True)]
    threads += [
        threading.Thread(target=work, args=(index, read_batch_item, item, check_mode, shared, own), daemon=True)
        for index, item in enumerate(batch, start=1)
    ]
    for thread in threads:
        thread.start()
    # Every pass ends within its own deadlines (its pct exec's, its node reads' budget); the wait for them is bounded
    # all the same, so that a pass that would not end (a bug) is named instead of hanging the node's module.
    # (A batch item's options are checked by its own pass: only a timeout that is already a number counts here.)
    given = [item.get("timeout") for item in batch]
    timeout = max([own["timeout"], *(t for t in given if isinstance(t, int) and not isinstance(t, bool))])
    waited = -(-len(threads) // parallel) * (timeout + node_read_budget(timeout) + KILL_GRACE)
    deadline = time.monotonic() + waited
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    late = {
        "failed": True,
        "changed": False,
        "msg": f"the fact pass of this target gave no answer within {waited:g} s (a read stuck in the kernel?)",
        "error": "wedged",
    }
    results = [dict(late) if result is None else result for result in results]
    return results[0], results[1:]


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    own = {name: module.params[name] for name in PASS_ARGUMENT_SPEC}
    result, others = read_targets(own, module.params["batch"], module.check_mode)
    for warning in result.pop("warnings", []):
        module.warn(warning)
    if module.params["batch"]:
        result["batch"] = others
    # The invocation Ansible adds (where it does) shows this task's own options: the batch would come back to the
    # controller only to be dropped there (each other target gets its own options from the action), and targets
    # whose options differ (a lock each) carry them all in it.
    result["invocation"] = {"module_args": {k: v for k, v in module.params.items() if k != "batch"}}
    if result.get("failed"):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
