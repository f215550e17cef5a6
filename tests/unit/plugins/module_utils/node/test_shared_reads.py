"""What the fact pass pays per CT: the node reads one node's CTs share (shared_reads.SharedReads,
process.process_owners) and the modules the probe program loads in every CT."""

import json
import subprocess
import sys
import threading
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import act_runner, shared_reads
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry

from tests.unit.plugins.module_utils.steps.gpu_processes.test_plan_jobs import fake_proc


# -- SharedReads: one read, every asker its answer ----------------------------------------------------------------
def test_passes_asking_at_once_share_one_read_and_each_gets_its_answer():
    shared = shared_reads.SharedReads()
    reads, answers, asked = [], [], []
    asking = threading.Barrier(8, timeout=5)
    everyone_asked = threading.Event()

    def read():
        reads.append(1)
        everyone_asked.wait(5)  # the read is still under way when the other seven ask
        time.sleep(0.05)
        return ["node answer"]

    def ask():
        asking.wait()  # all eight ask at the same moment
        asked.append(1)
        if len(asked) == 8:
            everyone_asked.set()
        answers.append(shared.get(("compute_apps", "pve1"), read))

    threads = [threading.Thread(target=ask) for _asker in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert reads == [1]
    assert answers == [["node answer"]] * 8


def test_a_failed_read_is_every_askers_error_and_other_keys_are_read_on_their_own():
    shared = shared_reads.SharedReads()
    calls = []

    def broken():
        calls.append("apps")
        raise OSError("nvidia-smi: no such file")

    for _attempt in range(3):
        with pytest.raises(OSError, match="nvidia-smi: no such file"):
            shared.get(("compute_apps", "pve1"), broken)
    assert calls == ["apps"]  # read once, failed once, the same error for the others
    assert shared.get(("process_owners", "pve1"), lambda: {516: "ct:200"}) == {516: "ct:200"}
    assert shared.get(("compute_apps", "pve2"), lambda: []) == []  # another node is another read


def test_an_asker_waits_for_the_read_under_way_instead_of_reading_again():
    shared = shared_reads.SharedReads()
    started, release = threading.Event(), threading.Event()
    reads = []

    def slow():
        reads.append(1)
        started.set()
        release.wait(5)
        return "first"

    first = threading.Thread(target=lambda: shared.get("key", slow))
    first.start()
    started.wait(5)
    second = []
    asking = threading.Event()

    def ask():
        asking.set()
        second.append(shared.get("key", lambda: reads.append(2) or "again"))

    waiter = threading.Thread(target=ask)
    waiter.start()
    asking.wait(5)
    waiter.join(0.2)
    assert waiter.is_alive() and second == []  # waiting, not reading
    release.set()
    first.join(5)
    waiter.join(5)
    assert (reads, second) == ([1], ["first"])


def test_each_fact_pass_context_shares_what_it_is_given_and_a_lone_pass_gets_its_own():
    class Target:
        label, vmid, node = "CT 200 on pve1", 200, "pve1"

    given = shared_reads.SharedReads()
    assert step_registry.target_context(Target, False, given)["shared"] is given
    alone, other = (
        step_registry.target_context(Target, False)["shared"],
        step_registry.target_context(Target, False)["shared"],
    )
    assert isinstance(alone, shared_reads.SharedReads) and alone is not other


def test_a_node_read_is_keyed_by_node_and_what_changes_it_never_by_the_asker():
    shared = shared_reads.SharedReads()
    reads = []

    def context(node, label):
        return {"target": {"label": label, "vmid": 200, "node": node}, "shared": shared}

    def read(answer):
        return lambda: reads.append(answer) or answer

    assert shared_reads.node_read(context("pve1", "CT 200"), ("compute_apps", 60), read("a60")) == "a60"
    assert shared_reads.node_read(context("pve1", "CT 201"), ("compute_apps", 60), read("again")) == "a60"
    # A pass given another timeout reads with its own: the first asker's would bound it wrongly.
    assert shared_reads.node_read(context("pve1", "CT 202"), ("compute_apps", 5), read("a5")) == "a5"
    assert shared_reads.node_read(context("pve2", "CT 300"), ("compute_apps", 60), read("b60")) == "b60"
    assert reads == ["a60", "a5", "b60"]


def test_a_wedged_shared_read_is_each_waiting_passs_wedged_problem_within_its_own_budget():
    """The first pass's read never answers: the passes that wait for it are each abandoned at their own deadline
    (their node-read threads, step_registry.NodeRead), the shortest budget first, none waiting for the longest."""
    shared = shared_reads.SharedReads()
    stuck = threading.Event()

    class Step:
        NAME = "gpu_processes"

        @staticmethod
        def read_node(_spec, _target, _answer, context):
            return shared_reads.node_read(context, ("compute_apps", 60), lambda: stuck.wait(30))

    class Target:
        node, timeout = "pve1", 60

    reads = []
    for budget in (0.3, 0.6, 0.9):
        context = {"target": {"label": f"CT {budget}", "vmid": 200, "node": "pve1"}, "shared": shared}
        reads.append(step_registry.NodeRead(Step, {}, Target, context, budget=budget))
        reads[-1].start()
    started = time.monotonic()
    ended = []
    for read in reads:
        assert read.finish() is False  # wedged, left behind
        ended.append(time.monotonic() - started)
        assert "gave no answer within" in read.wedged_reason()
    stuck.set()
    # Each at its own deadline, give or take a busy machine's scheduling; none waits for the wedged read.
    assert ended[0] < 1.0 and ended[1] - ended[0] > 0.15 and ended[2] - ended[1] > 0.15 and ended[2] < 2.5
    assert ended[0] >= 0.25 and ended[1] >= 0.55 and ended[2] >= 0.85  # not before its own (started a bit earlier)


def test_an_acting_modules_context_reads_the_node_afresh_each_time():
    run = act_runner.Run.__new__(act_runner.Run)

    class Target:
        label, vmid, node, is_container = "CT 200 on pve1", 200, "pve1", True

    run.target = Target
    first, second = run.context["shared"], run.context["shared"]
    assert isinstance(first, shared_reads.SharedReads) and first is not second  # a re-read after acting reads


# -- one walk of /proc's owners for the node -------------------------------------------------------------------
def test_process_owners_walks_proc_once_and_device_holders_reads_no_other_cgroup_given_them(tmp_path, monkeypatch):
    root = tmp_path / "proc"
    fake_proc(root, 516, ppid=1, comm="python3", argv=["python3", "train.py"], cgroup="/lxc/200/ns/init.scope")
    fake_proc(root, 777, ppid=1, comm="python3", argv=["python3"], cgroup="/lxc/201/ns/init.scope")
    fake_proc(root, 900, ppid=1, comm="sshd", argv=["sshd"], cgroup="/system.slice/ssh.service")
    owners = pp.process_owners(str(root))
    assert owners == {516: "ct:200", 777: "ct:201", 900: "host"}
    for pid in (777, 900):
        (root / str(pid) / "cgroup").unlink()  # given the owners, no other process's cgroup is read again
    asked = []
    monkeypatch.setattr(pp, "device_fds", lambda pid, proc_root: asked.append(pid) or [(195, 0)])
    held = pp.device_holders("ct:200", str(root), owners=owners)
    assert asked == [516]  # only the CT's own processes are looked at
    assert [(info.pid, devices) for info, devices in held] == [(516, [(195, 0)])]
    assert pp.device_holders("ct:201", str(root), exclude={777}, owners=owners) == []


def test_a_pid_reused_by_another_ct_since_the_owners_were_read_is_not_this_cts_holder(tmp_path, monkeypatch):
    """The node's owners are read once per execution; a pass that looks later finds pid 516 gone and reused by
    CT 201's process holding a GPU: never CT 200's holder (it would be ended as CT 200's)."""
    root = tmp_path / "proc"
    fake_proc(root, 516, ppid=1, comm="python3", argv=["python3", "train.py"], cgroup="/lxc/200/ns/init.scope")
    owners = pp.process_owners(str(root))
    (root / "516" / "cgroup").write_text("0::/lxc/201/ns/init.scope\n")  # exited; its pid reused in CT 201
    monkeypatch.setattr(pp, "device_fds", lambda pid, proc_root: [(195, 0)])
    assert pp.device_holders("ct:200", str(root), owners=owners) == []


# -- the probe program: what every CT loads on every run -------------------------------------------------------
# Modules that cost the CT's python CPU on every run and that no part of the fact pass needs: importlib.metadata
# alone pulls in email, zipfile, csv's friends and pathlib (about 20 ms of a 50 ms probe); platform and socket
# answered two strings that os.uname() and sys.version hold.
HEAVY = ("importlib.metadata", "email", "zipfile", "platform", "socket", "pathlib", "typing")


def test_the_probe_program_with_every_steps_part_loads_nothing_heavy():
    parts = {}
    for name in step_registry.STEP_NAMES:
        step = step_registry.load_step(name)
        if step.PROBE is not None:
            parts[node_target.probe_name(step.PROBE)] = (step.PROBE, {})  # each part's module code runs; probe() fails
    program = node_target.PROBES_MAIN + "\nsys.stderr.write(' '.join(sorted(sys.modules)))\n"
    done = subprocess.run(
        [*node_target.probes_argv(sys.executable)[:-1], program],  # the CT's argv, this program in PROBES_MAIN's place
        input=node_target.probes_input(parts),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answered = json.loads(done.stdout)
    assert set(answered) == set(parts)  # every part's source was run in this python
    loaded = done.stderr.split()
    assert [m for m in loaded if m.split(".")[0] in HEAVY or m in HEAVY] == []
