# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Node side: reads of the node that the passes of one module execution share (the fact pass's ``batch``, one
node's CTs read together): NVML's compute processes and the owner of every process are the node's, not a CT's."""

from __future__ import annotations

import threading


class SharedReads:
    """Node-side reads shared by the passes of one module execution (target_facts' ``batch``, one node's CTs): each
    key is read once, by the first pass that asks, and every pass that asks gets that answer, or that error.

    The passes of a batch start within milliseconds of each other (up to MAX_PARALLEL at once, the rest as those
    end), so the one read stands for what each would have read at about that moment; a pass that starts later gets
    the same answer, not a fresher one (a fact pass reads state, it does not wait for it to change). It spares a node
    of N CTs N - 1 ``nvidia-smi`` queries (0.1-0.5 CPU-s each on a real node, and serialized in the driver) and
    N - 1 walks of every process's cgroup. A pass that asks while the read is under way waits for it in its
    node-read thread, which its own budget bounds (registry.NodeRead): a read that wedges is then the ``wedged``
    problem of every pass whose budget ends first, each at its own time. Keys carry what changes the read (the
    node, the timeout it is given), never the asker. The acting modules read alone: each of their contexts gets a
    fresh one.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._reads = {}  # key -> SharedRead

    def get(self, key, read):
        """``read()``'s answer for ``key``: read now if no pass asked before, else the first asker's (its error
        raised again)."""
        with self._lock:
            entry = self._reads.get(key)
            first = entry is None
            if first:
                entry = self._reads[key] = SharedRead()
        if first:
            try:
                entry.answer = read()
            except BaseException as error:  # re-raised to every pass that asks: each names its own target around it
                entry.error = error
            finally:
                entry.done.set()
        else:
            entry.done.wait()
        if entry.error is not None:
            raise entry.error
        return entry.answer


class SharedRead:
    """One key's read in :class:`SharedReads`: set ``done`` once ``answer`` or ``error`` is."""

    def __init__(self):
        self.done = threading.Event()
        self.answer = None
        self.error = None


def node_read(context, key, read):
    """``read()``'s answer, or the one it gave another pass of this module execution (``context["shared"]``,
    :class:`SharedReads`) on the same node: ``key`` names the read and what changes it (a timeout, say)."""
    return context["shared"].get((context["target"]["node"], *key), read)
