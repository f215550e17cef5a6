"""plugins/strategy/per_node.py: linear, with each node's fact pass in one worker process.

Which hosts' tasks share a node's worker and how they are grouped are functions; a host whose thread raises ends
its worker as a worker of its own would. Real ``ansible-playbook`` processes then show one node's hosts run in one
worker, none forked per host, each with its own result; and every task the strategy does not hold run as linear.
"""

import contextlib
import importlib
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.unit.plugins.test_action_target_facts import ansible_env, reports_of


@pytest.fixture(scope="module")
def strategy():
    """The plugin, imported only when these tests run (it imports Ansible's task queue and the action)."""
    return importlib.import_module("ansible_collections.pve_gpu.recover.plugins.strategy.per_node")


# A fact pass that shares its node's worker: every keyword as the preflight role leaves it.
SHARED = dict(
    delegate_to="pve1",
    per_node=True,
    loop=None,
    timeout=None,
    async_val=0,
    run_once=False,
    throttle=0,
    forks=64,
    version="2.19.14",
)


def test_the_fact_pass_delegated_to_its_node_shares_the_nodes_worker(strategy):
    assert strategy.shares_worker(strategy.SHARED_ACTION, **SHARED)
    assert strategy.shares_worker(strategy.SHARED_ACTION, **dict(SHARED, version="2.21.5"))


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"delegate_to": None}, "not delegated: its host is its own node"),
        ({"delegate_to": ""}, "delegated to nothing"),
        ({"per_node": False}, "each CT read in an execution of its own: a worker per host, as many as forks"),
        ({"loop": ["a"]}, "a loop"),
        ({"timeout": 30}, "timeout is SIGALRM, which only a process's main thread can take"),
        ({"async_val": 60}, "async"),
        ({"run_once": True}, "run_once runs one host"),
        ({"throttle": 2}, "throttle limits hosts at once"),
        ({"forks": 1}, "one fork: one host at a time"),
        ({"version": "2.22.0"}, "an ansible-core whose internals it was not written for"),
        ({"version": "2.18.6"}, "an ansible-core before the supported range"),
    ],
)
def test_a_fact_pass_that_cannot_share_a_worker_runs_as_linear_runs_it(strategy, change, why):
    assert not strategy.shares_worker(strategy.SHARED_ACTION, **dict(SHARED, **change)), why


def test_no_other_action_shares_a_worker(strategy):
    for action in ("ansible.builtin.command", "pve_gpu.recover.gpu_processes", "target_facts", "pve_gpu.recover"):
        assert not strategy.shares_worker(action, **SHARED), action


def test_hosts_are_grouped_by_node_in_the_order_they_came(strategy):
    members = [(node, host, "task", {}, "context") for node, host in [("b", 1), ("a", 2), ("b", 3), ("c", 4), ("a", 5)]]
    groups = strategy.node_groups(members)
    assert [node for node, _members in groups] == ["b", "a", "c"]
    assert {node: [m[0] for m in hosts] for node, hosts in groups} == {"b": [1, 3], "a": [2, 5], "c": [4]}
    assert groups[0][1][0] == (1, "task", {}, "context")  # each member without its node
    assert strategy.node_groups([]) == []


def test_each_host_enters_the_task_context_this_ansible_core_makes(strategy, monkeypatch):
    made = []

    class Created:  # ansible-core 2.21: TaskContext.create(task=, task_vars=, host_name=)
        @classmethod
        def create(cls, **kwargs):
            made.append(kwargs)
            return "created"

    class Constructed:  # 2.19 and 2.20: TaskContext(task)
        def __init__(self, task):
            made.append(task)

    monkeypatch.setattr(strategy.ansible_task, "TaskContext", Created)
    assert strategy.task_context("task", {"x": 1}, "ct1") == "created"
    monkeypatch.setattr(strategy.ansible_task, "TaskContext", Constructed)
    assert isinstance(strategy.task_context("task", {}, "ct1"), Constructed)
    assert made == [{"task": "task", "task_vars": {"x": 1}, "host_name": "ct1"}, "task"]


class Named:
    def __init__(self, name):
        self.name = name

    def copy(self, **_kwargs):
        return Named(self.name)


def test_a_host_whose_thread_raises_ends_its_worker_as_a_worker_of_its_own_would(strategy, monkeypatch):
    """WorkerProcess.run: nothing may return into the strategy's code in a forked child; the worker ends (the run
    then stops with Ansible's "A worker was found in a dead state")."""

    def raising(_own):
        raise RuntimeError("the executor broke")

    monkeypatch.setattr(strategy.WorkerProcess, "_run", raising)
    monkeypatch.setattr(strategy, "task_context", lambda *_args: contextlib.nullcontext())
    worker = object.__new__(strategy.NodeWorker)
    ended = []
    worker._hard_exit = ended.append
    worker._run_host(Named("ct1"), Named("task"), {}, None)
    assert len(ended) == 1 and "RuntimeError: the executor broke" in ended[0]


def test_each_host_runs_on_its_own_copy_of_the_task_with_its_own_variables(strategy, monkeypatch):
    """TaskExecutor sets the task's fields as it templates them: hosts in threads of one process must not share
    the task object the strategy queued for all of them."""
    seen = []
    monkeypatch.setattr(
        strategy.WorkerProcess, "_run", lambda own: seen.append((own._host.name, own._task, own._task_vars))
    )
    monkeypatch.setattr(strategy, "task_context", lambda *_args: contextlib.nullcontext())
    worker = object.__new__(strategy.NodeWorker)
    task = Named("task")
    worker._members = [(Named(f"ct{i}"), task, {"host": i}, None) for i in range(3)]
    worker._run()
    assert sorted((name, variables["host"]) for name, _task, variables in seen) == [("ct0", 0), ("ct1", 1), ("ct2", 2)]
    assert all(copy is not task for _name, copy, _variables in seen)
    assert len({id(copy) for _name, copy, _variables in seen}) == 3


def playbook_of_two_nodes(tmp_path, strategy_name, *extra):
    """Three CTs of node pve1 and one of pve2 (the controller itself, local) through the real strategy, action and
    module, delegated to their node as the preflight role does; ct2 with wrong step settings of its own. Ansible's
    debug output says each worker it forks. Returns (the run, {host: report})."""
    (tmp_path / "hosts.yml").write_text(
        "all:\n  children:\n    nodes:\n      hosts:\n        pve1: {ansible_connection: local}\n"
        "        pve2: {ansible_connection: local}\n"
        "    cts:\n      hosts:\n"
        "        ct1: {pve_vmid: 201, pve_node: pve1}\n"
        "        ct2: {pve_vmid: 202, pve_node: pve1, ct_steps: {nope: {}}}\n"
        "        ct3: {pve_vmid: 203, pve_node: pve1}\n        ct4: {pve_vmid: 204, pve_node: pve2}\n"
    )
    (tmp_path / "play.yml").write_text(
        f"- hosts: cts\n  gather_facts: false\n  strategy: {strategy_name}\n  tasks:\n"
        "    - pve_gpu.recover.target_facts:\n"
        '        vmid: "{{ pve_vmid }}"\n        node_name: "{{ pve_node }}"\n'
        '        steps: "{{ ct_steps | default({}) }}"\n        per_node: "{{ per_node | default(true) }}"\n'
        '      delegate_to: "{{ pve_node }}"\n'
        "    - ansible.builtin.debug:\n        msg: after\n"
    )
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", str(tmp_path / "hosts.yml")]
    argv += ["-f", "8", "-vvv", "-e", f"ansible_python_interpreter={sys.executable}", *extra]
    argv.append(str(tmp_path / "play.yml"))
    env = dict(ansible_env(tmp_path), ANSIBLE_DEBUG="1")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    return done, {host: report for host, (report,) in reports_of(tmp_path).items()}


def forked(done):
    """How many workers linear's queueing forked: its debug line for each."""
    return len(re.findall(r"worker is \d+ \(out of \d+ available\)", done.stdout + done.stderr))


def test_one_nodes_hosts_run_in_one_worker_each_with_its_own_result(tmp_path):
    done, reports = playbook_of_two_nodes(tmp_path, "pve_gpu.recover.per_node")
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert "per_node: 3 host(s) of pve1 in one worker" in done.stdout, tail
    assert "per_node: 1 host(s) of pve2 in one worker" in done.stdout, tail
    # The fact pass forked none per host; only the debug task after it did, one per host still in the play (none:
    # every fact pass failed on this controller, which is no Proxmox node).
    assert forked(done) == 0, tail
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]
    assert "pct not found in PATH of node pve1" in reports["ct1"]["error"]["msg"]
    assert "unknown step(s) nope" in reports["ct2"]["error"]["msg"]
    assert "pct not found in PATH of node pve1" in reports["ct3"]["error"]["msg"]
    assert "pct not found in PATH of node pve2" in reports["ct4"]["error"]["msg"]
    assert len({report["run_id"] for report in reports.values()}) == 1
    # Each host its own result in the recap, as with a worker of its own.
    for host in ("ct1", "ct2", "ct3", "ct4"):
        assert re.search(rf"^{host}\s+: ok=0\s+changed=0\s+unreachable=0\s+failed=1", done.stdout, re.M), tail


def test_linear_and_what_cannot_share_a_worker_fork_one_worker_per_host(tmp_path):
    done, reports = playbook_of_two_nodes(tmp_path, "linear")
    assert "in one worker" not in done.stdout and forked(done) == 4, done.stdout[-3000:]
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]
    # per_node off: each CT an execution of its own, so a worker of its own, as many at once as forks allow.
    (tmp_path / "off").mkdir()
    done, reports = playbook_of_two_nodes(tmp_path / "off", "pve_gpu.recover.per_node", "-e", "per_node=false")
    assert "in one worker" not in done.stdout, done.stdout[-3000:]
    assert forked(done) == 4 and sorted(reports) == ["ct1", "ct2", "ct3", "ct4"], done.stdout[-3000:]
