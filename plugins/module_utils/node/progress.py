# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Node side: a long step's progress, from the script in the target to the controller, while the module runs.

A module cannot print while it runs: Ansible reads its answer when it ends. So a long step's acting module (the
venv build, the compile cache's warm-up) runs as an Ansible async job, and writes its progress into that job's
status file: the status async_wrapper wrote (``started``, not ``finished``, its ``ansible_job_id``) with one more
key, ``pve_gpu_recover_progress``. Whoever reads the status gets it: the step's action (plugins/plugin_utils/
long_step.py, through :func:`wait_for_job` in the step_job_status module: each status call waits here, on the node,
until the job ends or the progress interval passes) or Ansible's own ``async_status`` where a task polls the module
itself. When the job finishes, async_wrapper replaces the file with the module's answer, as always.

Finding the file takes two facts of ansible-core's async_wrapper (2.19 to 2.21, unchanged since 2.x): the module
is its child, started with argv ``... async_wrapper.py <jid> <time limit> ...``, and the file is
``$ANSIBLE_ASYNC_DIR/<jid>.<pid>``. Both are checked, and the file is written only while it holds exactly that
job's unfinished status; anything else (no async, another layout) and the module simply tells nothing: progress
never changes what the module does. A converged target, whose acting task is skipped, runs nothing more than before.

What the target says is untrusted text: each line is parsed as JSON of the expected shape, its text made one
printable line (text.printable) and cut.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import progress as ct_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable

KEY = "pve_gpu_recover_progress"
MARK = ct_progress.MARK
JID = re.compile(r"^j?\d{1,20}$")
# A job's status file, as async_wrapper names it: ``<jid>.<pid>``.
JOB_NAME = re.compile(r"^j?\d{1,20}\.\d{1,10}$")
# The job file is rewritten at most this often (a phase change at once): a status call shows it at most every
# progress interval (15 s), and each write costs a rename.
WRITE_INTERVAL = 2.0
TEXT_CHARS = 240
# While a status call waits, the job file is checked this often (a stat; read again only when it changed): the end
# of a job is seen within this, and 20 stats a second cost nothing measurable.
TICK = 0.05
# A status file is read up to this size: the module's answer (a venv's freeze: about 100 KB) or its progress.
JOB_FILE_CAP = 64 * 1024 * 1024


def parse_line(line):
    """``{"phase", "line", "phase_seconds"}`` of one progress line from the target, or None for any other line.

    >>> parse_line('pve-gpu-recover-progress {"phase": "installing", "line": "Downloading torch", "phase_seconds": 3}')
    {'phase': 'installing', 'line': 'Downloading torch', 'phase_seconds': 3.0}
    """
    if not line.startswith(MARK):
        return None
    try:
        found = json.loads(line[len(MARK) :])
    except ValueError:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("phase"), str):
        return None
    seconds = found.get("phase_seconds")
    number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
    return {
        "phase": clean(found["phase"]),
        "line": clean(found["line"]) if isinstance(found.get("line"), str) else None,
        "phase_seconds": float(seconds) if number else None,
    }


def clean(text):
    return printable(" ".join(str(text).split()), TEXT_CHARS)


def elapsed(seconds):
    """``252.4`` -> ``4m12s``; ``3725`` -> ``1h02m05s``."""
    seconds = int(max(0, seconds or 0))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{seconds:02d}s"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def describe(progress):
    """One line for people from a progress document (the controller's side: the callback, the drift runner).

    >>> describe({"step": "training_venv", "phase": "installing the lock", "line": "Downloading torch (846.0MiB)",
    ...           "elapsed_seconds": 252})
    'training_venv: installing the lock (4m12s): Downloading torch (846.0MiB)'
    """
    if not isinstance(progress, dict):
        return ""
    step = clean(progress.get("step") or "step")
    what = clean(progress.get("phase") or "working")
    line = progress.get("line")
    text = f"{step}: {what} ({elapsed(progress.get('elapsed_seconds'))})"
    return text + (f": {clean(line)}" if isinstance(line, str) and line else "")


def async_job_file(environ=None, ppid=None, proc="/proc"):
    """The async status file of the job this module runs as, or None when it runs otherwise (see the docstring)."""
    environ = os.environ if environ is None else environ
    if "ANSIBLE_ASYNC_DIR" not in environ:
        return None
    ppid = os.getppid() if ppid is None else ppid
    try:
        with open(f"{proc}/{ppid}/cmdline", "rb") as handle:
            argv = [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return None
    jid = job_id(argv)
    if jid is None:
        return None
    directory = os.path.expanduser(environ["ANSIBLE_ASYNC_DIR"])
    try:
        found = [n for n in os.listdir(directory) if n.startswith(jid + ".") and n[len(jid) + 1 :].isdigit()]
    except OSError:
        return None
    return os.path.join(directory, found[0]) if len(found) == 1 else None


def job_id(argv):
    """The ``<jid>`` argument async_wrapper was started with, or None.

    >>> job_id(["/usr/bin/python3", "/root/.ansible/tmp/t/async_wrapper.py", "j955916282008", "60", "/m.py", "_"])
    'j955916282008'
    """
    for index, arg in enumerate(argv[:-1]):
        if os.path.basename(arg) == "async_wrapper.py":
            return argv[index + 1] if JID.match(argv[index + 1]) else None
    return None


def follow(step, label, payload, first="starting"):
    """The ``on_output`` reader for ``Target.run_probes`` when this module runs as an async job, else None.

    It asks the acting script for progress (``payload["progress"] = True``) and tells ``first`` at once.
    """
    reporter = Reporter.for_this_job(step, label)
    if reporter.path is None:
        return None
    payload["progress"] = True
    reporter.phase(first)
    return reporter.feed


class Reporter:
    """Takes the target's output as it comes (:meth:`feed`) and keeps the job file's progress up to date.

    ``path`` is the job file (None: nothing is written; tests pass their own). Every write checks that the file
    still holds the job's unfinished status, then replaces it by a new file (mkstemp, rename) in the same
    directory: async_status reads the old one or the new one, never half of one.
    """

    def __init__(self, step, label, *, path=None, clock=time.monotonic, wall=time.time):
        self.step = step
        self.label = label
        self.path = path
        self.clock = clock
        self.wall = wall
        self.started = clock()
        self.written = None
        self.partial = ""
        self.progress = None
        self.writes = 0

    @classmethod
    def for_this_job(cls, step, label):
        return cls(step, label, path=async_job_file())

    def phase(self, name):
        """The module's own phase (before the target's script says more): told at once."""
        self.tell({"phase": clean(name), "line": None, "phase_seconds": 0.0}, force=True)

    def feed(self, stream, chunk):
        """Output of the target's process as it comes (``stream`` ``stderr`` holds the progress lines)."""
        if stream != "stderr" or not chunk:
            return
        text = self.partial + (chunk.decode(errors="replace") if isinstance(chunk, bytes) else chunk)
        *lines, self.partial = text.split("\n")
        self.partial = self.partial[-65536:]
        found = [p for p in map(parse_line, lines) if p]
        if found:
            self.tell(found[-1])

    def tell(self, found, force=False):
        force = force or found.get("phase") != (self.progress or {}).get("phase")  # a new phase: at once
        self.progress = {
            "step": self.step,
            "target": self.label,
            **found,
            "elapsed_seconds": round(self.clock() - self.started, 1),
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.wall())),
        }
        now = self.clock()
        if self.path and (force or self.written is None or now - self.written >= WRITE_INTERVAL):
            self.written = now
            self.write()

    def write(self):
        """The job file with the progress in it, only while it holds this job's unfinished status."""
        try:
            with open(self.path, encoding="utf-8") as handle:
                status = json.load(handle)
        except (OSError, ValueError):
            return
        name = os.path.basename(self.path)
        if not isinstance(status, dict) or status.get("ansible_job_id") != name or status.get("finished"):
            return
        if not status.get("started"):
            return
        directory = os.path.dirname(self.path)
        handle, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".progress", dir=directory)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(dict(status, **{KEY: self.progress}), out)
            os.replace(temp, self.path)
            self.writes += 1
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temp)


# -- the status call's side: waiting on the node for the job -----------------------------------------------------
def job_finished(status):
    """async_status's rule: a status without ``started`` is the module's answer (or async_wrapper's own failure);
    ``{}``, a file that did not parse, is a job still running."""
    return isinstance(status, dict) and bool(status) and ("started" not in status or bool(status.get("finished")))


def read_job(path):
    """The job file's status: a dict; ``{}`` while it does not parse (async_status reads that as running), a
    failure when it is over JOB_FILE_CAP; None when there is no such file."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(JOB_FILE_CAP + 1)
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    if len(data) > JOB_FILE_CAP:  # never a progress: an answer too big to read, said as the job's failure
        return {"failed": True, "msg": f"the job's answer in {path} is over {JOB_FILE_CAP >> 20} MiB: not read"}
    try:
        status = json.loads(data)
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def _signature(path):
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_ino, found.st_mtime_ns, found.st_size)


def wait_for_job(path, seconds, *, clock=time.monotonic, sleep=time.sleep):
    """Wait here, on the node, until the job file says the job finished or ``seconds`` have passed; return the last
    status read (:func:`read_job`), None when the file never existed while it waited.

    A status call of a followed step costs one module execution per progress interval, however long the job runs,
    and sees its end within TICK: the file is checked with a stat and read again only when it changed (a new
    progress, or async_wrapper's rename of the answer over it).
    """
    deadline = clock() + max(0.0, float(seconds))
    seen, status = None, None
    while True:
        signature = _signature(path)
        if signature is not None and signature != seen:
            seen, status = signature, read_job(path)
            if job_finished(status):
                return status
        left = deadline - clock()
        if left <= 0:
            return status
        sleep(min(TICK, left))
