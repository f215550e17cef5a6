"""run_local under hostile commands (issue 8): a hard deadline whatever holds the pipes, and bounded output."""

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import command as node_command
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.command import CommandResult, run_local

# A child that leaves its session (setsid) and keeps stdout/stderr open for 30 s; its pid goes to argv[1].
DETACHED = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    with open(sys.argv[1] + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(30)
    os._exit(0)
PARENT
"""


@pytest.fixture
def detached(tmp_path):
    """``(argv_for(parent_code), marker)``: runs DETACHED; the detached child is killed after the test."""
    marker = tmp_path / "detached.pid"

    def argv_for(parent):
        return [sys.executable, "-c", DETACHED.replace("PARENT", parent), str(marker)]

    yield argv_for, marker
    deadline = time.monotonic() + 2
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if marker.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(marker.read_text()), signal.SIGKILL)


def test_a_detached_child_holding_the_pipes_cannot_stretch_a_timeout(detached):
    argv_for, marker = detached
    started = time.monotonic()
    result = run_local(argv_for("time.sleep(30)"), timeout=1)
    took = time.monotonic() - started
    assert result.timed_out
    assert took < 3, f"run_local took {took:.1f} s for a 1 s timeout"
    assert marker.exists()  # the detached child was there, holding the pipes, the whole time
    assert Path(f"/proc/{int(marker.read_text())}").exists()


def test_a_command_that_exits_while_a_detached_child_holds_the_pipes_returns_soon(detached):
    argv_for, _ = detached
    started = time.monotonic()
    result = run_local(argv_for("import time; time.sleep(0.2); print('done')"), timeout=20)
    assert time.monotonic() - started < 3
    assert (result.rc, result.stdout, result.timed_out) == (0, "done\n", False)


def test_a_command_that_closes_its_output_but_runs_on_is_still_timed_out():
    started = time.monotonic()
    result = run_local(["sh", "-c", "exec >&- 2>&-; sleep 30"], timeout=1)
    assert result.timed_out
    assert time.monotonic() - started < 3


def test_a_command_that_closes_its_output_keeps_its_exit_code():
    result = run_local(["sh", "-c", "echo out; exec >&- 2>&-; sleep 0.2; exit 3"], timeout=10)
    assert (result.rc, result.stdout, result.timed_out) == (3, "out\n", False)


def test_stdin_larger_than_a_pipe_buffer_goes_through():
    payload = "x" * 300_000 + "\n"
    result = run_local(["cat"], stdin=payload, timeout=10)
    assert (result.rc, result.stdout, result.truncated) == (0, payload, False)


def test_stdin_a_command_does_not_read_is_no_error():
    result = run_local(["true"], stdin="y" * 300_000, timeout=10)
    assert (result.rc, result.timed_out) == (0, False)


# -- output cap ------------------------------------------------------------------------------------------------
def test_a_command_printing_for_the_whole_timeout_keeps_only_the_cap():
    started = time.monotonic()
    result = run_local(["yes"], timeout=1)
    assert time.monotonic() - started < 3
    assert result.timed_out
    assert 0 < len(result.stdout) <= node_command.OUTPUT_CAP
    assert result.stdout.startswith("y\ny\n")
    assert result.truncated


def test_the_head_of_each_stream_is_kept():
    result = run_local(["sh", "-c", "printf abcdef; printf xyz >&2"], timeout=10, output_cap=4)
    assert (result.stdout, result.stderr, result.truncated) == ("abcd", "xyz", True)


def test_output_within_the_cap_is_not_truncated():
    result = run_local(["sh", "-c", "printf abcd"], timeout=10, output_cap=4)
    assert (result.stdout, result.truncated) == ("abcd", False)


def test_a_result_built_without_truncated_still_works():
    assert CommandResult(argv=["x"], rc=0, stdout="", stderr="").truncated is False
