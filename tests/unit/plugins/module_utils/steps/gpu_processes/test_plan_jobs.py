"""Jobs that restart their workers (issue 8): the walk up a holder's parents on a fake /proc tree, the plan that
ends launchers first, and real shells that restart what is ended."""

import contextlib
import functools
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import ending as gpu_ending
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import plan as gpu_plan

SESSION = "/lxc/200/ns/user.slice/user-0.slice/session-3.scope"


def fake_proc(root, pid, *, ppid, comm, argv, nspid=None, cgroup=SESSION, start=None):
    """A /proc/<pid> as the node sees a process: stat (with ppid and start time), status (NSpid), cgroup, cmdline."""
    base = root / str(pid)
    base.mkdir(parents=True)
    fields = [str(ppid), *["1"] * 17, str(start if start is not None else pid), "0"]
    (base / "stat").write_text(f"{pid} ({comm}) S {' '.join(fields)}\n")
    (base / "status").write_text(f"Name:\t{comm}\nNSpid:\t{pid}\t{nspid if nspid is not None else pid - 400}\n")
    (base / "cgroup").write_text(f"0::{cgroup}\n")
    (base / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


@pytest.fixture
def proc(tmp_path, monkeypatch):
    """A fake node /proc under tmp_path (and its cgroup tree), read by gpu_facts instead of the real one."""
    root = tmp_path / "proc"
    cgroups = tmp_path / "cgroup"
    monkeypatch.setattr(gpu_facts, "read_process", functools.partial(pp.read_process, proc_root=str(root)))
    monkeypatch.setattr(
        gpu_facts,
        "read_unit_members",
        functools.partial(pp.read_unit_members, cgroup_roots=(str(cgroups),), proc_root=str(root)),
    )
    # CT 200: its init, a login shell running a `while true` loop around torchrun, which runs the worker.
    fake_proc(root, 300, ppid=100, comm="systemd", argv=["/sbin/init"], nspid=1, cgroup="/lxc/200/ns/init.scope")
    fake_proc(root, 470, ppid=300, comm="sshd-session", argv=["sshd-session: root@pts/0"])
    fake_proc(root, 480, ppid=470, comm="bash", argv=["-bash"])
    fake_proc(root, 490, ppid=480, comm="bash", argv=["bash", "-c", "while true; do torchrun train.py; done"])
    fake_proc(root, 500, ppid=490, comm="torchrun", argv=["/usr/bin/python3", "/usr/local/bin/torchrun", "train.py"])
    fake_proc(root, 516, ppid=500, comm="python3", argv=["python3", "train.py"])
    # A DataLoader worker forked by the worker: it inherited the GPU device files, so it is a holder too.
    fake_proc(root, 517, ppid=516, comm="pt_data_worker", argv=["python3", "train.py"])
    return root, cgroups


def holder(info, memory=0):
    return {"info": info, "gpus": {0: memory} if memory else {}, "found_by": {"device"}}


def plan(to_end, ancestors, units, protected=()):
    holders = {e["info"].pid: e for e in to_end}
    return gpu_plan.plan_jobs(
        to_end,
        holders,
        ancestors,
        units,
        owner="ct:200",
        launchers=gpu_facts.DEFAULT_LAUNCHERS,
        protected=list(protected),
    )


def test_the_walk_reads_parents_up_to_the_interactive_login_shell_and_not_beyond(proc):
    worker = gpu_facts.read_process(516)
    ancestors, units = gpu_facts.read_jobs([worker], "ct:200")
    # 480 is read (that is how the walk knows to stop) but nothing above it: not sshd, not the CT's init.
    assert sorted(ancestors) == [480, 490, 500]
    assert units == {}
    assert ancestors[500].ppid == 490
    restarters, services = plan([holder(worker, 20000)], ancestors, units)
    assert [(r["info"].pid, r["why"], r["restarts"]) for r in restarters] == [
        (490, "a shell running the job", [516]),  # the farthest first: the loop must not start torchrun again
        (500, "a launcher (matches 'torchrun')", [516]),
    ]
    assert services == []


def test_a_forked_child_holding_the_gpu_is_no_launcher_and_shares_its_parents_launchers(proc):
    worker, child = gpu_facts.read_process(516), gpu_facts.read_process(517)
    ancestors, units = gpu_facts.read_jobs([worker, child], "ct:200")
    restarters, _ = plan([holder(worker, 20000), holder(child)], ancestors, units)
    # The child's parent is a holder (ended anyway): its walk stops there; the launchers are the worker's.
    assert [(r["info"].pid, r["restarts"]) for r in restarters] == [(490, [516]), (500, [516])]


def test_the_walk_never_crosses_into_the_node_or_another_ct(proc):
    root, _ = proc
    # Started by `pct exec` / lxc-attach: its parent is the node's lxc-attach, in the node's cgroup.
    fake_proc(root, 700, ppid=1, comm="lxc-attach", argv=["lxc-attach", "-n", "200"], cgroup="/user.slice")
    fake_proc(root, 716, ppid=700, comm="python3", argv=["python3", "t.py"], cgroup="/lxc/200/ns/.lxc")
    # A parent in CT 201 (a pid namespace shared by mistake, or a forged ppid): never part of CT 200's job.
    fake_proc(root, 800, ppid=1, comm="bash", argv=["bash", "-c", "loop"], cgroup="/lxc/201/ns/.lxc")
    fake_proc(root, 816, ppid=800, comm="python3", argv=["python3", "t.py"], cgroup="/lxc/200/ns/.lxc")
    infos = [gpu_facts.read_process(716), gpu_facts.read_process(816)]
    ancestors, _ = gpu_facts.read_jobs(infos, "ct:200")
    assert sorted(ancestors) == [700, 800]  # read, and the walk stopped at each
    restarters, _ = plan([holder(i) for i in infos], ancestors, {})
    assert restarters == []


def test_the_walk_stops_at_the_cts_init_and_at_a_protected_parent(proc):
    root, _ = proc
    # A shell the protected daemon was started from: above the daemon, so never part of the holder's job.
    fake_proc(root, 590, ppid=300, comm="bash", argv=["bash", "/etc/start-dcgm.sh"])
    fake_proc(root, 600, ppid=590, comm="nv-hostengine", argv=["nv-hostengine"])
    fake_proc(root, 616, ppid=600, comm="bash", argv=["bash", "-c", "python3 t.py"])
    fake_proc(root, 617, ppid=616, comm="python3", argv=["python3", "t.py"])
    worker = gpu_facts.read_process(617)
    ancestors, units = gpu_facts.read_jobs([worker], "ct:200")
    restarters, _ = plan([holder(worker)], ancestors, units, protected=["nv-hostengine"])
    assert [r["info"].pid for r in restarters] == [616]  # the protected daemon above it is never ended


def test_a_holder_in_its_own_service_is_found_with_the_services_members(proc):
    root, cgroups = proc
    unit = "/lxc/200/ns/system.slice/train.service"
    fake_proc(root, 900, ppid=300, comm="bash", argv=["/bin/bash", "/opt/train/loop.sh"], cgroup=unit)
    fake_proc(root, 916, ppid=900, comm="python3", argv=["python3", "train.py"], cgroup=unit)
    (cgroups / unit.lstrip("/")).mkdir(parents=True)
    (cgroups / unit.lstrip("/") / "cgroup.procs").write_text("900\n916\n")
    worker = gpu_facts.read_process(916)
    ancestors, units = gpu_facts.read_jobs([worker], "ct:200")
    assert units == {unit: [(900, 900), (916, 916)]}
    restarters, services = plan([holder(worker, 1000)], ancestors, units)
    assert [r["info"].pid for r in restarters] == [900]
    assert [(e["info"].pid, u["name"]) for e, u in services] == [(916, "train.service")]


def test_check_mode_facts_list_the_launchers_a_run_would_end(proc):
    worker = gpu_facts.read_process(516)
    ancestors, units = gpu_facts.read_jobs([worker], "ct:200")
    apps = [{"pid": 516, "used_memory_mib": 20000, "gpu_uuid": "GPU-a"}]
    node = {"apps": apps, "infos": {516: worker}, "devices": [], "ancestors": ancestors, "units": units}
    context = {
        "target": {"label": "CT 200 on pve1", "vmid": 200, "node": "pve1"},
        "steps": {"preflight": {"gpus": [{"index": 0, "uuid": "GPU-a", "memory_used_mib": 20009}]}},
    }
    spec = {key: value["default"] for key, value in gpu_facts.SPEC.items()}
    facts = gpu_facts.evaluate_step(spec, None, node, context)
    assert [launcher["pid"] for launcher in facts["launchers"]] == [490, 500]
    assert facts["changes"] == [
        "end launcher pid 490 (bash, pid 90 inside: 'bash -c while true; do torchrun train.py; done'), a shell "
        "running the job, parent of pid 516",
        "end launcher pid 500 (torchrun, pid 100 inside: '/usr/bin/python3 /usr/local/bin/torchrun train.py'), a "
        "launcher (matches 'torchrun'), parent of pid 516",
        "end pid 516 (python3, pid 116 inside) on GPU 0, 20000 MiB",
    ]
    assert (facts["problems"], facts["pending"]) == ([], True)
    refused = gpu_facts.evaluate_step(dict(spec, end_launchers=False), None, node, context)
    assert refused["pending"] is False
    assert refused["problems"][0].startswith("CT 200 on pve1: the processes holding its GPUs are restarted when")


# -- real processes --------------------------------------------------------------------------------------------
def children(pid):
    """Live children of ``pid`` (from /proc/<pid>/task/<pid>/children)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout} s")


def in_session(sid):
    """Live processes of session ``sid`` (field 6 of stat): the loop and every worker it started."""
    found = []
    for pid in pp.list_pids():
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        match = pp.STAT.match(text)
        rest = text[match.end() :].split() if match else []
        if match and match.group(2) not in pp.GONE_STATES and len(rest) > 2 and rest[2] == str(sid):
            found.append(pid)
    return found


@pytest.fixture
def loop():
    """A real `while true` shell (a session of its own) restarting its worker (`sleep`) whenever it dies."""
    shell = subprocess.Popen(["sh", "-c", "while true; do sleep 30; done"], start_new_session=True)
    yield shell
    with contextlib.suppress(ProcessLookupError):
        os.killpg(shell.pid, signal.SIGKILL)  # the loop's own process group: it and its workers
    shell.wait(timeout=5)


def test_ending_only_the_worker_of_a_real_loop_gets_a_new_worker(loop):
    first = wait_for(lambda: children(loop.pid))[0]
    gpu_ending.signal_process(pp.read_process(first), signal.SIGTERM)
    second = wait_for(lambda: [c for c in children(loop.pid) if c != first])[0]
    # A new child is the shell's fork until it execs sleep: wait for the exec, not only the fork (under load the
    # fork was seen as `sh`).
    assert wait_for(lambda: pp.read_process(second).comm == "sleep")  # what the step saw before issue 8: a new holder


def test_a_real_loop_is_found_as_the_workers_restarter_and_ended_first_so_nothing_restarts(loop):
    worker = pp.read_process(wait_for(lambda: children(loop.pid))[0])
    owner = worker.owner
    ancestors, units = gpu_facts.read_jobs([worker], owner)
    restarters, _ = gpu_plan.plan_jobs(
        [holder(worker)],
        {worker.pid: holder(worker)},
        ancestors,
        units,
        owner=owner,
        launchers=gpu_facts.DEFAULT_LAUNCHERS,
        protected=[],
    )
    # Only the loop is ended here: what is above it belongs to whoever runs the tests.
    mine = [r for r in restarters if r["info"].pid == loop.pid]
    assert [(r["why"], r["restarts"]) for r in mine] == [("a shell running the job", [worker.pid])]
    killed, survivors = gpu_ending.end_processes(
        [*mine, holder(worker)],
        grace=2,
        kill_timeout=2,
        poll_interval=0.01,
        alive=pp.still_there,
        send=gpu_ending.signal_process,
    )
    assert survivors == []
    assert sorted(k["pid"] for k in killed) == sorted([loop.pid, worker.pid])
    assert loop.wait(timeout=5) == -signal.SIGTERM
    time.sleep(0.2)  # time enough for a loop to start a new worker, if it still could
    assert in_session(loop.pid) == []  # no new worker: the loop was gone before its worker ended
