# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run commands in a Proxmox VE container (``pct exec``) or on a host: the ONE place that builds those argvs.

Every module of this project that touches a container or a host goes through :class:`Target`:

* with a vmid, a command runs inside the container as
  ``pct exec <vmid> --keep-env 0 -- timeout -k 5 <secs> env LC_ALL=C LANG=C <argv...>``
  (``--keep-env 0`` so the node's environment never leaks in; ``timeout`` inside the CT so that a command that
  hangs is killed in the CT too, not only the ``pct`` client on the node);
* without a vmid, the same command runs on this host (the module already runs there).

argv is always a list and never reaches a shell, and it carries no data: anything large (probe payloads, a hashed
lock, file content) goes on stdin, since Linux refuses one argument over 128 KiB (an argv it refuses all the same
is a TargetError of kind ``too_large``). The vmid is an integer in Proxmox's range before it is ever formatted.
Failures of ``pct`` itself (container missing or stopped, ``pct`` missing, a command missing inside) become
:class:`TargetError` with one line that says what was found and what to do.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_errors import RecoverError

VMID_MIN = 100
VMID_MAX = 999_999_999
DEFAULT_TIMEOUT = 60
KILL_GRACE = 5  # seconds `timeout -k` waits after SIGTERM before SIGKILL
C_LOCALE = {"LC_ALL": "C", "LANG": "C"}
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Messages of Proxmox's pct (pve-container: src/PVE/CLI/pct.pm, src/PVE/LXC/Config.pm) and of lxc-attach.
PCT_NOT_RUNNING = re.compile(r"container '(\d+)' not running!")
PCT_NO_CONFIG = re.compile(r"Configuration file '([^']+)' does not exist")
PCT_CONFIG_NODE = re.compile(r"(?:^|/)nodes/([^/]+)/lxc/")  # the node pct looked on, in its config path
PCT_PARAM_ERROR = re.compile(r"400 Parameter verification failed")
# pmxcfs, the cluster file system: every node of a cluster sees every node's CT configs here, as
# <node>/lxc/<vmid>.conf. Read only when pct says a CT is not on its node (a CT migrated since the inventory was
# written), never in a run that finds its CT.
PVE_NODES = "/etc/pve/nodes"
# pct before pve-container 5.0.9 (Proxmox VE 8.1, March 2024) has no --keep-env: Getopt::Long warns about it and
# the CLI handler fails with "400 unable to parse option" before anything runs in the CT.
PCT_NO_KEEP_ENV = re.compile(r"Unknown option: keep-env")
# What a cleared environment gets inside the CT (lxc-attach --clear-env's PATH).
CT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# rc 127 from lxc-attach, timeout(1) or env(1) when the command does not exist where it should run.
NOT_FOUND = (
    re.compile(r'Failed to exec "([^"]+)"'),
    re.compile(r"failed to run command [\u2018'`]([^\u2019'`]+)[\u2019'`]"),  # quotes: typographic or plain
    re.compile(r"env: [\u2018'`]([^\u2019'`]+)[\u2019'`]: No such file or directory"),
)
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_TIMEOUT = 124
EXIT_PCT_DIED = 255
# run_local's hard limits: each stream keeps its first OUTPUT_CAP bytes; after the deadline (or after the command
# exited while something it started still holds its pipes) the pipes are read for DRAIN_GRACE more seconds, and a
# killed leader is waited for REAP_GRACE seconds. POLL_INTERVAL is how often the leader's exit is checked.
OUTPUT_CAP = 8 * 1024 * 1024
DRAIN_GRACE = 1.0
REAP_GRACE = 0.5
POLL_INTERVAL = 0.1
READ_CHUNK = 65536


# The options of every module that reaches a target (documented once in plugins/doc_fragments/pve_target.py).
TARGET_ARGUMENT_SPEC = {
    "vmid": {"type": "int"},
    "node_name": {"type": "str"},
    "timeout": {"type": "int", "default": DEFAULT_TIMEOUT},
}
# The option of the modules that run probe parts or scripts in the target's own Python (doc fragment
# pve_target.python): the same interpreter everywhere, the fact pass's (the roles pass preflight_python).
PYTHON_ARGUMENT_SPEC = {"python": {"type": "str", "default": "python3"}}


class TargetError(RecoverError):
    """A command could not be run where it should, or failed.

    ``kind`` is stable for code (``invalid``, ``missing``, ``moved``, ``stopped``, ``no_pct``, ``not_found``,
    ``timeout``, ``failed``, ``probe``, ``too_large``); ``str(error)`` is the message for ``fail_json(msg=...)``.
    """

    @classmethod
    def of(cls, message, result, *, kind):
        """The error for a command that ran: its argv, exit code and output go along, apart from the message."""
        return cls(message, kind=kind, cmd=result.argv, rc=result.rc, stdout=result.stdout, stderr=result.stderr)


@dataclass(frozen=True)
class CommandResult:
    """What one command did: the argv actually executed (pct wrapper included), exit code, output, duration."""

    argv: list
    rc: int
    stdout: str
    stderr: str
    seconds: float = 0.0
    timed_out: bool = field(default=False)
    truncated: bool = field(default=False)  # a stream was longer than run_local's output_cap: only its head is kept
    abandoned: bool = field(default=False)  # it outlived SIGKILL (state D) and was left behind unreaped


def nodes_holding(vmid, nodes_dir=None):
    """The cluster nodes whose configuration holds CT ``vmid``, sorted: ``<nodes_dir>/<node>/lxc/<vmid>.conf``
    exists (``nodes_dir``: :data:`PVE_NODES`, which every node of a cluster sees whole). ``[]`` off a cluster.

    ``nodes_holding(200)`` -> ``["pve2"]`` once CT 200 migrated to pve2, seen from pve1 as from pve2."""
    nodes_dir = PVE_NODES if nodes_dir is None else nodes_dir
    try:
        names = os.listdir(nodes_dir)
    except OSError:
        return []
    return sorted(name for name in names if os.path.isfile(os.path.join(nodes_dir, name, "lxc", f"{vmid}.conf")))


def validate_vmid(value):
    """Return ``value`` as a Proxmox CT id (int 100..999999999) or None; raise TargetError for anything else.

    ``validate_vmid(200)`` is 200; ``validate_vmid("200; touch /tmp/x")`` raises: a vmid is formatted into a pct
    argv only after this check, so no string a user writes ever becomes part of a command.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not VMID_MIN <= value <= VMID_MAX:
        raise TargetError(
            f"vmid must be an integer from {VMID_MIN} to {VMID_MAX} (a Proxmox VE CT id), got {value!r}",
            kind="invalid",
        )
    return value


def run_local(argv, *, stdin=None, timeout=DEFAULT_TIMEOUT, env=None, output_cap=OUTPUT_CAP, on_output=None):
    """Run argv on this host without a shell; kill its whole process group when ``timeout`` passes.

    Hard deadline: the call returns at most ``timeout`` + DRAIN_GRACE + REAP_GRACE seconds after it started,
    whatever the command does. Output is read until the deadline (or until the command has exited and its pipes
    close, or DRAIN_GRACE after it exited while something it started still holds them); after a timeout the group
    is killed and what is left in the pipes is read for at most DRAIN_GRACE more, so a detached child (one that
    called setsid and keeps stdout open) or a process stuck in the driver cannot hold the run. Each stream keeps
    its first ``output_cap`` bytes; the rest is read and dropped (``truncated`` says so), so a command that prints
    without end never grows memory. A leader that outlives SIGKILL (state D) is left unreaped with rc -9 and
    ``abandoned`` set: no wait here is without a deadline.

    ``on_output(stream, chunk)``, when given, gets each chunk of ``stdout`` or ``stderr`` as it is read (a long
    step's progress lines, plugins/module_utils/pve_progress.py); what it raises is ignored.

    Raises FileNotFoundError when argv[0] does not exist (the caller turns it into a clear TargetError).
    """
    started = time.monotonic()
    full_env = dict(os.environ)
    full_env.update(C_LOCALE)
    full_env.update(env or {})
    data = stdin.encode() if isinstance(stdin, str) else stdin
    # Not run_command, which waits without a deadline; not a `with`: Popen.__exit__ would wait without one too.
    proc = subprocess.Popen(  # pylint: disable=ansible-bad-function
        argv,
        stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=full_env,
        start_new_session=True,  # so a timeout can kill pct and everything it started
    )
    try:
        out, err, timed_out = exchange(proc, data, started + timeout, output_cap, on_output)
    finally:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if proc.poll() is None:
            kill_group(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(REAP_GRACE)
    abandoned = proc.returncode is None  # never waited for again: a D-state process may never exit
    return CommandResult(
        argv=list(argv),
        rc=proc.returncode if proc.returncode is not None else -signal.SIGKILL,
        stdout=bytes(out.data).decode(errors="replace"),
        stderr=bytes(err.data).decode(errors="replace"),
        seconds=round(time.monotonic() - started, 3),
        timed_out=timed_out,
        truncated=out.dropped > 0 or err.dropped > 0,
        abandoned=abandoned,
    )


@dataclass
class CappedBuffer:
    """The first ``cap`` bytes of a stream and how many bytes after them were read and dropped."""

    cap: int
    data: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def add(self, chunk):
        room = max(0, self.cap - len(self.data))
        self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - room)


def kill_group(proc):
    """SIGKILL the process group run_local started (the leader's pid is its id); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def exchange(proc, data, deadline, cap, on_output=None):
    """Feed ``data`` to stdin and read stdout/stderr until EOF or the deadline; ``(out, err, timed_out)``.

    The same job as ``Popen.communicate`` with two differences: no wait is without a deadline (see run_local)
    and each stream keeps at most ``cap`` bytes.
    """
    buffers = {proc.stdout.fileno(): CappedBuffer(cap), proc.stderr.fileno(): CappedBuffer(cap)}
    streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    timed_out = False
    stop_at = None  # once set (the group was killed or the leader exited): stop reading at this time anyway
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        feeder = StdinFeeder(proc.stdin, data, selector)
        while selector.get_map():
            now = time.monotonic()
            if stop_at is None and (now >= deadline or proc.poll() is not None):
                # Killed at the deadline, or exited while what it started may keep the pipes open: not for long.
                timed_out = now >= deadline and proc.poll() is None
                if timed_out:
                    kill_group(proc)
                stop_at = now + DRAIN_GRACE
            if stop_at is not None and now >= stop_at:
                break
            wait = min(deadline if stop_at is None else stop_at, now + POLL_INTERVAL) - now
            for key, _ in selector.select(max(wait, 0)):
                if key.fd not in buffers:
                    feeder.write()
                    continue
                chunk = os.read(key.fd, READ_CHUNK)
                if chunk:
                    buffers[key.fd].add(chunk)
                    if on_output is not None:
                        with contextlib.suppress(Exception):  # a reader of progress never stops the command
                            on_output(streams[key.fd], chunk)
                else:
                    selector.unregister(key.fd)
    if not timed_out and proc.poll() is None:
        # It closed its output but still runs: wait for it as long as the deadline allows.
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
    out, err = buffers.values()
    return out, err, timed_out


class StdinFeeder:
    """Writes ``data`` to a child's stdin without ever blocking (the pipe is non-blocking, driven by a selector)."""

    def __init__(self, pipe, data, selector):
        self.pipe = pipe
        self.view = memoryview(data or b"")
        self.offset = 0
        self.selector = selector
        if pipe is None:
            return
        if self.view:
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe.fileno(), selectors.EVENT_WRITE)
        else:
            pipe.close()

    def write(self):
        try:
            self.offset += os.write(self.pipe.fileno(), self.view[self.offset : self.offset + READ_CHUNK])
        except BlockingIOError:
            return
        except BrokenPipeError:
            self.offset = len(self.view)  # it stopped reading: the rest of stdin is not wanted
        if self.offset >= len(self.view):
            self.selector.unregister(self.pipe.fileno())
            with contextlib.suppress(BrokenPipeError):
                self.pipe.close()


class Target:
    """A Proxmox CT seen from its node (``vmid`` given) or a bare host (``vmid`` None).

    ``runner`` executes an argv on the node and returns a CommandResult (tests inject a fake that asserts the
    exact argvs); ``node`` names the node in messages; ``python`` is the CT's interpreter that runs probe parts.
    """

    def __init__(self, vmid=None, *, node=None, runner=None, pct="pct", timeout=DEFAULT_TIMEOUT, python="python3"):
        self.vmid = validate_vmid(vmid)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
            # timeout(1) reads 0 as "no deadline": a hung command would then hang the run.
            raise TargetError(f"timeout must be a whole number of seconds, at least 1, got {timeout!r}", kind="invalid")
        self.node = node or socket.gethostname()
        self.runner = runner or run_local
        self.pct = pct
        self.timeout = timeout
        self.python = python
        # Whether this node's pct takes --keep-env (pve-container 5.0.9+); learnt from its answer, once per Target.
        self.pct_keep_env = True

    @classmethod
    def from_params(cls, params):
        """The target a module's TARGET_ARGUMENT_SPEC (and PYTHON_ARGUMENT_SPEC) options name."""
        python = params.get("python") or "python3"
        return cls(params["vmid"], node=params["node_name"], timeout=params["timeout"], python=python)

    @property
    def is_container(self):
        return self.vmid is not None

    @property
    def label(self):
        """How messages name this target: ``CT 200 on pve1`` or ``host pve1``."""
        return f"CT {self.vmid} on {self.node}" if self.is_container else f"host {self.node}"

    # -- argv shapes ---------------------------------------------------------------------------------------
    def command_argv(self, argv, *, timeout=None, env=None):
        """The argv that runs ``argv`` in the target with a deadline (pure; unit tests assert it exactly)."""
        argv = [str(a) for a in argv]
        if not argv:
            raise TargetError(f"{self.label}: empty command", kind="invalid")
        seconds = int(timeout or self.timeout)
        guarded = ["timeout", "-k", str(KILL_GRACE), str(seconds)]
        if not self.is_container:
            return [*guarded, *argv]
        extra = []
        for name, value in sorted((env or {}).items()):
            if not ENV_NAME.match(name):
                raise TargetError(f"{self.label}: invalid environment variable name {name!r}", kind="invalid")
            extra.append(f"{name}={value}")
        if "=" in argv[0]:
            # env(1) would read it as an assignment, not as the command.
            raise TargetError(f"{self.label}: command name {argv[0]!r} contains '='", kind="invalid")
        locale = [f"{k}={v}" for k, v in C_LOCALE.items()]
        if self.pct_keep_env:
            return [self.pct, "exec", str(self.vmid), "--keep-env", "0", "--", *guarded, "env", *locale, *extra, *argv]
        # An older pct passes the node's environment on: clear it inside the CT instead.
        inner = ["env", "-i", f"PATH={CT_PATH}", *locale, *extra, *argv]
        return [self.pct, "exec", str(self.vmid), "--", *guarded, *inner]

    def pct_argv(self, *args):
        """A plain ``pct <subcommand> <vmid> ...`` call (status, push, pull)."""
        return [self.pct, args[0], str(self.vmid), *[str(a) for a in args[1:]]]

    # -- running -------------------------------------------------------------------------------------------
    def run(self, argv, *, stdin=None, timeout=None, env=None, check=True, on_output=None):
        """Run ``argv`` in the target; return CommandResult. With ``check``, a non-zero exit raises TargetError.

        ``on_output(stream, chunk)`` gets the output as it comes (see run_local); only passed on when given.
        """
        seconds = int(timeout or self.timeout)
        wrapped = self.command_argv(argv, timeout=seconds, env=env)
        result = self._execute(
            wrapped,
            argv,
            stdin=stdin,
            timeout=seconds + KILL_GRACE + 10,
            env=None if self.is_container else env,
            on_output=on_output,
        )
        if self.is_container and self.pct_keep_env and self._pct_lacks_keep_env(result):
            # Rejected before anything ran in the CT: safe to run again the old way.
            self.pct_keep_env = False
            wrapped = self.command_argv(argv, timeout=seconds, env=env)
            result = self._execute(wrapped, argv, stdin=stdin, timeout=seconds + KILL_GRACE + 10, on_output=on_output)
        self._raise_for_wrapper(result, argv, seconds)
        if check and result.rc != 0:
            raise TargetError.of(
                f"{self.label}: `{' '.join(map(str, argv))}` failed with exit code {result.rc}: "
                f"{first_line(result.stderr) or first_line(result.stdout) or 'no output'}",
                result,
                kind="failed",
            )
        return result

    def run_on_node(self, argv, *, stdin=None, timeout=None, env=None, check=True):
        """Run ``argv`` on the node itself (NVML, /proc and cgroups are only visible there), never in the CT."""
        node_target = (
            self if not self.is_container else Target(node=self.node, runner=self.runner, timeout=self.timeout)
        )
        return node_target.run(argv, stdin=stdin, timeout=timeout, env=env, check=check)

    def status(self):
        """``running`` or ``stopped`` as ``pct status`` says; TargetError when the CT does not exist."""
        argv = self.pct_argv("status")
        result = self._execute(argv, argv, timeout=self.timeout)
        self._raise_for_pct(result)
        match = re.search(r"^status: (\S+)", result.stdout, re.MULTILINE)
        if result.rc != 0 or not match:
            raise TargetError.of(
                f"{self.label}: `pct status {self.vmid}` gave no status (exit {result.rc}): "
                f"{first_line(result.stderr) or first_line(result.stdout)}",
                result,
                kind="failed",
            )
        return match.group(1)

    def read_file(self, path, *, timeout=None):
        """Content of ``path`` in the target, or None when it does not exist."""
        result = self.run(["cat", "--", path], timeout=timeout, check=False)
        if result.rc != 0:
            if "No such file or directory" in result.stderr:
                return None
            raise TargetError.of(
                f"{self.label}: cannot read {path}: {first_line(result.stderr)}",
                result,
                kind="failed",
            )
        return result.stdout

    def write_file(self, path, content, *, mode=0o644, timeout=None):
        """Write ``content`` to ``path`` in the target atomically (temp file + rename); the path stays an argv."""
        script = 'umask 077 && t="$1.tmp.$$" && cat > "$t" && chmod "$2" "$t" && mv -f "$t" "$1"'
        self.run(["sh", "-c", script, "sh", path, f"{mode:o}"], stdin=content, timeout=timeout)

    def run_probe(self, probe_module, payload, *, python=None, timeout=None):
        """Run ``probe_module.probe(payload)`` in the target and return its JSON-able answer (one ``pct exec``)."""
        name = probe_name(probe_module)
        part = self.run_probes({name: (probe_module, payload)}, python=python, timeout=timeout)[name]
        if "error" in part:
            raise TargetError(f"{self.label}: the {name} probe failed: {part['error']}", kind="probe")
        return part["answer"]

    def run_probes(self, parts, *, python=None, timeout=None, on_output=None):
        """Run several probe parts in the target in ONE process and return ``{name: {"answer"|"error", "seconds"}}``.

        ``parts`` maps a name to ``(probe_module, payload)``. In a CT the modules' sources and their payloads
        travel as one JSON document on stdin to the CT's python through ONE ``pct exec`` (argv holds only the
        fixed PROBES_MAIN: a payload such as a hashed lock can pass Linux's 128 KiB limit on one argument), each
        executed in a namespace of its own (so their helpers never clash) and called in order; a part that raises
        reports its error without stopping the others. On a bare host the parts run in this process, in a thread
        waited for ``timeout`` + KILL_GRACE seconds at most: a part stuck on a hung mount or in the driver is an
        error of kind ``wedged`` instead of a hung run. The answer of a CT is untrusted: anything but the expected
        JSON shape is a TargetError naming what came back. ``python``: the CT's interpreter, the target's own when
        None.

        ``on_output(stream, chunk)`` gets the parts' output as it comes: their progress lines (pve_ct_progress),
        which an error's message then leaves out. On a bare host the parts run here, and their lines go to it
        through ``pve_ct_progress.sink``.
        """
        python = python or self.python
        if not self.is_container:
            if on_output is None:
                return run_parts_bounded(parts, int(timeout or self.timeout) + KILL_GRACE, self.label)
            pve_ct_progress.sink = lambda line: on_output("stderr", line + "\n")
            try:
                return run_parts_bounded(parts, int(timeout or self.timeout) + KILL_GRACE, self.label)
            finally:
                pve_ct_progress.sink = None
        result = self.run(
            probes_argv(python), stdin=probes_input(parts), timeout=timeout, check=False, on_output=on_output
        )
        if on_output is not None:
            result = dataclasses.replace(result, stderr=pve_ct_progress.strip(result.stderr))
        try:
            answer = json.loads(result.stdout)
        except ValueError:
            answer = None
        names = " + ".join(parts)
        if result.rc != 0 or not isinstance(answer, dict):
            raise TargetError.of(
                f"{self.label}: the {names} probe failed (exit {result.rc}): "
                f"{last_line(result.stderr) or 'no JSON on stdout'}",
                result,
                kind="probe",
            )
        for name in parts:
            part = answer.get(name)
            if not isinstance(part, dict) or not ("answer" in part or isinstance(part.get("error"), str)):
                raise TargetError.of(
                    f"{self.label}: the {names} probe answered no {name!r} part in the expected shape; "
                    f"is something inside the CT replacing {python}?",
                    result,
                    kind="probe",
                )
        return {name: answer[name] for name in parts}

    # -- internals -----------------------------------------------------------------------------------------
    def _execute(self, wrapped, argv, *, stdin=None, timeout, env=None, on_output=None):
        try:
            extra = {} if on_output is None else {"on_output": on_output}  # runners that take no reader get none
            return self.runner(wrapped, stdin=stdin, timeout=timeout, env=env, **extra)
        except FileNotFoundError:
            if self.is_container:
                raise TargetError(
                    f"pct not found in PATH of node {self.node}: this is not a Proxmox VE node; set pve_node to "
                    f"the node that hosts CT {self.vmid}, or leave pve_vmid unset for a bare GPU host",
                    kind="no_pct",
                    cmd=wrapped,
                ) from None
            raise TargetError(
                f"{self.label}: `{wrapped[0]}` not found in PATH (coreutils `timeout` is needed to run "
                f"`{argv[0]}` with a deadline)",
                kind="not_found",
                cmd=wrapped,
            ) from None
        except OSError as error:
            if error.errno != errno.E2BIG:
                raise
            # A size limit is an error that says so, never a traceback (large data goes on stdin).
            longest = max(len(str(a).encode()) for a in wrapped)
            raise TargetError(
                f"{self.label}: the command line of `{argv[0]}` is too large for the kernel (E2BIG: "
                f"{sum(len(str(a).encode()) + 1 for a in wrapped)} bytes, the longest argument {longest} bytes; "
                f"Linux allows 128 KiB per argument): send large data on stdin",
                kind="too_large",
                cmd=[str(a)[:200] for a in wrapped],
            ) from None

    @staticmethod
    def _pct_lacks_keep_env(result):
        return result.rc == EXIT_PCT_DIED and bool(PCT_NO_KEEP_ENV.search(result.stderr))

    def _raise_for_pct(self, result):
        if not self.is_container or result.rc != EXIT_PCT_DIED:
            return
        err = result.stderr
        if PCT_NOT_RUNNING.search(err):
            raise TargetError.of(
                f"{self.label} is not running (pct: container '{self.vmid}' not running!); "
                f"start it with `pct start {self.vmid}` on {self.node} and run again",
                result,
                kind="stopped",
            )
        missing = PCT_NO_CONFIG.search(err)
        if missing:
            self._raise_if_moved(missing.group(1), result)
            raise TargetError.of(
                f"CT {self.vmid} does not exist on node {self.node} ({missing.group(1)} is missing); "
                f"check pve_vmid and pve_node in the inventory (`pct list` on the node shows its CTs)",
                result,
                kind="missing",
            )
        if PCT_PARAM_ERROR.search(err):
            raise TargetError.of(
                f"{self.label}: pct rejected the call: {' '.join(err.split())[:300]}",
                result,
                kind="invalid",
            )

    def _raise_if_moved(self, config, result):
        """A CT pct does not find on this node but another node of the cluster holds (:func:`nodes_holding`; ``config``
        is the path pct names, ``nodes/<this node>/lxc/<vmid>.conf``) has migrated: say where it lives now."""
        here = PCT_CONFIG_NODE.search(config)
        elsewhere = [node for node in nodes_holding(self.vmid) if not here or node != here.group(1)]
        if not elsewhere:
            return
        where = " and ".join(elsewhere)
        one = len(elsewhere) == 1
        raise TargetError.of(
            f"CT {self.vmid} lives on {'node' if one else 'nodes'} {where} now (moved from {self.node}): set "
            f"pve_node to {where if one else 'the one it runs on'} or use the community.proxmox.proxmox inventory "
            f"plugin",
            result,
            kind="moved",
        )

    def _raise_for_wrapper(self, result, argv, seconds):
        self._raise_for_pct(result)
        if result.timed_out or (result.rc == EXIT_TIMEOUT and result.seconds >= seconds - 0.5):
            left = (
                "; it did not exit after SIGKILL (stuck in the kernel or the driver, state D) and was left behind"
                if getattr(result, "abandoned", False)
                else ""
            )
            raise TargetError.of(
                f"{self.label}: `{' '.join(map(str, argv))}` timed out after {seconds} s and was killed{left}",
                result,
                kind="timeout",
            )
        if result.rc in (EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE):
            for pattern in NOT_FOUND:
                found = pattern.search(result.stderr)
                if found and found.group(1) == str(argv[0]):
                    where = f"inside CT {self.vmid}" if self.is_container else f"on host {self.node}"
                    raise TargetError.of(
                        f"{self.label}: `{argv[0]}` not found {where} (PATH of a non-login root shell); "
                        f"install it there or give its full path",
                        result,
                        kind="not_found",
                    )


def probe_name(module):
    """``...module_utils.steps.preflight.probe`` -> ``preflight``: how messages name a probe part (its step's name)."""
    parts = module.__name__.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] in ("probe", "script") else parts[-1]


def run_part(function, payload):
    """One probe part's result: its answer, or the error it raised, and how long it took."""
    started = time.monotonic()
    try:
        return {"answer": function(payload), "seconds": round(time.monotonic() - started, 3)}
    except Exception as error:  # one broken part must not hide the answers of the others
        return {"error": f"{type(error).__name__}: {error}", "seconds": round(time.monotonic() - started, 3)}


def run_parts_bounded(parts, seconds, label, clock=time.monotonic):
    """The bare host's run_probes: each part of ``parts`` in order in a daemon thread, waited for ``seconds``.

    A part that has not answered by then (and every part after it) gets ``{"error": "wedged: ...", "wedged":
    True}``; the thread is left behind (a daemon: the module's exit ends it; a wait on a hung NFS or FUSE mount
    is killable).
    """
    answers = {}
    worker = threading.Thread(
        target=lambda: answers.update((n, run_part(m.probe, p)) for n, (m, p) in parts.items()),
        name="probe parts",
        daemon=True,
    )
    started = clock()
    worker.start()
    worker.join(seconds)
    if not worker.is_alive():
        return answers
    done = dict(answers)  # a copy: the stuck thread may still add to answers
    for name in parts:
        if name not in done:
            done[name] = {
                "error": f"wedged: no answer within {seconds} s on {label} (a hung NFS/FUSE mount or a device stuck "
                f"in the driver: look for processes in state D); the part was abandoned",
                "wedged": True,
                "seconds": round(clock() - started, 3),
            }
    return done


def probes_argv(python):
    """``[python, "-I", "-S", "-c", PROBES_MAIN]``: the probe program's argv, fixed whatever the payloads (pure).

    ``-S``: the parts need the standard library only, so the CT's ``site`` (its site-packages and their ``.pth``
    files, which a CT's own packages may break or make slow) never runs before them; it also spares every CT's
    read the import of ``site`` (docs/benchmarks.md, the fleet)."""
    return [python, "-I", "-S", "-c", PROBES_MAIN]


# Sources read so far (module_source), by module name.
_SOURCES = {}
_SOURCES_LOCK = threading.Lock()


def module_source(module):
    """``inspect.getsource(module)``, read once per process and under a lock: the passes of one node's targets run in
    threads (target_facts' ``batch``), and two threads reading sources from AnsiballZ's zip at once made inspect
    fail with "could not get source code" (linecache's cache is not safe from threads; seen at 16 CTs)."""
    with _SOURCES_LOCK:
        if module.__name__ not in _SOURCES:
            _SOURCES[module.__name__] = inspect.getsource(module)
        return _SOURCES[module.__name__]


def probes_input(parts):
    """The stdin of PROBES_MAIN for ``parts`` (``{name: (module, payload)}``): one JSON document holding the
    container-side modules the parts declare in ``SHARED`` (each once, a module's own ``SHARED`` before it), then
    each part's source and payload. Data, never argv: a hashed lock of a full ML stack is larger than one argument
    may be (MAX_ARG_STRLEN, 128 KiB)."""
    return json.dumps(
        {
            "shared": {m.__name__: module_source(m) for m in shared_modules(m for m, _ in parts.values())},
            "sources": {name: module_source(module) for name, (module, _) in parts.items()},
            "payloads": {name: payload for name, (_, payload) in parts.items()},
        }
    )


def shared_modules(modules):
    """The container-side modules ``modules`` declare in ``SHARED``, and those their own ``SHARED`` declare, at any
    depth: each once, after every module it needs (pure). A part names only what it imports itself."""
    found = []

    def add(module, seen):
        for needed in getattr(module, "SHARED", ()):
            if needed not in found and needed not in seen:
                add(needed, (*seen, needed))
                found.append(needed)

    for module in modules:
        add(module, ())
    return found


# What the CT's python runs (``-c``; the parts come on stdin, see probes_input): stub modules for ``ansible`` and the
# collection's module_utils, always, so that nothing of the CT's own Python path (an Ansible, a copy of this
# collection) is ever imported by a part; the shared modules, each registered under its own dotted name, so that a
# part's ``from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_fs`` finds it; then each
# part's source in a module of its own and probe(payload) of each, in order; the answers as one JSON object on
# stdout. Standard library only, Python 3.9+.
#
# Every CT pays its imports on every run, so it imports no pure-Python module: the ``json`` package imports ``re``
# (and ``re`` imports ``enum``, ``functools``, ``collections``): about 7 of the 13 ms the old imports cost a CT
# (docs/benchmarks.md, "The CT's read without imports"). It reads its stdin with json's own C scanner and writes
# the answer with json's own C string encoder (``_json``, what ``json.loads``/``json.dumps`` call); a value that is
# not plain JSON data, or a Python without ``_json``, goes through the ``json`` package as before.
PROBES_MAIN = """
import sys, time

try:
    from _json import encode_basestring_ascii as quote, make_scanner
except ImportError:
    quote = make_scanner = None


class NotPlain(Exception):
    pass


class Decoding:
    # What json's C scanner asks of its decoder: json.loads' defaults.
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


def loads(data):
    if make_scanner is not None:
        try:
            text = data.decode("utf-8")
            value, end = make_scanner(Decoding)(text, 0)
            if end == len(text):
                return value
        except (StopIteration, ValueError, RecursionError):
            pass  # json.loads says what is wrong, or reads what this does not (a BOM, deep nesting)
    import json

    return json.loads(data)


def dumps(value):
    kind = type(value)
    if kind is str:
        return quote(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    if kind is list or kind is tuple:
        return "[" + ", ".join([dumps(item) for item in value]) + "]"
    if kind is dict and all(type(key) is str for key in value):
        return "{" + ", ".join([quote(key) + ": " + dumps(item) for key, item in value.items()]) + "}"
    raise NotPlain


def stub(dotted):
    names = dotted.split(".")
    for depth in range(1, len(names) + 1):
        name = ".".join(names[:depth])
        if name not in sys.modules:
            sys.modules[name] = type(sys)(name)
            if depth > 1:
                setattr(sys.modules[".".join(names[: depth - 1])], names[depth - 1], sys.modules[name])
    return sys.modules[dotted]


answers = {}
given = loads(sys.stdin.buffer.read())
payloads = given["payloads"]
stub("ansible.module_utils")
stub("ansible_collections.pve_gpu.recover.plugins.module_utils")
for dotted, source in given["shared"].items():
    exec(compile(source, "<shared " + dotted + ">", "exec"), stub(dotted).__dict__)
for name, source in given["sources"].items():
    started = time.monotonic()
    try:
        module = type(sys)("probe_" + name)
        exec(compile(source, "<probe " + name + ">", "exec"), module.__dict__)
        answer = {"answer": module.probe(payloads[name])}
    except Exception as error:
        answer = {"error": type(error).__name__ + ": " + str(error)}
    answer["seconds"] = round(time.monotonic() - started, 3)
    answers[name] = answer
try:
    if quote is None:
        raise NotPlain
    written = dumps(answers)
except (NotPlain, RecursionError):  # deep nesting: json's C encoder goes deeper than this recursion
    import json

    written = json.dumps(answers)
sys.stdout.write(written)
"""


def first_line(text):
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def last_line(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""
