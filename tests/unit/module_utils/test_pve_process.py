"""Node-side process knowledge: cgroup owners, NSpid, stat, device holders, protected names."""

import os
import subprocess
import sys
import time

import pytest
from ansible.module_utils import pve_process as pp

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
    ],
)
def test_cgroup_owner(cgroup, owner):
    assert pp.parse_cgroup_owner(cgroup) == owner


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


def test_device_fds_compare_devices_not_paths():
    # /dev/null is a character device of major 1: a holder of it is found when 1 counts as a GPU major.
    with open(os.devnull, "rb"):
        holders = pp.device_fds(os.getpid(), {1})
    assert (1, 3) in holders
    assert pp.device_fds(os.getpid(), {195}) == []


def test_proc_devices_of_the_h200_machine():
    # bench/hardware_run.sh, 2026-12-02: `grep -i nvidia /proc/devices` on an H200 with the open kernel module.
    text = (FIXTURES / "h200" / "proc_devices_nvidia.txt").read_text()
    assert pp.parse_proc_devices(text) == {195, 238, 239, 240, 241, 242}
