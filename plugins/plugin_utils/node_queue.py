# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One module execution per node, not per target (the target_facts action's ``per_node``, on by default).

The forks of one run whose targets share a node and its connection post their options to a queue in the run's own
temp directory (``local_tmp``, so never another run's); the first to take the node's lock waits until every host of
the play batch has posted (to its own node's queue or another's) or none has for a while (GATHER_IDLE_COVERED where
the forks cover the batch, else GATHER_IDLE; GATHER_LONGEST at most, longer for a batch of hundreds), then reads, in
one execution, every target of its node that has posted by then (``batch``: the passes run side by side on the node;
what each target shares with the reading fork's own options travels once, batch_items), writes each its result and
lets go, and each waiting fork returns its own. Every target keeps its own task, result, report, ``--limit`` and
failure; each one's options are the ones Ansible templated for it, so nothing of another host's is guessed. A lone
target (one host in the play batch, a bare host, or one fork at a time) runs exactly as before and marks its
arrival all the same, as does a host that fails the action's checks: no read waits for a host that will not post.
Forks that arrive while a read runs are the next read's. A read that did not answer the targets it carried (its own
options failed the module before it read them, it raised) queues them again for the next fork; an unreachable node
answers each of them unreachable at once; a fork that leaves its wait (a task timeout) takes its request back; any
failure of the queue itself reads the target alone, and once (a fork that cannot wait for the node's lock after a
reader claimed its request waits for that reader's answer instead). A fork waits for the node's lock no longer than
a read may take (NodeQueue.hold's deadline): past it, the fork reads its target alone, with a warning naming the
holder. The queue only ever saves time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import tempfile
import time

from ansible.utils.display import Display
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.registry import BATCH_SAME_AS_TASK

display = Display()

# The queue of the targets of one node waiting for the fact pass, in the run's own temp directory (NodeQueue).
QUEUE_DIR = "pve-gpu-recover-node-passes"


# A fork that reads its node's targets first waits for the others: until every host of the play batch has come
# (to any node), or none has come for an idle time, never longer than GATHER_LONGEST in all, or GATHER_PER_HOST per
# host of the batch where that is longer. Ansible's linear strategy starts the forks of a task one after another,
# round-robin over the nodes in an inventory like the lab's: 64 take about 2 s on 2 busy cores, and over 5 s
# (gaps of 0.2 s and more) when those cores are shared with the 64 CTs' probes, so a wait for the node's own
# targets alone, a short idle time or a fixed bound split a node's targets into two reads or more. Idle time:
# GATHER_IDLE_COVERED when the forks cover the batch (a host that has not come by then is not coming: skipped, or
# failed before its action), GATHER_IDLE when they do not (the rest of the batch comes only as reads end: waiting
# is for nothing).
GATHER_IDLE = 0.15


GATHER_IDLE_COVERED = 1.0


GATHER_LONGEST = 10.0


GATHER_PER_HOST = 0.1


# Seconds beyond a claimed read's own bounds (ssh's connection, the module's start) that a fork whose request another
# fork claimed waits for its answer before it reads its target itself (_result_wait).
RESULT_WAIT_SLACK = 60
# The longest pause between two asks for a lock another fork holds (flock_within).
POLL_LONGEST = 0.05


def write_json_atomically(path, value):
    """``value`` as JSON at ``path`` through a temporary file beside it: a reader never sees half of it."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(value, default=str))  # dumps: the C encoder (dump's is Python's)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def batch_items(others, own):
    """The module's ``batch`` for the waiting targets whose options are ``others``: of each, the options whose value
    differs from the task's own (``own``), and under BATCH_SAME_AS_TASK the names of those whose value is the same,
    which the module takes from its own options; so what every target shares (a hashed lock of over 100 KB) travels
    to the node once, not once per target (pure). An option a target leaves out stays out: the module gives it its
    default, as that target's own task would. Values are compared as the module receives them, as JSON: ``1``,
    ``1.0``, ``"1"`` and ``true`` all differ."""
    shared = {name: as_json(value) for name, value in task_options(own).items()}
    items = []
    for options in others:
        same = sorted(n for n, value in options.items() if shared.get(n) is not None and shared[n] == as_json(value))
        item = {name: value for name, value in options.items() if name not in same}
        if same:
            item[BATCH_SAME_AS_TASK] = same
        items.append(item)
    return items


def as_json(value):
    """``value`` as one JSON text, keys sorted: two values are the same option for the module when these are. None
    for a value that cannot be written so (a dict whose keys mix numbers and strings): never shared, it travels."""
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None


def task_options(args):
    """The module options of a task's ``args``: not ``batch`` (the action's, per read), nor the ``_ansible_*`` keys
    Ansible writes into them when it runs the module, which a retried task (``retries``/``until``) still has."""
    return {name: value for name, value in args.items() if name != "batch" and not name.startswith("_ansible_")}


def flock_within(descriptor, longest, clock=time.monotonic, sleep=time.sleep):
    """Take an exclusive flock of ``descriptor`` within ``longest`` seconds: whether it was taken. Asked again every
    few milliseconds (at most POLL_LONGEST apart), so a lock let go is taken at once, and no wait is without end."""
    deadline = clock() + longest
    pause = 0.001
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if clock() >= deadline:
                return False
        sleep(min(pause, max(0.0, deadline - clock())))
        pause = min(pause * 2, POLL_LONGEST)


def flock_holder(path, proc="/proc"):
    """Who holds a flock of ``path``, as a warning names it: ``pid 4242 (ansible-playbook)`` from /proc/locks, or
    ``another process`` when that cannot be told."""
    try:
        info = os.stat(path)
        with open(os.path.join(proc, "locks"), encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return "another process"
    wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == wanted and "->" not in fields:
            try:
                with open(os.path.join(proc, fields[4], "comm"), encoding="utf-8", errors="replace") as handle:
                    name = handle.read().strip()
            except OSError:
                name = "gone"
            return f"pid {fields[4]} ({name})"
    return "another process"


class NodeQueue:
    """The targets of one node waiting for their fact pass in one run of one task (module docstring).

    A directory (mode 0700) with ``requests/`` (each waiting target's module options, posted by its fork),
    ``results/`` (each one's result, written by the fork that read it) and ``lead`` (the lock that fork holds while
    it reads). A fork that takes the lock and finds no result of its own claims every request posted by then: the
    fork before it wrote a result for each request it claimed before it let go, so its own is among them.

    ``arrivals``: a directory the queues of every node of this task share, where each fork marks its host as it
    posts; ``expected``: the hosts of the fork's play batch. The gathering then knows when no fork is left to come:
    it counts the marks of those hosts only, so a batch that shrank (a host failed the controller's checks) or a
    host marked by an earlier batch or retry of the task never makes it wait for one that will not come (a retry
    finds its own mark there and waits an idle time at most). Without them, it waits for this node's own requests.
    """

    def __init__(self, directory, arrivals=None, expected=(), idle=GATHER_IDLE):
        self.directory = directory
        self.arrivals = arrivals
        self.expected = {self.mark(host) for host in expected}
        self.idle = idle
        for part in ("requests", "results"):
            os.makedirs(os.path.join(directory, part), mode=0o700, exist_ok=True)
        if arrivals:
            os.makedirs(arrivals, mode=0o700, exist_ok=True)

    def post(self, options, name=None, host=None):
        """Queue one target's ``options`` (again, under ``name``); the name its result will be found under. ``host``:
        the inventory host that arrives with them (its first post)."""
        name = name or f"{time.monotonic_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"
        write_json_atomically(os.path.join(self.directory, "requests", f"{name}.json"), options)
        if host is not None and self.arrivals:
            # Marked once the request is there, so a gathering that saw every mark claims every request. A mark
            # that cannot be made costs only a longer wait, never an error after the request is queued (its
            # fork would read its target alone while another read it too).
            with contextlib.suppress(OSError):
                self.mark_arrival(self.arrivals, host)
        return name

    @staticmethod
    def mark(host):
        """The file name that marks ``host``'s arrival (any inventory name, as a safe file name)."""
        return hashlib.sha256(str(host).encode()).hexdigest()[:32]

    @classmethod
    def mark_arrival(cls, arrivals, host):
        """Mark ``host`` as come in the ``arrivals`` directory (made if missing); OSError when it cannot be."""
        os.makedirs(arrivals, mode=0o700, exist_ok=True)
        os.close(os.open(os.path.join(arrivals, cls.mark(host)), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))

    def arrived(self):
        """How many have come: hosts of the play batch to any node (``arrivals``), else this node's waiting
        requests."""
        if self.arrivals and self.expected:
            return len(self.expected.intersection(os.listdir(self.arrivals)))
        return len(self.waiting())

    def withdraw(self, name):
        """Take ``name``'s request off the queue if no fork claimed it: a target whose fork left is never read.
        Whether it was still there (False: a reader has claimed it, and answers it or queues it again)."""
        try:
            os.unlink(os.path.join(self.directory, "requests", f"{name}.json"))
        except FileNotFoundError:
            return False
        return True

    def await_result(self, name, longest, clock=time.monotonic, sleep=time.sleep):
        """The result of ``name``, which a reader has claimed, waited for ``longest`` seconds at most. None when
        none came by then, or when the reader queued the request again (it did not answer it): taken back here,
        so no other fork reads it either."""
        deadline = clock() + longest
        while True:
            found = self.result(name)
            if found is not None:
                return found
            if self.withdraw(name) or clock() >= deadline:
                return None
            sleep(0.05)

    def hold(self, longest, clock=time.monotonic, sleep=time.sleep):
        """Wait for the node's lock, ``longest`` seconds at most, and hold it (one fork reads the node's targets at a
        time): its descriptor, to close to let go; None when it cannot be had (the target is then read alone). A lock
        held past ``longest`` (longer than a read may take: a hung fork) is a warning naming its holder, never a
        hang."""
        path = os.path.join(self.directory, "lead")
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            held = flock_within(descriptor, longest, clock, sleep)
        except OSError:
            held = False
        if not held:
            os.close(descriptor)
            display.warning(
                f"target_facts: the node's read lock {path} has been held for more than {longest:g} s by "
                f"{flock_holder(path)} (a read of this node's targets that does not end); this target is read alone"
            )
            return None
        return descriptor

    def waiting(self):
        """The names of the requests no fork has claimed yet, oldest first."""
        return sorted(
            n[: -len(".json")] for n in os.listdir(os.path.join(self.directory, "requests")) if n.endswith(".json")
        )

    def gather(self, idle=None, longest=None, clock=time.monotonic, sleep=time.sleep):
        """Wait while more targets are still coming: until all ``expected`` have, or none came for ``idle``
        seconds (default: the queue's), at most ``longest`` in all (default: GATHER_LONGEST, or GATHER_PER_HOST
        per expected host where that is longer). How many of this node's are waiting then."""
        idle = self.idle if idle is None else idle
        if longest is None:
            longest = max(GATHER_LONGEST, GATHER_PER_HOST * len(self.expected))
        started = last_change = clock()
        count = self.arrived()
        expected = len(self.expected) if self.arrivals and self.expected else float("inf")
        while count < expected and clock() - last_change < idle and clock() - started < longest:
            sleep(0.01)
            now = self.arrived()
            if now != count:
                count, last_change = now, clock()
        return len(self.waiting())

    def claim(self):
        """Every waiting request, taken off the queue: ``[(name, options)]``, oldest first (one that cannot be read
        is dropped: its fork, finding no result, reads its target itself)."""
        claimed = []
        for name in self.waiting():
            path = os.path.join(self.directory, "requests", f"{name}.json")
            try:
                with open(path, encoding="utf-8") as handle:
                    claimed.append((name, json.load(handle)))
            except (OSError, ValueError):
                pass
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return claimed

    def answer(self, name, result):
        write_json_atomically(os.path.join(self.directory, "results", f"{name}.json"), result)

    def result(self, name):
        """The result written for ``name``, taken off the queue; None when there is none (yet, or readable)."""
        path = os.path.join(self.directory, "results", f"{name}.json")
        try:
            with open(path, encoding="utf-8") as handle:
                found = json.load(handle)
        except (OSError, ValueError):
            return None
        os.unlink(path)
        return found
