"""Issue 19 with real processes, bare mode: the run's own process tree is never ended, and a parent left running
that restarts its worker is seen in the process table during the settle window.

Everything but the GPU is real: supervisors, bash loops and the shell that "runs the playbook" are processes this
test starts (each in a session of its own, killed in a finally), the module's code reads the real /proc and
signals them. The GPU is a directory: a worker "opens the GPU" by writing its pid there after INIT seconds, as a
CUDA worker holds the device only after `import torch` and CUDA init (2-4 s on an H200, docs/hardware.md). The
settle windows here are shorter than restart delay + INIT, so a watch that only looked for new GPU holders would
miss every restart: these tests fail without the child watch (issue 19's mutation check).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import acting as gpu_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import messages as gpu_messages
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import plan as gpu_plan

UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
INIT = 3.0  # seconds from a worker's start to its first "GPU allocation"
# A worker: holds the "GPU" (its pid in the directory argv[2]) INIT seconds after it starts, until it is ended.
WORKER = (
    "import os, signal, sys, time\n"
    "time.sleep(float(sys.argv[1]))\n"
    "open(os.path.join(sys.argv[2], str(os.getpid())), 'w').close()\n"
    "signal.pause()\n"
)
# A supervisor no launcher pattern names: starts a worker, and when it dies, waits DELAY s and starts another
# (DELAY 'never': it keeps running and starts nothing, like a Jupyter server whose kernel died and that does not
# restart it). The first worker holds the GPU at once (the job has been running for a while).
SUPERVISOR = (
    "import signal, subprocess, sys, time\n"
    "delay, gpu, worker = sys.argv[1], sys.argv[2], sys.argv[3]\n"
    "init = '0'\n"
    "while True:\n"
    "    subprocess.Popen([sys.executable, '-c', worker, init, gpu]).wait()\n"
    "    if delay == 'never':\n"
    "        while True:\n"
    "            signal.pause()\n"
    "    time.sleep(float(delay))\n"
    f"    init = '{INIT}'\n"
)


def holders(gpu):
    """The live processes whose pid is in the "GPU" directory (zombies and gone ones are not holders)."""
    found = []
    for name in os.listdir(gpu):
        info = pp.read_process(int(name))
        if info is not None and info.state not in pp.GONE_STATES:
            found.append(info)
    return found


class FakeSmi:
    """nvidia-smi on a node with one GPU whose holders are the "GPU" directory's processes (20000 MiB each)."""

    def __init__(self, gpu):
        self.gpu = gpu

    def __call__(self, *args, **kwargs):
        return self  # NvidiaSmi(target.run, timeout=...) inside the step

    def memory(self):
        used = 20000 * len(holders(self.gpu))
        return [{"index": 0, "uuid": UUID, "memory_used_mib": used}]

    def compute_apps(self):
        return [{"pid": i.pid, "used_memory_mib": 20000, "gpu_uuid": UUID} for i in holders(self.gpu)]


TARGET = SimpleNamespace(label="localhost", node="localhost", vmid=None, is_container=False, timeout=60, run=None)


def settings(**changes):
    p = {name: option["default"] for name, option in gpu_facts.SPEC.items()}
    p.update(grace=2, kill_timeout=2, memory_timeout=5, poll_interval=0.05, **changes)
    return p


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """The fake GPU for the step (real /proc, real signals); kills every session a test started, at the end."""
    directory = tmp_path / "gpu"
    directory.mkdir()
    smi = FakeSmi(str(directory))
    monkeypatch.setattr(gpu_acting, "NvidiaSmi", smi)
    # This machine's processes are the host's: the step's owner for a bare host.
    monkeypatch.setattr(
        gpu_acting,
        "device_holders",
        lambda owner, proc_root="/proc", exclude=(): [(i, [(195, 0)]) for i in holders(smi.gpu)],
    )
    sessions = []

    def start(argv):
        process = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sessions.append(process)
        return process

    yield SimpleNamespace(dir=str(directory), smi=smi, start=start)
    for process in sessions:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the session's own process group: it and what it started
        process.wait(timeout=5)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


def alive(pid):
    stat = pp.read_stat(pid)
    return stat is not None and stat[1] not in pp.GONE_STATES


def supervisor(gpu, delay):
    process = gpu.start([sys.executable, "-c", SUPERVISOR, str(delay), gpu.dir, WORKER])
    first = wait_for(lambda: holders(gpu.dir))[0]
    assert first.ppid == process.pid
    return process, first


def test_a_name_and_command_line_a_ct_chose_cannot_forge_a_line_or_drive_the_terminal():
    # Issue 25 item 11: comm and argv are the CT's choice; a newline forged a line in --diff and the journal.
    forged = "x\nend pid 1 (init) on GPU 0\x1b[2K"
    info = pp.ProcessInfo(516, 41, forged[:15], "S", "ct:200", [f"python3 {forged}"], 10, ppid=450)
    entry = {"info": info, "gpus": {0: 100}, "found_by": {"nvml"}}
    parent = {"info": info, "of": [517]}
    restarter = dict(entry, why="a shell running the job", restarts=[517])
    texts = [
        gpu_plan.diff_cleanup([entry], [restarter])["before"].rstrip("\n"),
        *gpu_plan.plan_changes([entry], [restarter]),
        gpu_messages.window_message("CT 200 on pve1", entry, "why"),
        str(gpu_messages.as_result(entry)),
        str(gpu_messages.as_launcher(restarter)),
        str(gpu_messages.as_parent(parent)),
        gpu_messages.describe_process(info),
    ]
    for text in texts:
        lines = text.split("\n")
        assert all("\x1b" not in line for line in lines)
        assert not any(line.startswith("end pid 1") for line in lines[1:]), text
    assert gpu_messages.as_result(entry)["name"] == "x\\nend pid 1 (in"
    assert gpu_messages.as_parent(parent)["command"] == "python3 x\\nend pid 1 (init) on GPU 0\\x1b[2K"


# -- the run's own process tree ---------------------------------------------------------------------------------
def test_the_module_and_its_parents_are_the_runs_own_processes():
    own = gpu_facts.run_processes()
    assert (os.getpid(), pp.read_stat(os.getpid())[2]) in own
    assert (os.getppid(), pp.read_stat(os.getppid())[2]) in own
    # A controller pid that names no ansible-playbook here (a controller elsewhere has other pids) is ignored.
    with subprocess.Popen(["sleep", "30"]) as other:
        try:
            assert gpu_facts.run_processes(other.pid) == own
        finally:
            other.kill()


def test_a_holder_started_by_the_shell_that_runs_the_playbook_ends_and_the_shell_and_the_run_survive(gpu):
    # `python3 worker.py & ansible-playbook recover.yml; wait` in one bash -c: the holder's parent is the shell
    # running the playbook. `exec -a` names the stand-in ansible-playbook like the real one (argv[0]).
    shell = gpu.start(
        [
            "bash",
            "-c",
            f'{sys.executable} -c "$1" 0 "$2" & (exec -a ansible-playbook sleep 60); wait',
            "bash",
            WORKER,
            gpu.dir,
        ]
    )
    worker = wait_for(lambda: holders(gpu.dir))[0]
    controller = wait_for(
        lambda: [
            p
            for p in pp.list_pids()
            if pp.read_stat(p) and pp.parse_ppid(Path(f"/proc/{p}/stat").read_text()) == shell.pid and p != worker.pid
        ]
    )[0]
    assert worker.ppid == shell.pid
    warnings = []
    result = gpu_acting.cleanup(TARGET, gpu.smi, settings(settle=0.5, controller_pid=controller), warn=warnings.append)
    assert [k["pid"] for k in result["killed"]] == [worker.pid]
    assert result["launchers"] == []  # the shell "running the job" is the run's: never ended, whatever it matches
    assert alive(shell.pid) and alive(controller)
    [named] = result["own_run"]
    # Named with its command line, control characters escaped (the worker's script has newlines), cut short.
    assert named.startswith(f"pid {shell.pid} (bash: 'bash -c {sys.executable} -c ")
    assert named.endswith("...') also runs this recover run: not ended")
    assert warnings == [f"localhost: {result['own_run'][0]}"]
    assert result["parents"] == [] and result["changed"] is True
    assert gpu.smi.memory()[0]["memory_used_mib"] == 0


# The step as a local connection runs it: a child (here a grandchild) of the shell that runs the playbook.
RUN_AS_MODULE = """
import json, sys
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
import conftest  # noqa: F401  (module_utils as ansible.module_utils)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import acting
from unit.plugins.module_utils.steps.gpu_processes import test_acting_restarts as here
smi = here.FakeSmi(sys.argv[2])
acting.NvidiaSmi = smi
acting.device_holders = lambda owner, proc_root="/proc", exclude=(): [(i, [(195, 0)]) for i in here.holders(smi.gpu)]
print(json.dumps(acting.cleanup(here.TARGET, smi, here.settings(settle=0.5))))
"""


def test_in_bare_mode_the_module_below_the_playbooks_shell_ends_the_holder_and_leaves_the_shell(gpu, tmp_path):
    # No controller pid at all: the module's own parents are the run's (ansible-playbook, the shell above it).
    result_file, done = tmp_path / "result.json", tmp_path / "done"
    shell = gpu.start(
        [
            "bash",
            "-c",
            f'{sys.executable} -c "$1" 0 "$2" & '
            f'until [ -n "$(ls "$2")" ]; do sleep 0.05; done; '
            f'{sys.executable} -c "$3" "$4" "$2" > "$5"; echo "$?" > "$6"; sleep 60',
            "bash",
            WORKER,
            gpu.dir,
            RUN_AS_MODULE,
            str(Path(__file__).resolve().parents[5]),
            str(result_file),
            str(done),
        ]
    )
    worker = wait_for(lambda: holders(gpu.dir))[0]
    wait_for(lambda: done.exists() and done.read_text().strip(), timeout=30)
    assert done.read_text().strip() == "0"  # the run completed
    result = json.loads(result_file.read_text())
    assert [k["pid"] for k in result["killed"]] == [worker.pid]
    assert result["launchers"] == []
    assert alive(shell.pid)  # the shell that runs the "playbook" survived, and is named
    assert [s.split(" (")[0] for s in result["own_run"]] == [f"pid {shell.pid}"]


def test_without_the_controller_pid_the_shell_is_the_jobs_and_the_walk_stops_at_the_module_itself(gpu):
    shell = gpu.start(["bash", "-c", f'{sys.executable} -c "$1" 0 "$2"; sleep 60', "bash", WORKER, gpu.dir])
    worker = wait_for(lambda: holders(gpu.dir))[0]
    # No controller pid: the shell is not the run's, so it is "a shell running the job" and planned with it.
    plain = gpu_acting.cleanup(TARGET, gpu.smi, settings(), check_mode=True)
    assert [r["pid"] for r in plain["launchers"]] == [shell.pid]
    # Above the shell is this test's process, playing the module: the run's own, named, never planned.
    assert plain["own_run"] == [
        f"{gpu_messages.describe_process(pp.read_process(os.getpid()))} also runs this recover run: not ended"
    ]
    assert alive(worker.pid) and alive(shell.pid)


# -- parents left running, watched for restarts -----------------------------------------------------------------
@pytest.mark.parametrize("delay", [0, 2, 5])
def test_a_supervisor_restarting_its_worker_after_a_delay_is_seen_and_ended_with_its_new_worker(gpu, delay):
    process, first = supervisor(gpu, delay)
    # The window is shorter than delay + INIT: only the child watch can see this restart in time.
    result = gpu_acting.cleanup(TARGET, gpu.smi, settings(settle=delay + 1.5))
    assert process.wait(timeout=5) == -signal.SIGTERM
    killed = [k["pid"] for k in result["killed"]]
    # The first worker, then the supervisor and its new worker, ended together: listed as each was seen gone, in
    # either order (on a loaded machine the supervisor, this test's child, can be seen gone after its worker).
    assert killed[0] == first.pid and process.pid in killed[1:] and len(killed) == 3, killed
    assert [(r["pid"], r["reason"].split(":")[0]) for r in result["launchers"]] == [
        (process.pid, "restarted its worker")
    ]
    assert result["parents"][0]["pid"] == process.pid
    assert result["parents"][0]["note"].startswith("started pid ")
    # The watch ended at the restart, and no second window ran: with the supervisor ended, nothing was left running
    # that could start a worker again.
    assert result["watched"] <= delay + 1.5 + 0.5
    assert result["changes"][-1].startswith(f"end launcher pid {process.pid} ({first.comm}: ")
    time.sleep(INIT + 0.5)  # long enough for a restarted worker to hold the GPU again, had anything survived
    assert holders(gpu.dir) == []


def test_a_bash_until_loop_is_ended_first_so_nothing_restarts(gpu):
    loop = gpu.start(
        ["bash", "-c", f'until {sys.executable} -c "$1" 0 "$2"; do sleep 1; done', "bash", WORKER, gpu.dir]
    )
    worker = wait_for(lambda: holders(gpu.dir))[0]
    result = gpu_acting.cleanup(TARGET, gpu.smi, settings(settle=1.5))
    assert [(r["pid"], r["reason"]) for r in result["launchers"]] == [(loop.pid, "a shell running the job")]
    assert sorted(k["pid"] for k in result["killed"]) == sorted([loop.pid, worker.pid])
    assert loop.wait(timeout=5) == -signal.SIGTERM
    assert result["parents"] == []


@pytest.mark.parametrize("name", ["supervise.py", "jupyter-lab"])
def test_a_parent_that_never_restarts_is_named_not_ended_and_nothing_fails(gpu, name, tmp_path):
    # A home-made supervisor, or a Jupyter-like server whose kernel holds the GPU: ending the kernel must not end
    # the server, which starts nothing afterwards.
    script = tmp_path / name
    script.write_text(SUPERVISOR)
    process = gpu.start([sys.executable, str(script), "never", gpu.dir, WORKER])
    kernel = wait_for(lambda: holders(gpu.dir))[0]
    result = gpu_acting.cleanup(TARGET, gpu.smi, settings(settle=1.0))
    assert [k["pid"] for k in result["killed"]] == [kernel.pid]
    assert alive(process.pid)
    assert result["launchers"] == []
    assert [(p["pid"], p["name"], p["parent_of"], p["note"]) for p in result["parents"]] == [
        (process.pid, kernel.comm, [kernel.pid], "may start workers again: not ended")
    ]
    assert 1.0 <= result["watched"] < 2.0


def test_a_jupyter_like_server_that_restarts_its_kernel_is_ended_with_it(gpu, tmp_path):
    script = tmp_path / "jupyter-lab"
    script.write_text(SUPERVISOR)
    process = gpu.start([sys.executable, str(script), "0", gpu.dir, WORKER])
    wait_for(lambda: holders(gpu.dir))
    result = gpu_acting.cleanup(TARGET, gpu.smi, settings(settle=1.0))
    assert process.wait(timeout=5) == -signal.SIGTERM
    assert [r["pid"] for r in result["launchers"]] == [process.pid]


def test_with_end_launchers_false_a_restarting_supervisor_fails_the_step_naming_it_and_the_fix(gpu):
    process, first = supervisor(gpu, 0)
    with pytest.raises(gpu_messages.GpuProcessesError) as raised:
        gpu_acting.cleanup(TARGET, gpu.smi, settings(settle=1.5, end_launchers=False))
    assert f"pid {process.pid} ({first.comm}: " in str(raised.value)
    assert f"stop it (`kill {process.pid}` on the node)" in str(raised.value)
    assert raised.value.details["restarted"][0]["pid"] == process.pid
    assert alive(process.pid)  # named, not ended


def test_unattended_a_restarting_supervisor_is_left_to_a_window_and_named(gpu):
    process, first = supervisor(gpu, 0)
    # A guard that names another job: this one is a stray, ended; its supervisor is deferred, not ended.
    result = gpu_acting.cleanup(
        TARGET, gpu.smi, settings(settle=1.5, unattended=True, guard=[{"match": "no-such-job"}])
    )
    assert [k["pid"] for k in result["killed"]] == [first.pid]
    assert alive(process.pid)
    assert any(f"pid {process.pid} ({first.comm}: " in s and "needs a window" in s for s in result["needs_window"])
    assert result["kept_gpus"] == [0]
