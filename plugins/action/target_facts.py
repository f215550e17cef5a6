"""target_facts' action: the controller's share of the fact pass, so that a converged run is this one task.

Before the module runs, on the controller and at no remote cost: the inventory is checked (``pve_vmid`` a CT id,
``pve_node`` set beside it), the run is named (``run_id``: one id for every target of one ansible-playbook run) and
the lock's ``owner``, ``controller`` and ``controller_pid`` are filled in when the task leaves them out
(plugins/plugin_utils/run_identity.py). Each of these was a task of its own (a set_fact, an assert, two ``pipe``
lookups), and every task costs a worker process. The steps' settings and the pass's own options are read here too,
from the roles' variables, in Python (plugins/plugin_utils/settings.py).

Then the module runs exactly as Ansible's ``normal`` action runs it, with its AnsiballZ payload kept between runs
(plugins/plugin_utils/payload_store.py), and, where several targets of one node run at once, one module execution
reads them all (plugins/plugin_utils/node_queue.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

from ansible import constants as C
from ansible import context as ansible_context
from ansible.errors import AnsibleConnectionFailure
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action.normal import ActionModule as NormalAction
from ansible.utils.display import Display
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import DEFAULT_TIMEOUT, KILL_GRACE
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.registry import (
    STEP_NAMES,
    StepSpecError,
    settings_from_variables,
)
from ansible_collections.pve_gpu.recover.plugins.plugin_utils import payload_store, settings
from ansible_collections.pve_gpu.recover.plugins.plugin_utils.node_queue import (
    GATHER_IDLE,
    GATHER_IDLE_COVERED,
    GATHER_LONGEST,
    GATHER_PER_HOST,
    QUEUE_DIR,
    RESULT_WAIT_SLACK,
    NodeQueue,
    batch_items,
    task_options,
)
from ansible_collections.pve_gpu.recover.plugins.plugin_utils.run_identity import (
    controller_defaults,
    new_run_id,
    run_id_problem,
    shared_run_id,
)
from ansible_collections.pve_gpu.recover.plugins.plugin_utils.settings import (
    inventory_problem,
    options_from_variables,
    renamed_variable_problem,
    variable_reader,
)

display = Display()

# Before Ansible forks the task's workers (settings.warm_templating).
settings.warm_templating()


def unreachable_message(node, error):
    """What an unreachable node's result says: the node by its inventory name, then Ansible's own sentence."""
    return f"the node {node} could not be reached: {error}"


class ActionModule(NormalAction):
    """``normal``, after the controller's checks and defaults, with the module's payload restored before and kept
    after (module docstring)."""

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        options_problem = self._options_from_variables(task_vars)
        args = self._task.args
        given = args.get("run_id")
        problem = run_id_problem(given) if given not in (None, "") else None
        kind = "invalid"
        # A run id the task gives names the run; one that cannot is never used (it would name the report's file).
        run_id = given if given not in (None, "") and problem is None else self._run_id()
        if options_problem:
            problem, kind = options_problem, "invalid"
        if problem is None and "pve_vmid" in task_vars:
            kind = "inventory"
            # The inventory's own variables, not the options: a task may pass a vmid of its own (the module checks
            # that), but pve_vmid set without pve_node, or set to null, names its target wrongly.
            problem = inventory_problem(
                task_vars.get("inventory_hostname"),
                True,
                self._templar.template(task_vars["pve_vmid"]),
                "pve_node" in task_vars,
                self._templar.template(task_vars["pve_node"]) if "pve_node" in task_vars else None,
            )
        if not problem:
            problem = renamed_variable_problem(task_vars.get("inventory_hostname"), task_vars)
            kind = "inventory" if problem else kind
        if not problem and args.get("batch"):
            problem, kind = "batch is filled in by the action (per_node), never by a task", "invalid"
        if not problem:
            problem, kind = self._settings_from_variables(task_vars), "invalid_step"
        if problem:
            self._mark_arrival(task_vars)  # it will never post: the other hosts' reads need not wait for it
            # Before any connection: a vmid that is not a CT id never reaches a node.
            return {"failed": True, "changed": False, "msg": problem, "error": kind, "run_id": run_id}
        args["run_id"] = run_id
        for option, value in controller_defaults().items():
            if args.get(option) in (None, ""):
                args[option] = value
        queue = self._node_queue(task_vars)
        if queue is None:
            self._mark_arrival(task_vars)  # read alone (a bare host, per_node off): nobody waits for it
        result = self._read_with_node(queue, tmp, task_vars) if queue else self._read_alone(tmp, task_vars)
        result["run_id"] = run_id  # the report names the run by it, whether the pass succeeded or not
        return result

    def _options_from_variables(self, task_vars):
        """Fill in the options the task leaves out from the preflight role's variables, where it asks
        (``options_from_variables``: options_from_variables); the option is the action's own, taken off the task's
        options once they are read (a retried task, retries/until, reads them again if this read failed). Returns a
        problem, or None."""
        args = self._task.args
        if not boolean(args.get("options_from_variables", False), strict=False):
            args.pop("options_from_variables", None)
            return None
        host = task_vars.get("inventory_hostname")
        try:
            args.update(options_from_variables(args, variable_reader(self._templar, task_vars), host))
        except StepSpecError as error:
            return f"{host}: {error}"
        args.pop("options_from_variables")
        return None

    def _settings_from_variables(self, task_vars):
        """Fill ``steps`` with the settings of the steps ``steps_from_variables`` names, read from their roles'
        variables (step_registry.settings_from_variables); a step ``steps`` gives keeps the settings given. The option
        is the action's own: taken off the task's options once it is read, so neither the module nor the other
        targets of a node's read get it. Returns a problem, or None.

        The variables are templated with this target's task variables; a value that templates to ``omit`` is not
        set (the acting task, templating the same variable, omits the option too). On ansible-core 2.21, Ansible's
        connection variables of the play context are not among them (a setting that names one is undefined here)."""
        args = self._task.args
        names = args.get("steps_from_variables") or []
        if not names:
            args.pop("steps_from_variables", None)
            return None
        given = args.get("steps") or {}
        host = task_vars.get("inventory_hostname")
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            known = ", ".join(STEP_NAMES)
            return f"{host}: steps_from_variables must be a list of step names ({known}), not {names!r}"
        if not isinstance(given, dict):
            return f"{host}: steps must be a dict of each step's settings by step name, not a {type(given).__name__}"

        try:
            read = settings_from_variables(names, variable_reader(self._templar, task_vars))
        except StepSpecError as error:
            return f"{host}: {error}"
        # Only now: a retried task (retries/until) reads them again if this read failed.
        args.pop("steps_from_variables")
        args["steps"] = {**read, **given}
        return None

    def _read_alone(self, tmp, task_vars, batch=None):
        """This target's pass (and ``batch``'s, the other targets' options) in one module execution."""
        args = self._task.args
        if batch:
            args["batch"] = batch
        try:
            return self._run_keeping_payload(tmp, task_vars)
        except AnsibleConnectionFailure as error:
            # What TaskExecutor makes of it, with the run's id: an unreachable node's report is named by it too.
            # Ansible's own words depend on when ssh died ("Connection refused" names the port, a "Broken pipe"
            # while the payload was written names only the address): the node is named whatever they say.
            node = args.get("node_name") or task_vars.get("inventory_hostname")
            return {"unreachable": True, "msg": unreachable_message(node, error)}
        finally:
            args.pop("batch", None)

    def _read_with_node(self, queue, tmp, task_vars):
        """This target's pass read with every other target of its node waiting then (NodeQueue).

        A fork that finds no result of its own when it gets the node's lock reads: its own target and every one
        waiting. So no fork ever waits on another for good: whatever the reading fork met (its module failed
        before it read the others, it raised, a file could not be written), the targets it did not answer are
        queued again and the next fork to get the lock reads them."""
        try:
            mine = queue.post(task_options(self._task.args), host=task_vars.get("inventory_hostname"))
        except Exception as error:  # by design: the queue only saves time
            display.vvv(f"target_facts: not queued ({type(error).__name__}: {error}); this target is read alone")
            return self._read_alone(tmp, task_vars)
        descriptor = queue.hold(self._result_wait(queue))
        try:
            if descriptor is None:  # the node's lock cannot be had: this target is read alone, and once
                if queue.withdraw(mine):
                    return self._read_alone(tmp, task_vars)
                # A reader claimed it before: its answer comes (reading it here too would read the target twice).
                found = queue.await_result(mine, self._result_wait(queue))
                return found if found is not None else self._read_alone(tmp, task_vars)
            found = queue.result(mine)
            if found is None:
                return self._lead(queue, mine, tmp, task_vars)
        finally:
            if descriptor is not None:
                os.close(descriptor)  # lets the lock go
            queue.withdraw(mine)  # a fork that leaves unread (a task timeout, ^C) is never read by another
        return found

    def _result_wait(self, queue):
        """How long a fork waits for the reader that claimed its request: that reader's gathering, then its read at
        the worst the pass's own deadlines allow (a few commands of ``timeout`` each), and RESULT_WAIT_SLACK."""
        try:
            timeout = int(self._task.args.get("timeout") or DEFAULT_TIMEOUT)
        except (TypeError, ValueError):
            timeout = DEFAULT_TIMEOUT
        gathering = max(GATHER_LONGEST, GATHER_PER_HOST * len(queue.expected))
        return gathering + 3 * (timeout + KILL_GRACE) + RESULT_WAIT_SLACK

    def _lead(self, queue, mine, tmp, task_vars):
        """Read this target and every target waiting on its node in one module execution; answer each of them."""
        with contextlib.suppress(OSError):
            queue.gather()  # the rest of the play batch: linear starts their forks tens of ms apart
        claimed = [(name, options) for name, options in queue.claim() if name != mine]
        answered = set()
        try:
            result = self._read_alone(tmp, task_vars, batch_items([o for _name, o in claimed], self._task.args))
            others = result.pop("batch", None)
            invocation = result.get("invocation") or {}
            # Where Ansible adds the invocation, this target's shows its own options, not the batch: the module
            # leaves it out, but not when its options failed AnsibleModule's own checks (Ansible echoes them all).
            (invocation.get("module_args") or {}).pop("batch", None)
            if result.get("unreachable"):
                others = [dict(result) for _claimed in claimed]  # one node, one timeout for all of them
            if not isinstance(others, list) or len(others) != len(claimed):
                return result  # not read (this target's own options failed the module, say): queued again below
            for (name, options), other in zip(claimed, others, strict=True):
                if invocation and isinstance(other, dict):
                    other.setdefault("invocation", {"module_args": options})
                queue.answer(name, other)
                answered.add(name)
            return result
        finally:
            for name, options in claimed:
                if name not in answered:
                    with contextlib.suppress(Exception):
                        queue.post(options, name)

    def _node_queue(self, task_vars):
        """The queue of this target's node (NodeQueue), or None when it is read alone: ``per_node`` off, a bare
        host (no vmid), one host in the play batch, one fork, or a queue that cannot be made (then said at -vvv)."""
        args = self._task.args
        # As the module reads it: "false" from an extra var is false.
        if not boolean(args.get("per_node", True), strict=False) or args.get("vmid") in (None, ""):
            return None
        play_batch = task_vars.get("ansible_play_batch") or ()
        parallel = self._parallel()
        if len(play_batch) < 2 or getattr(self._task, "async_val", 0) or parallel == 1:
            return None  # one at a time: no other target is ever waiting to share the read
        try:
            delegated = (task_vars.get("ansible_delegated_vars") or {}).get(self._task.delegate_to) or {}
            context = self._play_context
            # Targets share an execution only where it reaches the very same node the very same way.
            reach = [
                self._task.delegate_to,
                getattr(self._connection, "transport", None),
                context.remote_addr,
                context.port,
                context.remote_user,
                context.private_key_file,
                context.become,
                context.become_user,
                context.become_method,
                context.check_mode,
                # The node's own connection variables (its ssh arguments, a jump host, its interpreter).
                {k: v for k, v in delegated.items() if k.startswith("ansible_") and isinstance(v, (str, int, bool))},
                self._task.environment,
                self._task.no_log,
                self._task._uuid,
            ]
            key = hashlib.sha256(json.dumps(reach, default=str).encode()).hexdigest()[:32]
            # Every node's queue of this task marks the hosts that came, so a read knows when none of its play
            # batch is left to wait for.
            return NodeQueue(
                os.path.join(C.DEFAULT_LOCAL_TMP, QUEUE_DIR, key),
                arrivals=self._arrivals(),
                expected=play_batch,
                idle=GATHER_IDLE_COVERED if parallel is not None and parallel >= len(play_batch) else GATHER_IDLE,
            )
        except Exception as error:  # by design: the queue only saves time; the target is then read alone
            display.vvv(f"target_facts: no node queue ({type(error).__name__}: {error}); this target is read alone")
            return None

    def _arrivals(self):
        """The directory where the hosts of this task mark their arrival (NodeQueue), every node's the same."""
        task_key = hashlib.sha256(str(self._task._uuid).encode()).hexdigest()[:32]
        return os.path.join(C.DEFAULT_LOCAL_TMP, QUEUE_DIR, f"arrivals-{task_key}")

    def _parallel(self):
        """How many hosts run this task at once: ``--forks``, or the task's ``throttle`` where lower; None when
        unknown (Ansible driven without its command line)."""
        forks = ansible_context.CLIARGS.get("forks")
        throttle = getattr(self._task, "throttle", 0)
        if not isinstance(forks, int):
            return None
        return min(forks, throttle) if isinstance(throttle, int) and throttle > 0 else forks

    def _mark_arrival(self, task_vars):
        """Mark this host as come without queueing it (it is read alone, or fails before): a read of another
        node's targets then stops waiting for it at once instead of after an idle wait."""
        if len(task_vars.get("ansible_play_batch") or ()) < 2:
            return
        try:
            NodeQueue.mark_arrival(self._arrivals(), task_vars.get("inventory_hostname"))
        except Exception as error:  # by design: a mark only saves the others a wait
            display.vvv(f"target_facts: arrival not marked ({type(error).__name__}: {error})")

    @staticmethod
    def _run_id():
        """The run's shared id; one of the target's own, with a warning, when Ansible's temp directory is unusable."""
        run_id = shared_run_id(C.DEFAULT_LOCAL_TMP)
        if run_id is None:
            display.warning(
                f"target_facts: cannot share the run's id through {C.DEFAULT_LOCAL_TMP}; each target names its own"
            )
            run_id = new_run_id()
        return run_id

    def _run_keeping_payload(self, tmp, task_vars):
        place = payload_store.guarded("looked up", self._payload_place)
        if place:
            payload_store.guarded("restored", payload_store.restore, *place)
        result = super().run(tmp, task_vars)
        if place:
            payload_store.guarded("kept", payload_store.keep, *place)
        return result

    def _payload_place(self):
        """``(store, key, local_cache, fqn)``, or None when the payload is not to be kept (payload_store)."""
        module_path = self._shared_loader_obj.module_loader.find_plugin(self._task.action, mod_type=".py")
        return (
            payload_store.place(module_path, C.DEFAULT_LOCAL_TMP, C.DEFAULT_MODULE_UTILS_PATH) if module_path else None
        )
