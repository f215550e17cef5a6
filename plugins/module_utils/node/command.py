# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A command on this host under a hard deadline: :func:`run_local`, the runner :class:`Target
<plugins.module_utils.node.target.Target>` uses by default, and :class:`CommandResult`, what every runner answers.

No wait is without a deadline: the process group is killed at the deadline, the pipes are read for a grace after it,
a leader that outlives SIGKILL (state D) is left behind, named; each stream keeps its first OUTPUT_CAP bytes.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field

DEFAULT_TIMEOUT = 60
C_LOCALE = {"LC_ALL": "C", "LANG": "C"}
# run_local's hard limits: each stream keeps its first OUTPUT_CAP bytes; after the deadline (or after the command
# exited while something it started still holds its pipes) the pipes are read for DRAIN_GRACE more seconds, and a
# killed leader is waited for REAP_GRACE seconds. POLL_INTERVAL is how often the leader's exit is checked.
OUTPUT_CAP = 8 * 1024 * 1024
DRAIN_GRACE = 1.0
REAP_GRACE = 0.5
POLL_INTERVAL = 0.1
READ_CHUNK = 65536


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
    step's progress lines, plugins/module_utils/node/progress.py); what it raises is ignored.

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
            for key, _events in selector.select(max(wait, 0)):
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
