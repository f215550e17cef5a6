"""The lab's GPU holder: a real process whose life decides whether the nvidia-smi stand-in counts its memory.

Reproduces capture-1.log's "hold memory, then kill" runs: a holder freed its memory on SIGTERM, one that ignored
SIGTERM kept it until SIGKILL. Waits poll the stand-in with a short deadline; every process is reaped.
"""

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import HOLDER, Lab, gpu_holder, gpulab, wait_until


def proc_state(pid: int) -> str | None:
    stat = gpulab.read_proc_stat("/proc", pid)
    return stat[0] if stat else None


@pytest.fixture
def lab(lab):
    """The shared lab of conftest.py, with capture-1's H200 written to its state."""
    gpulab.write_fixture_config(lab.state)
    return lab


def test_sigterm_frees_memory(lab):
    proc, pid = lab.hold("--gpu", "0", "--mib", "20998")
    assert pid == proc.pid  # on the node the host pid is its own pid
    assert lab.used() == "21007 MiB\n"
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: lab.used() == "0 MiB\n")
    assert proc.wait(timeout=10) == -signal.SIGTERM  # killed by the default action, as exit=143 in the capture
    assert proc.stdout.read() == ""  # "held" was the one and only line
    assert lab.apps() == ""
    assert list((lab.state / "holders").glob("*.json")) == []  # the dead holder's file is pruned


def test_ignore_term_survives_until_sigkill(lab):
    proc, pid = lab.hold("--gpu", "0", "--mib", "20998", "--ignore-term")
    sig_ign = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn"))
    assert int(sig_ign.split()[1], 16) & (1 << (signal.SIGTERM - 1))
    # An ignored signal is discarded when it is sent, so the process is still there right after kill().
    proc.send_signal(signal.SIGTERM)
    assert proc.poll() is None
    assert proc_state(pid) not in (None, "Z")
    assert lab.used() == "21007 MiB\n"
    proc.send_signal(signal.SIGKILL)
    wait_until(lambda: lab.used() == "0 MiB\n")
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_zombie_counts_as_freed(lab):
    proc, pid = lab.hold("--gpu", "0", "--mib", "20998")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: proc_state(pid) == "Z")  # dead but not reaped: the pid still exists under /proc
    assert lab.used() == "0 MiB\n"
    assert lab.apps() == ""
    assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.parametrize(
    ("name", "comm"),
    [
        ("nvidia-persistenced", "nvidia-persiste"),
        ("nv-hostengine", "nv-hostengine"),
        ("nv-fabricmanager", "nv-fabricmanage"),
    ],
)
def test_name_sets_comm_and_argv0(lab, name, comm):
    proc, pid = lab.hold("--gpu", "0", "--mib", "64", "--name", name)
    assert pid == proc.pid  # the re-exec keeps the pid
    assert Path(f"/proc/{pid}/comm").read_text() == f"{comm}\n"
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == name.encode()
    assert lab.apps() == f"{pid}, {name}, 64 MiB, GPU-bf580366-c11c-e730-752a-e9ca8716b7fa\n"


def test_holder_on_several_gpus_of_a_container_view(tmp_path):
    lab = Lab(tmp_path)
    config = gpulab.write_config(lab.state, 4, views={"ct200": [1, 3]})
    uuids = [g["uuid"] for g in config["gpus"]]
    try:
        _, pid = lab.hold("--gpu", "0", "--gpu", uuids[3], "--mib", "100", view="ct200")
        apps = lab.smi_stdout("--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader", view="ct200")
        assert apps == f"{pid}, {uuids[1]}, 100 MiB\n{pid}, {uuids[3]}, 100 MiB\n"
        assert lab.smi_stdout("--query-gpu=memory.used", "--format=csv,noheader,nounits") == "0\n109\n0\n109\n"
        registration = gpulab.live_holders(lab.state)[0]
        assert (registration["pid"], registration["view"], registration["gpus"]) == (
            pid,
            "ct200",
            {uuids[1]: 100, uuids[3]: 100},
        )
        refused = lab.start("--gpu", "2", "--mib", "1", view="ct200")  # the view has GPUs 0 and 1 only
        assert refused.wait(timeout=20) == 2
        assert "no GPU '2' in view 'ct200'" in refused.stderr.read()
    finally:
        lab.close()


def test_refuses_like_cuda_when_it_cannot_hold(lab):
    gpulab.set_leak(lab.state, 0, 143000)
    oom = lab.start("--gpu", "0", "--mib", "1000")
    assert oom.wait(timeout=20) == 1
    assert "out of memory" in oom.stderr.read()
    gpulab.clear_leaks(lab.state)

    gpulab.set_fault(lab.state, "node", "gpu_lost")
    lost = lab.start("--gpu", "0", "--mib", "1000")
    assert lost.wait(timeout=20) == 1
    assert "is lost" in lost.stderr.read()
    gpulab.clear_faults(lab.state)

    lab.kernel_file.unlink()
    no_driver = lab.start("--gpu", "0", "--mib", "1000")
    assert no_driver.wait(timeout=20) == 1
    assert "couldn't communicate with the NVIDIA driver" in no_driver.stderr.read()
    assert no_driver.stdout.read() == ""


def test_pid_reuse_is_not_the_holder(lab):
    """A registration whose start time does not match the live pid is a dead holder whose pid was reused."""
    state, start = gpulab.read_proc_stat("/proc", os.getpid())
    assert state != "Z"
    uuid = "GPU-bf580366-c11c-e730-752a-e9ca8716b7fa"
    stale = gpulab.register_holder(lab.state, os.getpid(), start - 1, {uuid: 500})
    assert lab.used() == "0 MiB\n"
    assert not stale.exists()
    gpulab.register_holder(lab.state, os.getpid(), start, {uuid: 500})
    assert lab.used() == "509 MiB\n"
    gpulab.clear_holders(lab.state)
    assert lab.used() == "0 MiB\n"


def test_device_files_are_held_open(tmp_path):
    """O_PATH descriptors on nvidiactl, nvidia-uvm and nvidia<minor>, so /proc/*/fd scans and fuser see them."""
    for name in ("nvidiactl", "nvidia-uvm", "nvidia5"):
        (tmp_path / name).write_text("")
    gpus = [gpulab.GpuView(0, {"uuid": "GPU-x"}, 5), gpulab.GpuView(1, {"uuid": "GPU-y"}, 6)]  # nvidia6 is absent
    fds = gpu_holder.open_device_files(gpus, dev_dir=str(tmp_path))
    try:
        targets = [str(Path(f"/proc/self/fd/{fd}").readlink()) for fd in fds]
        assert targets == [str(tmp_path / n) for n in ("nvidiactl", "nvidia-uvm", "nvidia5")]
    finally:
        for fd in fds:
            os.close(fd)


def test_find_host_pid_in_a_container(tmp_path):
    """Inside a container the host entry is the one whose NSpid ends with our pid AND shares our pid namespace."""
    me = os.getpid()
    my_ns = str(Path("/proc/self/ns/pid").readlink())
    for pid, ns in ((4242, "pid:[1]"), (5151, my_ns)):  # 4242: same local pid in another container
        entry = tmp_path / str(pid)
        (entry / "ns").mkdir(parents=True)
        (entry / "status").write_text(f"Name:\tpython3\nNSpid:\t{pid}\t{me}\n")
        (entry / "ns" / "pid").symlink_to(ns)
    (tmp_path / "77").mkdir()  # an entry we may not read
    assert gpulab.find_host_pid(tmp_path) == 5151
    assert gpulab.find_host_pid("/proc") == me
    (tmp_path / "5151" / "ns" / "pid").unlink()
    with pytest.raises(LookupError):
        gpulab.find_host_pid(tmp_path)


def test_holder_in_a_pid_namespace_registers_its_host_pid(lab, tmp_path):
    """Like a holder in a container: its own pid is namespaced, the host's /proc is bind-mounted elsewhere."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a private pid + mount namespace")
    hostproc = tmp_path / "hostproc"
    hostproc.mkdir()
    view = tmp_path / "view-pidns.json"
    gpulab.write_view_config(
        view,
        "node",
        lab.state,
        proc_root=str(hostproc),
        kernel_version_file=str(lab.kernel_file),
        nvml_library_glob=str(lab.lib_dir / "libnvidia-ml.so.*"),
    )
    # sh stays pid 1 of the namespace (pid 1 would ignore SIGTERM); the holder is its child.
    script = (
        f"mount --bind /proc {shlex.quote(str(hostproc))} && mount -t proc proc /proc && "
        f"{shlex.quote(sys.executable)} {shlex.quote(str(HOLDER))} --gpu 0 --mib 77"
    )
    proc = subprocess.Popen(
        [unshare, "--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c", script],
        env={**os.environ, gpulab.LAB_CONFIG_ENV: str(view)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lab.procs.append(proc)
    line = proc.stdout.readline()
    if not line:
        pytest.skip(f"cannot make namespaces here: {proc.stderr.read().strip()}")
    host_pid = int(line.split()[1])
    try:
        nspid = next(x for x in Path(f"/proc/{host_pid}/status").read_text().splitlines() if x.startswith("NSpid"))
        outer, inner = nspid.split()[1:]  # host pid first, then the pid inside the namespace
        assert (outer, int(inner) < 10) == (str(host_pid), True)
        assert lab.apps() == f"{host_pid}, {sys.executable}, 77 MiB, GPU-bf580366-c11c-e730-752a-e9ca8716b7fa\n"
        os.kill(host_pid, signal.SIGTERM)
        wait_until(lambda: lab.used() == "0 MiB\n")
        assert proc.wait(timeout=10) != 0  # the namespace ended with the holder
    finally:
        if gpulab.read_proc_stat("/proc", host_pid):
            os.kill(host_pid, signal.SIGKILL)
