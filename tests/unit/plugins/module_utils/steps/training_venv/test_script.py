"""The venv build script (steps/training_venv/script.py) as a CT runs it: its source and its shared modules fed to
a python on stdin (``python -I -S -c PROBES_MAIN``), the way one ``pct exec`` runs it.

Its commands (uv, pip, the new venv's python) run through the one container-side runner (ct/run.py): each in a
session of its own, killed with everything it started at the build's deadline, and ended with the script when the
``timeout`` around the pct exec ends the script (issue 42 item 5).
"""

import os
import signal
import subprocess
import sys
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script as venv_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.acting import build_payload

from tests.conftest import FIXTURES

STAMP = "20261203T101500Z"
# A uv whose `pip sync` starts a helper of its own and then waits: what a download that hangs looks like.
HANGING_UV = """#!/bin/sh
case "$1" in
  venv) shift 4; mkdir -p "$1/bin"; exit 0 ;;
  pip) sleep 300 & echo "$$ $!" > "$PIDS"; wait ;;
esac
exit 1
"""


def alive(pid):
    """Whether ``pid`` still runs (a zombie waiting for its parent's wait counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def payload_for(tmp_path, uv, timeout=600):
    spec = {"path": str(tmp_path / "venvs" / "train"), "lock": (FIXTURES / "venv" / "lock_cu128.txt").read_text()}
    spec.update(python_version="3.11", tooling="ignore", keep=None, unattended=False, unattended_keep=3)
    return build_payload(spec, {"uv": str(uv), "build_timeout": timeout}, STAMP)


def test_the_build_script_ended_by_its_timeout_ends_the_commands_it_started(tmp_path):
    """`timeout` around the pct exec sends SIGTERM to the script; uv and what uv started, each command in a session
    of its own, end with it instead of running on in the CT."""
    uv = tmp_path / "uv"
    uv.write_text(HANGING_UV)
    uv.chmod(0o755)
    pids = tmp_path / "pids"
    script = subprocess.Popen(
        node_target.probes_argv(sys.executable),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin", "PIDS": str(pids)},
        text=True,
    )
    script.stdin.write(node_target.probes_input({"build": (venv_script, payload_for(tmp_path, uv))}))
    script.stdin.close()
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = [int(pid) for pid in pids.read_text().split()]
    try:
        assert all(alive(pid) for pid in started)
        script.send_signal(signal.SIGTERM)  # the script alone, as `timeout` signals its child
        assert script.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in started if alive(pid)], "the build's commands outlived the script"
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if script.poll() is None:
            script.kill()


def test_a_command_past_the_builds_deadline_is_killed_with_what_it_started(tmp_path):
    uv = tmp_path / "uv"
    uv.write_text(HANGING_UV)
    uv.chmod(0o755)
    pids = tmp_path / "pids"
    env = {"PATH": "/usr/bin:/bin", "PIDS": str(pids)}
    done = subprocess.run(
        node_target.probes_argv(sys.executable),
        input=node_target.probes_input({"build": (venv_script, payload_for(tmp_path, uv, timeout=3))}),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert '"error": "timeout"' in done.stdout
    assert "did not finish within the build's 3 s (build_timeout) and was killed" in done.stdout
    assert not [pid for pid in map(int, pids.read_text().split()) if alive(pid)]
    assert not os.path.exists(tmp_path / "venvs" / f"train.{STAMP}")
