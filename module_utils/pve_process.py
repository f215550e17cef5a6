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

import os
import re
from dataclasses import asdict, dataclass

PROXMOX_CGROUP = re.compile(r"^/lxc/(\d+)(?:/|$)")
LXC_PAYLOAD_CGROUP = re.compile(r"^/lxc\.payload\.([^/]+)")
# /proc/<pid>/stat: "pid (comm) state ..." where comm may itself contain spaces and parentheses.
STAT = re.compile(r"^\d+ \((.*)\) (\S) ", re.DOTALL)
STATES = {
    "R": "running", "S": "sleeping", "D": "uninterruptible (disk sleep)", "Z": "zombie", "T": "stopped",
    "t": "tracing stop", "X": "dead", "I": "idle", "P": "parked", "W": "paging",
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
    rest = text[match.end():].split()
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
    """Words for an owner: ``CT 201``, ``LXC container x``, ``node pve1 itself``."""
    if owner.startswith("ct:"):
        return f"CT {owner[3:]}"
    if owner.startswith("lxc:"):
        return f"LXC container {owner[4:]}"
    return f"node {node} itself"
