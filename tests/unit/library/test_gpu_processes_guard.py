"""plugins/modules/gpu_processes.py in unattended mode: the guard re-read by the module itself (its own pid-file read in
the target), guarded holders and their launchers never signalled, stray ones ended, the memory wait and the settle
watch that know the guarded job stays; attended, the guard changes nothing. Replayed through FakeRunner and the
fake process table of test_gpu_processes.py."""

import json
import socket

import gpu_processes
import pytest
import target_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts

from tests.fakes import FakeRunner, run_module
from tests.unit.library.test_gpu_processes import FakeProcesses
from tests.unit.library.test_target_facts import (
    ANCHORS,
    APPS_ARGV,
    NODE_VERSION,
    TRAIN,
    UUID0,
    NodeProcesses,
    node_version,
    params,
    probe_call,
)

UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
PCT = ["pct", "exec", "200", "--keep-env", "0", "--", "timeout", "-k", "5", "60", "env", "LC_ALL=C", "LANG=C"]
NODE = ["timeout", "-k", "5", "60", "nvidia-smi"]
CT_MEMORY = (
    [*PCT, "nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv"],
    (0, f"index, uuid, memory.used [MiB]\n0, {UUID_A}, 20009 MiB\n1, {UUID_B}, 5009 MiB\n", ""),
)
APPS = [*NODE, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv"]
NODE_APPS = (
    APPS,
    (
        0,
        f"pid, process_name, used_gpu_memory [MiB], gpu_uuid\n516, python3, 20000 MiB, {UUID_A}\n"
        f"600, python3, 5000 MiB, {UUID_B}\n",
        "",
    ),
)
NODE_APPS_AFTER = (
    APPS,
    (0, f"pid, process_name, used_gpu_memory [MiB], gpu_uuid\n516, python3, 20000 MiB, {UUID_A}\n", ""),
)
# After the stray run ended: GPU 1 is free, GPU 0 still holds the guarded job's memory (the wait does not ask for it).
NODE_MEMORY = (
    [*NODE, "--query-gpu=index,uuid,memory.used", "--format=csv"],
    (0, f"index, uuid, memory.used [MiB]\n0, {UUID_A}, 20009 MiB\n1, {UUID_B}, 0 MiB\n", ""),
)
SESSION = "/lxc/200/ns/user.slice/user-0.slice/session-3.scope"


def proc(ns_pid, comm, cmdline, ppid, start, *, dies_on="SIGTERM", devices=(), **more):
    return dict(
        ns_pid=ns_pid,
        comm=comm,
        state="S",
        owner="ct:200",
        cmdline=cmdline,
        start_time=start,
        ppid=ppid,
        cgroup=SESSION,
        dies_on=dies_on,
        devices=[list(d) for d in devices],
        **more,
    )


def job():
    """CT 200: in a tmux session, a login shell runs a `while true` loop around torchrun, which runs the worker on
    GPU 0; a stray run from another shell holds GPU 1."""
    return {
        300: proc(1, "systemd", ["/sbin/init"], 100, 2, dies_on="never"),
        470: proc(5, "tmux: server", ["tmux", "new", "-s", "train"], 300, 3, dies_on="never"),
        480: proc(10, "bash", ["-bash"], 470, 6),
        490: proc(11, "bash", ["bash", "-c", "while true; do torchrun train.py; done"], 480, 7),
        500: proc(12, "torchrun", ["/usr/bin/python3", "/usr/local/bin/torchrun", "train.py"], 490, 8),
        516: proc(41, "python3", ["python3", "train.py"], 500, 10, devices=[(195, 0)]),
        590: proc(50, "bash", ["-bash"], 300, 20),
        600: proc(60, "python3", ["python3", "leftover.py"], 590, 21, devices=[(195, 1)]),
    }


@pytest.fixture(autouse=True)
def on_pve1(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")


def run(params, calls, procs, monkeypatch, capsys, *, check_mode=False):
    table = FakeProcesses(procs)
    table.patch(monkeypatch)
    args = {"vmid": 200, "poll_interval": 0.25, **params}
    result = run_module(gpu_processes, args, FakeRunner(*calls), monkeypatch, capsys, check_mode=check_mode)
    return result, table.signals


def pid_file_call(answer, files=("/run/train.pid",), python="python3"):
    """The module's own read of the guard's pid files, inside the CT: one more pct exec."""
    argv = [*PCT, python, "-I", "-", json.dumps({"gpu_processes": {"pid_files": list(files)}})]
    return argv, (0, json.dumps({"gpu_processes": {"answer": {"pid_files": answer}, "seconds": 0.01}}), "")


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_unattended_the_guarded_worker_and_its_launchers_live_and_the_stray_run_is_ended(
    check_mode, monkeypatch, capsys
):
    calls = [CT_MEMORY, NODE_APPS] + ([] if check_mode else [NODE_MEMORY])
    params = {"unattended": True, "guard": [{"match": r"train\.py"}]}
    result, signals = run(params, calls, job(), monkeypatch, capsys, check_mode=check_mode)
    assert result["changed"] is True
    assert [p["pid"] for p in result["processes"]] == [600]
    assert result["launchers"] == []
    assert [(g["pid"], g["command"]) for g in result["guarded"]] == [(516, "python3 train.py")]
    assert result["needs_window"] == [
        "CT 200 on pve1: pid 516 (python3, pid 41 inside) on GPU 0, 20000 MiB, running 'python3 train.py', is left "
        "running: it matches gpu_processes_guard {match: 'train\\\\.py'}; ending it needs a window (run recover.yml "
        "without recover_unattended)"
    ]
    assert result["diff"]["before"] == "pid 600 (python3, pid 60 inside) on GPU 1, 5000 MiB\n"
    assert signals == ([] if check_mode else [[600, "SIGTERM"]])


def test_unattended_a_new_worker_of_the_guarded_job_during_the_settle_watch_is_no_new_holder(monkeypatch, capsys):
    procs = job()
    # The stray run's parent is a supervisor the step leaves running, so it watches; meanwhile torchrun starts a new
    # worker (elastic restart of its own, or a DataLoader).
    procs[590] = proc(50, "python3", ["python3", "supervise.py"], 300, 20)
    procs[530] = proc(43, "python3", ["python3", "train.py"], 500, 30, devices=[(195, 0)], born_after=600)
    params = {"unattended": True, "guard": [{"match": "torchrun"}]}
    result, signals = run(params, [CT_MEMORY, NODE_APPS, NODE_MEMORY, NODE_APPS_AFTER], procs, monkeypatch, capsys)
    assert "failed" not in result
    assert signals == [[600, "SIGTERM"]]
    assert [g["pid"] for g in result["guarded"]] == [516]
    assert [p["pid"] for p in result["parents"]] == [590] and result["watched"] > 0


def test_unattended_the_module_walks_past_the_login_shell_to_the_tmux_session_the_guard_names(monkeypatch, capsys):
    params = {"unattended": True, "guard": [{"match": "^tmux new -s train$"}]}
    calls = [CT_MEMORY, NODE_APPS, NODE_MEMORY]
    result, signals = run(params, calls, job(), monkeypatch, capsys)
    assert result["guarded"][0]["reason"].startswith("its ancestor pid 470 (tmux: server, pid 5 inside")
    assert (result["launchers"], signals) == ([], [[600, "SIGTERM"]])


def test_attended_the_guard_is_reported_and_the_whole_job_is_ended(monkeypatch, capsys):
    memory_free = (NODE_MEMORY[0], (0, f"index, uuid, memory.used [MiB]\n0, {UUID_A}, 0 MiB\n1, {UUID_B}, 0 MiB\n", ""))
    params = {"guard": [{"match": r"train\.py"}]}
    result, signals = run(params, [CT_MEMORY, NODE_APPS, memory_free], job(), monkeypatch, capsys)
    assert [g["pid"] for g in result["guarded"]] == [516]
    assert result["needs_window"] == []
    assert [p["pid"] for p in result["processes"]] == [516, 600]
    assert signals == [[490, "SIGTERM"], [500, "SIGTERM"], [516, "SIGTERM"], [600, "SIGTERM"]]


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_unattended_a_pid_file_read_by_the_module_guards_the_job_through_its_launcher(check_mode, monkeypatch, capsys):
    read = pid_file_call({"/run/train.pid": {"state": "ok", "pid": 12, "reason": None}})  # torchrun, inside
    calls = [CT_MEMORY, read, NODE_APPS] + ([] if check_mode else [NODE_MEMORY])
    params = {"unattended": True, "guard": [{"pid_file": "/run/train.pid"}]}
    result, signals = run(params, calls, job(), monkeypatch, capsys, check_mode=check_mode)
    assert result["guarded"][0]["reason"] == (
        "its parent pid 500 (torchrun, pid 12 inside: '/usr/bin/python3 /usr/local/bin/torchrun train.py') is the pid "
        "in /run/train.pid (gpu_processes_guard)"
    )
    assert signals == ([] if check_mode else [[600, "SIGTERM"]])


def test_the_pid_file_is_read_by_the_cts_python_the_option_names(monkeypatch, capsys):
    # `python` is the CT's interpreter of every probe part (the role passes preflight_python, the fact pass's).
    read = pid_file_call({"/run/train.pid": {"state": "ok", "pid": 12, "reason": None}}, python="/usr/bin/python3.11")
    params = {"unattended": True, "guard": [{"pid_file": "/run/train.pid"}], "python": "/usr/bin/python3.11"}
    result, signals = run(params, [CT_MEMORY, read, NODE_APPS], job(), monkeypatch, capsys, check_mode=True)
    assert (result["changed"], signals) == (True, [])
    assert [g["pid"] for g in result["guarded"]] == [516]


def test_unattended_with_only_the_guarded_job_nothing_is_ended_and_nothing_fails(monkeypatch, capsys):
    procs = {pid: spec for pid, spec in job().items() if pid not in (590, 600)}
    ct_memory = (CT_MEMORY[0], (0, f"index, uuid, memory.used [MiB]\n0, {UUID_A}, 20009 MiB\n1, {UUID_B}, 0 MiB\n", ""))
    params = {"unattended": True, "guard": [{"match": r"train\.py"}]}
    result, signals = run(params, [ct_memory, NODE_APPS_AFTER], procs, monkeypatch, capsys)
    assert (result["changed"], result["processes"], result["killed"], signals) == (False, [], [], [])
    assert len(result["needs_window"]) == 1
    assert "failed" not in result


def test_unattended_a_pid_file_that_names_no_pid_fails_before_anything_is_ended(monkeypatch, capsys):
    read = pid_file_call({"/run/train.pid": {"state": "unreadable", "pid": None, "reason": "it holds '', not one pid"}})
    params = {"unattended": True, "guard": [{"pid_file": "/run/train.pid"}]}
    result, signals = run(params, [CT_MEMORY, read, NODE_APPS], job(), monkeypatch, capsys)
    assert result["failed"] is True
    assert result["msg"].startswith(
        "CT 200 on pve1: cannot tell which process the guard's pid file names: /run/train.pid: it holds '', not one "
        "pid."
    )
    assert signals == []


@pytest.mark.parametrize(
    ("guard", "message"),
    [
        (
            [{"match": "x", "pid_file": "/run/x.pid"}],
            "gpu_processes_guard[0] has match and pid_file; give one per entry",
        ),
        ([{"pid_file": "train.pid"}], "gpu_processes_guard[0].pid_file 'train.pid' is not an absolute path"),
        ([{"match": "("}], "gpu_processes_guard[0].match '(' is not a regular expression"),
    ],
)
def test_a_guard_of_the_wrong_shape_fails_before_any_call(guard, message, monkeypatch, capsys):
    result, _ = run({"unattended": True, "guard": guard}, [], {}, monkeypatch, capsys)
    assert result["failed"] is True
    assert result["msg"].startswith(message)
    assert result["msg"].endswith("; fix the gpu_processes_* variable of that name")


# -- through the fact pass (plugins/modules/target_facts.py) ----------------------------------------------------------
def test_the_fact_pass_reads_the_pid_files_in_its_one_pct_exec_and_keeps_no_lock_for_window_work(
    tmp_path, monkeypatch, capsys
):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {516: TRAIN})
    payloads = {"preflight": ANCHORS["payload"], "gpu_processes": {"pid_files": ["/run/train.pid"]}}
    answers = {
        "preflight": ANCHORS["healthy"],
        "gpu_processes": {"pid_files": {"/run/train.pid": {"state": "ok", "pid": 41}}},
    }
    runner = FakeRunner(
        probe_call(payloads, answers),
        (APPS_ARGV, (0, f"pid, process_name, used_gpu_memory [MiB], gpu_uuid\n516, python3, 20000 MiB, {UUID0}\n", "")),
    )
    steps = {"gpu_processes": {"unattended": True, "guard": [{"pid_file": "/run/train.pid"}]}}
    facts = run_module(target_facts, params(tmp_path, vmid=200, steps=steps), runner, monkeypatch, capsys)
    facts = facts["ansible_facts"]["pve_gpu_recover"]
    assert (facts["pending"], facts["problems"], facts["lock"]["held"]) == ([], [], False)
    assert [g["pid"] for g in facts["gpu_processes"]["guarded"]] == [516]
    assert facts["gpu_processes"]["needs_window"][0].startswith("CT 200 on pve1: pid 516 (python3, pid 41 inside)")


def test_a_step_whose_facts_could_not_be_read_has_no_window_work():
    assert step_registry.failed_step(gpu_facts, "CT 200 on pve1", "boom")["needs_window"] == []
    assert "needs_window" not in step_registry.failed_step(preflight_facts, "CT 200 on pve1", "boom")
