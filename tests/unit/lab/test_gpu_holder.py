"""The lab's GPU holder: a real process whose life decides whether the nvidia-smi stand-in counts its memory.

Reproduces capture-1.log's "hold memory, then kill" runs: a holder freed its memory on SIGTERM, one that ignored
SIGTERM kept it until SIGKILL. Waits poll the stand-in with a short deadline; every process is reaped. Issue 8 adds
the holders of jobs: a supervisor that starts its worker again when it dies, a worker whose forked child keeps the
GPU files.
"""

import contextlib
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import HOLDER, Lab, gpu_holder, gpulab, wait_until

from tests.conftest import unavailable


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
        unavailable("needs root and unshare(1) for a private pid + mount namespace")
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
        unavailable(f"cannot make namespaces here: {proc.stderr.read().strip()}")
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


# -- jobs that restart their workers, workers that fork (issue 8) -----------------------------------------------
UUID0 = "GPU-bf580366-c11c-e730-752a-e9ca8716b7fa"


def held_line(proc) -> list[str]:
    """The words of the holder's one line (`held <pid> ...`), read like Lab.hold reads it."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=20), "holder did not report"
    line = proc.stdout.readline()
    assert line.startswith("held "), f"holder failed: {line!r} {'' if line else proc.stderr.read()}"
    return line.split()


def ppid_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def kill_all(pids) -> None:
    """SIGKILL the processes the test started (by pid) that still run: workers a supervisor left behind."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def workers(lab) -> list[int]:
    """The live holders of GPU memory (a supervisor is registered too, without GPUs)."""
    return [h["pid"] for h in gpulab.live_holders(lab.state) if not h.get("supervisor")]


def registered(lab) -> list[int]:
    return gpulab.holder_pids(lab.state)


def test_fork_child_inherits_the_gpu_files_and_outlives_its_parent(lab, tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0"):  # regular files: O_PATH needs no driver
        (dev / name).write_text("")
    view = tmp_path / "view-dev.json"
    gpulab.write_view_config(
        view,
        "node",
        lab.state,
        kernel_version_file=str(lab.kernel_file),
        nvml_library_glob=str(lab.lib_dir / "libnvidia-ml.so.*"),
        dev_dir=str(dev),
    )
    proc = subprocess.Popen(
        [sys.executable, str(HOLDER), "--gpu", "0", "--mib", "100", "--fork-child"],
        env={**os.environ, gpulab.LAB_CONFIG_ENV: str(view)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lab.procs.append(proc)
    words = held_line(proc)
    worker, child = int(words[1]), int(words[3])
    try:
        assert (words[0], words[2], worker) == ("held", "child", proc.pid)  # the first word is the memory's holder
        assert ppid_of(child) == worker
        files = {str(p.readlink()) for p in Path(f"/proc/{child}/fd").iterdir() if p.readlink().parent == dev}
        assert files == {str(dev / n) for n in ("nvidiactl", "nvidia-uvm", "nvidia0")}
        assert lab.apps() == f"{worker}, {sys.executable}, 100 MiB, {UUID0}\n"  # NVML lists the worker only
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert proc.stdout.read() == ""  # the child does not hold the caller's pipe
        wait_until(lambda: lab.used() == "0 MiB\n")
        # The child lives on with the GPU files: only a /proc/*/fd scan can find it, and it must be ended too.
        assert proc_state(child) not in (None, "Z")
        assert {str(p.readlink()) for p in Path(f"/proc/{child}/fd").iterdir()} >= {str(dev / "nvidia0")}
    finally:
        kill_all([child])


def test_a_supervisor_starts_its_worker_again_when_it_dies(lab):
    supervisor = lab.start("--gpu", "0", "--mib", "100", "--supervise", "--restart-delay", "0")
    words = held_line(supervisor)
    first = int(words[1])
    try:
        assert words[2:] == ["supervisor", str(supervisor.pid)]
        assert ppid_of(first) == supervisor.pid
        assert workers(lab) == [first]  # the supervisor holds nothing itself...
        assert registered(lab) == [supervisor.pid, first]  # ...but is registered, so the lab's cleanup ends it first
        assert lab.used() == "109 MiB\n"
        os.kill(first, signal.SIGKILL)  # what a cleanup that ends only the worker does
        second = wait_until(lambda: [p for p in workers(lab) if p != first])[0]
        assert ppid_of(second) == supervisor.pid
        assert lab.apps() == f"{second}, {sys.executable}, 100 MiB, {UUID0}\n"
        # SIGTERM ends the supervisor (default action); its worker is left holding, and nothing restarts it.
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=10) == -signal.SIGTERM
        assert workers(lab) == [second]
        os.kill(second, signal.SIGKILL)
        wait_until(lambda: lab.used() == "0 MiB\n")
        time.sleep(0.3)
        assert workers(lab) == []
    finally:
        kill_all(registered(lab))


def test_a_supervisor_ignoring_sigterm_passes_that_on_and_only_sigkill_first_stops_the_restarts(lab):
    supervisor = lab.start("--gpu", "0", "--mib", "100", "--supervise", "--ignore-term", "--restart-delay", "0")
    worker = int(held_line(supervisor)[1])
    try:
        for pid in (supervisor.pid, worker):
            sig_ign = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigIgn"))
            assert int(sig_ign.split()[1], 16) & (1 << (signal.SIGTERM - 1)), pid
        supervisor.send_signal(signal.SIGTERM)
        os.kill(worker, signal.SIGTERM)
        time.sleep(0.2)
        assert (supervisor.poll(), workers(lab)) == (None, [worker])
        # The launcher first, then its worker: what the gpu_processes step does. Nothing is started again.
        supervisor.send_signal(signal.SIGKILL)
        assert supervisor.wait(timeout=10) == -signal.SIGKILL
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: lab.used() == "0 MiB\n")
        time.sleep(0.3)
        assert workers(lab) == []
    finally:
        kill_all(registered(lab))


def test_a_named_supervisor_looks_like_its_launcher_and_its_workers_like_python(lab):
    supervisor = lab.start("--gpu", "0", "--mib", "64", "--supervise", "--name", "torchrun", argv0="torchrun")
    worker = int(held_line(supervisor)[1])
    try:
        assert Path(f"/proc/{supervisor.pid}/comm").read_text() == "torchrun\n"
        assert Path(f"/proc/{supervisor.pid}/cmdline").read_bytes().split(b"\0")[0] == b"torchrun"
        assert Path(f"/proc/{worker}/comm").read_text() != "torchrun\n"
        assert Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")[1] == str(HOLDER).encode()
        assert b"--supervise" not in Path(f"/proc/{worker}/cmdline").read_bytes()
    finally:
        kill_all(registered(lab))


def test_a_supervisor_stops_after_max_restarts(lab):
    supervisor = lab.start("--gpu", "0", "--mib", "64", "--supervise", "--max-restarts", "1", "--restart-delay", "0")
    first = int(held_line(supervisor)[1])
    try:
        os.kill(first, signal.SIGKILL)
        second = wait_until(lambda: [p for p in workers(lab) if p != first])[0]
        os.kill(second, signal.SIGKILL)
        assert supervisor.wait(timeout=10) == 0  # its last worker was killed: it gives up
        assert workers(lab) == []
    finally:
        kill_all(registered(lab))


def test_a_supervisor_whose_first_worker_cannot_hold_fails_like_it(lab):
    refused = lab.start("--gpu", "7", "--mib", "1", "--supervise")
    assert refused.wait(timeout=20) == 2
    assert "no GPU '7'" in refused.stderr.read()
    assert refused.stdout.read() == ""


def test_supervisor_options_are_not_passed_to_the_worker():
    argv = ["--gpu", "0", "--supervise", "--name", "torchrun", "--max-restarts=3", "--mib", "5", "--ignore-term"]
    assert gpu_holder.worker_argv(argv) == ["--gpu", "0", "--mib", "5", "--ignore-term"]
    with pytest.raises(SystemExit):
        gpu_holder.parse_args(["--gpu", "0", "--mib", "5", "--max-restarts", "1"])  # needs --supervise
