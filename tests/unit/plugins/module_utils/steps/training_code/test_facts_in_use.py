"""Unattended, the training code is never reset under a live job: which processes of the target use the repository
(in_use.processes_in_repository on a fake node /proc), and the code step's window rule (code_facts)."""

import os

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import facts as code_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import in_use

from tests.unit.plugins.module_utils.steps.gpu_processes.test_plan_jobs import fake_proc
from tests.unit.plugins.module_utils.steps.training_code.test_facts import CONTEXT, OTHER, SPEC, answer

REPO = "/srv/train"
UNATTENDED = dict(SPEC, unattended=True)
DIRTY = {"head": OTHER, "status": " M model.py\0"}
JOB = {"pid": 516, "ns_pid": 41, "name": "python3", "command": "python3 train.py", "how": "cwd", "file": REPO}


def process(root, pid, *, argv, cwd="/", fds=(), cgroup="/lxc/200/ns/.lxc", comm="python3"):
    """A /proc/<pid> with what tells whether a process uses a directory: cwd, fd/*, exe, maps, cmdline, environ."""
    fake_proc(root, pid, ppid=300, comm=comm, argv=argv, cgroup=cgroup)
    os.symlink(cwd, root / str(pid) / "cwd")
    os.symlink("/usr/bin/python3.11", root / str(pid) / "exe")
    (root / str(pid) / "fd").mkdir()
    for number, path in enumerate(["/dev/null", *fds]):
        os.symlink(path, root / str(pid) / "fd" / str(number))
    (root / str(pid) / "maps").write_text("55d0-55d1 r--p 00000000 00:2a 1 /usr/bin/python3.11\n")
    (root / str(pid) / "environ").write_bytes(b"LANG=C\0")


def test_a_process_uses_the_repository_by_its_cwd_an_open_file_or_a_path_in_its_command_line(tmp_path):
    root = tmp_path / "proc"
    process(root, 516, argv=["python3", "train.py"], cwd=f"{REPO}/runs")
    process(root, 517, argv=["python3", "-m", "tail"], fds=[f"{REPO}/logs/train.log (deleted)"])
    process(root, 518, argv=["python3", f"{REPO}/train.py"], cwd="/root")
    process(root, 519, argv=["python3", "/srv/train2/train.py"], cwd="/srv/train2")  # another directory
    process(root, 777, argv=["python3", "train.py"], cwd=REPO, cgroup="/lxc/201/ns/.lxc")  # another CT's
    users, unreadable = in_use.processes_in_repository("ct:200", [REPO], proc_root=str(root))
    assert [(info.pid, how, path) for info, how, path in users] == [
        (516, "cwd", f"{REPO}/runs"),
        (517, "open", f"{REPO}/logs/train.log"),
        (518, "argv", f"{REPO}/train.py"),
    ]
    assert unreadable == []


def test_unattended_a_reset_under_a_live_job_needs_a_window_and_nothing_is_pending():
    facts = code_facts.evaluate_step(UNATTENDED, answer(**DIRTY), {"users": [JOB]}, CONTEXT)
    assert (facts["pending"], facts["changes"], facts["in_use"]) == (False, [], [JOB])
    assert facts["diff"]["before"] == facts["diff"]["after"]
    assert facts["needs_window"] == [
        "CT 200 on pve1: the training code at /srv/train needs a reset (save 1 changed file to a backup, then check "
        "out 4f3c2a1b0e9d (HEAD is 9e8d7c6b5a4f on main)) but pid 516 (python3, pid 41 inside: 'python3 train.py'; "
        "cwd /srv/train) uses it: it is not reset under a live job; resetting it needs a window (stop the job, or "
        "run recover.yml without recover_unattended)"
    ]


def test_attended_or_with_nobody_using_it_or_the_job_ended_first_the_reset_is_pending():
    for spec, node in (
        (SPEC, {"users": [JOB]}),
        (UNATTENDED, {}),
        (UNATTENDED, {"users": [JOB], "ending": [41]}),  # the GPU step ends it before this step
    ):
        facts = code_facts.evaluate_step(spec, answer(**DIRTY), node, CONTEXT)
        assert (facts["pending"], facts["needs_window"]) == (True, []), (spec, node)


def test_what_the_target_chose_is_printable_in_the_sentence():
    job = dict(JOB, name="py\x1b[2J", command="python3 x\nCT 200: all good", file=f"{REPO}/\u202eevil")
    (sentence,) = code_facts.evaluate_step(UNATTENDED, answer(**DIRTY), {"users": [job]}, CONTEXT)["needs_window"]
    assert "\n" not in sentence and "\x1b" not in sentence and "\u202e" not in sentence
    assert "py\\x1b[2J" in sentence and "\\u202eevil" in sentence


def test_the_node_is_read_only_unattended_with_a_reset_due(monkeypatch):
    calls = []
    monkeypatch.setattr(in_use, "processes_in_repository", lambda *a, **k: calls.append(a) or ([], []))
    target = {"target": {"label": "CT 200 on pve1", "vmid": 200, "node": "pve1"}}
    assert code_facts.read_node(SPEC, None, answer(**DIRTY), target) == {}  # attended
    assert code_facts.read_node(UNATTENDED, None, answer(head=SPEC["commit"]), target) == {}  # converged
    assert code_facts.read_node(UNATTENDED, None, None, target) == {}  # the probe part failed
    assert calls == []
    assert code_facts.read_node(UNATTENDED, None, answer(**DIRTY), target) == {"users": []}
    assert calls == [("ct:200", [REPO], "/proc")]


def test_a_branch_name_cannot_forge_a_line_of_the_changes():
    facts = code_facts.evaluate_step(SPEC, answer(branch="main\nCT 200: in spec\u202e"), {}, CONTEXT)
    assert facts["changes"] == ['check out 4f3c2a1b0e9d (HEAD is 9e8d7c6b5a4f on "main\\nCT 200: in spec\\u202e")']
