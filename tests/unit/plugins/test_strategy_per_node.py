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
import threading
import types

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
    connection="ssh",
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
        ({"connection": "paramiko_ssh"}, "a process-wide client cache each task's close() empties"),
        ({"connection": "community.general.lxc"}, "a connection plugin nobody checked for threads"),
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
        self.vars = {"marker": name}

    def copy(self, **_kwargs):
        return Named(self.name)


def node_worker(strategy, members, parallel=2):
    """A NodeWorker as its forked process has it, without the process: its members and what HostRun reads of it."""
    worker = object.__new__(strategy.NodeWorker)
    worker._members = members
    worker._parallel = parallel
    worker._failures = []
    worker._loader = worker._shared_loader_obj = worker._final_q = worker._variable_manager = None
    worker.worker_id, worker.worker_queue = 3, "queue"
    return worker


def test_each_host_runs_on_its_own_copy_of_its_task_and_host_with_its_own_variables(strategy, monkeypatch):
    """TaskExecutor sets the task's fields as it templates them, and WorkerProcess._run empties the host's
    variables when it is done: threads of one process must not share the task the strategy queued for all of
    them, nor the inventory's Host, whose variables other threads still read (hostvars)."""
    seen = []

    def run(own):
        seen.append((own._host, own._task, own._task_vars, own.worker_id, own.worker_queue))
        own._host.vars = {}  # what WorkerProcess._run does last

    monkeypatch.setattr(strategy.WorkerProcess, "_run", run)
    monkeypatch.setattr(strategy, "task_context", lambda *_args: contextlib.nullcontext())
    task, hosts = Named("task"), [Named(f"ct{i}") for i in range(3)]
    worker = node_worker(strategy, [(host, task, {"host": i}, None) for i, host in enumerate(hosts)])
    worker._hard_exit = pytest.fail
    worker._run()
    assert sorted((host.name, variables["host"]) for host, _t, variables, _i, _q in seen) == [
        ("ct0", 0),
        ("ct1", 1),
        ("ct2", 2),
    ]
    assert all(own_task is not task for _h, own_task, _v, _i, _q in seen)
    assert len({id(own_task) for _h, own_task, _v, _i, _q in seen}) == 3
    assert all(own_host not in hosts for own_host, _t, _v, _i, _q in seen)
    assert [host.vars for host in hosts] == [{"marker": "ct0"}, {"marker": "ct1"}, {"marker": "ct2"}]
    assert {(worker_id, queue) for _h, _t, _v, worker_id, queue in seen} == {(3, "queue")}


def test_a_host_whose_thread_raises_ends_its_worker_once_the_others_have_sent_theirs(strategy, monkeypatch):
    """WorkerProcess.run: nothing may return into the strategy's code in a forked child; the worker ends (the run
    then stops with Ansible's "A worker was found in a dead state"), but only after every other host of the worker
    has run and sent its result, never in the middle of a sibling's send."""
    ran, raised = [], threading.Event()

    def run(own):
        if own._host.name == "ct1":
            raised.set()
            raise RuntimeError("the executor broke")
        assert raised.wait(10)  # the others finish only after ct1 has raised
        ran.append(own._host.name)

    monkeypatch.setattr(strategy.WorkerProcess, "_run", run)
    monkeypatch.setattr(strategy, "task_context", lambda *_args: contextlib.nullcontext())
    worker = node_worker(strategy, [(Named(f"ct{i}"), Named("task"), {}, None) for i in range(4)], parallel=4)
    ended = []
    worker._hard_exit = lambda message: ended.append((message, sorted(ran)))
    worker._run()
    ((message, finished),) = ended
    assert finished == ["ct0", "ct2", "ct3"]  # every sibling had sent its result when the worker ended
    assert "per_node: ct1:" in message and "RuntimeError: the executor broke" in message


def test_a_worker_runs_no_more_hosts_at_once_than_it_has_threads_for(strategy, monkeypatch):
    """``parallel`` threads (the play's forks: the strategy passes its number of worker slots) take the hosts in
    turn: two at a time here, each pair meeting at a barrier, and never a third beside them."""
    running, most, lock, pair = [], [], threading.Lock(), threading.Barrier(2, timeout=10)

    def run(_own):
        with lock:
            running.append(1)
            most.append(len(running))
        pair.wait()
        with lock:
            running.pop()

    monkeypatch.setattr(strategy.WorkerProcess, "_run", run)
    monkeypatch.setattr(strategy, "task_context", lambda *_args: contextlib.nullcontext())
    worker = node_worker(strategy, [(Named(f"ct{i}"), Named("task"), {}, None) for i in range(6)], parallel=2)
    worker._hard_exit = pytest.fail
    worker._run()
    assert len(most) == 6 and max(most) == 2


class Slot:
    """A worker slot's process as the strategy sees it."""

    def __init__(self, alive=False, exitcode=0):
        self.alive, self.exitcode, self.closed = alive, exitcode, False

    def is_alive(self):
        return self.alive

    def close(self):
        self.closed = True


def strategy_for_start(strategy, monkeypatch, workers, starts=None, terminated=False):
    """The strategy's bookkeeping of two held hosts of pve1, without Ansible's task queue; the NodeWorker it makes
    records itself and raises ``starts`` from start()."""
    module = object.__new__(strategy.StrategyModule)
    told = []
    module._tqm = types.SimpleNamespace(_terminated=terminated, send_callback=lambda *args: told.append(args))
    module._workers = workers
    module._final_q = module._loader = module._variable_manager = None
    module._process_rpc_queue = lambda: None  # ansible-core 2.21's workers' inventory requests: none here
    members = [(Named(f"ct{i}"), Named("task"), {}, None) for i in range(2)]
    for _host, task, *_rest in members:
        task._uuid = "uuid"
    module._queued_task_cache = {(host.name, "uuid"): {} for host, *_rest in members}
    module._pending_results = 2
    made = []

    class Worker:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def start(self):
            if starts:
                raise starts

    monkeypatch.setattr(strategy, "NodeWorker", Worker)
    return module, members, told, made


def test_a_node_worker_starts_in_a_free_slot_and_tells_each_host_it_starts(strategy, monkeypatch):
    busy = Slot(alive=True)
    done = Slot(alive=False, exitcode=0)
    module, members, told, made = strategy_for_start(strategy, monkeypatch, [busy, done])
    module._start_node_worker("pve1", members)
    assert done.closed and not busy.closed and module._workers[0] is busy
    ((kwargs,),) = [made]
    assert kwargs["members"] == members and kwargs["parallel"] == 2 and kwargs["worker_id"] == 1
    assert [(name, host.name) for name, host, _task in told] == [
        ("v2_runner_on_start", "ct0"),
        ("v2_runner_on_start", "ct1"),
    ]
    assert module._pending_results == 2


def test_a_node_worker_that_cannot_start_fails_the_run_instead_of_leaving_it_waiting(strategy, monkeypatch):
    module, members, _told, _made = strategy_for_start(
        strategy, monkeypatch, [None], starts=OSError(11, "Resource temporarily unavailable")
    )
    with pytest.raises(strategy.AnsibleError, match=r"no worker for the 2 host\(s\) of pve1: .*temporarily"):
        module._start_node_worker("pve1", members)
    assert module._pending_results == 0 and module._queued_task_cache == {} and module._workers == [None]


def test_a_run_that_is_ending_starts_no_node_worker_and_waits_for_none(strategy, monkeypatch):
    module, members, told, made = strategy_for_start(strategy, monkeypatch, [None], terminated=True)
    module._start_node_worker("pve1", members)
    assert made == [] and told == [] and module._pending_results == 0


def test_a_worker_that_ended_by_its_own_failure_stops_the_run_before_its_slot_is_reused(strategy, monkeypatch):
    module, members, _told, made = strategy_for_start(strategy, monkeypatch, [Slot(alive=False, exitcode=1)])
    with pytest.raises(strategy.AnsibleError, match="A worker was found in a dead state"):
        module._start_node_worker("pve1", members)
    assert made == []


def test_each_host_enters_the_task_context_of_the_ansible_core_under_test(strategy):
    """2.21 makes it with TaskContext.create(task=, task_vars=, host_name=); 2.19 and 2.20 with TaskContext(task)."""
    import ansible  # noqa: PLC0415

    major, minor = (int(n) for n in ansible.__version__.split(".")[:2])
    assert hasattr(strategy.ansible_task.TaskContext, "create") == ((major, minor) >= (2, 21))


def run_play(tmp_path, hosts, play, *extra, forks=8, stdin=None):
    """``play`` on inventory ``hosts`` (YAML texts) through the real strategy, action and module, every node the
    controller itself (local); Ansible's debug output says each worker linear forks and each host the strategy runs
    in a node's worker, with its pid. Returns (the run, {host: report})."""
    (tmp_path / "hosts.yml").write_text(hosts)
    (tmp_path / "play.yml").write_text(play)
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", str(tmp_path / "hosts.yml")]
    argv += ["-f", str(forks), "-vvv", "-e", f"ansible_python_interpreter={sys.executable}", *extra]
    argv.append(str(tmp_path / "play.yml"))
    env = dict(ansible_env(tmp_path), ANSIBLE_DEBUG="1")
    done = subprocess.run(
        argv, cwd=ROOT, env=env, input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    return done, {host: report for host, (report,) in reports_of(tmp_path).items()}


TWO_NODES = (
    "all:\n  children:\n    nodes:\n      hosts:\n        pve1: {ansible_connection: local}\n"
    "        pve2: {ansible_connection: local}\n"
    "    cts:\n      hosts:\n"
    "        ct1: {pve_vmid: 201, pve_node: pve1}\n"
    "        ct2: {pve_vmid: 202, pve_node: pve1, ct_steps: {nope: {}}}\n"
    "        ct3: {pve_vmid: 203, pve_node: pve1}\n        ct4: {pve_vmid: 204, pve_node: pve2}\n"
)


def fact_pass_play(strategy_name, extra_task=""):
    """The fact pass delegated to each CT's node, as the preflight role runs it (failures ignored, so that the task
    after it runs for every host), then a debug task."""
    return (
        f"- hosts: cts\n  gather_facts: false\n  strategy: {strategy_name}\n  tasks:\n"
        "    - pve_gpu.recover.target_facts:\n"
        '        vmid: "{{ pve_vmid }}"\n        node_name: "{{ pve_node }}"\n'
        '        steps: "{{ ct_steps | default({}) }}"\n        per_node: "{{ per_node | default(true) }}"\n'
        f"{extra_task}"
        '      delegate_to: "{{ pve_node }}"\n      ignore_errors: true\n'
        "    - ansible.builtin.debug:\n        msg: after\n"
    )


def forked(done):
    """How many workers linear's queueing forked: its debug line for each."""
    return len(re.findall(r"worker is \d+ \(out of \d+ available\)", done.stdout + done.stderr))


def failure_of(done, host):
    """What the run printed for ``host``'s failed fact pass (ignored: the task after it runs for every host)."""
    found = re.search(rf"^fatal: \[{host}( -> [^\]]+)?\]: FAILED! =>(.*?)(?=^\S)", done.stdout, re.M | re.S)
    return found.group(2) if found else ""


def worker_pids(done):
    """``{host: pid}`` of each host the strategy ran in a node's worker (its debug line, sent from that worker)."""
    return dict(re.findall(r"per_node: (\S+) runs in worker (\d+)", done.stdout + done.stderr))


def test_one_nodes_hosts_run_in_one_worker_process_each_with_its_own_result(tmp_path):
    done, reports = run_play(tmp_path, TWO_NODES, fact_pass_play("pve_gpu.recover.per_node"))
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    pids = worker_pids(done)
    assert sorted(pids) == ["ct1", "ct2", "ct3", "ct4"], tail
    assert pids["ct1"] == pids["ct2"] == pids["ct3"] != pids["ct4"]  # one process per node
    # linear forked no worker for the fact pass, and one per host for the debug task after it.
    assert forked(done) == 4, tail
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]
    assert "pct not found in PATH of node pve1" in failure_of(done, "ct1"), tail
    assert "unknown step(s) nope" in failure_of(done, "ct2")
    assert "pct not found in PATH of node pve1" in failure_of(done, "ct3")
    assert "pct not found in PATH of node pve2" in failure_of(done, "ct4")
    assert len({report["run_id"] for report in reports.values()}) == 1
    # Each host its own result in the recap, as with a worker of its own.
    for host in ("ct1", "ct2", "ct3", "ct4"):
        assert re.search(rf"^{host}\s+: ok=2\s+changed=0\s+unreachable=0\s+failed=0\s.*ignored=1", done.stdout, re.M)


def test_linear_and_a_fact_pass_that_cannot_share_a_worker_fork_one_worker_per_host(tmp_path):
    done, reports = run_play(tmp_path, TWO_NODES, fact_pass_play("linear"))
    assert worker_pids(done) == {} and forked(done) == 8, done.stdout[-3000:]
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]
    # per_node off: each CT an execution of its own, so a worker of its own, as many at once as forks allow.
    (tmp_path / "off").mkdir()
    done, reports = run_play(
        tmp_path / "off", TWO_NODES, fact_pass_play("pve_gpu.recover.per_node"), "-e", "per_node=false"
    )
    assert worker_pids(done) == {} and forked(done) == 8, done.stdout[-3000:]
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]


def test_a_fact_pass_reading_its_options_from_the_role_variables_shares_a_worker_unless_per_node_is_off(tmp_path):
    """The preflight role's task (options_from_variables): per_node is preflight_per_node, as the action reads it."""
    play = fact_pass_play("pve_gpu.recover.per_node").replace(
        '        steps: "{{ ct_steps | default({}) }}"\n        per_node: "{{ per_node | default(true) }}"\n',
        "        options_from_variables: true\n",
    )
    assert "options_from_variables" in play
    (tmp_path / "on").mkdir()
    done, reports = run_play(tmp_path / "on", TWO_NODES, play)
    assert sorted(worker_pids(done)) == ["ct1", "ct2", "ct3", "ct4"], done.stdout[-3000:]
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]
    (tmp_path / "off").mkdir()
    done, reports = run_play(tmp_path / "off", TWO_NODES, play, "-e", "preflight_per_node=False")
    assert worker_pids(done) == {} and forked(done) == 8, done.stdout[-3000:]
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]


def test_fewer_forks_than_nodes_start_each_nodes_worker_as_a_slot_frees(tmp_path):
    """Three nodes, two worker slots: the third node's worker waits for one. A CT whose node cannot be templated
    runs as linear runs it and fails with Ansible's own error, alone."""
    hosts = TWO_NODES.replace("        ct4: {pve_vmid: 204, pve_node: pve2}\n", "")
    hosts += "        ct4: {pve_vmid: 204, pve_node: pve2}\n        ct5: {pve_vmid: 205, pve_node: pve3}\n"
    hosts += "        ct6: {pve_vmid: 206}\n"
    hosts = hosts.replace("    cts:", "        pve3: {ansible_connection: local}\n    cts:")
    done, reports = run_play(tmp_path, hosts, fact_pass_play("pve_gpu.recover.per_node"), forks=2)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    pids = worker_pids(done)
    assert sorted(pids) == ["ct1", "ct2", "ct3", "ct4", "ct5"], tail
    assert len({pids["ct1"], pids["ct4"], pids["ct5"]}) == 3
    assert "per_node: 3 host(s) of pve1 in one worker, 2 at once" in done.stdout, tail  # the play's forks
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4", "ct5", "ct6"]
    assert "pct not found in PATH of node pve3" in failure_of(done, "ct5"), tail
    assert "pve_node" in failure_of(done, "ct6"), tail  # Ansible's own error, its own result


def test_a_host_that_ends_first_leaves_its_variables_to_the_hosts_still_running(tmp_path):
    """WorkerProcess._run empties the host's variables when its task is done; in a thread of a node's worker that
    must not empty them for the others (found by a reviewer: 39 of 40 CTs failed reading hostvars['ct1'])."""
    hosts = "all:\n  children:\n    nodes:\n      hosts:\n        pve1: {ansible_connection: local}\n"
    hosts += "    cts:\n      vars: {pve_node: pve1}\n      hosts:\n        ct1: {pve_vmid: 201, marker: kept}\n"
    hosts += "".join(f"        ct{i}: {{pve_vmid: {200 + i}}}\n" for i in range(2, 25))
    play = fact_pass_play("pve_gpu.recover.per_node", "        owner: \"{{ hostvars['ct1']['marker'] }}\"\n").replace(
        "      ignore_errors: true\n", "      ignore_errors: true\n      when: inventory_hostname != 'ct1'\n"
    )
    done, reports = run_play(tmp_path, hosts, play, forks=24)
    assert len(set(worker_pids(done).values())) == 1, done.stdout[-3000:]
    assert sorted(reports) == sorted(f"ct{i}" for i in range(1, 25)), done.stdout[-3000:]
    errors = {f"ct{i}": failure_of(done, f"ct{i}") for i in range(2, 25)}
    assert all("pct not found in PATH of node pve1" in msg for msg in errors.values()), errors


def test_the_debuggers_redo_of_a_host_of_a_nodes_worker_runs_again(tmp_path):
    """The task debugger queues a host again while the strategy waits for results: it must run, not wait for a
    start that never comes (found by a reviewer: the run hung)."""
    play = fact_pass_play("pve_gpu.recover.per_node").replace(
        "      ignore_errors: true\n", "      debugger: on_failed\n"
    )
    done, _reports = run_play(tmp_path, TWO_NODES, play, stdin="redo\ncontinue\n" * 8)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-2000:]
    # Four CTs failed; the ones redone failed again, each in a worker of its own (as linear runs it).
    assert len(re.findall(r"^fatal: \[ct\d", done.stdout, re.M)) > 4, done.stdout[-3000:]
    assert forked(done) >= 1, done.stdout[-3000:]


def test_recover_yml_uses_the_strategy_unless_told_linear(tmp_path):
    """The play's strategy is the project's, with Ansible's deprecation warning for a strategy from outside
    ansible-core; ``recover_strategy=linear`` runs Ansible's own, without it."""
    (tmp_path / "hosts.yml").write_text("gpu_targets:\n  hosts:\n    ct1: {pve_vmid: oops, pve_node: pve1}\n")
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", str(tmp_path / "hosts.yml")]
    argv += ["-c", "local", str(ROOT / "recover.yml")]
    warning = "Use of strategy plugins not included in ansible.builtin are deprecated"
    for extra, warned in (([], True), (["-e", "recover_strategy=linear"], False)):
        done = subprocess.run(
            argv + extra, cwd=ROOT, env=ansible_env(tmp_path), capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 2 and "ct1: pve_vmid must be a Proxmox CT id" in done.stdout, done.stdout[-2000:]
        assert (warning in " ".join((done.stdout + done.stderr).split())) == warned, extra


@pytest.mark.parametrize("where", ["node", "play"])
def test_a_node_reached_over_another_connection_than_ssh_or_local_forks_a_worker_per_host(tmp_path, where):
    """paramiko_ssh keeps a process-wide client cache that each task's close() empties: its hosts never share a
    worker, whether the node's inventory or the play names the connection (as TaskExecutor picks it)."""
    closed = "{ansible_host: 127.0.0.1, ansible_port: 9" + (
        ", ansible_connection: paramiko_ssh}" if where == "node" else "}"
    )
    hosts = TWO_NODES.replace("{ansible_connection: local}", closed)
    play = fact_pass_play("pve_gpu.recover.per_node")
    if where == "play":
        play = play.replace(
            "  gather_facts: false\n", "  gather_facts: false\n  vars: {ansible_connection: paramiko_ssh}\n"
        )
    done, reports = run_play(tmp_path, hosts, play)
    # Each CT's pass in a worker of its own (it fails: paramiko is not installed here, or the node is unreachable).
    assert worker_pids(done) == {} and "in one worker" not in done.stdout, done.stdout[-3000:]
    assert forked(done) >= 4, done.stdout[-3000:]
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]
