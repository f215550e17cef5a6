"""What the fact pass pays per CT: the node reads one node's CTs share (pve_steps.SharedReads,
pve_process.process_owners) and the modules the probe program loads in every CT."""

import json
import subprocess
import sys
import threading

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_steps, pve_target

from tests.unit.module_utils.test_gpu_jobs import fake_proc


# -- SharedReads: one read, every asker its answer ----------------------------------------------------------------
def test_passes_asking_at_once_share_one_read_and_each_gets_its_answer():
    shared = pve_steps.SharedReads()
    reads, answers = [], []
    asking = threading.Barrier(8, timeout=5)

    def read():
        reads.append(1)
        return ["node answer"]

    def ask():
        asking.wait()  # all eight ask at the same moment
        answers.append(shared.get(("compute_apps", "pve1"), read))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert reads == [1]
    assert answers == [["node answer"]] * 8


def test_a_failed_read_is_every_askers_error_and_other_keys_are_read_on_their_own():
    shared = pve_steps.SharedReads()
    calls = []

    def broken():
        calls.append("apps")
        raise OSError("nvidia-smi: no such file")

    for _ in range(3):
        with pytest.raises(OSError, match="nvidia-smi: no such file"):
            shared.get(("compute_apps", "pve1"), broken)
    assert calls == ["apps"]  # read once, failed once, the same error for the others
    assert shared.get(("process_owners", "pve1"), lambda: {516: "ct:200"}) == {516: "ct:200"}
    assert shared.get(("compute_apps", "pve2"), lambda: []) == []  # another node is another read


def test_an_asker_waits_for_the_read_under_way_instead_of_reading_again():
    shared = pve_steps.SharedReads()
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
    waiter = threading.Thread(target=lambda: second.append(shared.get("key", lambda: reads.append(2) or "again")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and second == []  # waiting, not reading
    release.set()
    first.join(5)
    waiter.join(5)
    assert (reads, second) == ([1], ["first"])


def test_each_fact_pass_context_shares_what_it_is_given_and_a_lone_pass_gets_its_own():
    class Target:
        label, vmid, node = "CT 200 on pve1", 200, "pve1"

    given = pve_steps.SharedReads()
    assert pve_steps.target_context(Target, False, given)["shared"] is given
    alone = pve_steps.target_context(Target, False)["shared"]
    assert isinstance(alone, pve_steps.SharedReads) and alone is not pve_steps.target_context(Target, False)["shared"]


# -- one walk of /proc's owners for the node -------------------------------------------------------------------
def test_process_owners_walks_proc_once_and_device_holders_reads_no_cgroup_given_them(tmp_path, monkeypatch):
    root = tmp_path / "proc"
    fake_proc(root, 516, ppid=1, comm="python3", argv=["python3", "train.py"], cgroup="/lxc/200/ns/init.scope")
    fake_proc(root, 777, ppid=1, comm="python3", argv=["python3"], cgroup="/lxc/201/ns/init.scope")
    fake_proc(root, 900, ppid=1, comm="sshd", argv=["sshd"], cgroup="/system.slice/ssh.service")
    owners = pp.process_owners(str(root))
    assert owners == {516: "ct:200", 777: "ct:201", 900: "host"}
    for pid in owners:
        (root / str(pid) / "cgroup").unlink()  # given the owners, nothing of a process's cgroup is read again
    asked = []
    monkeypatch.setattr(pp, "device_fds", lambda pid, proc_root: asked.append(pid) or [(195, 0)])
    held = pp.device_holders("ct:200", str(root), owners=owners)
    assert asked == [516]  # only the CT's own processes are looked at
    assert [(info.pid, devices) for info, devices in held] == [(516, [(195, 0)])]
    assert pp.device_holders("ct:201", str(root), exclude={777}, owners=owners) == []


# -- the probe program: what every CT loads on every run -------------------------------------------------------
# Modules that cost the CT's python CPU on every run and that no part of the fact pass needs: importlib.metadata
# alone pulls in email, zipfile, csv's friends and pathlib (about 20 ms of a 50 ms probe); platform and socket
# answered two strings that os.uname() and sys.version hold.
HEAVY = ("importlib.metadata", "email", "zipfile", "platform", "socket", "pathlib", "typing")


def test_the_probe_program_with_every_steps_part_loads_nothing_heavy():
    parts = {}
    for name in pve_steps.STEP_NAMES:
        step = pve_steps.load_step(name)
        if step.PROBE is not None:
            parts[pve_target.probe_name(step.PROBE)] = (step.PROBE, {})  # each part's module code runs; probe() fails
    program = pve_target.PROBES_MAIN + "\nsys.stderr.write(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run(
        [sys.executable, "-I", "-c", program],
        input=pve_target.probes_input(parts),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answered = json.loads(done.stdout)
    assert set(answered) == set(parts)  # every part's source was run in this python
    loaded = json.loads(done.stderr)
    assert [m for m in loaded if m.split(".")[0] in HEAVY or m in HEAVY] == []
