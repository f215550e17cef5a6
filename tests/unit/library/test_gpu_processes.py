"""plugins/modules/gpu_processes.py: the plan and the escalation (pure), and the module replayed through the YAML cases
against a fake runner and a fake process table that dies the way each case says."""

import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import gpu_processes
import pytest
import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import act_runner
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import ProcessInfo
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import acting as gpu_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import ending as gpu_ending
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import plan as gpu_plan

from tests.fakes import FakeRunner, run_module

CASES = yaml.safe_load(Path(__file__).with_suffix(".yaml").read_text())["cases"]
SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGKILL: "SIGKILL"}


class FakeProcesses:
    """The node's processes as the module sees them: alive until the signal in `dies_on` reaches them.

    A process with `born_after: PID` appears when PID dies (a worker its parent restarts); `units` maps a
    systemd service's cgroup path to its members ([pid, start_time]).
    """

    def __init__(self, procs, units=None):
        self.procs = {}
        self.devices = {}
        self.dies_on = {}
        self.born_after = {}
        for pid, spec in procs.items():
            fields = dict(spec)
            self.dies_on[int(pid)] = fields.pop("dies_on")
            self.devices[int(pid)] = [tuple(d) for d in fields.pop("devices")]
            if "born_after" in fields:
                self.born_after[int(pid)] = fields.pop("born_after")
            self.procs[int(pid)] = ProcessInfo(pid=int(pid), **fields)
        self.alive = set(self.procs) - set(self.born_after)
        self.units = units or {}
        self.signals = []

    def read_process(self, pid, proc_root="/proc"):
        return self.procs.get(pid) if pid in self.alive else None

    def read_unit_members(self, path):
        return self.units.get(path)

    def device_holders(self, owner, proc_root="/proc", exclude=(), owners=None):
        return [
            (self.procs[p], self.devices[p])
            for p in sorted(self.alive)
            if self.devices[p] and self.procs[p].owner == owner
        ]

    def still_there(self, info, proc_root="/proc"):
        return info.pid in self.alive

    def signal_process(self, info, signum):
        self.signals.append([info.pid, SIGNALS[signum]])
        if self.dies_on[info.pid] in (SIGNALS[signum], "SIGTERM"):
            self.alive.discard(info.pid)
            self.alive.update(p for p, parent in self.born_after.items() if parent == info.pid)

    def read_stat(self, pid, proc_root="/proc"):
        info = self.read_process(pid)
        return (info.comm, info.state, info.start_time) if info else None

    def children_of(self, parents, proc_root="/proc"):
        return {
            pid: {(c, self.procs[c].start_time) for c in self.alive if self.procs[c].ppid == pid} for pid in parents
        }

    def patch(self, monkeypatch):
        """Give the step this process table, in each of its modules that reads or signals (facts: the node reads
        that the module shares with the fact pass; acting: the rest), and a clock that sleeping only moves (no real
        waits)."""
        for name in ("read_process", "device_holders", "read_unit_members"):
            monkeypatch.setattr(gpu_facts, name, getattr(self, name))
        monkeypatch.setattr(gpu_facts, "process_owners", dict)  # device_holders above knows the owners
        for name in ("read_process", "device_holders", "still_there", "signal_process", "read_stat", "children_of"):
            monkeypatch.setattr(gpu_acting, name, getattr(self, name))
        clock = FakeClock()
        monkeypatch.setattr(gpu_acting, "time", SimpleNamespace(monotonic=clock, sleep=clock.sleep))
        # The runner times the module (its `seconds`) on the same clock.
        monkeypatch.setattr(act_runner, "time", SimpleNamespace(monotonic=clock))


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_module(case, check_mode, monkeypatch, capsys):
    calls = case["calls"] + ([] if check_mode else case.get("calls_run", []))
    runner = FakeRunner(*[(c["argv"], (c["rc"], c.get("stdout", ""), c.get("stderr", ""))) for c in calls])
    procs = FakeProcesses(case["procs"], case.get("units"))
    procs.patch(monkeypatch)
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    result = run_module(gpu_processes, case["params"], runner, monkeypatch, capsys, check_mode=check_mode)
    expect = dict(case.get("expect", {}), **case.get("expect_check" if check_mode else "expect_run", {}))
    for key, want in expect.items():
        if key == "signals":
            assert procs.signals == want
        elif key == "killed_signals":
            assert {k["pid"]: k["signal"] for k in result["killed"]} == want
        else:
            assert result.get(key, False if key == "failed" else None) == want, key


def info(pid, owner="ct:200", comm="python3", argv0="python3"):
    return ProcessInfo(pid=pid, ns_pid=pid, comm=comm, state="S", owner=owner, cmdline=[argv0], start_time=1)


def test_collect_merges_nvml_and_device_holders_and_skips_other_gpus_and_the_dead():
    gpus = [{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}]
    apps = [
        {"pid": 1, "used_memory_mib": 100, "gpu_uuid": "GPU-a"},
        {"pid": 1, "used_memory_mib": 50, "gpu_uuid": "GPU-b"},
        {"pid": 2, "used_memory_mib": 10, "gpu_uuid": "GPU-z"},  # not the target's GPU
        {"pid": 3, "used_memory_mib": 10, "gpu_uuid": "GPU-a"},  # gone before it could be read
    ]
    holders = gpu_plan.collect_holders(apps, gpus, {1: info(1), 2: info(2), 3: None}, [(info(4), [(195, 0)])])
    assert {pid: (h["gpus"], sorted(h["found_by"])) for pid, h in holders.items()} == {
        1: ({0: 100, 1: 50}, ["nvml"]),
        4: ({}, ["device"]),
    }


class FakeClock:
    """time.monotonic and time.sleep for code under test: sleeping only moves the clock."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_escalation_waits_only_as_long_as_needed():
    clock = FakeClock()
    alive = {1, 2}
    sent = []

    def send(process, signum):
        sent.append((process.pid, signum))
        if signum == signal.SIGKILL or process.pid == 1:
            alive.discard(process.pid)

    entries = [{"info": info(1)}, {"info": info(2)}]
    killed, survivors = gpu_ending.end_processes(
        entries,
        grace=1.0,
        kill_timeout=1.0,
        poll_interval=0.1,
        alive=lambda i: i.pid in alive,
        send=send,
        clock=clock,
        sleep=clock.sleep,
    )
    assert survivors == []
    assert [(k["pid"], k["signal"]) for k in killed] == [(1, "SIGTERM"), (2, "SIGKILL")]
    assert killed[0]["exited_after"] == 0.0
    assert 1.0 <= killed[1]["exited_after"] < 1.2  # the grace period, not a fixed sleep beyond it
    assert sent == [(1, signal.SIGTERM), (2, signal.SIGTERM), (2, signal.SIGKILL)]


def test_memory_wait_stops_at_the_first_free_poll():
    clock = FakeClock()
    answers = [[{"uuid": "GPU-a", "memory_used_mib": 500}], [{"uuid": "GPU-a", "memory_used_mib": 0}]]
    rows, polls, free = gpu_ending.wait_for_memory(
        lambda: answers.pop(0), {"GPU-a"}, threshold=0, timeout=30, poll_interval=0.02, clock=clock, sleep=clock.sleep
    )
    assert (polls, free, rows[0]["memory_used_mib"]) == (2, True, 0)
    assert clock.now == pytest.approx(0.02)


def test_memory_wait_gives_up_at_the_timeout():
    clock = FakeClock()
    busy = [{"uuid": "GPU-a", "memory_used_mib": 500}]
    _, polls, free = gpu_ending.wait_for_memory(
        lambda: busy, {"GPU-a"}, threshold=100, timeout=1, poll_interval=0.25, clock=clock, sleep=clock.sleep
    )
    assert (polls, free) == (5, False)


def test_threshold_and_other_gpus():
    rows = [{"uuid": "GPU-a", "memory_used_mib": 5}, {"uuid": "GPU-z", "memory_used_mib": 9000}]
    assert gpu_plan.busy_gpus(rows, {"GPU-a"}, 5) == []
    assert gpu_plan.busy_gpus(rows, {"GPU-a"}, 4) == [rows[0]]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"poll_interval": 0}, "poll_interval must be more than 0 seconds, got 0"),
        ({"grace": -1}, "grace must be 0 or more, got -1"),
        ({"memory_threshold_mib": -5}, "memory_threshold_mib must be 0 or more, got -5"),
    ],
)
def test_wait_options_that_cannot_work_fail_before_anything_runs(params, message, monkeypatch, capsys):
    result = run_module(gpu_processes, {"vmid": 200, **params}, FakeRunner(), monkeypatch, capsys)
    assert result["failed"]
    assert result["msg"] == f"{message}; fix the gpu_processes_* variable of that name"
    assert result["error"] == "invalid"  # like the other acting modules: code tells a wrong option by its kind


def test_a_run_says_what_it_changed_how_long_it_took_and_how_long_it_watched(monkeypatch, capsys):
    case = next(c for c in CASES if c["id"] == "ends_own_holders_sigterm_then_sigkill")
    calls = case["calls"] + case["calls_run"]
    runner = FakeRunner(*[(c["argv"], (c["rc"], c.get("stdout", ""), c.get("stderr", ""))) for c in calls])
    FakeProcesses(case["procs"], case.get("units")).patch(monkeypatch)
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    result = run_module(gpu_processes, case["params"], runner, monkeypatch, capsys)
    assert result["changes"] == [
        "end pid 516 (python3, pid 41 inside) on GPU 0, 20000 MiB",
        "end pid 517 (python3, pid 42 inside) on GPU 1, 5000 MiB",
    ]
    # No holder's parent is left running: nothing can restart what was ended, and the step ends when the memory is
    # free, watching nothing.
    assert result["watched"] == 0.0


def test_a_parent_left_running_is_watched_for_the_whole_settle_window(monkeypatch, capsys):
    case = next(
        c for c in CASES if c["id"] == "a_supervisors_nvidia_smi_health_check_during_the_settle_watch_is_no_restart"
    )
    calls = case["calls"] + case["calls_run"]
    runner = FakeRunner(*[(c["argv"], (c["rc"], c.get("stdout", ""), c.get("stderr", ""))) for c in calls])
    FakeProcesses(case["procs"], case.get("units")).patch(monkeypatch)
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    result = run_module(gpu_processes, case["params"], runner, monkeypatch, capsys)
    assert [p["pid"] for p in result["parents"]] == [450]
    assert result["watched"] == pytest.approx(10.0, abs=0.05)  # the default settle window, on the fake clock
    assert result["seconds"] >= result["watched"]


def test_check_mode_says_what_a_run_would_change_and_how_long_it_took(monkeypatch, capsys):
    case = next(c for c in CASES if c["id"] == "ends_own_holders_sigterm_then_sigkill")
    runner = FakeRunner(*[(c["argv"], (c["rc"], c.get("stdout", ""), c.get("stderr", ""))) for c in case["calls"]])
    FakeProcesses(case["procs"], case.get("units")).patch(monkeypatch)
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    result = run_module(gpu_processes, case["params"], runner, monkeypatch, capsys, check_mode=True)
    # The same lines as the real run (the result shape the acting modules' runner gives every module).
    assert result["changes"] == [
        "end pid 516 (python3, pid 41 inside) on GPU 0, 20000 MiB",
        "end pid 517 (python3, pid 42 inside) on GPU 1, 5000 MiB",
    ]
    assert (result["changed"], result["killed"], result["watched"]) == (True, [], 0.0)
    assert isinstance(result["seconds"], float)


def test_check_mode_warns_about_a_process_stuck_in_d(monkeypatch, capsys):
    case = next(c for c in CASES if c["id"] == "a_process_stuck_in_d_outlives_sigkill")
    runner = FakeRunner(*[(c["argv"], (c["rc"], c.get("stdout", ""), c.get("stderr", ""))) for c in case["calls"]])
    FakeProcesses(case["procs"]).patch(monkeypatch)
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    result = run_module(gpu_processes, case["params"], runner, monkeypatch, capsys, check_mode=True)
    assert result["changed"]
    assert "is in state D (stuck in the driver); a real run is likely to find it outliving SIGKILL" in str(
        result["warnings"]
    )
