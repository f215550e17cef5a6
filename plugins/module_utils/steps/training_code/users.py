# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Who uses the training repository just before the reset: the reset script's last look inside the target
(:func:`last_look`), by the one rule of the target (ct_proc.scan: its working directory, executable, an open or
mapped file, an absolute path in its command line, a ``PYTHONPATH`` entry or the package of ``-m`` in it). The fact
pass's node-side read (in_use.py) applies the same rule to the node's /proc. ``cmdline``, ``environ`` and ``maps``
take the process's mmap lock, which a thread stuck in the driver can hold for ever: ct_proc reads them in one child
under a deadline; a process that cannot be read counts as one that may use it, named.

Container side, shipped with the reset script (its ``SHARED``): standard library only, Python 3.9+, nothing of ours
but the container-side modules of its own ``SHARED``.
"""

import os

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc

SHARED = (ct_proc,)  # container-side modules Target.run_probes ships with this module
LATE = "not read before the reset's deadline: it may use it"


def own_tree(proc="/proc"):
    """This process and its parents: the run itself never counts as a user."""
    pids, pid = set(), os.getpid()
    while pid > 0 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"{proc}/{pid}/stat", encoding="utf-8", errors="replace") as handle:
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def last_look(roots, deadline, proc="/proc"):
    """``[{"pid", "name", "how", "file"} or {"pid", "name", "how": None, "error"}]``: the live processes that use
    one of ``roots`` now (or cannot be told not to: unreadable, or left unread by ``deadline``), this run's own
    process tree left out; ``how`` the cheapest way it uses one (ct_proc.ORDER), ``file`` the path that says so."""
    scanned = ct_proc.scan(roots, deadline, proc, exclude=own_tree(proc))
    found = [
        {"pid": u["pid"], "name": u["name"], "how": u["uses"][0][0], "file": u["uses"][0][2]} for u in scanned["users"]
    ]
    found += [{"pid": u["pid"], "name": u["name"], "how": None, "error": u["error"]} for u in scanned["unreadable"]]
    found += [{"pid": u["pid"], "name": u["name"], "how": None, "error": LATE} for u in scanned["late"]]
    return sorted(found, key=lambda user: user["pid"])
