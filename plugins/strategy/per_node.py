# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``linear`` strategy, with the fact pass of each node's targets run in one worker process.

``linear`` forks one worker per host for every task. For the fact pass (``pve_gpu.recover.target_facts`` delegated to
the target's node) that fork is most of what a converged CT costs the controller: about 30 ms of CPU a CT, a third of
it the fork's copy-on-write, against one module execution per node that reads all of that node's CTs
(docs/benchmarks.md, the fleet). So this strategy holds back the fact pass's hosts as ``linear`` queues them and,
once it has queued the task for every host, starts one worker per node (the task's ``delegate_to``), in which each
of the node's hosts runs in a thread of its own exactly as it would in a worker of its own: Ansible's
``WorkerProcess._run`` (TaskExecutor, the action, then the host's own result on Ansible's result queue). The
action's node queue (plugins/action/target_facts.py) then finds every target of the node waiting at once.

Every host keeps its own task, result, callbacks, ``--limit`` and failure; every other task, and a fact pass that
cannot share a worker (per_node off, a ``loop``, ``timeout``, ``async``, ``run_once`` or ``throttle`` on the task,
one worker slot: one fork, or one host), is queued as ``linear`` queues it. A thread that raises past Ansible's own
handling ends its worker, as an exception in a worker of its own does: the run stops with Ansible's "A worker was
found in a dead state".

Which internals it relies on (the strategy's queue and result bookkeeping, ``WorkerProcess._run``, the task context
each worker enters) differ across ansible-core versions, so the fact pass shares workers only on the versions it
was written and tested for (the project's supported range, KNOWN_ANSIBLE); on any other this is ``linear``.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: per_node
short_description: linear, with each node's fact pass in one worker process
version_added: "2.3.0"
description:
  - Runs a play as C(ansible.builtin.linear) does, task by task in lockstep across the hosts.
  - The fact pass (C(pve_gpu.recover.target_facts) delegated to the target's node) runs every host of one node in
    one worker process, a thread per host, instead of a forked worker per host. Each host keeps its own result,
    callbacks, C(--limit) and failure. The node's targets are then read in one module execution on the node at once.
  - Every other task, and a fact pass with a C(loop), C(timeout), C(async), C(run_once) or C(throttle), with
    C(per_node) off, or with one worker slot (one fork, or one host in the play batch), runs as
    C(ansible.builtin.linear) runs it; so does every task on an
    ansible-core outside the collection's supported range.
  - The collection's playbooks C(pve_gpu.recover.recover) and C(pve_gpu.recover.verify) use it; with
    C(-e recover_strategy=linear) they use C(ansible.builtin.linear) instead.
  - ansible-core 2.19 and later print a deprecation warning for any strategy plugin from outside ansible-core
    (ansible-core has no date for removing them); this one relies on ansible-core internals, which the collection's
    tests cover on both ends of its supported range.
author: pve-gpu-recover contributors (@pve-gpu-recover)
"""

import threading
import time
import traceback

import ansible
from ansible import constants as C
from ansible import context
from ansible.executor.process.worker import WorkerProcess
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins import loader as plugin_loader
from ansible.plugins.strategy.linear import StrategyModule as LinearStrategy
from ansible.template import Templar
from ansible.utils.display import Display
from ansible_collections.pve_gpu.recover.plugins.action.target_facts import known_ansible

try:  # ansible-core 2.19 and later: the ambient context of the task a worker runs
    from ansible._internal import _task as ansible_task
except ImportError:  # pragma: no cover - older ansible-core: known_ansible is false there
    ansible_task = None

display = Display()

# The action whose hosts share a worker per node (as Ansible resolves the task's action).
SHARED_ACTION = "pve_gpu.recover.target_facts"


def shares_worker(action, *, delegate_to, per_node, loop, timeout, async_val, run_once, throttle, forks, version):
    """Whether one host's task of this kind joins its node's worker rather than a worker of its own (pure): the fact
    pass, delegated, per node, none of the keywords the shared worker does not run as ``linear`` does (``timeout``
    is a signal, which only a process's main thread can take), more than one worker slot, a known ansible-core."""
    return (
        action == SHARED_ACTION
        and bool(delegate_to)
        and per_node
        and not (loop or timeout or async_val or run_once or throttle)
        and forks > 1
        and known_ansible(version)
    )


def node_groups(members):
    """``[(node, [member, ...])]``: the members, ``(node, host, task, task_vars, play_context)``, grouped by node in
    the order their nodes first come, each node's in the order they came (pure)."""
    groups = {}
    for node, *member in members:
        groups.setdefault(node, []).append(tuple(member))
    return list(groups.items())


def task_context(task, task_vars, host_name):
    """The ambient task context Ansible's worker enters around ``_run`` (WorkerProcess.run), as this ansible-core
    makes it: ``TaskContext.create`` on 2.21, ``TaskContext(task)`` on 2.19 and 2.20."""
    if hasattr(ansible_task.TaskContext, "create"):
        return ansible_task.TaskContext.create(task=task, task_vars=task_vars, host_name=host_name)
    return ansible_task.TaskContext(task)  # pylint: disable=missing-kwoa  # 2.21's fields are create()'s


class NodeWorker(WorkerProcess):
    """One forked worker for the hosts of one node: each host's task runs in a thread of its own, as it would in a
    worker of its own (``WorkerProcess._run``), and sends its own result."""

    def __init__(self, *, members, **kwargs):
        super().__init__(**kwargs)
        self._members = members  # [(host, task, task_vars, play_context)]

    def _run(self):
        threads = [
            threading.Thread(target=self._run_host, args=member, name=f"pve-gpu-recover-{member[0].name}")
            for member in self._members
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _run_host(self, host, task, task_vars, play_context):
        """One host's task, as ``WorkerProcess._run`` runs it in a worker of its own: on its own copy of the task
        (TaskExecutor sets the task's fields as it templates them), sharing this worker's queues."""
        try:
            own = object.__new__(WorkerProcess)
            own.__dict__.update(self.__dict__)
            own._host, own._task, own._task_vars, own._play_context = (
                host,
                task.copy(exclude_tasks=True),
                task_vars,
                play_context,
            )
            with task_context(own._task, task_vars, host.name):
                WorkerProcess._run(own)
        except BaseException:  # as WorkerProcess.run: nothing may return into the strategy's code
            self._hard_exit(traceback.format_exc())


class StrategyModule(LinearStrategy):
    """``linear``, with the fact pass's hosts held back as they are queued and started one worker per node once
    the task is queued for all of them (module docstring)."""

    def __init__(self, tqm):
        super().__init__(tqm)
        self._held = []  # [(node, host, task, task_vars, play_context)] of the task being queued

    def _queue_task(self, host, task, task_vars, play_context):
        node = self._node_of(host, task, task_vars)
        if node is None:
            return super()._queue_task(host, task, task_vars, play_context)
        # What linear's own _queue_task records and tells for a host it queues; the worker starts later.
        self._queued_task_cache[(host.name, task._uuid)] = {
            "host": host,
            "task": task,
            "task_vars": task_vars,
            "play_context": play_context,
        }
        self._held.append((node, host, task, task_vars, play_context))
        self._tqm.send_callback("v2_runner_on_start", host, task)
        self._pending_results += 1
        return None

    def _wait_on_pending_results(self, iterator):
        # linear waits here once it has queued the task for every host: the held ones start now, a worker per node.
        held, self._held = self._held, []
        for node, members in node_groups(held):
            self._start_node_worker(node, members)
        return super()._wait_on_pending_results(iterator)

    def _node_of(self, host, task, task_vars):
        """The node whose worker this host's task joins, or None when it is queued as linear queues it."""
        action = getattr(task, "resolved_action", None) or task.action
        if action != SHARED_ACTION or not task.delegate_to:
            return None
        try:
            templar = Templar(loader=self._loader, variables=task_vars)
            node = templar.template(task.delegate_to)
            together = shares_worker(
                action,
                delegate_to=node,
                per_node=boolean(templar.template(task.args.get("per_node", True)), strict=False),
                loop=task.loop,
                timeout=templar.template(task.timeout),
                async_val=templar.template(task.async_val),
                run_once=boolean(templar.template(task.run_once), strict=False),
                throttle=templar.template(task.throttle),
                forks=len(self._workers),
                version=ansible.__version__,
            )
        except Exception as error:  # by design: a task Ansible's worker will report on runs as linear runs it
            display.vvv(f"per_node: {host.name} queued alone ({type(error).__name__}: {error})")
            return None
        return str(node) if together else None

    def _start_node_worker(self, node, members):
        """Start the worker of ``node``'s ``members`` in the first free worker slot, waiting for one as linear's
        _queue_task does (handling the result queue's requests meanwhile where this ansible-core has them)."""
        host, task, task_vars, play_context = members[0]
        display.vvv(f"per_node: {len(members)} host(s) of {node} in one worker")
        while True:
            if hasattr(self, "_process_rpc_queue"):  # ansible-core 2.21: workers' inventory requests
                self._process_rpc_queue()
            for slot, previous in enumerate(self._workers):
                if previous is None or not previous.is_alive():
                    if previous:
                        previous.close()
                    worker = NodeWorker(
                        members=members,
                        final_q=self._final_q,
                        task_vars=task_vars,
                        host=host,
                        task=task,
                        play_context=play_context,
                        loader=self._loader,
                        variable_manager=self._variable_manager,
                        shared_loader_obj=plugin_loader.get_plugin_loader_namespace(),
                        worker_id=slot,
                        cliargs=context.CLIARGS,
                    )
                    self._workers[slot] = worker
                    worker.start()
                    return
            # Every slot busy (fewer forks than nodes): one frees when its worker has sent its results and ended
            # (Ansible's result thread reads them meanwhile), as linear's _queue_task waits for one.
            time.sleep(C.DEFAULT_INTERNAL_POLL_INTERVAL)
