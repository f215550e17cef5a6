# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Node-side knowledge of processes: which CT a host pid belongs to, its pid inside the CT, its state.

Proxmox VE puts a CT's processes in cgroup ``/lxc/<vmid>/...`` (``/lxc/<vmid>/ns`` for init, ``.../ns/.lxc``
for ``pct exec``); plain LXC and Incus use ``/lxc.payload.<name>`` (older LXC ``/lxc/<name>``). On a bare host the
processes of other container runtimes (Docker, Podman, Kubernetes, containerd, systemd-nspawn, LXC) are not the
host's own either: :func:`parse_cgroup_owner` names them. ``NSpid:`` in /proc/<pid>/status lists the pid in
every pid namespace from the host's outwards in, so its last value is the pid the CT sees. NVML reports host
pids, which is why GPU holders are mapped on the node, not inside the CT.

The rules that tell a holder's job from the rest (the parents that restart it, the systemd service it runs in)
are in process_job; which processes run from a directory (a venv about to be swapped) in
runs_from. This module holds the reads they share: a process's parents (:func:`ancestry`), its
children (:func:`children_of`) and the members of its service (:func:`read_unit_members`).

Parsing functions are pure; :func:`read_process` reads one pid under a proc root (``/proc`` by default).

Alive means any thread: a thread-group leader that exited (state Z) while other threads of it still run keeps the
process, its open files and its GPU memory; :func:`still_there` and the state of :func:`read_process` look at
``/proc/<pid>/task/*/stat`` for that.

Bounded reads: of the files read here only ``cmdline`` takes the process's mmap lock, which a thread stuck in the
driver can hold for ever; it is read by a child process (``head -c``) under run_local's hard deadline
(CMDLINE_TIMEOUT), so a stuck process costs seconds, never the run. ``stat``, ``status``, ``cgroup`` and the
``fd`` links do not take that lock and are read directly; an fd is only ever readlink'ed, never stat'ed (a stat
asks the open file's filesystem, which may be a hung NFS or FUSE mount). A file that cannot be read (gone, permission,
I/O error, garbage) is None, never a traceback; ProcessInfo.read_error says what could not be read.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import asdict, dataclass

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import run_local

PROXMOX_CGROUP = re.compile(r"^/lxc/(\d+)(?:/|$)")
LXC_PAYLOAD_CGROUP = re.compile(r"^/lxc\.payload\.([^/]+)")
# On a bare host: processes of other container runtimes are not the host's own. Searched in this order, so a
# Kubernetes pod run by containerd is "kubernetes", and a Podman container in machine.slice is "podman".
OTHER_CONTAINER_CGROUPS = (
    (re.compile(r"/docker[-/]([0-9a-f]{12})[0-9a-f]*(?:\.scope)?(?:/|$)"), "docker:{}"),
    (re.compile(r"/libpod-([0-9a-f]{12})[0-9a-f]*(?:\.scope)?(?:/|$)"), "podman:{}"),
    (re.compile(r"/kubepods[/.]"), "kubernetes"),
    # systemd-nspawn machines (machinectl start NAME): /machine.slice/systemd-nspawn@NAME.service/payload
    (re.compile(r"^/machine\.slice/systemd-nspawn@([^/]+)\.service(?:/|$)"), "nspawn:{}"),
    # containerd without Docker: the systemd cgroup driver nests containers under containerd.service (the
    # daemon and its shims sit in containerd.service itself: those are the host's); cgroupfs puts them in
    # /<namespace>/<id> (k8s.io for the CRI); the CRI with the systemd driver outside kubepods uses a scope.
    (re.compile(r"^/system\.slice/containerd\.service/([^/]+)"), "containerd:{}"),
    (re.compile(r"^/k8s\.io/([^/]+)"), "containerd:{}"),
    (re.compile(r"/cri-containerd-([0-9a-f]{12})[0-9a-f]*\.scope(?:/|$)"), "containerd:{}"),
    # LXC/Incus on a host that is not a Proxmox node: /lxc/NAME (a numeric NAME is a Proxmox CT, matched first).
    (re.compile(r"^/lxc/([^/]+)"), "lxc:{}"),
)
# A name taken from a cgroup path goes into messages: at most this long, other characters replaced by "?".
OWNER_NAME = re.compile(r"[^A-Za-z0-9_.:@+=-]")
OWNER_NAME_LIMIT = 64
LONG_ID = re.compile(r"^[0-9a-f]{32,}$")
# /proc/<pid>/stat: "pid (comm) state ..." where comm may itself contain spaces and parentheses.
STAT = re.compile(r"^\d+ \((.*)\) (\S) ", re.DOTALL)
# Character device major of /dev/nvidia<N> and /dev/nvidiactl; nvidia-uvm and nvidia-caps get dynamic majors
# that /proc/devices names.
NVIDIA_MAJOR = 195
# The device files a GPU process holds, as a /proc/<pid>/fd link names them: /dev/nvidia0, /dev/nvidiactl,
# /dev/nvidia-uvm, /dev/nvidia-caps/nvidia-cap1 ...
NVIDIA_DEVICE = re.compile(r"^/dev/nvidia[^/]*(?:/|$)")
# How the kernel marks a /proc link (an fd, exe, a mapped file) whose file was removed.
DELETED = " (deleted)"
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
GONE_STATES = ("Z", "X")  # a task in these states runs no more (a zombie's files and memory are released)
# Which live thread's state a zombie leader is reported with: the one that explains why it holds on.
STATE_ORDER = "DRTt"
CMDLINE_TIMEOUT = 2  # seconds a cmdline read may take (see the module docstring)
CMDLINE_LIMIT = 65536  # bytes of a cmdline read; argv beyond that is not needed to name a process
# Interpreters whose ``-m MODULE`` or script names the program (``python3 -m torch.distributed.run``), and whose
# argv[0] names the venv it runs from (process_job.program_names, runs_from.is_interpreter).
INTERPRETERS = ("python*", "pypy*")


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
    read_error: str = ""  # what could not be read (e.g. its cmdline, when that timed out)
    ppid: int = 0  # host pid of its parent (0: none, or not read)
    cgroup: str = ""  # its cgroup path as the node sees it (``/lxc/200/ns/system.slice/train.service``)

    def as_dict(self):
        return asdict(self)


def owner_name(raw):
    """A container name from a cgroup path as owners carry it: a long hex id cut to 12 like ``docker ps`` shows
    it, any other name with safe characters only (others become ``?``), at most 64."""
    if LONG_ID.match(raw):
        return raw[:12]
    return OWNER_NAME.sub("?", raw[:OWNER_NAME_LIMIT])


def parse_cgroup_owner(text):
    """Who owns a process, from /proc/<pid>/cgroup: ``ct:<vmid>`` (Proxmox), another runtime's, or ``host``.

    The other runtimes: ``lxc:<name>``, ``docker:<id>``, ``podman:<id>``, ``kubernetes``, ``nspawn:<name>``,
    ``containerd:<id>`` (OTHER_CONTAINER_CGROUPS).

    >>> parse_cgroup_owner("0::/lxc/200/ns/.lxc\\n")
    'ct:200'
    >>> parse_cgroup_owner("0::/system.slice/ssh.service\\n")
    'host'
    >>> parse_cgroup_owner("0::/machine.slice/systemd-nspawn@train.service/payload\\n")
    'nspawn:train'
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
            return f"lxc:{owner_name(payload.group(1))}"
        for pattern, owner in OTHER_CONTAINER_CGROUPS:
            found = pattern.search(path)
            if found:
                return owner.format(*(owner_name(g) for g in found.groups()))
    return "host"


def parse_cgroup_path(text):
    """The process's cgroup path from /proc/<pid>/cgroup: the unified (``0::``) one, else systemd's, else the
    first; ``""`` when there is none.

    >>> parse_cgroup_path("12:pids:/lxc/200/ns\\n1:name=systemd:/lxc/200/ns/init.scope\\n0::/lxc/200/ns/init.scope\\n")
    '/lxc/200/ns/init.scope'
    """
    paths = {}
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths.setdefault(parts[0] if parts[0] == "0" else parts[1], parts[2])
    for key in ("0", "name=systemd"):
        if paths.get(key, "/") != "/":
            return paths[key]
    return next(iter(paths.values()), "")


def parse_status_nspid(text):
    """The pids of ``NSpid:`` in /proc/<pid>/status, outermost (host) first; [] when the line is absent."""
    for line in (text or "").splitlines():
        if line.startswith("NSpid:"):
            pids = line.split()[1:]
            return [int(p) for p in pids] if all(p.isdigit() for p in pids) else []
    return []


def parse_stat(text):
    """``(comm, state, start_time)`` from /proc/<pid>/stat, or None when it cannot be read."""
    match = STAT.match(text or "")
    if not match:
        return None
    rest = text[match.end() :].split()
    # After "pid (comm) state " the fields start at field 4 (ppid); starttime is field 22.
    start_time = int(rest[22 - 4]) if len(rest) > 22 - 4 and rest[22 - 4].isdigit() else 0
    return match.group(1), match.group(2), start_time


def parse_ppid(text):
    """The parent pid (field 4) of a /proc/<pid>/stat line, or 0 when it cannot be read.

    >>> parse_ppid("516 (python3) S 500 516 500 0 -1")
    500
    """
    match = STAT.match(text or "")
    rest = text[match.end() :].split() if match else []
    return int(rest[0]) if rest and rest[0].isdigit() else 0


def describe_state(letter):
    """``D`` -> ``uninterruptible (disk sleep)``: the words a survivor report uses."""
    return STATES.get(letter, letter)


def _read(path):
    """The text of a /proc file, or None when it cannot be read (gone, no permission, I/O error...)."""
    try:
        with open(path, "rb") as handle:
            return handle.read().decode(errors="replace")
    except (OSError, ValueError):
        return None


def read_bounded(path, *, timeout=None, limit=CMDLINE_LIMIT):
    """``(text, error)`` of a file that can block (``/proc/<pid>/cmdline``), read by a child under a deadline.

    ``error`` is None or one sentence (``could not read /proc/7/cmdline: no answer within 2 s ...``). ``timeout``
    defaults to CMDLINE_TIMEOUT. Where ``head`` is missing the file is read directly.
    """
    timeout = CMDLINE_TIMEOUT if timeout is None else timeout
    try:
        result = run_local(["head", "-c", str(limit), "--", path], timeout=timeout)
    except FileNotFoundError:
        text = _read(path)
        return text, None if text is not None else f"could not read {path}"
    if result.timed_out:
        return None, (
            f"could not read {path}: no answer within {timeout} s (the process is likely stuck in the kernel or the "
            f"driver)"
        )
    if result.rc != 0:
        said = result.stderr.strip().splitlines()[-1:] or [f"exit {result.rc}"]
        return None, f"could not read {path}: {said[0]}"
    return result.stdout, None


def read_stat(pid, proc_root="/proc"):
    """``(comm, state, start_time)`` of ``pid``'s thread-group leader, or None when it is gone or unreadable."""
    return parse_stat(_read(os.path.join(proc_root, str(pid), "stat")))


def thread_states(pid, proc_root="/proc"):
    """The state letter of every thread of ``pid`` (``/proc/<pid>/task/*/stat``); [] when none can be read."""
    task_dir = os.path.join(proc_root, str(pid), "task")
    try:
        tids = sorted(t for t in os.listdir(task_dir) if t.isdigit())
    except OSError:
        return []
    states = []
    for tid in tids:
        stat = parse_stat(_read(os.path.join(task_dir, tid, "stat")))
        if stat is not None:
            states.append(stat[1])
    return states


def live_state(state, threads):
    """The state a process counts as: its leader's, or, for a leader gone (Z) with threads still running, the
    state of the live thread that explains it (D before R before S...); pure.

    >>> live_state("Z", ["Z", "S", "D"]), live_state("Z", ["Z"]), live_state("S", [])
    ('D', 'Z', 'S')
    """
    if state not in GONE_STATES:
        return state
    live = [t for t in threads if t not in GONE_STATES]
    if not live:
        return state
    return min(live, key=lambda t: (STATE_ORDER.index(t) if t in STATE_ORDER else len(STATE_ORDER), t))


def read_process(pid, proc_root="/proc"):
    """ProcessInfo of host ``pid`` under ``proc_root``, or None when it is gone (or not readable).

    ``state`` is :func:`live_state`: a zombie leader whose other threads run reads as their state, not Z.
    """
    base = os.path.join(proc_root, str(pid))
    stat_text = _read(os.path.join(base, "stat"))
    stat = parse_stat(stat_text)
    if stat is None:
        return None
    comm, state, start_time = stat
    if state in GONE_STATES:
        state = live_state(state, thread_states(pid, proc_root))
    nspids = parse_status_nspid(_read(os.path.join(base, "status")))
    text, error = read_bounded(os.path.join(base, "cmdline"))
    cgroup = _read(os.path.join(base, "cgroup"))
    return ProcessInfo(
        pid=int(pid),
        ns_pid=nspids[-1] if nspids else int(pid),
        comm=comm,
        state=state,
        owner=parse_cgroup_owner(cgroup),
        cmdline=[a for a in (text or "").split("\0") if a],
        start_time=start_time,
        read_error=error or "",
        ppid=parse_ppid(stat_text),
        cgroup=parse_cgroup_path(cgroup),
    )


def owner_label(owner, node):
    """Words for an owner: ``CT 201``, ``LXC container x``, ``Docker container 0123456789ab``, ``node pve1 itself``."""
    kind, _, name = owner.partition(":")
    words = {
        "ct": "CT",
        "lxc": "LXC container",
        "docker": "Docker container",
        "podman": "Podman container",
        "nspawn": "systemd-nspawn container",
        "containerd": "containerd container",
    }
    if kind in words:
        return f"{words[kind]} {name}"
    if kind == "kubernetes":
        return "a Kubernetes pod"
    return f"node {node} itself"


def owner_of(target):
    """How /proc ownership names the target's processes: ``ct:<vmid>``, or ``host`` for a bare host."""
    return f"ct:{target['vmid']}" if target["vmid"] is not None else "host"


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


def device_fds(pid, proc_root="/proc"):
    """The NVIDIA device files ``pid`` has open (``["/dev/nvidia0", "/dev/nvidiactl"]``), sorted, once each.

    Matched by the text of each /proc/<pid>/fd/N link (os.readlink), never by stat: stat follows the link to the
    open file and asks its filesystem, so one fd on a hung NFS or FUSE mount would block the read for ever, while
    readlink of a /proc fd only prints the path the kernel keeps. The kernel writes that path as the process's
    own mount namespace names it, so a CT's /dev/nvidiaN reads as such on the node.
    """
    fd_dir = os.path.join(proc_root, str(pid), "fd")
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return []
    found = set()
    for fd in fds:
        try:
            link = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        link = link[: -len(DELETED)] if link.endswith(DELETED) else link
        if NVIDIA_DEVICE.match(link):
            found.add(link)
    return sorted(found)


def list_pids(proc_root="/proc"):
    try:
        return sorted(int(e) for e in os.listdir(proc_root) if e.isdigit())
    except OSError:
        return []


def read_owner(pid, proc_root="/proc"):
    """Owner of ``pid`` from its cgroup alone (one small read: enough to skip other CTs' processes quickly)."""
    return parse_cgroup_owner(_read(os.path.join(proc_root, str(pid), "cgroup")))


def process_owners(proc_root="/proc"):
    """``{pid: owner}`` of every process (:func:`read_owner`): one walk of /proc that a node's CTs can share."""
    return {pid: read_owner(pid, proc_root) for pid in list_pids(proc_root)}


def device_holders(owner, proc_root="/proc", exclude=(), owners=None):
    """ProcessInfo and NVIDIA device files (:func:`device_fds`) of every process of ``owner`` that holds one;
    ``exclude`` pids skipped. ``owners``: a :func:`process_owners` read earlier (else every cgroup is read now)."""
    holders = []
    for pid, found in (process_owners(proc_root) if owners is None else owners).items():
        if pid in exclude or found != owner:
            continue
        devices = device_fds(pid, proc_root)
        if devices:
            info = read_process(pid, proc_root)
            # Owned now, not only when ``owners`` was read: a pid gone and reused since by another CT's process
            # is not this target's.
            if info is not None and info.owner == owner:
                holders.append((info, devices))
    return holders


def still_there(info, proc_root="/proc"):
    """True while the process of ``info`` lives: same pid, same start time, and a thread of it not a zombie.

    A zombie has freed its files and GPU memory, but a thread-group leader in state Z whose other threads still
    run has not: it is there (and needs SIGKILL). Reads only ``stat`` files, never the cmdline, so polling it is
    cheap and cannot block.
    """
    stat = read_stat(info.pid, proc_root)
    if stat is None or stat[2] != info.start_time:
        return False
    if stat[1] not in GONE_STATES:
        return True
    return live_state(stat[1], thread_states(info.pid, proc_root)) not in GONE_STATES


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


# -- a holder's job as the node shows it: its parents, its children, its service's members ---------------------
CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd")
UNIT_MEMBERS_LIMIT = 4096


def ancestry(pid, proc_root="/proc", limit=64):
    """``[(pid, start_time), ...]`` of ``pid`` and its parents up to (not including) pid 1, nearest first; ``[]``
    when ``pid`` is gone. Reads only ``stat`` (never the cmdline), so it cannot block."""
    chain = []
    while pid > 1 and len(chain) < limit:
        text = _read(os.path.join(proc_root, str(pid), "stat"))
        stat = parse_stat(text)
        if stat is None or (pid, stat[2]) in chain:
            break
        chain.append((pid, stat[2]))
        pid = parse_ppid(text)
    return chain


def children_of(parents, proc_root="/proc"):
    """``{parent pid: {(child pid, start_time), ...}}`` of the live children of ``parents`` (host pids), from one
    scan of ``/proc/*/stat`` (field 4): a supervisor's restarted worker shows here the moment it is forked, seconds
    before it opens a GPU. Zombies are left out (a child that died is no restart)."""
    found = {pid: set() for pid in parents}
    if not found:
        return found
    for pid in list_pids(proc_root):
        text = _read(os.path.join(proc_root, str(pid), "stat"))
        stat = parse_stat(text)
        if stat is None or stat[1] in GONE_STATES:
            continue
        ppid = parse_ppid(text)
        if ppid in found:
            found[ppid].add((pid, stat[2]))
    return found


def read_unit_members(path, cgroup_roots=CGROUP_ROOTS, proc_root="/proc"):
    """``[(pid, start_time)]`` of every process in the cgroup ``path`` and below it (host pids), or None when the
    cgroup cannot be found under any of ``cgroup_roots``."""
    for root in cgroup_roots:
        top = os.path.join(root, path.lstrip("/"))
        if not os.path.isdir(top):
            continue
        pids = set()
        for directory, _, _ in os.walk(top):
            text = _read(os.path.join(directory, "cgroup.procs"))
            pids.update(int(p) for p in (text or "").split() if p.isdigit())
            if len(pids) >= UNIT_MEMBERS_LIMIT:
                break
        members = []
        for pid in sorted(pids):
            stat = read_stat(pid, proc_root)
            if stat is not None:
                members.append((pid, stat[2]))
        return members
    return None
