"""Unattended, the training venv is never swapped under a live process: which processes of the target run from it
(runs_from.processes_running_from on a fake node /proc), and the venv step's window rule (venv_facts)."""

import os

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import runs_from
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import compare as venv_compare
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts

from tests.unit.plugins.module_utils.steps.gpu_processes.test_plan_jobs import fake_proc
from tests.unit.plugins.module_utils.steps.training_venv.test_facts import CONTEXT, IN_SPEC, LOCK
from tests.unit.plugins.module_utils.steps.training_venv.test_facts import POLLUTED as DRIFTED

PATH = "/opt/venvs/train"
REAL = "/opt/venvs/train.20261203T101500Z"
SPEC = dict(venv_facts.SPEC_DEFAULTS, lock=LOCK, unattended=True)
POLLUTED = dict(DRIFTED, real_path=REAL)  # sglang and friends, PyPI's cu130 torch; the venv behind the link
CHANGES = venv_compare.venv_facts(SPEC, POLLUTED, "CT 200 on pve1")["changes"]
JOB = {
    "pid": 516,
    "ns_pid": 41,
    "name": "python3",
    "command": "python3 train.py",
    "how": "mapped",
    "file": f"{REAL}/lib/python3.11/site-packages/torch/lib/libtorch.so",
}


def process(root, pid, *, exe, argv, maps=(), cgroup="/lxc/200/ns/.lxc", comm="python3"):
    """A /proc/<pid> with what the node reads to tell where a process runs from: exe, cmdline, maps."""
    fake_proc(root, pid, ppid=300, comm=comm, argv=argv, cgroup=cgroup)
    if exe is not None:
        os.symlink(exe, root / str(pid) / "exe")
    lines = [f"7f{n:04x}000-7f{n:04x}fff r-xp 00000000 00:2a {n} {path}\n" for n, path in enumerate(maps)]
    (root / str(pid) / "maps").write_text("55d0-55d1 r--p 00000000 00:2a 1 /usr/bin/python3.11\n" + "".join(lines))


# -- who runs from a directory, read on the node ---------------------------------------------------------------
def test_a_process_runs_from_the_venv_by_its_exe_its_interpreters_argv0_or_a_mapped_file(tmp_path):
    root = tmp_path / "proc"
    roots = [PATH, REAL]
    # A binary of the venv itself (a console script compiled to an executable, uv's python).
    process(root, 510, exe=f"{REAL}/bin/ninja", argv=["ninja"], comm="ninja")
    # Started by the venv's path: its exe is the base interpreter (bin/python is a link), argv[0] says the venv.
    process(root, 516, exe="/usr/bin/python3.11", argv=[f"{PATH}/bin/python", "train.py"])
    # Activated by PATH (argv[0] "python"), but torch's libraries are mapped from the version behind the link.
    process(root, 517, exe="/usr/bin/python3.11", argv=["python", "train.py"], maps=[f"{REAL}/lib/libtorch.so"])
    # A deleted file of the venv (an old .so replaced in place) still counts.
    process(root, 518, exe="/usr/bin/python3.11", argv=["python"], maps=[f"{REAL}/lib/old.so (deleted)"])
    # Neither: a shell, and a python of another venv.
    process(root, 520, exe="/usr/bin/bash", argv=[f"{PATH}/bin/activate"], comm="bash")
    process(root, 521, exe="/usr/bin/python3.11", argv=["/opt/venvs/other/bin/python"], maps=["/opt/venvs/other/x.so"])
    # Another CT's process running from a venv of the same path: none of this target's business.
    process(root, 777, exe="/usr/bin/python3.11", argv=[f"{PATH}/bin/python"], cgroup="/lxc/201/ns/.lxc")
    # A kernel thread has no exe.
    process(root, 2, exe=None, argv=[], cgroup="/")
    users, unreadable = runs_from.processes_running_from("ct:200", roots, proc_root=str(root))
    assert [(info.pid, how, path) for info, how, path in users] == [
        (510, "exe", f"{REAL}/bin/ninja"),
        (516, "argv0", f"{PATH}/bin/python"),
        (517, "mapped", f"{REAL}/lib/libtorch.so"),
        (518, "mapped", f"{REAL}/lib/old.so"),
    ]
    assert unreadable == []
    assert users[1][0].cmdline == [f"{PATH}/bin/python", "train.py"]


def test_a_process_whose_files_cannot_be_read_is_named_not_passed_over(tmp_path):
    root = tmp_path / "proc"
    process(root, 530, exe=None, argv=["python3"])
    (root / "530" / "exe").mkdir()  # readlink fails with something other than "no such file"
    users, unreadable = runs_from.processes_running_from("ct:200", [PATH], proc_root=str(root))
    assert users == []
    assert [(info.pid, error.startswith(f"could not read {root}/530/exe")) for info, error in unreadable] == [
        (530, True)
    ]


def test_paths_compare_by_whole_directory_names():
    assert runs_from.under(f"{PATH}/bin/python", [PATH]) == PATH
    assert runs_from.under(PATH, [PATH + "/"]) == PATH
    assert runs_from.under(f"{PATH}.20261203T101500Z/bin/python", [PATH]) is None  # another directory, same prefix
    assert runs_from.under("python", [PATH]) is None
    assert runs_from.under(None, [PATH]) is None


# -- the window rule -------------------------------------------------------------------------------------------
def test_unattended_a_venv_in_use_needs_a_window_and_nothing_is_pending():
    facts = venv_facts.evaluate_step(SPEC, POLLUTED, {"users": [JOB]}, CONTEXT)
    assert (facts["pending"], facts["changes"], facts["problems"]) == (False, [], [])
    assert facts["needs_window"] == [
        f"CT 200 on pve1: the venv at /opt/venvs/train needs a rebuild ({'; '.join(CHANGES[:3])}; and "
        f"{len(CHANGES) - 3} more) but pid 516 (python3, pid 41 inside: 'python3 train.py'; mapped "
        f"{REAL}/lib/python3.11/site-packages/torch/lib/libtorch.so) runs from it: it is not swapped under a live "
        "process; rebuilding it needs a window (stop the job, or run recover.yml without recover_unattended)"
    ]
    assert "torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)" in CHANGES
    assert facts["in_use"] == [JOB]
    assert facts["diff"]["before"] == facts["diff"]["after"]  # what stays: the venv as it is
    # The drift is still there to see: what differs from the lock.
    assert "torch" in [w["name"] for w in facts["wrong"]]


def test_attended_the_same_venv_is_rebuilt_whoever_runs_from_it():
    facts = venv_facts.evaluate_step(dict(SPEC, unattended=False), POLLUTED, {"users": [JOB]}, CONTEXT)
    assert (facts["pending"], facts["needs_window"], facts["changes"]) == (True, [], CHANGES)
    assert facts["diff"]["before"] != facts["diff"]["after"]


def test_a_process_the_gpu_step_ends_first_does_not_count():
    gpu = {"pending": True, "processes": [{"pid": 516, "ns_pid": 41}], "launchers": []}
    context = dict(CONTEXT, steps={"gpu_processes": gpu})
    facts = venv_facts.evaluate_step(SPEC, POLLUTED, {"users": [JOB]}, context)
    assert (facts["pending"], facts["needs_window"], facts["in_use"], facts["ending_pids"]) == (True, [], [], [41])
    # The module in check mode gets the same pids as an option.
    facts = venv_facts.evaluate_step(SPEC, POLLUTED, {"users": [JOB], "ending": [41]}, CONTEXT)
    assert facts["pending"] is True


def test_a_process_that_could_not_be_read_is_not_vouched_for():
    unsure = {
        "pid": 530,
        "ns_pid": 55,
        "name": "python3",
        "command": "python3",
        "how": None,
        "error": "could not read /proc/530/maps: no answer within 2 s",
    }
    facts = venv_facts.evaluate_step(SPEC, POLLUTED, {"users": [unsure]}, CONTEXT)
    assert facts["pending"] is False
    assert (
        "but whether pid 530 (python3, pid 55 inside: 'python3'; could not read /proc/530/maps: no answer within "
        "2 s) runs from it cannot be told: it is not swapped" in facts["needs_window"][0]
    )


def test_the_node_is_read_only_unattended_and_only_when_a_rebuild_is_due(monkeypatch):
    asked = []

    def scan(owner, roots, proc_root="/proc", exclude=()):
        asked.append((owner, roots))
        return [], []

    monkeypatch.setattr(venv_facts, "processes_running_from", scan)
    assert venv_facts.read_node(dict(SPEC, unattended=False), None, POLLUTED, CONTEXT) == {}
    assert venv_facts.read_node(SPEC, None, IN_SPEC, CONTEXT) == {}  # a venv in spec: nothing to swap, nothing read
    assert asked == []
    assert venv_facts.read_node(SPEC, None, POLLUTED, CONTEXT) == {"users": []}
    assert asked == [("ct:200", [PATH, REAL])]
    facts = venv_facts.evaluate_step(SPEC, POLLUTED, {"users": []}, CONTEXT)
    assert (facts["pending"], facts["needs_window"]) == (True, [])  # nobody runs from it: rebuilt unattended too


@pytest.mark.parametrize("unattended", [False, True])
def test_a_venv_in_spec_has_the_window_keys_empty(unattended):
    facts = venv_facts.evaluate_step(dict(SPEC, unattended=unattended), IN_SPEC, {}, CONTEXT)
    assert (facts["needs_window"], facts["in_use"], facts["pending"]) == ([], [], False)


def test_a_shell_sitting_in_an_old_version_keeps_it_from_retention_but_not_from_a_swap(tmp_path):
    root = tmp_path / "proc"
    old = "/opt/venvs/train.20261201T101500Z"
    process(root, 530, exe="/usr/bin/bash", argv=["-bash"], comm="bash")
    os.symlink(old, root / "530" / "cwd")
    assert runs_from.processes_running_from("ct:200", [old], proc_root=str(root)) == ([], [])
    users, unreadable = runs_from.processes_running_from("ct:200", [old], proc_root=str(root), cwd=True)
    assert ([(info.pid, how, path) for info, how, path in users], unreadable) == ([(530, "cwd", old)], [])
