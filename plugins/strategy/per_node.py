# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``linear`` strategy, with the fact pass of each node's targets run in one worker process.

``linear`` forks one worker per host for every task. For the fact pass (``pve_gpu.recover.target_facts`` delegated to
the target's node) that fork is most of what a converged CT costs the controller: 30 to 40 ms of CPU a CT, about a
third of it the fork's copy-on-write (its system time), against one module execution per node that reads all of
that node's CTs (docs/benchmarks.md, the fleet). So this strategy holds back the fact pass's hosts as ``linear``
queues them and, once it has queued the task for every host, starts one worker per node (the task's
``delegate_to``), whose threads (the play's forks, per worker) take the node's hosts in turn, each run as it would
be in a worker of its own: Ansible's ``WorkerProcess._run`` (TaskExecutor, the action, then the host's own
result on Ansible's result queue) on that host's own copy of the task and of its inventory ``Host`` (HostRun). The
action's node queue (plugins/action/target_facts.py) then finds every target of the node waiting at once.

Every host keeps its own task, result, callbacks, ``--limit`` and failure; every other task, a host the task
debugger queues again, and a fact pass that cannot share a worker (per_node off, a ``loop``, ``timeout``, ``async``,
``run_once`` or ``throttle`` on the task, a connection not known to be safe in threads, one worker slot: one fork,
or one host) is queued as ``linear`` queues it. A thread that raises past Ansible's own handling ends its worker
once the node's other hosts have sent their results, as an exception in a worker of its own ends that worker: the
run stops with Ansible's "A worker was found in a dead state". A worker that cannot start (no process to be had)
fails the run with the reason.

Which internals it relies on (the strategy's queue and result bookkeeping, ``WorkerProcess._run``, the task context
each worker enters) differ across ansible-core versions, so the fact pass shares workers only on the versions it
was written for (the project's supported range, KNOWN_ANSIBLE: tested on 2.19 and 2.21; 2.20's worker is 2.19's,
read from its source); on any other this is ``linear``.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: per_node
short_description: linear, with each node's fact pass in one worker process
version_added: "2.3.0"
description:
  - Runs a play as C(ansible.builtin.linear) does, task by task in lockstep across the hosts.
  - The fact pass (C(pve_gpu.recover.target_facts) delegated to the target's node) runs every host of one node in
    one worker process, whose threads (the play's forks) take its hosts in turn, instead of a forked worker per host.
    Each host keeps its own result, callbacks, C(--limit) and failure. The node's targets that share its connection
    are then read in one module execution on the node.
  - Every other task, and a fact pass with a C(loop), C(timeout) (ansible.cfg's C(task_timeout) too), C(async),
    C(run_once) or C(throttle), with the module's C(per_node) option off (C(preflight_per_node), where the task
    reads its options from the role's variables), over a connection other than C(ssh) or
    C(local), or with one worker slot (one fork, or one host in the play batch), runs as C(ansible.builtin.linear)
    runs it; so does every task on an ansible-core outside the collection's supported range.
  - The collection's playbooks C(pve_gpu.recover.recover) and C(pve_gpu.recover.verify) use it; with
    C(-e recover_strategy=linear) they use C(ansible.builtin.linear) instead.
  - ansible-core 2.19 and later print a deprecation warning for any strategy plugin from outside ansible-core
    (ansible-core has no date for removing them); this one relies on ansible-core internals, which the collection's
    tests cover on both ends of its supported range.
author: pve-gpu-recover contributors (@pve-gpu-recover)
"""

import copy
import os
import queue
import threading
import time
import traceback

import ansible
from ansible import constants as C
from ansible import context
from ansible.errors import AnsibleError
from ansible.executor.process.worker import WorkerProcess
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins import loader as plugin_loader
from ansible.plugins.strategy.linear import StrategyModule as LinearStrategy
from ansible.template import Templar
from ansible.utils.display import Display
from ansible_collections.pve_gpu.recover.plugins.action.target_facts import (
    known_ansible,
    per_node_source,
    variable_reader,
)

try:  # ansible-core 2.19 and later: the ambient context of the task a worker runs
    from ansible._internal import _task as ansible_task
except ImportError:  # pragma: no cover - older ansible-core: known_ansible is false there
    ansible_task = None

display = Display()

# The action whose hosts share a worker per node (as Ansible resolves the task's action).
SHARED_ACTION = "pve_gpu.recover.target_facts"
# The connections a node's hosts may share a worker over: each connection object is its own (ssh's master is shared
# by its socket, the action's lock guards its opening). paramiko_ssh, for one, keeps a process-wide client cache that
# each task's close() empties, and its known_hosts lock (lockf) does not exclude threads.
THREAD_SAFE_CONNECTIONS = frozenset({"ssh", "ansible.builtin.ssh", "local", "ansible.builtin.local"})


def shares_worker(
    action, *, delegate_to, connection, per_node, loop, timeout, async_val, run_once, throttle, forks, version
):
    """Whether one host's task of this kind joins its node's worker rather than a worker of its own (pure): the fact
    pass, delegated, per node, over a connection whose plugin keeps no state a thread could share
    (THREAD_SAFE_CONNECTIONS), none of the keywords the shared worker does not run as ``linear`` does (``timeout``,
    which ansible.cfg's ``task_timeout`` also sets, is a signal, which only a process's main thread can take), more
    than one worker slot, a known ansible-core."""
    return (
        action == SHARED_ACTION
        and bool(delegate_to)
        and connection in THREAD_SAFE_CONNECTIONS
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


class HostRun:
    """What ``WorkerProcess._run`` reads of its worker, for one host run in a thread of a NodeWorker: that host's own
    copy of the task and of its ``Host`` (``_run`` ends by emptying the host's variables and groups, which in a
    worker of its own touches only that process's copy, and here would empty them for every other thread still
    reading that host's ``hostvars``), its variables, and the worker's queues."""

    def __init__(self, worker, host, task, task_vars, play_context):
        self._host = copy.copy(host)
        self._task = task.copy(exclude_tasks=True)  # TaskExecutor sets the task's fields as it templates them
        self._task_vars = task_vars
        self._play_context = play_context
        self._loader = worker._loader
        self._shared_loader_obj = worker._shared_loader_obj
        self._final_q = worker._final_q
        self._variable_manager = worker._variable_manager
        self.worker_id = worker.worker_id  # Display's prompts name the worker (current_worker)
        self.worker_queue = worker.worker_queue


class NodeWorker(WorkerProcess):
    """One forked worker for the hosts of one node: each host's task runs in a thread, as it would in a worker of
    its own (``WorkerProcess._run`` on a HostRun), and sends its own result. ``parallel`` threads (the play's forks,
    fewer for fewer hosts) take the hosts in turn, so a node of hundreds of CTs is never hundreds of threads."""

    def __init__(self, *, members, parallel, **kwargs):
        super().__init__(**kwargs)
        self._members = members  # [(host, task, task_vars, play_context)]
        self._parallel = max(1, parallel)
        self._failures = []

    def _run(self):
        waiting = queue.SimpleQueue()
        for member in self._members:
            waiting.put(member)
        threads = []
        for number in range(min(self._parallel, len(self._members))):
            thread = threading.Thread(target=self._run_hosts, args=(waiting,), name=f"pve-gpu-recover-{number}")
            try:
                thread.start()
            except RuntimeError:  # no more threads to be had (a pids limit): those started take every host
                break
            threads.append(thread)
        if not threads:
            self._run_hosts(waiting)
        for thread in threads:
            thread.join()
        if self._failures:
            # Only once every other host has sent its result: as a worker of its own whose task raised past
            # Ansible's own handling, this worker ends, and the run stops ("A worker was found in a dead state").
            self._hard_exit("\n".join(self._failures))

    def _run_hosts(self, waiting):
        """Run the waiting hosts' tasks one after another until none is left."""
        while True:
            try:
                member = waiting.get_nowait()
            except queue.Empty:
                return
            self._run_host(*member)

    def _run_host(self, host, task, task_vars, play_context):
        """One host's task, as ``WorkerProcess._run`` runs it in a worker of its own (HostRun)."""
        try:
            own = HostRun(self, host, task, task_vars, play_context)
            display.debug(f"per_node: {host.name} runs in worker {os.getpid()}")
            with task_context(own._task, task_vars, host.name):
                WorkerProcess._run(own)
        except BaseException:  # as WorkerProcess.run: nothing may return into the strategy's code
            self._failures.append(f"per_node: {host.name}: {traceback.format_exc()}")


class StrategyModule(LinearStrategy):
    """``linear``, with the fact pass's hosts held back as they are queued and started one worker per node once
    the task is queued for all of them (module docstring)."""

    def __init__(self, tqm):
        super().__init__(tqm)
        self._held = []  # [(node, host, task, task_vars, play_context)] of the task being queued
        self._draining = False  # in _wait_on_pending_results: a host queued now (the debugger's redo) runs at once
        self._connections = {}  # (task uuid, node): the connection a task delegated there uses

    def _queue_task(self, host, task, task_vars, play_context):
        node = None if self._draining else self._node_of(host, task, task_vars)
        if node is None:
            return super()._queue_task(host, task, task_vars, play_context)
        # What linear's own _queue_task records for a host it queues; its worker starts (and is told) later.
        self._queued_task_cache[(host.name, task._uuid)] = {
            "host": host,
            "task": task,
            "task_vars": task_vars,
            "play_context": play_context,
        }
        self._held.append((node, host, task, task_vars, play_context))
        self._pending_results += 1
        return None

    def _wait_on_pending_results(self, iterator):
        # linear waits here once it has queued the task for every host: the held ones start now, a worker per node.
        held, self._held = self._held, []
        for node, members in node_groups(held):
            self._start_node_worker(node, members)
        self._draining = True
        try:
            return super()._wait_on_pending_results(iterator)
        finally:
            self._draining = False

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
                connection=self._connection_of(str(node), task, task_vars, templar),
                per_node=boolean(
                    per_node_source(task.args, variable_reader(templar, task_vars), templar.template), strict=False
                ),
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

    def _connection_of(self, node, task, task_vars, templar):
        """The connection a task delegated to ``node`` uses, as TaskExecutor picks it: the delegated host's
        ``ansible_connection`` (its inventory, group, play, role and task variables), else the task's ``connection``
        (its block's, its play's, the command line's); read once per node and task."""
        key = (task._uuid, node)
        if key not in self._connections:
            delegated, name = self._variable_manager.get_delegated_vars_and_hostname(templar, task, task_vars)
            given = (delegated.get("ansible_delegated_vars") or {}).get(name, {}).get("ansible_connection")
            self._connections[key] = str(templar.template(given if given is not None else task.connection))
        return self._connections[key]

    def _start_node_worker(self, node, members):
        """Start the worker of ``node``'s ``members`` in the first free worker slot, waiting for one as linear's
        _queue_task does (handling the workers' inventory requests meanwhile where this ansible-core has them)."""
        host, task, task_vars, play_context = members[0]
        parallel = len(self._workers)
        display.vvv(f"per_node: {len(members)} host(s) of {node} in one worker, {min(parallel, len(members))} at once")
        while not self._tqm._terminated:
            if hasattr(self, "_process_rpc_queue"):  # ansible-core 2.21
                self._process_rpc_queue()
            slot = self._free_slot()
            if slot is None:
                # Every slot busy (fewer forks than nodes): one frees when its worker has sent its results and
                # ended (Ansible's result thread reads them meanwhile), as linear's _queue_task waits for one.
                time.sleep(C.DEFAULT_INTERNAL_POLL_INTERVAL)
                continue
            self._workers[slot] = worker = NodeWorker(
                members=members,
                parallel=parallel,
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
            for member in members:  # as linear's _queue_task tells each host it starts
                self._tqm.send_callback("v2_runner_on_start", member[0], member[1])
            try:
                worker.start()
            except (EOFError, OSError, AssertionError) as error:  # no process to be had (EAGAIN, ENOMEM)
                self._workers[slot] = None
                self._forget(members)
                raise AnsibleError(f"per_node: no worker for the {len(members)} host(s) of {node}: {error}") from error
            return
        self._forget(members)  # the run is ending: never started, never waited for

    def _free_slot(self):
        """The first worker slot free for a new worker, or None. A worker that ended by its own failure stops the
        run as Ansible's wait does (has_dead_workers), before its slot, and its exit code, are reused."""
        for slot, previous in enumerate(self._workers):
            if previous is None:
                return slot
            if not previous.is_alive():
                if previous.exitcode not in (None, 0):
                    raise AnsibleError("A worker was found in a dead state")
                previous.close()
                return slot
        return None

    def _forget(self, members):
        """Take back what _queue_task recorded for ``members``: no result will come for them."""
        for host, task, _task_vars, _play_context in members:
            self._queued_task_cache.pop((host.name, task._uuid), None)
        self._pending_results -= len(members)
