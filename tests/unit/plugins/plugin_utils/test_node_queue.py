"""plugins/plugin_utils/node_queue.py: a fork waits for its node's read lock no longer than a read may take; a lock
another process holds past that is a warning naming the holder, and the target is read alone, never a hang (issue
40, item 7). A real process holds the flock."""

import subprocess
import sys
import time

from ansible.module_utils import _internal as module_internal

controller = module_internal.is_controller
from ansible_collections.pve_gpu.recover.plugins.plugin_utils import node_queue  # noqa: E402

# Importing controller code flips module_utils to controller semantics; the module tests in this process need it back.
module_internal.is_controller = controller

HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def hold_in_another_process(path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_lock_held_past_the_longest_read_is_named_and_never_waited_for_without_end(tmp_path, monkeypatch):
    warnings = []
    monkeypatch.setattr(node_queue.display, "warning", warnings.append)
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    holder = hold_in_another_process(tmp_path / "q" / "lead")
    try:
        started = time.monotonic()
        assert queue.hold(0.5) is None
        assert 0.5 <= time.monotonic() - started < 2.0
    finally:
        holder.stdin.close()
        holder.wait(10)
    (warning,) = warnings
    assert f"the node's read lock {tmp_path / 'q' / 'lead'} has been held for more than 0.5 s" in warning
    assert f"by pid {holder.pid} (python" in warning
    assert warning.endswith("this target is read alone")
    descriptor = queue.hold(0.5)  # let go: taken at once
    assert descriptor is not None


def test_a_lock_let_go_while_a_fork_waits_is_taken_at_once(tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    holder = hold_in_another_process(tmp_path / "q" / "lead")
    started = time.monotonic()
    subprocess.Popen(["sh", "-c", f"sleep 0.3; kill {holder.pid}"])
    assert queue.hold(30) is not None
    assert time.monotonic() - started < 1.5
    holder.wait(10)


def test_the_wait_asks_again_sooner_at_first_and_never_past_its_deadline():
    now, pauses = [0.0], []

    def sleep(seconds):
        pauses.append(seconds)
        now[0] += seconds

    class Held:
        def fileno(self):
            raise BlockingIOError

    assert node_queue.flock_within(Held(), 1.0, clock=lambda: now[0], sleep=sleep) is False
    assert pauses[0] == 0.001 and max(pauses) == node_queue.POLL_LONGEST
    assert now[0] == 1.0
