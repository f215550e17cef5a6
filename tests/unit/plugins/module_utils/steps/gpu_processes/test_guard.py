"""The GPU step's guard (unattended mode): which holders are the training job that runs as expected, on a fake
node /proc; the facts of the fact pass attended and unattended; the guard's shape; the pid-file probe part."""

import functools
import json
import os
import re

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.shared_reads import SharedReads
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import probe_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import messages as gpu_messages
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import probe as gpu_probe

from tests.unit.plugins.module_utils.steps.gpu_processes.test_plan_jobs import fake_proc

LABEL = "CT 200 on pve1"
CONTEXT = {
    "target": {"label": LABEL, "vmid": 200, "node": "pve1"},
    "steps": {
        "preflight": {
            "gpus": [
                {"index": 0, "uuid": "GPU-a", "memory_used_mib": 20009},
                {"index": 1, "uuid": "GPU-b", "memory_used_mib": 5009},
            ]
        }
    },
}
DEFAULTS = {name: option["default"] for name, option in gpu_facts.SPEC.items()}
TRAIN_SENTENCE = (
    f"{LABEL}: pid 516 (python3, pid 116 inside) on GPU 0, 20000 MiB, running 'python3 train.py', is left running: "
    "it matches gpu_processes_guard {match: 'train\\\\.py'}; ending it needs a window (run recover.yml without "
    "recover_unattended)"
)


class FakeSmi:
    """NVML's compute processes on the node: the training worker on GPU a, a stray process on GPU b."""

    apps = [
        {"pid": 516, "process_name": "python3", "used_memory_mib": 20000, "gpu_uuid": "GPU-a"},
        {"pid": 600, "process_name": "python3", "used_memory_mib": 5000, "gpu_uuid": "GPU-b"},
    ]

    def __init__(self, run, timeout=60):
        pass

    def compute_apps(self):
        return list(self.apps)


@pytest.fixture
def node(tmp_path, monkeypatch):
    """CT 200 as the node sees it: tmux runs a login shell, which runs a `while true` loop around torchrun, which
    runs the worker (GPU 0) and its DataLoader child (device files); a stray run left on GPU 1."""
    root = tmp_path / "proc"
    monkeypatch.setattr(gpu_facts, "read_process", functools.partial(pp.read_process, proc_root=str(root)))
    fake_proc(root, 300, ppid=100, comm="systemd", argv=["/sbin/init"], nspid=1, cgroup="/lxc/200/ns/init.scope")
    fake_proc(root, 460, ppid=300, comm="tmux: server", argv=["tmux", "new", "-s", "train"])
    fake_proc(root, 480, ppid=460, comm="bash", argv=["-bash"])
    fake_proc(root, 490, ppid=480, comm="bash", argv=["bash", "-c", "while true; do torchrun train.py; done"])
    fake_proc(root, 500, ppid=490, comm="torchrun", argv=["/usr/bin/python3", "/usr/local/bin/torchrun", "train.py"])
    fake_proc(root, 516, ppid=500, comm="python3", argv=["python3", "train.py"])
    fake_proc(root, 517, ppid=516, comm="pt_data_worker", argv=["python3", "-c", "worker"])
    fake_proc(root, 590, ppid=300, comm="bash", argv=["-bash"])
    fake_proc(root, 600, ppid=590, comm="python3", argv=["python3", "leftover.py"])

    def device_holders(owner, proc_root="/proc", exclude=(), owners=None):
        return [(gpu_facts.read_process(517), [(195, 0)])] if owner == "ct:200" else []

    monkeypatch.setattr(gpu_facts, "device_holders", device_holders)
    monkeypatch.setattr(gpu_facts, "process_owners", dict)  # device_holders above knows the owners
    monkeypatch.setattr(gpu_facts, "NvidiaSmi", FakeSmi)
    return root


class Target:
    run_on_node = None
    timeout = 60


def facts(guard, unattended, answer=None, context=CONTEXT, **spec):
    settings = dict(DEFAULTS, guard=guard, unattended=unattended, **spec)
    context = dict(context, shared=SharedReads())  # this pass's node reads, its own
    node = gpu_facts.read_node(settings, Target, answer, context)
    return gpu_facts.evaluate_step(settings, answer, node, context)


def pids(entries):
    return [e["pid"] for e in entries]


# -- a holder the guard names ----------------------------------------------------------------------------------
@pytest.mark.usefixtures("node")
def test_unattended_leaves_the_holders_the_guard_matches_running_and_ends_only_the_stray():
    found = facts([{"match": r"train\.py"}], unattended=True)
    assert pids(found["processes"]) == [600]
    assert found["launchers"] == []  # the loop and torchrun are the guarded job's: never ended
    assert found["changes"] == ["end pid 600 (python3, pid 200 inside) on GPU 1, 5000 MiB"]
    assert [(g["pid"], g["reason"]) for g in found["guarded"]] == [
        (516, "it matches gpu_processes_guard {match: 'train\\\\.py'}"),
        (
            517,
            "its parent pid 516 (python3, pid 116 inside: 'python3 train.py') matches gpu_processes_guard "
            "{match: 'train\\\\.py'}",
        ),
    ]
    assert found["guarded"][0]["command"] == "python3 train.py"
    assert found["needs_window"][0] == TRAIN_SENTENCE
    assert len(found["needs_window"]) == 2
    assert found["kept_gpus"] == [0]  # the verify step leaves GPU 0's memory to the guarded job, asserts GPU 1's
    # GPU 0 stays busy with the guarded job: no "memory no process holds" problem; the stray is ended.
    assert (found["problems"], found["pending"]) == ([], True)
    json.dumps(found)


@pytest.mark.usefixtures("node")
def test_only_guarded_holders_leave_nothing_pending_and_no_problem(monkeypatch):
    monkeypatch.setattr(FakeSmi, "apps", FakeSmi.apps[:1])  # the stray run is gone, GPU 1 free
    gpus = [dict(CONTEXT["steps"]["preflight"]["gpus"][0]), {"index": 1, "uuid": "GPU-b", "memory_used_mib": 0}]
    context = dict(CONTEXT, steps={"preflight": {"gpus": gpus}})
    found = facts([{"match": r"train\.py"}], unattended=True, context=context)
    assert (found["processes"], found["changes"], found["problems"], found["pending"]) == ([], [], [], False)
    assert found["diff"] == {"before": "", "after": ""}
    assert found["needs_window"][0] == TRAIN_SENTENCE


@pytest.mark.usefixtures("node")
def test_a_holder_is_guarded_through_its_parent_and_through_an_ancestor_above_the_interactive_shell():
    by_parent = facts([{"match": "torchrun"}], unattended=True)
    reasons = {g["pid"]: g["reason"] for g in by_parent["guarded"]}
    torchrun = "pid 500 (torchrun, pid 100 inside: '/usr/bin/python3 /usr/local/bin/torchrun train.py')"
    assert reasons == {
        516: f"its parent {torchrun} matches gpu_processes_guard {{match: 'torchrun'}}",
        517: f"its ancestor {torchrun} matches gpu_processes_guard {{match: 'torchrun'}}",
    }
    # tmux lies above the login shell, where the walk for launchers stops; the guard's walk goes on to the init.
    by_session = facts([{"match": "^tmux new -s train$"}], unattended=True)
    assert pids(by_session["guarded"]) == [516, 517]
    assert by_session["guarded"][0]["reason"].startswith("its ancestor pid 460 (tmux: server, pid 60 inside")
    assert pids(by_session["processes"]) == [600]
    # The target's init is never a match: a guard naming it guards nothing.
    assert facts([{"match": "/sbin/init"}], unattended=True)["guarded"] == []


@pytest.mark.usefixtures("node")
def test_a_pid_file_names_the_jobs_main_process_by_its_pid_inside_the_target():
    guard = [{"pid_file": "/run/train.pid"}]
    answer = {"pid_files": {"/run/train.pid": {"state": "ok", "pid": 100, "reason": None}}}  # torchrun, inside
    found = facts(guard, unattended=True, answer=answer)
    assert pids(found["guarded"]) == [516, 517]
    assert found["guarded"][0]["reason"].endswith("is the pid in /run/train.pid (gpu_processes_guard)")
    assert (pids(found["processes"]), found["launchers"]) == ([600], [])
    # The host pid 100 is nobody here: a pid file is read in the target's pid namespace, never the node's.
    assert facts(guard, True, {"pid_files": {"/run/train.pid": {"state": "ok", "pid": 500}}})["guarded"] == []
    # No pid file: its job does not run; nothing is guarded by it and the whole job is ended.
    gone = facts(guard, unattended=True, answer={"pid_files": {"/run/train.pid": {"state": "missing", "pid": None}}})
    assert (gone["guarded"], pids(gone["processes"]), pids(gone["launchers"])) == ([], [516, 517, 600], [490, 500])


@pytest.mark.usefixtures("node")
def test_an_unreadable_pid_file_stops_an_unattended_run_and_not_an_attended_one():
    answer = {
        "pid_files": {"/run/train.pid": {"state": "unreadable", "pid": None, "reason": "it holds 'x', not one pid"}}
    }
    found = facts([{"pid_file": "/run/train.pid"}], unattended=True, answer=answer)
    assert found["problems"] == [
        f"{LABEL}: cannot tell which process the guard's pid file names: /run/train.pid: it holds 'x', not one pid. "
        "Nothing was ended: an unattended run ends nothing it cannot tell from the guarded job. Fix the pid file or "
        "gpu_processes_guard"
    ]
    assert found["pending"] is False
    assert facts([{"pid_file": "/run/train.pid"}], unattended=False, answer=answer)["problems"] == []
    with pytest.raises(gpu_messages.GpuProcessesError, match="answered no 'pid_files' object"):
        facts([{"pid_file": "/run/train.pid"}], unattended=True, answer={"pid_file": []})


@pytest.mark.usefixtures("node")
def test_attended_the_guard_changes_nothing_but_the_facts_still_name_what_it_matches():
    found = facts([{"match": r"train\.py"}], unattended=False)
    assert pids(found["processes"]) == [516, 517, 600]
    assert pids(found["launchers"]) == [490, 500]
    assert pids(found["guarded"]) == [516, 517]
    assert (found["needs_window"], found["kept_gpus"], found["pending"]) == ([], [], True)
    # Without a guard nothing is guarded, in either mode.
    assert facts([], unattended=False)["guarded"] == facts([], unattended=True)["guarded"] == []


@pytest.mark.usefixtures("node")
def test_unattended_without_a_guard_nothing_is_ended_and_every_holder_is_named_in_needs_window():
    # Issue 25 item 5: with the default (empty) guard, `--correct` used to end every GPU holder, a healthy
    # training job included, every hour.
    found = facts([], unattended=True)
    assert (found["processes"], found["launchers"], found["changes"], found["pending"]) == ([], [], [], False)
    assert found["problems"] == []
    assert len(found["needs_window"]) == 3
    assert found["needs_window"][0].startswith("CT 200 on pve1: pid 516 (python3, pid 116 inside) on GPU 0")
    assert "no gpu_processes_guard names the training job" in found["needs_window"][0]
    assert found["kept_gpus"] == [0, 1]
    # Attended, the same holders are ended as before.
    assert pids(facts([], unattended=False)["processes"]) == [516, 517, 600]


def test_a_holder_sharing_the_guarded_job_or_parent_of_a_guarded_one_is_left_running_too(node, monkeypatch):
    # An evaluation run torchrun started next to the worker, on GPU 1: ending it alone would make torchrun
    # restart the group, the guarded worker with it.
    fake_proc(node, 520, ppid=500, comm="python3", argv=["python3", "eval.py"])
    monkeypatch.setattr(
        FakeSmi,
        "apps",
        [*FakeSmi.apps, {"pid": 520, "process_name": "python3", "used_memory_mib": 10, "gpu_uuid": "GPU-b"}],
    )
    # ... and the evaluation's own worker, holding device files: it goes with what it descends from.
    fake_proc(node, 521, ppid=520, comm="python3", argv=["python3", "-c", "eval worker"])
    devices = [(gpu_facts.read_process(517), [(195, 0)]), (gpu_facts.read_process(521), [(195, 1)])]
    monkeypatch.setattr(gpu_facts, "device_holders", lambda owner, proc_root="/proc", exclude=(), owners=None: devices)
    found = facts([{"match": r"^python3 train\.py$"}], unattended=True)
    kept = {int(s.split("pid ")[1].split(" ")[0]): s for s in found["needs_window"]}
    assert sorted(kept) == [516, 517, 520, 521]
    assert "its job shares pid 500 (torchrun, pid 100 inside" in kept[520]
    assert "with the guarded pid 516 (python3, pid 116 inside) on GPU 0, 20000 MiB" in kept[520]
    assert "it descends from pid 520 (python3, pid 120 inside) on GPU 1, 10 MiB, which is left running" in kept[521]
    assert pids(found["guarded"]) == [516, 517]  # the guard named those; 520 and 521 are kept because of them
    assert pids(found["processes"]) == [600]
    # The pid file names the DataLoader child: its parent, the worker, is kept too (ending it ends the child).
    answer = {"pid_files": {"/run/loader.pid": {"state": "ok", "pid": 117}}}
    child = facts([{"pid_file": "/run/loader.pid"}], unattended=True, answer=answer)
    assert pids(child["guarded"]) == [517]
    assert any("pid 516" in s and "it is a parent of the guarded pid 517" in s for s in child["needs_window"])
    assert pids(child["processes"]) == [600]


# -- the guard's shape -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("guard", "message"),
    [
        ([{"regex": "x"}], "gpu_processes_guard[0] has regex; each entry is {match: REGEX}"),
        ([{"match": "x"}, {"match": "y", "pid_file": "/run/p"}], "gpu_processes_guard[1] has match and pid_file; "),
        ([{}], "gpu_processes_guard[0] has neither match nor pid_file; give one per entry"),
        ([{"match": ""}], "gpu_processes_guard[0].match is ''; give a non-empty string"),
        ([{"match": 7}], "gpu_processes_guard[0].match is 7; give a non-empty string"),
        ([{"match": "train(.py"}], "gpu_processes_guard[0].match 'train(.py' is not a regular expression: "),
        ([{"pid_file": "run/train.pid"}], "gpu_processes_guard[0].pid_file 'run/train.pid' is not an absolute path"),
    ],
)
def test_a_guard_of_the_wrong_shape_is_named_before_anything_runs(guard, message):
    assert gpu_facts.check_spec(dict(DEFAULTS, guard=guard)).startswith(message)
    with pytest.raises(step_registry.StepSpecError, match=re.escape(f"settings of step gpu_processes: {message}")):
        step_registry.validate_specs({"gpu_processes": {"guard": guard}})


def test_a_guard_entry_that_is_no_dict_is_named_too():
    assert gpu_facts.check_spec(dict(DEFAULTS, guard=["train.py"])).startswith(
        "gpu_processes_guard[0] is 'train.py', not a dict; each entry is {match: REGEX}"
    )
    # The fact pass (and the module) check the types first: Ansible names the option and what it wanted.
    with pytest.raises(
        step_registry.StepSpecError, match=re.escape("Elements value for option 'guard' is of type str")
    ):
        step_registry.validate_specs({"gpu_processes": {"guard": ["train.py"]}})


def test_the_settings_validate_and_default_to_attended_without_a_guard():
    specs = step_registry.validate_specs({"gpu_processes": {"unattended": "true", "guard": [{"match": "train"}]}})
    assert (specs["gpu_processes"]["unattended"], specs["gpu_processes"]["guard"]) == (True, [{"match": "train"}])
    defaults = step_registry.validate_specs({"gpu_processes": {}})["gpu_processes"]
    assert (defaults["unattended"], defaults["guard"]) == (False, [])
    assert gpu_facts.check_spec(defaults) is None


# -- the pid files, read inside the target ---------------------------------------------------------------------
def test_the_fact_pass_reads_pid_files_in_its_one_probe_only_when_the_guard_names_some():
    plain = step_registry.validate_specs({"gpu_processes": {"guard": [{"match": "train"}]}})
    assert set(step_registry.probe_parts(plain, 60)) == {"preflight"}
    guarded = step_registry.validate_specs(
        {"gpu_processes": {"guard": [{"pid_file": "/run/a.pid"}, {"pid_file": "/run/a.pid"}]}}
    )
    part = step_registry.probe_parts(guarded, 60)[probe_name(gpu_probe)]
    assert part == (gpu_probe, {"pid_files": ["/run/a.pid"]})
    assert probe_name(gpu_probe) == gpu_facts.NAME


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"4711\n", {"state": "ok", "pid": 4711, "reason": None}),
        (b"  4711  ", {"state": "ok", "pid": 4711, "reason": None}),
        (b"", {"state": "unreadable", "pid": None, "reason": "it holds '', not one pid"}),
        (b"4711 4712\n", {"state": "unreadable", "pid": None, "reason": "it holds '4711 4712\\n', not one pid"}),
        (b"0\n", {"state": "unreadable", "pid": None, "reason": "it holds '0\\n', not one pid"}),
        (b"1" * 65, {"state": "unreadable", "pid": None, "reason": "it is too large to be a pid file"}),
    ],
)
def test_a_pid_file_holds_one_pid_or_it_is_named_unreadable(tmp_path, content, expected):
    (tmp_path / "train.pid").write_bytes(content)
    assert gpu_probe.read_pid_file(str(tmp_path / "train.pid")) == expected


def test_a_missing_pid_file_a_directory_and_a_fifo_never_block(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # nobody writes it: a blocking open would hang the whole fact pass
    answer = gpu_probe.probe({"pid_files": [str(tmp_path / "none"), str(tmp_path), str(tmp_path / "fifo")]})
    assert answer == {
        "pid_files": {
            str(tmp_path / "none"): {"state": "missing", "pid": None, "reason": None},
            str(tmp_path): {"state": "unreadable", "pid": None, "reason": "it is not a regular file"},
            str(tmp_path / "fifo"): {"state": "unreadable", "pid": None, "reason": "it is not a regular file"},
        }
    }
