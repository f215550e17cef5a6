# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: what a long acting script is doing, told while it does it.

The venv build and the compile cache warm-up run for minutes in ONE ``pct exec`` whose answer comes at the end.
While they run, they say what they are at on the probe process's stderr, one line each, ``MARK`` then a JSON object
``{"phase", "line", "phase_seconds"}``: the phase (``installing the lock with `uv pip sync```), the last line the
command printed (``Downloading torch (846.0MiB)``, a warm-up's ``compiling layer 12/40``), and how long the phase
has run. The module on the node reads them as they come (``Target.run_probes(on_output=...)``) and hands them to
the controller (plugins/module_utils/node/progress.py). Nothing here waits on the reader: a line is written and the
script goes on. Only a script whose payload asks for it (``"progress": true``, set by a module that has somewhere
to send it) tells anything: :func:`start`. A command's output reaches it through :func:`follow_output`, the
``on_output`` of the one runner (``ct_run.run``).

Shipped with the acting scripts (``SHARED``) and imported on a node as any module_util: standard library only,
Python 3.9+, nothing of ours imported. On a bare host the script runs in the module's process, and the module sets
:data:`sink` to take the lines directly.

A line leaves the target as an answer does: a script whose commands see secrets (the venv build's index
credentials and secret environment) gives :func:`start` its ``redact`` (``ct_act.redact`` with those secrets),
applied to each phase and output line before it is cut to LINE_CHARS, so no part of a secret is ever told.
"""

import contextlib
import json
import sys
import time

MARK = "pve-gpu-recover-progress "
# At most one line per this many seconds (a phase change is told at once); the controller polls every 15 s.
INTERVAL = 2.0
LINE_CHARS = 240
READ_CHUNK = 65536
# Where lines go: None writes them to stderr (in a CT, the pct exec's); a module on a bare host sets a callable.
sink = None
_state = {"enabled": False, "phase": None, "since": 0.0, "line": None, "told": 0.0, "redact": None}


def start(enabled, redact=None):
    """Tell progress from now on (``enabled``: the payload's ``progress``), or nothing at all.

    ``redact(text)``, when given, masks what must not leave the target in each phase and line (see above).
    """
    _state.update(enabled=bool(enabled), phase=None, since=time.monotonic(), line=None, told=0.0, redact=redact)


def _masked(text):
    redact = _state["redact"]
    if redact is None:
        return text
    try:
        return str(redact(text))
    except Exception:  # progress is never worth failing the work for, nor a secret worth telling
        return ""


def _tell(force=False):
    now = time.monotonic()
    if not _state["enabled"] or (not force and now - _state["told"] < INTERVAL):
        return
    _state["told"] = now
    text = MARK + json.dumps(
        {"phase": _state["phase"], "line": _state["line"], "phase_seconds": round(now - _state["since"], 1)}
    )
    with contextlib.suppress(Exception):  # progress is never worth failing the work for
        if sink is not None:
            sink(text)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()


def phase(name):
    """A new phase starts (told at once): ``phase("installing the lock with `uv pip sync`")``."""
    _state.update(phase=_masked(str(name))[:LINE_CHARS], since=time.monotonic(), line=None)
    _tell(force=True)


def note(line):
    """The command's latest output line (told at most every INTERVAL seconds; the newest one wins)."""
    line = " ".join(_masked(str(line)).split())[:LINE_CHARS]
    if line:
        _state["line"] = line
        _tell()


def strip(text):
    """``text`` (a command's stderr, read on the node) without its progress lines: an error names what failed."""
    return "".join(line for line in (text or "").splitlines(keepends=True) if not line.startswith(MARK))


def last_line(data):
    """The last non-empty line of ``data`` (bytes), a progress bar's ``\\r`` counted as a line end, or ``""``.

    >>> last_line(b"Collecting six\\nDownloading torch (846.0MiB)\\n")
    'Downloading torch (846.0MiB)'
    """
    for line in reversed(data.replace(b"\r", b"\n").split(b"\n")):
        if line.strip():
            return line.decode(errors="replace").strip()
    return ""


def follow_output(what=None):
    """A follower of one command: the ``on_output`` of the one runner (``ct_run.run(..., on_output=...)``).

    ``what`` (``installing the lock with `uv pip sync```), when given, is told at once as the new phase. Then each
    line the command ends is told (:func:`note`) as it comes, the newest one winning; a line not ended yet is told
    once it ends. The runner calls it with None every ``ct_run.TICK`` seconds of silence, so a command that prints
    nothing for a while is still told (the phase and its time) every INTERVAL seconds. Both streams come through
    one follower: a line is whatever ends next, on either.
    """
    if what is not None:
        phase(what)
    partial = [b""]  # the line not ended yet, its last LINE_CHARS * 4 bytes

    def on_output(chunk):
        if chunk is None:
            _tell()
            return
        text = partial[0] + chunk
        end = max(text.rfind(b"\n"), text.rfind(b"\r"))
        if end >= 0:
            note(last_line(text[:end]))
        else:
            _tell()  # output, but no line ended: the elapsed time stays live
        partial[0] = text[end + 1 :][-LINE_CHARS * 4 :]

    return on_output
