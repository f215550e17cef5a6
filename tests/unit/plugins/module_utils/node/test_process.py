"""Node-side process knowledge (plugins/module_utils/node/process.py, process_job.py): cgroup owners, NSpid,
stat, device holders, protected names, a holder's job."""

import os
import subprocess
import sys
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process_job
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.facts import DEFAULT_LAUNCHERS

from tests.conftest import FIXTURES


@pytest.mark.parametrize(
    ("cgroup", "owner"),
    [
        ("0::/lxc/200/ns/.lxc\n", "ct:200"),  # pct exec into a Proxmox CT (cgroup2)
        ("12:pids:/lxc/200/ns\n0::/lxc/200/ns\n", "ct:200"),  # the CT's init, hybrid hierarchy
        ("0::/lxc/2000/ns/user.slice\n", "ct:2000"),
        ("0::/lxc.payload.web/init.scope\n", "lxc:web"),  # plain LXC
        ("0::/system.slice/docker-0123456789abcdef0123.scope\n", "docker:0123456789ab"),
        ("0::/docker/0123456789abcdef\n", "docker:0123456789ab"),
        ("0::/machine.slice/libpod-abcdefabcdef1234.scope/container\n", "podman:abcdefabcdef"),
        ("0::/kubepods.slice/kubepods-besteffort.slice/pod1.slice\n", "kubernetes"),
        ("0::/system.slice/nvidia-persistenced.service\n", "host"),
        ("0::/process_api/c78e463df76334121038f5dac0773009\n", "host"),  # the H200 capture's own process
        ("0::/lxc.monitor/200\n", "host"),  # the CT's monitor runs on the node, not in the CT
        ("", "host"),
        # Other container runtimes on a bare host (issue 8): never the host's own.
        ("0::/machine.slice/systemd-nspawn@train.service/payload/system.slice/x.service\n", "nspawn:train"),
        ("0::/machine.slice/systemd-nspawn@train.service\n", "nspawn:train"),
        ("0::/system.slice/containerd.service/9f86d081884c7d659a2feaa0c55ad015\n", "containerd:9f86d081884c"),
        ("0::/system.slice/containerd.service/runner-7\n", "containerd:runner-7"),
        ("0::/k8s.io/4e07408562bedb8b60ce05c1decfe3ad16b72230967de01f640b7e4729b49fce\n", "containerd:4e07408562be"),
        (
            "0::/system.slice/cri-containerd-4e07408562bedb8b60ce05c1decfe3ad16b72230967de01f.scope\n",
            "containerd:4e07408562be",
        ),
        ("0::/lxc.payload.web/system.slice/train.service\n", "lxc:web"),  # Incus / LXC 4+
        ("0::/lxc/web/init.scope\n", "lxc:web"),  # older LXC on a host that is no Proxmox node
        ("0::/lxc.payload.a b$(x)/init.scope\n", "lxc:a?b??x?"),  # a name goes into messages: safe characters only
        ("0::/system.slice/containerd.service\n", "host"),  # the daemon and its shims are the host's
        ("0::/machine.slice/libpod-conmon-abcdefabcdef1234.scope\n", "host"),  # Podman's monitor, not the container
    ],
)
def test_cgroup_owner(cgroup, owner):
    assert pp.parse_cgroup_owner(cgroup) == owner


@pytest.mark.parametrize(
    ("cgroup", "path"),
    [
        ("0::/lxc/200/ns/system.slice/train.service\n", "/lxc/200/ns/system.slice/train.service"),
        (
            "12:pids:/lxc/200\n1:name=systemd:/lxc/200/ns/system.slice/x.service\n0::/\n",
            "/lxc/200/ns/system.slice/x.service",
        ),
        ("4:memory:/user.slice\n", "/user.slice"),
        ("", ""),
    ],
)
def test_cgroup_path(cgroup, path):
    assert pp.parse_cgroup_path(cgroup) == path


def test_ppid_from_stat_with_parentheses_in_comm():
    assert pp.parse_ppid("516 (a) b) (c) S 500 516 500 0 -1 4194560") == 500
    assert pp.parse_ppid("garbage") == 0


@pytest.mark.parametrize(
    ("path", "owner", "unit"),
    [
        (
            "/lxc/200/ns/system.slice/train.service",
            "ct:200",
            {"name": "train.service", "valid": True, "path": "/lxc/200/ns/system.slice/train.service", "user": None},
        ),
        (
            "/lxc/200/ns/system.slice/train.service/worker",
            "ct:200",  # Delegate=yes: a cgroup below the unit's
            {"name": "train.service", "valid": True, "path": "/lxc/200/ns/system.slice/train.service", "user": None},
        ),
        (
            "/system.slice/train@3.service",
            "host",
            {"name": "train@3.service", "valid": True, "path": "/system.slice/train@3.service", "user": None},
        ),
        (
            "/user.slice/user-1000.slice/user@1000.service/app.slice/train.service",
            "host",
            {
                "name": "train.service",
                "valid": True,
                "path": "/user.slice/user-1000.slice/user@1000.service/app.slice/train.service",
                "user": 1000,
            },
        ),
        (
            "/lxc/200/ns/system.slice/x;reboot;.service",
            "ct:200",
            {
                "name": "x;reboot;.service",
                "valid": False,
                "path": "/lxc/200/ns/system.slice/x;reboot;.service",
                "user": None,
            },
        ),
        (
            "/lxc/200/ns/system.slice/a\\x2db.service",
            "ct:200",  # systemd's escape is no plain name either
            {
                "name": "a\\x2db.service",
                "valid": False,
                "path": "/lxc/200/ns/system.slice/a\\x2db.service",
                "user": None,
            },
        ),
    ],
)
def test_systemd_unit(path, owner, unit):
    assert process_job.systemd_unit(path, owner) == unit


@pytest.mark.parametrize(
    ("path", "owner"),
    [
        ("/lxc/200/ns/.lxc", "ct:200"),  # pct exec
        ("/lxc/200/ns/user.slice/user-0.slice/session-3.scope", "ct:200"),  # a login session
        ("/lxc/200/ns/system.slice/ssh.service", "ct:200"),  # sshd without pam_systemd keeps logins in its unit
        ("/lxc/200/ns/system.slice/cron.service", "ct:200"),
        ("/lxc/200/ns/system.slice/container-getty@1.service", "ct:200"),
        ("/lxc/201/ns/system.slice/train.service", "ct:200"),  # another CT's: never ours to name
        ("/lxc/200/system.slice/train.service", "ct:200"),  # outside the CT's own systemd (ns)
        ("/user.slice/user-1000.slice/user@1000.service/init.scope", "host"),  # the user manager itself
        ("/system.slice/train.service", "docker:0123456789ab"),
        ("", "host"),
    ],
)
def test_no_systemd_unit(path, owner):
    assert process_job.systemd_unit(path, owner) is None


def test_unit_members_and_whose_job_a_service_is(tmp_path):
    unit = tmp_path / "cg" / "system.slice" / "train.service"
    (unit / "worker").mkdir(parents=True)
    (unit / "cgroup.procs").write_text("100\n")
    (unit / "worker" / "cgroup.procs").write_text("516\n999\n")  # 999 is gone
    for pid, start in ((100, 5), (516, 10)):
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "stat").write_text(f"{pid} (x) S 1 " + "1 " * 17 + f"{start} 0\n")
    members = pp.read_unit_members("/system.slice/train.service", (str(tmp_path / "cg"),), str(tmp_path / "proc"))
    assert members == [(100, 5), (516, 10)]
    assert pp.read_unit_members("/system.slice/none.service", (str(tmp_path / "cg"),)) is None

    def info(pid, start):
        return pp.ProcessInfo(pid, pid, "python3", "S", "host", [], start)

    # The job's oldest is the service's main.
    assert process_job.unit_is_job(members, [info(516, 10), info(100, 5)])
    # The service's main (a CI runner) is not in the job.
    assert not process_job.unit_is_job(members, [info(516, 10)])
    # Pid 100 reused: not the same process.
    assert not process_job.unit_is_job(members, [info(516, 10), info(100, 6)])
    # Unreadable: counted as the job's (nothing ended, named).
    assert process_job.unit_is_job(None, [info(516, 10)])


def shell(*argv, comm="bash"):
    return pp.ProcessInfo(pid=9, ns_pid=9, comm=comm, state="S", owner="ct:200", cmdline=list(argv), start_time=1)


@pytest.mark.parametrize(
    ("argv", "interactive"),
    [
        (["-bash"], True),  # a login shell
        (["-sh"], True),
        (["bash"], True),  # a terminal's shell (tmux, screen, su)
        (["/bin/bash", "-i"], True),
        (["bash", "--login"], True),
        (["bash", "--rcfile", "x.rc"], True),  # the option's argument is no script
        ([], True),  # argv unreadable: never taken for a job
        (["bash", "-c", "while true; do python train.py; done"], False),
        (["/bin/sh", "-ec", "python train.py"], False),
        (["bash", "-o", "pipefail", "-c", "x"], False),
        (["bash", "run.sh"], False),
        (["sh", "-e", "/opt/train/loop.sh", "--epochs", "3"], False),
        (["bash", "--", "run.sh"], False),
    ],
)
def test_interactive_shells(argv, interactive):
    assert process_job.is_interactive_shell(shell(*argv)) is interactive


@pytest.mark.parametrize(
    ("comm", "argv", "matched"),
    [
        ("torchrun", ["/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc-per-node", "8", "train.py"], "torchrun"),
        ("python3", ["python3", "-m", "torch.distributed.run", "train.py"], "torch.distributed.run"),
        ("python3", ["/usr/bin/python3", "-u", "-mtorch.distributed.launch", "t.py"], "torch.distributed.launch"),
        ("python", ["python", "-m", "torch.distributed.elastic.agent.server.api"], "torch.distributed.elastic*"),
        ("accelerate", ["/venv/bin/python", "/venv/bin/accelerate", "launch", "t.py"], "accelerate"),
        ("python3", ["python3", "/venv/bin/deepspeed", "t.py"], "deepspeed"),
        ("python3", ["python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x"], "deepspeed.launcher*"),
        ("python3", ["python3", "train.py", "-m", "torchrun"], None),  # train.py's own arguments do not count
        ("python3", ["python3", "-c", "import torchrun"], None),
        ("bash", ["bash", "torchrun"], None),  # only an interpreter's script names the program
    ],
)
def test_launcher_names(comm, argv, matched):
    info = pp.ProcessInfo(pid=1, ns_pid=1, comm=comm, state="S", owner="host", cmdline=argv, start_time=1)
    assert process_job.matches_launcher(info, DEFAULT_LAUNCHERS) == matched


@pytest.mark.parametrize(
    ("info", "stop"),
    [
        (pp.ProcessInfo(50, 1, "systemd", "S", "ct:200", ["/sbin/init"], 1), "is the init of its pid namespace"),
        (pp.ProcessInfo(1, 1, "systemd", "S", "host", ["/sbin/init"], 1), "belongs to another owner"),
        (pp.ProcessInfo(60, 5, "bash", "S", "ct:200", ["-bash"], 1), "is an interactive shell"),
        (pp.ProcessInfo(61, 6, "sshd", "S", "ct:200", ["sshd: root@pts/0"], 1), "starts sessions or services"),
        (pp.ProcessInfo(62, 7, "tmux: server", "S", "ct:200", ["tmux"], 1), "starts sessions or services"),
        (pp.ProcessInfo(63, 8, "nv-hostengine", "S", "ct:200", ["nv-hostengine"], 1), "is protected"),
        (pp.ProcessInfo(64, 9, "bash", "S", "ct:200", ["bash", "-c", "while :; do x; done"], 1), None),
        (pp.ProcessInfo(65, 10, "sudo", "S", "ct:200", ["sudo", "python3", "t.py"], 1), None),
        (None, "is gone"),
    ],
)
def test_where_a_walk_up_the_parents_stops(info, stop):
    assert process_job.walk_stop(info, "ct:200", ["nv-hostengine"]) == stop


def test_nspid_outermost_first():
    assert pp.parse_status_nspid("Name:\tpython3\nNSpid:\t20430\t51\n") == [20430, 51]
    assert pp.parse_status_nspid("Name:\tpython3\n") == []


def test_stat_with_spaces_and_parentheses_in_comm():
    fields = " ".join(["S", *map(str, range(4, 22)), "123456", "0"])
    comm, state, start = pp.parse_stat(f"77 (my (weird) name) {fields}")
    assert (comm, state, start) == ("my (weird) name", "S", 123456)
    assert pp.parse_stat("garbage") is None


def test_proc_devices_majors():
    text = (
        "Character devices:\n  1 mem\n195 nvidia-frontend\n238 nvidia-uvm\n241 nvidia-caps\n\n"
        "Block devices:\n259 blkext\n"
    )
    assert pp.parse_proc_devices(text) == {195, 238, 241}
    assert pp.parse_proc_devices("") == {195}


def test_describe_state():
    assert pp.describe_state("D") == "uninterruptible (disk sleep)"
    assert pp.describe_state("?") == "?"


@pytest.mark.parametrize(
    ("comm", "argv0", "patterns", "matched"),
    [
        ("nvidia-persiste", "/usr/bin/nvidia-persistenced", ["nvidia-persistenced"], "nvidia-persistenced"),
        ("nvidia-persiste", "nvidia-persistenced", ["nvidia-persistenced"], "nvidia-persistenced"),
        ("dcgm-exporter", "/usr/bin/dcgm-exporter", ["nv-hostengine", "dcgm*"], "dcgm*"),
        ("nv-hostengine", "nv-hostengine", ["nv-hostengine"], "nv-hostengine"),
        ("python3", "python3", ["nvidia-persistenced", "dcgm*"], None),
        ("python3", "/opt/nvidia-persistenced-fake/bin/python3", ["nvidia-persistenced"], None),
    ],
)
def test_protected_names(comm, argv0, patterns, matched):
    info = pp.ProcessInfo(pid=1, ns_pid=1, comm=comm, state="S", owner="host", cmdline=[argv0], start_time=1)
    assert pp.matches_name(info, patterns) == matched


def test_owner_labels():
    assert pp.owner_label("nspawn:train", "gpu1") == "systemd-nspawn container train"
    assert pp.owner_label("containerd:9f86d081884c", "gpu1") == "containerd container 9f86d081884c"
    assert pp.owner_label("lxc:web", "gpu1") == "LXC container web"
    assert pp.owner_label("ct:201", "pve1") == "CT 201"
    assert pp.owner_label("host", "pve1") == "node pve1 itself"
    assert pp.owner_label("docker:0123456789ab", "gpu1") == "Docker container 0123456789ab"
    assert pp.owner_label("kubernetes", "gpu1") == "a Kubernetes pod"


# -- real processes --------------------------------------------------------------------------------------------
def test_read_process_of_this_process():
    info = pp.read_process(os.getpid())
    assert info.pid == os.getpid()
    assert info.state in ("R", "S")
    assert info.start_time > 0
    assert info.cmdline


def test_a_gone_process_reads_as_none():
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    assert pp.read_process(child.pid) is None


def test_a_zombie_is_not_there_any_more():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    info = pp.read_process(child.pid)
    assert pp.still_there(info)
    child.stdin.close()  # it exits; Popen does not reap it until wait(), so it stays a zombie meanwhile
    deadline = time.monotonic() + 10
    while pp.read_process(child.pid).state != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pp.read_process(child.pid).state == "Z"
    assert not pp.still_there(info)  # a zombie has released its files, and with them its GPU memory
    child.wait()


def test_device_fds_of_a_real_process_without_gpu_files_is_empty():
    with open(os.devnull, "rb"):
        assert pp.device_fds(os.getpid()) == []


def test_proc_devices_of_the_h200_machine():
    # bench/hardware_run.sh, 2026-12-02: `grep -i nvidia /proc/devices` on an H200 with the open kernel module.
    text = (FIXTURES / "h200" / "proc_devices_nvidia.txt").read_text()
    assert pp.parse_proc_devices(text) == {195, 238, 239, 240, 241, 242}
