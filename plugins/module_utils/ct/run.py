# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: the ONE way code in the target runs a command, with one kill rule.

Every probe part and acting script that runs a command does it through :func:`run`: the preflight and compile
cache parts' ``nvidia-smi``, every git read and write of the training code step (ct/git.py, its reset script),
the venv build's uv and pip, the compile cache's warm-up. So: standard library only, Python 3.9+, nothing of ours
imported; ``Target.run_probes`` ships its source with the parts that name it in ``SHARED``.

The rule: a command starts in a session of its own, with no stdin, in ``cwd`` (``/`` unless told: no project
file of some working directory is read), as ``user`` when given. Its output is read as it comes, each stream kept
up to ``cap`` bytes (what a target's command prints is untrusted: the rest is read and dropped). At its deadline
its whole process group gets SIGKILL (what it started dies with it) and it is waited for ``grace`` seconds, then
left behind, named: a process stuck in the kernel or the driver never exits, and the run must not hang on it.
An acting script that may itself be ended (the ``timeout`` around its ``pct exec``) calls :func:`end_with_me` first,
so that what it started, in sessions of their own, is ended with it.
"""

import contextlib
import os
import selectors
import signal
import subprocess
import time

# Seconds a killed command may take to exit before it is left behind (a process in state D never exits).
REAP_GRACE = 2
# Bytes of each stream kept: nvidia-smi prints KB, git's listing of a big tree MBs (ct/git.py keeps more).
OUTPUT_CAP = 4 * 1024 * 1024
_CHUNK = 65536
# How often ``on_output`` hears from a silent command (a progress heartbeat); a ``None`` chunk says "still running".
TICK = 2.0
# Process groups started and not yet ended (end_with_me ends them with this process).
_started = set()


def text_of(data):
    """Output as ``text=True`` reads it (universal newlines), bytes that are not UTF-8 replaced (U+FFFD)."""
    return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


def _read(process, deadline, cap, on_output, stall):
    """``([stdout, stderr] as bytes, reached their end, cut, stalled)``: both pipes read until their end,
    ``deadline``, or ``stall`` seconds without output (``stalled``)."""
    kept = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    cut = stalled = False
    heard = time.monotonic()
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            left = deadline - now
            quiet = left if stall is None else heard + stall - now
            if left <= 0 or quiet <= 0:
                stalled = left > 0
                break
            ready = selector.select(min(left, quiet, TICK) if on_output else min(left, quiet))
            if ready:
                heard = time.monotonic()
            elif on_output:
                on_output(None)
            for key, _events in ready:
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                if on_output:
                    on_output(chunk)
                room = len(chunk) if cap is None else cap - len(kept[key.fd])
                cut = cut or len(chunk) > room
                kept[key.fd] += chunk[: max(room, 0)]
        ended = not selector.get_map()
    return [bytes(kept[process.stdout.fileno()]), bytes(kept[process.stderr.fileno()])], ended, cut, stalled


def run(
    argv,
    timeout,
    env=None,
    *,
    user=None,
    cwd="/",
    cap=OUTPUT_CAP,
    text=True,
    grace=REAP_GRACE,
    on_output=None,
    fds=(),
    stall=None,
):
    """Run ``argv`` (never a shell) within ``timeout`` seconds, by the rule above.

    ``{"rc", "stdout", "stderr"}``, and when it applies: ``"missing": True`` (not found or not runnable, ``rc``
    127), ``"timed_out": True`` (killed at the deadline, ``rc`` 124), ``"abandoned": True`` (it did not exit
    ``grace`` seconds after SIGKILL), ``"truncated": True`` (a stream had more than ``cap`` bytes; None keeps
    all). ``env``: its whole environment (this process's when None). ``user``: ``(uid, gid, groups)`` it runs
    as. ``text`` False: both streams as bytes. ``on_output(chunk)``: each chunk of output as it comes, and None
    every TICK seconds while it is silent (ct/progress.py tells a long step's progress with it). ``fds``: open
    file descriptors it keeps, at the same numbers (git works on a directory opened as ``/proc/self/fd/<fd>``).
    ``stall``: seconds it may print nothing before it is killed as at its deadline (``"stalled": True`` too:
    ct/proc.py's reader prints after each file, so the one it is stuck on is known).

    >>> run(["echo", "hi"], 10)
    {'rc': 0, 'stdout': 'hi\\n', 'stderr': ''}
    """
    as_output = text_of if text else bytes
    switch = {} if user is None else {"user": user[0], "group": user[1], "extra_groups": list(user[2])}
    try:
        # Runs in the target, where no AnsibleModule.run_command exists.
        process = subprocess.Popen(  # pylint: disable=ansible-bad-function
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its process group is all it started: killed together at the deadline
            pass_fds=tuple(fds),
            **switch,
        )
    except FileNotFoundError:
        return _said(as_output, 127, f"{argv[0]}: command not found", missing=True)
    except (PermissionError, NotADirectoryError) as error:
        return _said(as_output, 127, f"{argv[0]}: cannot run it: {error.strerror}", missing=True)
    deadline = time.monotonic() + timeout
    _started.add(process.pid)
    with process:
        (out, err), ended, cut, stalled = _read(process, deadline, cap, on_output, stall)
        rc = _wait(process, deadline) if ended else None
        if rc is not None:
            _started.discard(process.pid)
            done = {"rc": rc, "stdout": as_output(out), "stderr": as_output(err)}
            return dict(done, truncated=True) if cut else done
        _kill_group(process.pid)
        said = f"{argv[0]} printed nothing for {stall:g} s" if stalled else f"{argv[0]} timed out after {timeout:g} s"
        flags = {"timed_out": True, "stalled": True} if stalled else {"timed_out": True}
        if _wait(process, time.monotonic() + grace) is None:
            # Left behind (a zombie until this process exits); named so the report says why.
            said += f" and did not exit after SIGKILL within {grace:g} s (stuck in the kernel or the driver)"
            process.returncode = -signal.SIGKILL  # so that leaving the with-block does not wait for it
            flags["abandoned"] = True
        # What it printed before, then why it ended: a caller's error quotes both.
        ending = said if as_output is text_of else said.encode()
        return dict({"rc": 124, "stdout": as_output(out), "stderr": as_output(err) + ending}, **flags)


def _kill_group(pid):
    _started.discard(pid)
    with contextlib.suppress(ProcessLookupError):  # gone already
        os.killpg(pid, signal.SIGKILL)


def end_with_me():
    """From now on SIGTERM or SIGHUP to this process first kills every command :func:`run` started and has not seen
    end (each in a session of its own, so the signal sent to this process group misses them), then exits 143."""

    def ending(signum, _frame):
        for pid in list(_started):
            _kill_group(pid)
        os._exit(128 + signum)

    # Only the main thread may set a handler: on a bare host the script runs in the module's thread, where no
    # timeout around a pct exec can end it, and nothing is set.
    with contextlib.suppress(ValueError):
        for number in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, ending)


def _wait(process, deadline):
    """Its exit code, or None when it has not exited by ``deadline``."""
    try:
        return process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _said(as_output, rc, message, **flags):
    """A result this module made up (``message`` as stderr) in the caller's type, text or bytes."""
    stderr = message if as_output is text_of else message.encode()
    return dict({"rc": rc, "stdout": as_output(b""), "stderr": stderr}, **flags)
