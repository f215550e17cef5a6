# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Node-side knowledge of processes: which CT a host pid belongs to, its pid inside the CT, its state.

Proxmox VE puts a CT's processes in cgroup ``/lxc/<vmid>/...`` (``/lxc/<vmid>/ns`` for init, ``.../ns/.lxc``
for ``pct exec``); plain LXC uses ``/lxc.payload.<name>``. ``NSpid:`` in /proc/<pid>/status lists the pid in
every pid namespace from the host's outwards in, so its last value is the pid the CT sees. NVML reports host
pids, which is why GPU holders are mapped on the node, not inside the CT.

Parsing functions are pure; :func:`read_process` reads one pid under a proc root (``/proc`` by default).
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat as stat_module
from dataclasses import asdict, dataclass

PROXMOX_CGROUP = re.compile(r"^/lxc/(\d+)(?:/|$)")
LXC_PAYLOAD_CGROUP = re.compile(r"^/lxc\.payload\.([^/]+)")
# On a bare host: processes of Docker/Podman containers and Kubernetes pods are not the host's own.
OTHER_CONTAINER_CGROUPS = (
    (re.compile(r"/docker[-/]([0-9a-f]{12})[0-9a-f]*(?:\.scope)?(?:/|$)"), "docker:{}"),
    (re.compile(r"/libpod-([0-9a-f]{12})[0-9a-f]*(?:\.scope)?(?:/|$)"), "podman:{}"),
    (re.compile(r"/kubepods[/.]"), "kubernetes"),
)
# /proc/<pid>/stat: "pid (comm) state ..." where comm may itself contain spaces and parentheses.
STAT = re.compile(r"^\d+ \((.*)\) (\S) ", re.DOTALL)
# Character device major of /dev/nvidia<N> and /dev/nvidiactl; nvidia-uvm and nvidia-caps get dynamic majors
# that /proc/devices names.
NVIDIA_MAJOR = 195
STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible (disk sleep)",
    "Z": "zombie",
    "T": "stopped",
    "t": "tracing stop",
    "X": "dead",
    "I": "idle",
    "P": "parked",
    "W": "paging",
}


@dataclass(frozen=True)
class ProcessInfo:
    """One process as the node sees it."""

    pid: int  # host pid
    ns_pid: int  # pid in its innermost pid namespace (the CT's view); equals pid on the host
    comm: str  # kernel name, at most 15 characters
    state: str  # one letter: R S D Z T ...
    owner: str  # "ct:<vmid>", "lxc:<name>" or "host"
    cmdline: list  # argv as the kernel records it
    start_time: int  # clock ticks after boot (field 22 of stat): tells a reused pid apart

    def as_dict(self):
        return asdict(self)


def parse_cgroup_owner(text):
    """Who owns a process, from /proc/<pid>/cgroup: ``ct:<vmid>`` (Proxmox), ``lxc:<name>`` or ``host``.

    >>> parse_cgroup_owner("0::/lxc/200/ns/.lxc\\n")
    'ct:200'
    >>> parse_cgroup_owner("0::/system.slice/ssh.service\\n")
    'host'
    """
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2]
        proxmox = PROXMOX_CGROUP.match(path)
        if proxmox:
            return f"ct:{int(proxmox.group(1))}"
        payload = LXC_PAYLOAD_CGROUP.match(path)
        if payload:
            return f"lxc:{payload.group(1)}"
        for pattern, owner in OTHER_CONTAINER_CGROUPS:
            found = pattern.search(path)
            if found:
                return owner.format(*found.groups())
    return "host"


def parse_status_nspid(text):
    """The pids of ``NSpid:`` in /proc/<pid>/status, outermost (host) first; [] when the line is absent."""
    for line in (text or "").splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return []


def parse_stat(text):
    """``(comm, state, start_time)`` from /proc/<pid>/stat, or None when it cannot be read."""
    match = STAT.match(text or "")
    if not match:
        return None
    rest = text[match.end() :].split()
    # After "pid (comm) state " the fields start at field 4 (ppid); starttime is field 22.
    start_time = int(rest[22 - 4]) if len(rest) > 22 - 4 else 0
    return match.group(1), match.group(2), start_time


def describe_state(letter):
    """``D`` -> ``uninterruptible (disk sleep)``: the words a survivor report uses."""
    return STATES.get(letter, letter)


def _read(path):
    try:
        with open(path, "rb") as handle:
            return handle.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None


def read_process(pid, proc_root="/proc"):
    """ProcessInfo of host ``pid`` under ``proc_root``, or None when it is gone (or not readable)."""
    base = os.path.join(proc_root, str(pid))
    stat = parse_stat(_read(os.path.join(base, "stat")))
    if stat is None:
        return None
    comm, state, start_time = stat
    nspids = parse_status_nspid(_read(os.path.join(base, "status")))
    cmdline = [a for a in (_read(os.path.join(base, "cmdline")) or "").split("\0") if a]
    return ProcessInfo(
        pid=int(pid),
        ns_pid=nspids[-1] if nspids else int(pid),
        comm=comm,
        state=state,
        owner=parse_cgroup_owner(_read(os.path.join(base, "cgroup"))),
        cmdline=cmdline,
        start_time=start_time,
    )


def owner_label(owner, node):
    """Words for an owner: ``CT 201``, ``LXC container x``, ``Docker container 0123456789ab``, ``node pve1 itself``."""
    kind, _, name = owner.partition(":")
    words = {"ct": "CT", "lxc": "LXC container", "docker": "Docker container", "podman": "Podman container"}
    if kind in words:
        return f"{words[kind]} {name}"
    if kind == "kubernetes":
        return "a Kubernetes pod"
    return f"node {node} itself"


def parse_proc_devices(text):
    """Majors of NVIDIA character devices from /proc/devices (``195 nvidia-frontend``, ``238 nvidia-uvm``).

    195 is always included: it is NVIDIA's registered major, whatever /proc/devices says.
    """
    majors = {NVIDIA_MAJOR}
    for line in (text or "").splitlines():
        if line.startswith("Block devices:"):
            break
        else:
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].startswith("nvidia"):
                majors.add(int(parts[0]))
    return majors


def nvidia_device_majors(proc_root="/proc"):
    return parse_proc_devices(_read(os.path.join(proc_root, "devices")))


def device_fds(pid, majors, proc_root="/proc"):
    """``[(major, minor), ...]`` of the NVIDIA character devices ``pid`` has open.

    Compares the devices themselves (st_rdev of each /proc/<pid>/fd/N), like fuser does, so it works for a
    process in a CT whose /dev is not the node's.
    """
    fd_dir = os.path.join(proc_root, str(pid), "fd")
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return []
    found = []
    for fd in fds:
        try:
            info = os.stat(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if stat_module.S_ISCHR(info.st_mode) and os.major(info.st_rdev) in majors:
            found.append((os.major(info.st_rdev), os.minor(info.st_rdev)))
    return sorted(set(found))


def list_pids(proc_root="/proc"):
    try:
        return sorted(int(e) for e in os.listdir(proc_root) if e.isdigit())
    except OSError:
        return []


def read_owner(pid, proc_root="/proc"):
    """Owner of ``pid`` from its cgroup alone (one small read: enough to skip other CTs' processes quickly)."""
    return parse_cgroup_owner(_read(os.path.join(proc_root, str(pid), "cgroup")))


def device_holders(owner, proc_root="/proc", exclude=()):
    """ProcessInfo and NVIDIA device fds of every process of ``owner`` that holds one; ``exclude`` pids skipped."""
    majors = nvidia_device_majors(proc_root)
    holders = []
    for pid in list_pids(proc_root):
        if pid in exclude or read_owner(pid, proc_root) != owner:
            continue
        devices = device_fds(pid, majors, proc_root)
        if devices:
            info = read_process(pid, proc_root)
            if info is not None:
                holders.append((info, devices))
    return holders


def still_there(info, proc_root="/proc"):
    """True while the process of ``info`` lives: same pid, same start time, not a zombie (a zombie freed its GPU)."""
    now = read_process(info.pid, proc_root)
    return now is not None and now.start_time == info.start_time and now.state not in ("Z", "X")


def matches_name(info, patterns):
    """The first of ``patterns`` (fnmatch) naming this process by comm, argv[0] or its basename; else None.

    comm is cut to 15 characters by the kernel, so a pattern is also compared cut to 15
    (``nvidia-persistenced`` -> comm ``nvidia-persiste``).
    """
    names = {info.comm}
    if info.cmdline:
        names.update({info.cmdline[0], os.path.basename(info.cmdline[0])})
    for pattern in patterns:
        for name in names:
            if fnmatch.fnmatchcase(name, pattern) or (name == info.comm and fnmatch.fnmatchcase(name, pattern[:15])):
                return pattern
    return None
