# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""GPU processes probe: the pids in the guard's pid files, read inside the target.

A pid file (``gpu_processes_guard: [{pid_file: /run/train.pid}]``) names the guarded job's main process by its pid
in the target's pid namespace, at a path of the target's filesystem. Both only make sense inside the target: read
from the node through ``/proc/<pid>/root`` an absolute symlink (Debian's ``/var/run -> /run``) would resolve in
the node's root. So this part runs inside, in the fact pass's one ``pct exec`` (only when the guard names pid
files), or as the module's own ``pct exec`` when it re-reads.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probes``; on a bare host ``probe()``
runs in the module's own process. So: standard library only, Python 3.9+, no imports from ansible, plain JSON out.
It only reads: at most PID_FILE_LIMIT bytes of a regular file, opened non-blocking (a FIFO never hangs it).
"""

import os
import stat

PID_FILE_LIMIT = 64  # a pid and a newline; anything larger is not a pid file


def read_pid_file(path):
    """``{"state": "ok", "pid": 4711, "reason": None}``; ``state`` ``missing`` (no such file: its job does not
    run) or ``unreadable`` (with ``reason``) and ``pid`` None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return {"state": "missing", "pid": None, "reason": None}
    except OSError as error:
        return {"state": "unreadable", "pid": None, "reason": f"it cannot be opened: {error.strerror}"}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {"state": "unreadable", "pid": None, "reason": "it is not a regular file"}
        data = os.read(fd, PID_FILE_LIMIT + 1)
    except OSError as error:
        return {"state": "unreadable", "pid": None, "reason": f"it cannot be read: {error.strerror}"}
    finally:
        os.close(fd)
    if len(data) > PID_FILE_LIMIT:
        return {"state": "unreadable", "pid": None, "reason": "it is too large to be a pid file"}
    words = data.decode("ascii", errors="replace").split()
    if len(words) != 1 or not words[0].isdigit() or int(words[0]) < 1:
        shown = data.decode("ascii", errors="replace")[:20]
        return {"state": "unreadable", "pid": None, "reason": f"it holds {shown!r}, not one pid"}
    return {"state": "ok", "pid": int(words[0]), "reason": None}


def probe(payload):
    """Answer ``{"pid_files": [path, ...]}`` with ``{"pid_files": {path: read_pid_file(path)}}``."""
    return {"pid_files": {path: read_pid_file(path) for path in payload.get("pid_files") or []}}
