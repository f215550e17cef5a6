#!/usr/bin/python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Build, break and tear down the pve-gpu-recover lab: a Proxmox VE node as real as this machine allows.

* Real privileged LXC containers (CT 200 with eight GPUs, CT 201 beside it) from a cached debootstrap rootfs,
  placed in cgroup ``lxc/<vmid>/ns`` like Proxmox does, each with its own pid namespace.
* A real sshd on 127.0.0.1 playing the Proxmox node, in a private mount namespace where ``/usr/sbin`` carries
  the ``pct`` and ``nvidia-smi`` stand-ins and ``/proc/driver/nvidia/version`` the "kernel module" version.
* GPUs are the one thing that cannot be real: the nvidia-smi stand-in (standins/nvidia_smi.py) answers from a
  state shared by node and CTs in the H200 formats of tests/fixtures/h200, and standins/gpu_holder.py starts
  real processes that "hold" GPU memory until they die.

Everything lives under LAB_DIR (default /var/lib/pve-gpu-recover-lab); the rootfs cache under CACHE_DIR (default
/var/cache/pve-gpu-recover-lab) survives ``destroy`` so a second ``create`` takes seconds. Run as root.

Several nodes can run side by side (tests/lab/fleet.py builds them): the environment names the node,
PVE_GPU_LAB_NODE (default pve-lab), PVE_GPU_LAB_SSH_PORT (required for any other node), PVE_GPU_LAB_DIR (default
/var/lib/pve-gpu-recover-lab-<node> for one), and ``create --ct`` its CTs (vmids unique on the machine). Each command
acts on that node only; one machine-wide lock keeps two labctl from changing LXC and cgroups at once.

    labctl.py create [--ct VMID:GPUS ...] [--gpus N]
                                build (or repair) the node; idempotent
    labctl.py destroy           stop and remove the node but the rootfs cache; checks nothing of it is left behind
    labctl.py status            what runs
    labctl.py inventory         the Ansible inventory of the lab (YAML)
    labctl.py stop-ct VMID / start-ct VMID
    labctl.py stop-node / start-node    the node's sshd and its sessions down (unreachable) / up again
    labctl.py fault VIEW MODE [--gpu N]   break it: driver_mismatch, driver_not_loaded, no_nvml, gpu_lost,
                                          inforom, no_permission, no_devices
    labctl.py repair            undo every fault
    labctl.py hold WHERE --gpu N [--gpu N] --mib M [--ignore-term] [--name NAME]
                                start a GPU holder in WHERE (ct200, ct201 or node); prints its host pid
    labctl.py freeze PID / thaw put a process in state D (cgroup freezer) / let it go
    labctl.py leak --gpu N --mib M   GPU memory held by no process (repair clears it)
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STANDINS = os.path.join(HERE, "standins")
sys.path.insert(0, STANDINS)
import gpulab  # noqa: E402  (the stand-ins' shared state library lives beside this script)

DEFAULT_NODE = "pve-lab"
DEFAULT_LAB_DIR = "/var/lib/pve-gpu-recover-lab"
# One lock for every node on this machine: vmids, cgroups and the freezer are the machine's, whichever node changes
# them (the default lab's lock path, so a labctl of an older checkout waits for this one too).
MACHINE_LOCK = f"{DEFAULT_LAB_DIR}.lock"
NODE_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,30}")


def node_settings(environ):
    """The node this labctl builds, from the environment: the default lab (pve-lab on 2222) or another node.

    Names that are global on the machine are derived from the node name, so nodes coexist: the lab directory, the
    frozen cgroup, the GPU UUIDs and serials, and the node's /run/lock (a directory of its own, mounted over
    /run/lock in its namespace, as each real node has its own). The default node keeps every name it always had
    (the molecule scenarios read its paths and its lock directory on the machine's /run/lock).
    """
    node = environ.get("PVE_GPU_LAB_NODE", DEFAULT_NODE)
    if not NODE_NAME_PATTERN.fullmatch(node):
        raise ValueError(f"PVE_GPU_LAB_NODE must be a host name of lower-case letters, digits and '-', got {node!r}")
    default = node == DEFAULT_NODE
    port = environ.get("PVE_GPU_LAB_SSH_PORT", "2222" if default else None)
    if port is None:
        raise ValueError(f"node {node} needs its own PVE_GPU_LAB_SSH_PORT (2222 is the default lab's)")
    return {
        "node": node,
        "lab_dir": environ.get("PVE_GPU_LAB_DIR", DEFAULT_LAB_DIR if default else f"{DEFAULT_LAB_DIR}-{node}"),
        "ssh_port": int(port),
        "frozen_cgroup": "pgr-frozen" if default else f"pgr-frozen-{node}",
        # None: the GPUs the default lab always had; a name: GPUs (UUIDs, serials) of that node only.
        "gpu_seed": None if default else node,
        "private_run_lock": not default,
    }


try:
    NODE = node_settings(os.environ)
except ValueError as error:
    sys.exit(f"labctl: {error}")
LAB_DIR = NODE["lab_dir"]
CACHE_DIR = os.environ.get("PVE_GPU_LAB_CACHE", "/var/cache/pve-gpu-recover-lab")
SSH_PORT = NODE["ssh_port"]
NODE_NAME = NODE["node"]
DRIVER_VERSION = "580.159.04"
MISMATCHED_LIBRARY = "580.95.05"
SUITE = "bookworm"
# What the CT rootfs needs now: python3 for probes and venvs, git (and Debian's git-lfs: a training repository on
# LFS, molecule/training_code) for the training code, procps/psmisc for people. The cache is keyed by this list.
PACKAGES = ("python3", "python3-venv", "git", "git-lfs", "psmisc", "procps", "ca-certificates", "coreutils")
RECIPE_VERSION = "1"  # bump when the rootfs recipe changes so the cache is rebuilt
# CTs of the lab: CT 200 is the training container with eight GPUs; CT 201 is a neighbour with two GPUs of its
# own (the node has ten), whose processes recovery of CT 200 must never touch. CT 201 gets them in reverse order
# (its GPU 0 is the node's GPU 9), as Proxmox passes GPUs by the order of the CT's config: the project matches GPUs
# by UUID, never by index, and the lab keeps that honest.
DEFAULT_CTS = {200: list(range(8)), 201: [9, 8]}
CT_LIB = "/usr/local/lib/pve-gpu-lab"
CT_STATE = "/run/pve-gpu-lab/gpu"
CT_HOSTPROC = "/run/pve-gpu-lab/hostproc"
NVML_DIR = "usr/lib/x86_64-linux-gnu"
CT_INDEX = "/srv/pve-gpu-lab/index"
INDEX_PID = "/run/pve-gpu-lab-index.pid"
# In the CT: what an HTTPS index with a login is given (its key, certificate and user:password), root's alone.
INDEX_FILES = "/run/pve-gpu-lab-index"
UVM_MAJOR = 238  # the fixture machine's dynamic nvidia-uvm major


def path(*parts):
    return os.path.join(LAB_DIR, *parts)


def log(message):
    print(f"labctl: {message}", file=sys.stderr, flush=True)


def run(argv, check=True, **kwargs):
    return subprocess.run(argv, check=check, text=True, **kwargs)


def write(file, content, mode=0o644):
    os.makedirs(os.path.dirname(file), exist_ok=True)
    with open(file, "w", encoding="utf-8") as handle:
        handle.write(content)
    os.chmod(file, mode)


@contextlib.contextmanager
def lab_lock():
    """One labctl at a time on this machine, whatever its node (two molecule runs at once would clash on cgroup
    lxc/200; two nodes' creates on the rootfs cache and the cgroup parents)."""
    os.makedirs(os.path.dirname(MACHINE_LOCK), exist_ok=True)
    with open(MACHINE_LOCK, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# -- rootfs cache ------------------------------------------------------------------------------------------
def debian_mirror():
    """The Debian mirror this machine's apt already uses (LAB-NOTES: debootstrap works against it)."""
    for source in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        with open(source, encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("URIs:") and line.rstrip().endswith("/debian"):
                    return line.split(None, 1)[1].strip()
    return "http://deb.debian.org/debian"


def rootfs_cache():
    """Path of the cached rootfs, built once per recipe (debootstrap about 40 s) and reused by every create."""
    key = hashlib.sha256(f"{RECIPE_VERSION} {SUITE} {' '.join(PACKAGES)}".encode()).hexdigest()[:12]
    rootfs = os.path.join(CACHE_DIR, f"rootfs-{SUITE}-{key}")
    if os.path.exists(os.path.join(rootfs, ".complete")):
        return rootfs
    building = f"{rootfs}.building"
    shutil.rmtree(building, ignore_errors=True)
    os.makedirs(CACHE_DIR, exist_ok=True)
    log(f"building the CT rootfs cache {rootfs} with debootstrap (once; about a minute)")
    run(
        ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, building, debian_mirror()],
        stdout=subprocess.DEVNULL,
    )
    # The rootfs inherits this machine's hostname and an unreachable nameserver; both make commands wait 10 s.
    write(os.path.join(building, "etc/resolv.conf"), "")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(building, "etc/hostname"))
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", os.path.join(building, "etc/ssl/certs/ca-certificates.crt"))
    run(["chroot", building, "apt-get", "clean"])
    write(os.path.join(building, ".complete"), f"{SUITE} {' '.join(PACKAGES)}\n")
    shutil.rmtree(rootfs, ignore_errors=True)
    os.rename(building, rootfs)
    return rootfs


# -- GPU state, stand-ins ------------------------------------------------------------------------------------
def ct_views(cts):
    return {f"ct{vmid}": gpus for vmid, gpus in cts.items()}


def node_gpu_count(cts, gpus=None):
    """The node's GPU count: ``gpus`` when given (at least every index the CTs name), else eight or as many as the
    CTs name."""
    named = max([0, *(max(g) + 1 for g in cts.values() if g)])
    if gpus is not None and gpus < named:
        raise ValueError(f"the CTs name GPU index {named - 1}, but the node has {gpus} GPUs")
    return gpus if gpus is not None else max(8, named)


def install_standins(cts, gpu_count):
    """Copy the stand-ins into the lab and write the node's wrappers and view config."""
    shutil.rmtree(path("standins"), ignore_errors=True)
    shutil.copytree(STANDINS, path("standins"), ignore=shutil.ignore_patterns("__pycache__"))
    compileall.compile_dir(path("standins"), quiet=1)  # their bytecode, for the CTs that mount them read-only
    state = path("gpu")
    if not os.path.exists(os.path.join(state, "config.json")):
        gpus = gpulab.make_gpus(gpu_count, node=NODE["gpu_seed"])
        gpulab.write_config(state, views=ct_views(cts), gpus=gpus)
    node_config = {
        "view": "node",
        "state_dir": state,
        "proc_root": "/proc",
        "kernel_version_file": "/proc/driver/nvidia/version",
        "nvml_library_glob": path("node/lib/libnvidia-ml.so.*"),
    }
    write(path("node/standin.json"), json.dumps(node_config, indent=1))
    write(
        path("node/pct.json"),
        json.dumps({"lxcpath": path("lxc"), "node": NODE_NAME, "log": path("pct-calls.log")}, indent=1),
    )
    write(path("node/bin/nvidia-smi"), wrapper(path("node/standin.json"), path("standins")), 0o755)
    write(
        path("node/bin/pct"),
        f'#!/bin/sh\nPVE_GPU_LAB_PCT={path("node/pct.json")} exec /usr/bin/python3 {path("standins/pct.py")} "$@"\n',
        0o755,
    )
    write(path("node/lib", f"libnvidia-ml.so.{DRIVER_VERSION}"), "placeholder of the NVIDIA userspace library\n")
    if not os.path.exists(path("node/proc-driver/nvidia/version")):
        write_kernel_version(DRIVER_VERSION)


def wrapper(config, directory):
    """The executable of the nvidia-smi stand-in in ``directory``: its ``main()`` imported, not the file run as a
    script, so that its bytecode comes from the directory's __pycache__ (install_standins writes it; a CT sees the
    directory read-only, where Python could never write it). Run as a script, it was compiled from its 48 KB of
    source on every call, a cost the real program (compiled, about 23 ms of wall time per call on the H200) has
    not: about 2 ms of each call's CPU in a CT (docs/benchmarks.md, the fleet)."""
    program = f'import sys; sys.path.insert(0, "{directory}"); import nvidia_smi as n; sys.exit(n.main(sys.argv[1:]))'
    return f"#!/bin/sh\nPVE_GPU_LAB_CONFIG={config} exec /usr/bin/python3 -c '{program}' \"$@\"\n"


def write_kernel_version(version):
    """The "loaded kernel module", as the real driver prints it in /proc/driver/nvidia/version."""
    # Byte for byte the H200's (tests/fixtures/h200/proc_driver_nvidia_version.txt), with the version swapped.
    write(
        path("node/proc-driver/nvidia/version"),
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  (nixbld@)  \n"
        "GCC version:  gcc version 15.3.0 (GCC) \n",
    )


# -- containers ----------------------------------------------------------------------------------------------
def ct_config(vmid, rootfs):
    """An LXC config close to what Proxmox generates for a privileged CT with GPUs passed through."""
    delta = path("lxc", str(vmid), "delta")
    return "\n".join(
        [
            f"lxc.uts.name = ct{vmid}",
            "lxc.include = /usr/share/lxc/config/common.conf",
            "lxc.arch = linux64",
            f"lxc.rootfs.path = overlay:{rootfs}:{delta}",
            "lxc.apparmor.profile = unconfined",
            "lxc.init.cmd = /bin/sleep infinity",
            "lxc.net.0.type = empty",
            # Proxmox's cgroup layout: the node maps processes to CTs by /lxc/<vmid>/ in /proc/<pid>/cgroup.
            f"lxc.cgroup.dir.container = lxc/{vmid}",
            f"lxc.cgroup.dir.monitor = lxc.monitor/{vmid}",
            "lxc.cgroup.dir.container.inner = ns",
            # What Proxmox's GPU passthrough recipe allows: the NVIDIA majors.
            "lxc.cgroup.devices.allow = c 195:* rwm",
            f"lxc.cgroup.devices.allow = c {UVM_MAJOR}:* rwm",
            "lxc.cgroup2.devices.allow = c 195:* rwm",
            f"lxc.cgroup2.devices.allow = c {UVM_MAJOR}:* rwm",
            # Lab plumbing: the shared GPU state, the host's /proc for the stand-in (NVML reports host pids), the
            # kernel module version (one kernel for node and CTs), the stand-ins themselves.
            f"lxc.mount.entry = {path('gpu')} {CT_STATE[1:]} none bind,create=dir 0 0",
            f"lxc.mount.entry = /proc {CT_HOSTPROC[1:]} none rbind,create=dir 0 0",
            f"lxc.mount.entry = {path('node/proc-driver')} proc/driver none bind,optional 0 0",
            f"lxc.mount.entry = {path('standins')} {CT_LIB[1:]} none bind,ro,create=dir 0 0",
            # Package indexes the venv tests serve on the CT's own loopback (the CT has no network).
            f"lxc.mount.entry = {path('index')} {CT_INDEX[1:]} none bind,ro,create=dir 0 0",
            "",
        ]
    )


def prepare_ct(vmid, gpus, rootfs):
    """Write the CT's config and its own files (hostname, stand-in wrapper, userspace driver) into its delta."""
    ct = path("lxc", str(vmid))
    delta = os.path.join(ct, "delta")
    os.makedirs(delta, exist_ok=True)
    write(os.path.join(ct, "config"), ct_config(vmid, rootfs))
    write(os.path.join(delta, "etc/hostname"), f"ct{vmid}\n")
    write(os.path.join(delta, "etc/hosts"), f"127.0.0.1 localhost ct{vmid}\n::1 localhost\n")
    view = {
        "view": f"ct{vmid}",
        "state_dir": CT_STATE,
        "proc_root": CT_HOSTPROC,
        "kernel_version_file": "/proc/driver/nvidia/version",
        "nvml_library_glob": f"/{NVML_DIR}/libnvidia-ml.so.*",
        "dev_dir": "/dev",  # a GPU whose /dev/nvidiaN is missing is invisible to NVML in the CT, as for real
    }
    write(os.path.join(delta, "etc/pve-gpu-lab/standin.json"), json.dumps(view, indent=1))
    write(
        os.path.join(delta, "usr/bin/nvidia-smi"),
        wrapper("/etc/pve-gpu-lab/standin.json", CT_LIB),
        0o755,
    )
    write(
        os.path.join(delta, "usr/local/bin/gpu-holder"),
        f"#!/bin/sh\nPVE_GPU_LAB_CONFIG=/etc/pve-gpu-lab/standin.json exec /usr/bin/python3 "
        f'{CT_LIB}/gpu_holder.py "$@"\n',
        0o755,
    )
    if gpus:
        set_ct_library(vmid, DRIVER_VERSION)


def set_ct_library(vmid, version):
    """Install the placeholder of the NVIDIA userspace library of ``version`` in the CT (only that one)."""
    lib_dir = path("lxc", str(vmid), "delta", NVML_DIR)
    os.makedirs(lib_dir, exist_ok=True)
    for old in glob.glob(os.path.join(lib_dir, "libnvidia-ml.so.*")):
        os.unlink(old)
    if version:
        write(os.path.join(lib_dir, f"libnvidia-ml.so.{version}"), "placeholder of the NVIDIA userspace library\n")


def lxc(command, vmid, *args, check=True, **kwargs):
    return run([command, "-P", path("lxc"), "-n", str(vmid), *args], check=check, capture_output=True, **kwargs)


def ct_running(vmid):
    state = lxc("lxc-info", vmid, "-s", check=False)
    return "RUNNING" in state.stdout


def start_ct(vmid):
    """Start the CT (if stopped) and create its GPU device nodes the way passthrough bind-mounts them."""
    if not ct_running(vmid):
        # A lab cut off mid-run (its monitor killed) leaves the stopped CT's cgroups behind, and lxc-start then
        # fails ("Failed to create monitor cgroup"): they are empty, so removing them loses nothing.
        remove_cgroups([vmid])
        lxc("lxc-start", vmid)
    # A real CT's init brings its loopback up; ours (sleep) does not, and the venv tests serve indexes there.
    init = lxc("lxc-info", vmid, "-p", "-H").stdout.strip()
    run(["nsenter", "--target", init, "--net", "--", "ip", "link", "set", "lo", "up"])
    gpus = gpulab.read_config(path("gpu"))["views"].get(f"ct{vmid}", [])
    if not gpus:
        return
    minors = [gpulab.global_index(path("gpu"), uuid) for uuid in gpus]
    nodes = [(f"/dev/nvidia{m}", 195, m) for m in minors]
    nodes += [("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", UVM_MAJOR, 0), ("/dev/nvidia-uvm-tools", UVM_MAJOR, 1)]
    script = "; ".join(f"[ -e {p} ] || mknod -m 666 {p} c {ma} {mi}" for p, ma, mi in nodes)
    lxc("lxc-attach", vmid, "--clear-env", "--", "sh", "-c", script)


def stop_ct(vmid):
    if ct_running(vmid):
        lxc("lxc-stop", vmid, "-k")


def remove_cgroups(vmids):
    """LXC leaves empty cgroup directories behind; remove ours deepest first (and the parents if empty)."""
    for hierarchy in [*glob.glob("/sys/fs/cgroup/*/"), "/sys/fs/cgroup/"]:
        for vmid in vmids:
            for top in (f"lxc/{vmid}", f"lxc.monitor/{vmid}"):
                base = os.path.join(hierarchy, top)
                for dirpath, _, _ in sorted(os.walk(base), key=lambda w: -w[0].count("/")):
                    with contextlib.suppress(OSError):
                        os.rmdir(dirpath)
        for parent in ("lxc", "lxc.monitor", "lxc.pivot"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(hierarchy, parent))


# -- the node (sshd) -----------------------------------------------------------------------------------------
def sshd_pid():
    try:
        with open(path("ssh/sshd.pid"), encoding="utf-8") as handle:
            pid = int(handle.read().strip())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None


def start_node():
    """A real sshd on 127.0.0.1 as the Proxmox node, with pct and nvidia-smi on its /usr/sbin."""
    ssh = path("ssh")
    os.makedirs(ssh, mode=0o700, exist_ok=True)
    for key in ("host_ed25519", "id_ed25519"):
        if not os.path.exists(os.path.join(ssh, key)):
            run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    f"pve-gpu-lab-{key}",
                    "-f",
                    os.path.join(ssh, key),
                ]
            )
    shutil.copy(os.path.join(ssh, "id_ed25519.pub"), os.path.join(ssh, "authorized_keys"))
    with open(os.path.join(ssh, "host_ed25519.pub"), encoding="utf-8") as handle:
        host_key = " ".join(handle.read().split()[:2])
    write(os.path.join(ssh, "known_hosts"), f"[127.0.0.1]:{SSH_PORT} {host_key}\n")
    write(
        os.path.join(ssh, "sshd_config"),
        "\n".join(
            [
                f"Port {SSH_PORT}",
                "ListenAddress 127.0.0.1",
                f"HostKey {ssh}/host_ed25519",
                f"PidFile {ssh}/sshd.pid",
                f"AuthorizedKeysFile {ssh}/authorized_keys",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "MaxSessions 50",
                "MaxStartups 50:30:100",
                "Subsystem sftp internal-sftp",
                "",
            ]
        ),
    )
    if sshd_pid():
        return
    with socket.socket() as probe:
        # Another node's sshd (or anything) on this port would make ours fail with a log line nobody reads.
        if probe.connect_ex(("127.0.0.1", SSH_PORT)) == 0:
            sys.exit(f"labctl: port {SSH_PORT} is in use on 127.0.0.1; give node {NODE_NAME} another one")
    os.makedirs("/run/sshd", exist_ok=True)
    # A stock Debian .bashrc returns at once for a non-interactive shell (ssh "pct exec ..."): the node's does this.
    write(
        path("node/bashrc"),
        "# the lab node's root .bashrc: like Debian's, nothing for non-interactive shells\n[ -z \"$PS1\" ] && return\n",
    )
    script = (
        f"mount -t overlay overlay -o lowerdir={path('node/bin')}:/usr/sbin /usr/sbin && "
        f"mount --bind {path('node/proc-driver')} /proc/driver && "
        # root's shell on a Proxmox node reads a stock .bashrc; this machine's may run tools (pyenv init costs
        # 0.9 s per ssh command), which would bill every ssh of the benchmarks for what a node never does.
        f"{{ [ ! -f /root/.bashrc ] || mount --bind {path('node/bashrc')} /root/.bashrc; }} && "
        f"{run_lock_script()}"
        f"{node_dev_script()} && "
        f"exec /usr/sbin/sshd -f {ssh}/sshd_config -E {ssh}/sshd.log"  # one 'Accepted' line per connection
    )
    run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script])
    deadline = time.monotonic() + 10
    while not sshd_pid():
        if time.monotonic() > deadline:
            sys.exit("labctl: sshd of the lab node did not start; see its config in " + ssh)
        time.sleep(0.05)
    write(os.path.join(ssh, "mntns"), os.readlink(f"/proc/{sshd_pid()}/ns/mnt") + "\n")


def run_lock_script():
    """A node of several gets a /run/lock of its own (the recover run locks live there), so no node sees or waits
    for another's locks; the default lab keeps the machine's (its molecule scenarios read the locks there)."""
    if not NODE["private_run_lock"]:
        return ""
    # The host sees this node's locks in the lab directory.
    os.makedirs(path("node/run-lock"), exist_ok=True)
    os.chmod(path("node/run-lock"), 0o1777)  # noqa: S103 (world-writable and sticky like every /run/lock)
    return f"mkdir -p /run/lock && mount --bind {path('node/run-lock')} /run/lock && "


def stop_node():
    """Stop the node's sshd and end its sessions: the node is unreachable until ``start-node``."""
    namespace = node_namespace()
    pid = sshd_pid()
    if pid:
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not os.path.exists(f"/proc/{pid}"):
                break
            time.sleep(0.05)
    # The node's sessions (one sshd per connection, kept open by a controller's ControlPersist) outlive the
    # listener and keep the old namespace, and with it a /proc/driver of a deleted lab: end every process in it.
    for pid in node_namespace_pids(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return namespace


def node_namespace():
    """The mount namespace of the node's sshd (recorded at start), e.g. ``mnt:[4026532301]``, or None."""
    try:
        with open(path("ssh/mntns"), encoding="utf-8") as handle:
            return handle.read().strip()
    except FileNotFoundError:
        return None


def node_namespace_pids(namespace):
    """Every process living in the node's mount namespace: the sshd listener and all its sessions."""
    pids = []
    for entry in glob.glob("/proc/[0-9]*/ns/mnt") if namespace else []:
        with contextlib.suppress(OSError):
            if os.readlink(entry) == namespace:
                pids.append(int(entry.split("/")[2]))
    return pids


def node_dev_script():
    """Shell commands giving the node's namespace a /dev of its own with the NVIDIA device nodes a real GPU node
    has (/dev/nvidia0..N, nvidiactl, nvidia-uvm), so the node can also be tested as a bare GPU host. The machine's
    own /dev is never touched: a tmpfs over /dev, only in the node's mount namespace."""
    basics = [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)]
    gpus = len(gpulab.read_config(path("gpu"))["gpus"])
    nvidia = [(f"nvidia{n}", 195, n) for n in range(gpus)]
    nvidia += [("nvidiactl", 195, 255), ("nvidia-uvm", UVM_MAJOR, 0), ("nvidia-uvm-tools", UVM_MAJOR, 1)]
    nodes = " && ".join(f"mknod -m 666 /dev/{name} c {major} {minor}" for name, major, minor in basics + nvidia)
    return (
        "mount -t tmpfs -o mode=755,nosuid tmpfs /dev && "
        f"{nodes} && mkdir /dev/pts /dev/shm && "
        "mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /dev/pts && ln -s pts/ptmx /dev/ptmx && "
        "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm && "
        "ln -s /proc/self/fd /dev/fd && ln -s fd/0 /dev/stdin && ln -s fd/1 /dev/stdout && ln -s fd/2 /dev/stderr"
    )


def ssh_argv(*command):
    ssh = path("ssh")
    return [
        "ssh",
        "-i",
        f"{ssh}/id_ed25519",
        "-o",
        f"UserKnownHostsFile={ssh}/known_hosts",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-p",
        str(SSH_PORT),
        "root@127.0.0.1",
        *command,
    ]


# -- commands --------------------------------------------------------------------------------------------------
def parse_cts(specs):
    """``200:0-7`` ``201:`` -> {200: [0..7], 201: []}; no spec gives the default lab."""
    if not specs:
        return dict(DEFAULT_CTS)
    cts = {}
    for spec in specs:
        vmid, _, gpus = spec.partition(":")
        indexes = []
        for part in filter(None, gpus.split(",")):
            first, _, last = part.partition("-")
            indexes.extend(range(int(first), int(last or first) + 1))
        cts[int(vmid)] = indexes
    return cts


def create(args):
    existing = saved_cts()
    # A node of several has no CTs of its own by default: --ct names them (or the ones it was built with).
    cts = parse_cts(args.ct) if args.ct or NODE_NAME == DEFAULT_NODE else existing
    if not cts:
        sys.exit(f"labctl: node {NODE_NAME} needs its CTs: --ct VMID:GPUS (repeat), e.g. --ct 300:0-3 --ct 301:4-7")
    if existing and existing != cts:
        sys.exit(f"labctl: a lab with CTs {existing} exists; run `labctl.py destroy` before creating {cts}")
    try:
        gpu_count = node_gpu_count(cts, args.gpus)
    except ValueError as error:
        sys.exit(f"labctl: {error}")
    if os.path.exists(path("gpu/config.json")) and len(gpulab.read_config(path("gpu"))["gpus"]) != gpu_count:
        sys.exit(f"labctl: node {NODE_NAME} exists with another GPU count; run `labctl.py destroy` first")
    rootfs = rootfs_cache()
    for vmid in cts:
        busy = glob.glob(f"/sys/fs/cgroup/*/lxc/{vmid}") + glob.glob(f"/sys/fs/cgroup/lxc/{vmid}")
        if busy and not os.path.exists(path("lxc", str(vmid), "config")):
            sys.exit(f"labctl: cgroup lxc/{vmid} is in use by another container on this machine; stop it first")
    os.makedirs(LAB_DIR, exist_ok=True)
    os.makedirs(path("index"), exist_ok=True)
    write(path("cts.json"), json.dumps({str(k): v for k, v in cts.items()}))
    install_standins(cts, gpu_count)
    for vmid, gpus in cts.items():
        prepare_ct(vmid, gpus, rootfs)
        start_ct(vmid)
    start_node()
    check = run(
        ssh_argv("pct", "exec", str(min(cts)), "--keep-env", "0", "--", "nvidia-smi", "-L"),
        capture_output=True,
        check=False,
    )
    if check.returncode != 0:
        sys.exit(f"labctl: the lab is up but `pct exec ... nvidia-smi -L` through its sshd failed:\n{check.stderr}")
    write(path("inventory.yml"), inventory_yaml(cts))
    log(f"lab ready: node {NODE_NAME} = root@127.0.0.1:{SSH_PORT}, CTs {', '.join(map(str, cts))}")
    print(check.stdout, end="")


def saved_cts():
    try:
        with open(path("cts.json"), encoding="utf-8") as handle:
            return {int(k): v for k, v in json.load(handle).items()}
    except FileNotFoundError:
        return {}


def node_host_lines(node, port, lab_dir, indent=8):
    """A lab node as an inventory host (YAML lines): root over its sshd on loopback with the lab's key and known
    hosts. tests/lab/fleet.py writes its nodes with it too."""
    pad = " " * indent
    ssh = os.path.join(lab_dir, "ssh")
    return [
        f"{pad}{node}:",
        f"{pad}  ansible_host: 127.0.0.1",
        f"{pad}  ansible_port: {port}",
        f"{pad}  ansible_user: root",
        f"{pad}  ansible_ssh_private_key_file: {ssh}/id_ed25519",
        f"{pad}  ansible_ssh_common_args: -o UserKnownHostsFile={ssh}/known_hosts",
        f"{pad}  ansible_python_interpreter: /usr/bin/python3",
    ]


def inventory_yaml(cts):
    lines = [
        "# Written by tests/lab/labctl.py create: the lab's node and containers.",
        "all:",
        "  children:",
        "    pve_nodes:",
        "      hosts:",
        *node_host_lines(NODE_NAME, SSH_PORT, LAB_DIR),
        "    gpu_targets:",
        "      hosts:",
    ]
    for vmid in cts:
        lines += [f"        ct{vmid}:", f"          pve_node: {NODE_NAME}", f"          pve_vmid: {vmid}"]
    return "\n".join(lines) + "\n"


def kill_holders():
    """Every GPU holder the lab started, wherever it runs (their host pids are in the shared state)."""
    for pid in gpulab.holder_pids(path("gpu")) if os.path.isdir(path("gpu")) else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def node_vmids():
    """The vmids of this node: its saved CTs, else the CTs it has configs for, else (the default lab) 200 and 201.
    Never another node's: destroy stops and cleans only these."""
    cts = saved_cts()
    if cts:
        return cts
    found = {int(d): [] for d in os.listdir(path("lxc")) if d.isdigit()} if os.path.isdir(path("lxc")) else {}
    return found or (dict(DEFAULT_CTS) if NODE_NAME == DEFAULT_NODE else {})


def destroy(_args):
    cts = node_vmids()
    thaw()
    kill_holders()
    namespace = stop_node()
    for vmid in cts:
        if os.path.exists(path("lxc", str(vmid), "config")):
            stop_ct(vmid)
    remove_cgroups(cts)
    shutil.rmtree(LAB_DIR, ignore_errors=True)
    leftovers = leftover_report(namespace, cts)
    if leftovers:
        sys.exit("labctl: destroy left things behind:\n" + "\n".join(leftovers))
    log(f"node {NODE_NAME} destroyed (rootfs cache kept in {CACHE_DIR})")


def names_lab_dir(text):
    """Whether ``text`` names this node's LAB_DIR (not another node's whose directory merely starts the same)."""
    return re.search(re.escape(LAB_DIR) + r"(?=[/\s]|$)", text) is not None


def leftover_report(namespace, vmids):
    """Processes, mounts and cgroups of this node still present: destroy must leave none (other nodes may run)."""
    found = []
    for proc in glob.glob("/proc/[0-9]*"):
        with contextlib.suppress(OSError):
            with open(os.path.join(proc, "cmdline"), "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
            if names_lab_dir(cmdline) and "labctl" not in cmdline:
                found.append(f"process {proc[6:]}: {cmdline.strip()}")
    found += [f"process {pid} in the node's mount namespace" for pid in node_namespace_pids(namespace)]
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        found += [f"mount: {line.strip()}" for line in handle if names_lab_dir(line)]
    for vmid in vmids:
        found += [f"cgroup: {d}" for d in glob.glob(f"/sys/fs/cgroup/**/lxc/{vmid}", recursive=True)]
    # The CTs have no network (lxc.net.0.type = empty) and the node listens on loopback: no interface may appear.
    links = run(["ip", "-o", "link", "show"], capture_output=True, check=False).stdout
    found += [f"interface: {line.split(':')[1].strip()}" for line in links.splitlines() if "veth" in line]
    if os.path.exists(LAB_DIR):
        found.append(f"directory {LAB_DIR}")
    return found


def status(_args):
    cts = saved_cts()
    if not cts:
        print("no lab" if NODE_NAME == DEFAULT_NODE else f"no node {NODE_NAME}")
        return
    for vmid in cts:
        print(f"CT {vmid}: {'running' if ct_running(vmid) else 'stopped'}")
    print(f"node {NODE_NAME}: sshd {'pid ' + str(sshd_pid()) if sshd_pid() else 'not running'} on port {SSH_PORT}")
    if NODE["private_run_lock"]:
        print(f"node {NODE_NAME}: /run/lock is {path('node/run-lock')}")


def fault(args):
    """Break the lab the way real nodes break; ``repair`` undoes all of it."""
    view, mode = args.view, args.mode
    vmid = int(view[2:]) if view.startswith("ct") else None
    if mode == "driver_mismatch":
        set_ct_library(vmid, MISMATCHED_LIBRARY)
    elif mode == "no_nvml":
        set_ct_library(vmid, None)
    elif mode == "driver_not_loaded":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path("node/proc-driver/nvidia/version"))
    elif mode == "no_devices":
        lxc("lxc-attach", vmid, "--clear-env", "--", "sh", "-c", "rm -f /dev/nvidia*")
    else:
        config = gpulab.read_config(path("gpu"))
        gpu = config["views"][view][args.gpu] if args.gpu is not None else None
        gpulab.set_fault(path("gpu"), view, mode, gpu=gpu)
    log(f"fault {mode} set on {view}")


def repair(_args):
    thaw()
    write_kernel_version(DRIVER_VERSION)
    gpulab.clear_faults(path("gpu"))
    gpulab.clear_leaks(path("gpu"))
    set_pct_config(keep_env_option=True)
    for vmid, gpus in saved_cts().items():
        if gpus:
            set_ct_library(vmid, DRIVER_VERSION)
        start_ct(vmid)
    log("every fault repaired")


FREEZER = "/sys/fs/cgroup/freezer"
FROZEN_CGROUP = NODE["frozen_cgroup"]  # per node: thaw of one node never lets another's frozen process go


def freeze(args):
    """Freeze a process in a cgroup-v1 freezer child of its own cgroup: it shows state D and SIGKILL waits until
    it is thawed, which is exactly a process stuck in the driver (the real cause needs a GPU)."""
    with open(f"/proc/{args.pid}/cgroup", encoding="utf-8") as handle:
        current = next(line.split(":", 2)[2].strip() for line in handle if ":freezer:" in line)
    frozen = os.path.join(FREEZER, current.lstrip("/"), FROZEN_CGROUP)
    os.makedirs(frozen, exist_ok=True)
    write(os.path.join(frozen, "cgroup.procs"), f"{args.pid}\n")
    write(os.path.join(frozen, "freezer.state"), "FROZEN\n")
    log(f"process {args.pid} frozen (state D) in {frozen}")


def thaw(_args=None):
    """Thaw every process labctl froze, so it can die, and remove the freezer cgroups."""
    for frozen in glob.glob(os.path.join(FREEZER, "**", FROZEN_CGROUP), recursive=True):
        write(os.path.join(frozen, "freezer.state"), "THAWED\n")
        with open(os.path.join(frozen, "cgroup.procs"), encoding="utf-8") as handle:
            pids = [int(p) for p in handle.read().split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                os.rmdir(frozen)
                break
            time.sleep(0.05)


def leak(args):
    """GPU memory held with no process: what a driver that failed to release it looks like."""
    config = gpulab.read_config(path("gpu"))
    uuid = config["gpus"][args.gpu]["uuid"]
    gpulab.set_leak(path("gpu"), uuid, args.mib)
    log(f"{args.mib} MiB leaked on node GPU {args.gpu} ({uuid})")


def hold(args):
    """Start a GPU holder in a CT (through lxc-attach, like a training run) or on the node; print its host pid.

    With --fork-child it prints ``<pid> child <child pid>``, with --supervise ``<worker pid> supervisor <pid>``
    (both: ``<worker> child <child> supervisor <pid>``): the first word is always the process holding the memory.
    """
    holder = [
        *(["--name", args.name] if args.name else []),
        *(a for g in args.gpu for a in ("--gpu", g)),
        "--mib",
        str(args.mib),
        *(["--ignore-term"] if args.ignore_term else []),
        *(["--fork-child"] if args.fork_child else []),
        *(["--supervise"] if args.supervise else []),
        *(["--max-restarts", str(args.max_restarts)] if args.max_restarts is not None else []),
        *(["--restart-delay", str(args.restart_delay)] if args.restart_delay is not None else []),
    ]
    if args.where == "node":
        # On the node means in the node's mount namespace, where its /proc/driver/nvidia/version lives.
        env = dict(os.environ, PVE_GPU_LAB_CONFIG=path("node/standin.json"))
        argv = [
            "nsenter",
            "--target",
            str(sshd_pid()),
            "--mount",
            "--",
            "/usr/bin/python3",
            path("standins/gpu_holder.py"),
            *holder,
        ]
    else:
        env = dict(os.environ)
        argv = [
            "lxc-attach",
            "-P",
            path("lxc"),
            "-n",
            args.where[2:],
            "--clear-env",
            "--",
            "/usr/local/bin/gpu-holder",
            *holder,
        ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        text=True,
    )
    line = proc.stdout.readline()
    match = re.match(r"held (\d+((?: (?:child|supervisor) \d+)*))\s*$", line)
    if not match:
        sys.exit(f"labctl: the holder did not start (exit {proc.poll()}): {line!r}")
    print(match.group(1))


def index_server_argv(port, broken=None, tls=False, auth=False, access_log=None):
    """The index server's command line inside the CT. Its key, certificate and login are files of INDEX_FILES
    (copied there first: never a secret on a command line, which every process of the CT can read)."""
    return [
        "/usr/bin/python3",
        f"{CT_LIB}/index_server.py",
        CT_INDEX,
        "--port",
        str(port),
        "--pid-file",
        INDEX_PID,
        *(["--break", broken] if broken else []),
        *(["--tls-cert", f"{INDEX_FILES}/cert.pem", "--tls-key", f"{INDEX_FILES}/key.pem"] if tls else []),
        *(["--auth-file", f"{INDEX_FILES}/auth"] if auth else []),
        *(["--access-log", access_log] if access_log else []),
    ]


def index_files(args):
    """``{name in INDEX_FILES: this machine's file}`` of index-serve's --tls-cert, --tls-key and --auth-file."""
    if bool(args.tls_cert) != bool(args.tls_key):
        sys.exit("labctl: index-serve takes --tls-cert and --tls-key together")
    named = {"cert.pem": args.tls_cert, "key.pem": args.tls_key, "auth": args.auth_file}
    return {name: source for name, source in named.items() if source}


def index_serve(args):
    """Serve the lab's package indexes (``path('index')``, filled by the tests) on 127.0.0.1 inside a CT: plain
    HTTP, or HTTPS only with a certificate (of a private CA the CT does not trust: tests/lab/private_ca.py), and
    wanting Basic credentials with an auth file."""
    vmid = int(args.where.removeprefix("ct"))
    files = index_files(args)
    index_stop(args)
    for name, source in files.items():
        with open(source, encoding="utf-8") as handle:
            content = handle.read()
        script = f"umask 077 && mkdir -p {INDEX_FILES} && cat > {INDEX_FILES}/{name}"
        lxc("lxc-attach", vmid, "--clear-env", "--", "sh", "-c", script, input=content)
    server = index_server_argv(
        args.port, args.broken, tls="cert.pem" in files, auth="auth" in files, access_log=args.access_log
    )
    argv = ["lxc-attach", "-P", path("lxc"), "-n", str(vmid), "--clear-env", "--", "setsid", *server]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True
    )
    line = proc.stdout.readline().decode()
    if not line.startswith("serving"):
        sys.exit(f"labctl: the index server did not start in CT {vmid} (exit {proc.poll()}): {line!r}")
    extras = [f"breaking on {args.broken!r}"] if args.broken else []
    extras += ["wanting a login"] if "auth" in files else []
    log(f"CT {vmid}: {line.strip()}" + "".join(f", {extra}" for extra in extras))


def index_stop(args):
    vmid = int(args.where.removeprefix("ct"))
    script = f"[ -f {INDEX_PID} ] && kill $(cat {INDEX_PID}) 2>/dev/null; rm -rf {INDEX_PID} {INDEX_FILES}; true"
    lxc("lxc-attach", vmid, "--clear-env", "--", "sh", "-c", script, check=False)


def set_pct_config(**changes):
    config_path = path("node/pct.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config.update(changes)
    write(config_path, json.dumps(config, indent=1))


def pct_delay(args):
    """Every later pct call sleeps ``args.seconds`` first (0 turns it off); the benchmark's cost model."""
    if args.seconds < 0:
        sys.exit("labctl: pct-delay takes 0 or more seconds")
    set_pct_config(delay=args.seconds)


def pct_mode(args):
    """``old``: the node's pct predates pve-container 5.0.9 (no ``--keep-env``); ``current``: Proxmox VE 8.1+."""
    set_pct_config(keep_env_option=args.mode == "current")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("create")
    p.add_argument(
        "--ct",
        action="append",
        help="VMID:GPU-INDEXES in the CT's order, e.g. 200:0-7 (repeat; default: 200:0-7 201:9,8)",
    )
    p.add_argument("--gpus", type=int, help="GPUs of the node (default: eight, or as many as the CTs name)")
    p.set_defaults(func=create)
    sub.add_parser("destroy").set_defaults(func=destroy)
    sub.add_parser("stop-node", help="stop the node's sshd and its sessions: unreachable").set_defaults(
        func=lambda _a: stop_node()
    )
    sub.add_parser("start-node", help="start the node's sshd again").set_defaults(func=lambda _a: start_node())
    sub.add_parser("status").set_defaults(func=status)
    sub.add_parser("inventory").set_defaults(func=lambda _a: print(inventory_yaml(saved_cts()), end=""))
    for name, func in (("stop-ct", lambda a: stop_ct(a.vmid)), ("start-ct", lambda a: start_ct(a.vmid))):
        p = sub.add_parser(name)
        p.add_argument("vmid", type=int)
        p.set_defaults(func=func)
    p = sub.add_parser("fault")
    p.add_argument("view", help="node or ct<vmid>")
    p.add_argument(
        "mode",
        choices=[
            "driver_mismatch",
            "no_nvml",
            "driver_not_loaded",
            "no_devices",
            "gpu_lost",
            "inforom",
            "no_permission",
        ],
    )
    p.add_argument("--gpu", type=int, help="index of the GPU in that view (gpu_lost, inforom)")
    p.set_defaults(func=fault)
    sub.add_parser("repair").set_defaults(func=repair)
    p = sub.add_parser("pct-delay", help="make every pct call cost SECONDS first, like a real node's Perl pct")
    p.add_argument("seconds", type=float)
    p.set_defaults(func=pct_delay)
    p = sub.add_parser("index-serve", help="serve the lab's package indexes on 127.0.0.1 inside a CT")
    p.add_argument("where", help="ct<vmid>")
    p.add_argument("--port", type=int, default=8900)
    p.add_argument("--break", dest="broken", help="cut the first download whose path has this and go down")
    p.add_argument("--tls-cert", help="HTTPS only, with this certificate (a file here, copied into the CT)")
    p.add_argument("--tls-key", help="the certificate's key (a file here, copied into the CT, mode 0600)")
    p.add_argument("--auth-file", help="want Basic credentials: a file here holding user:password (copied in)")
    p.add_argument("--access-log", help="a file in the CT the server appends '<path> <user or ->' to per request")
    p.set_defaults(func=index_serve)
    p = sub.add_parser("index-stop", help="stop a CT's index server")
    p.add_argument("where", help="ct<vmid>")
    p.set_defaults(func=index_stop)
    p = sub.add_parser("pct-mode", help="old: a pct without --keep-env (before Proxmox VE 8.1); current: 8.1+")
    p.add_argument("mode", choices=["old", "current"])
    p.set_defaults(func=pct_mode)
    p = sub.add_parser("hold")
    p.add_argument("where", help="ct<vmid> or node")
    p.add_argument("--gpu", action="append", required=True)
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--name")
    p.add_argument("--fork-child", action="store_true", help="the holder forks a child that keeps its GPU files")
    p.add_argument("--supervise", action="store_true", help="a supervisor that starts the holder again when it dies")
    p.add_argument("--max-restarts", type=int, help="with --supervise: restarts at most (default: for ever)")
    p.add_argument("--restart-delay", type=float, help="with --supervise: seconds before a restart (0.1)")
    p.set_defaults(func=hold)
    p = sub.add_parser("freeze", help="put a process in state D (cgroup freezer) until thaw/repair")
    p.add_argument("pid", type=int)
    p.set_defaults(func=freeze)
    sub.add_parser("thaw").set_defaults(func=thaw)
    p = sub.add_parser("leak", help="GPU memory held with no process")
    p.add_argument("--gpu", type=int, required=True, help="index of the GPU on the node")
    p.add_argument("--mib", type=int, required=True)
    p.set_defaults(func=leak)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("labctl: run as root (the lab starts LXC containers and an sshd)")
    with lab_lock():
        args.func(args)


if __name__ == "__main__":
    main()
