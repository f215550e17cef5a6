"""ct_run: the one runner of commands in the target (probe parts and acting scripts alike), with one kill rule.
Real processes; what it returns is compared with subprocess.run's own answer."""

import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import probe as preflight_probe


# -- run -------------------------------------------------------------------------------------------------------
def test_run_answers_like_subprocess_run_with_text_output():
    argv = ["sh", "-c", 'printf "out\\r\\nline\\n"; printf "err\\n" >&2; exit 3']
    done = ct_run.run(argv, 10)
    real = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done == {"rc": 3, "stdout": real.stdout, "stderr": real.stderr}
    assert done["stdout"] == "out\nline\n"


def test_run_gives_the_command_no_stdin_and_the_environment_it_is_given():
    done = ct_run.run(["sh", "-c", 'cat; echo "[$PROBE_VALUE]"'], 10, env={"PROBE_VALUE": "x y", "PATH": "/bin"})
    assert done == {"rc": 0, "stdout": "[x y]\n", "stderr": ""}


def test_a_command_killed_by_a_signal_has_its_negative_number_as_subprocess_says():
    assert ct_run.run(["sh", "-c", "kill -9 $$"], 10)["rc"] == -9


def test_output_larger_than_a_pipe_on_both_streams_at_once_is_read_whole():
    script = "import sys; sys.stdout.write('o' * 300000); sys.stderr.write('e' * 300000)"
    done = ct_run.run([sys.executable, "-c", script], 30)
    assert (len(done["stdout"]), len(done["stderr"]), done["rc"]) == (300000, 300000, 0)


def test_bytes_that_are_not_utf8_are_replaced_not_an_error():
    done = ct_run.run(["printf", "GPU \\377 0\\n"], 10)
    assert done["stdout"] == "GPU \ufffd 0\n"


def test_a_command_that_is_not_found_is_rc_127_and_named():
    done = ct_run.run(["no-such-command-pve-gpu"], 10)
    assert done == {
        "rc": 127,
        "stdout": "",
        "stderr": "no-such-command-pve-gpu: command not found",
        "missing": True,
    }


def test_run_is_safe_from_many_threads_at_once():
    """On a bare host the parts run in the module's threads (one per target of the node's batch)."""
    answers = []
    threads = [
        threading.Thread(target=lambda n=n: answers.append(ct_run.run(["echo", str(n)], 30)["stdout"]))
        for n in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(answers) == sorted(f"{n}\n" for n in range(16))


def test_no_descriptor_is_left_open_after_a_run_or_a_timeout():
    before = set(os.listdir("/proc/self/fd"))
    ct_run.run(["true"], 10)
    ct_run.run(["no-such-command-pve-gpu"], 10)
    ct_run.run(["sleep", "5"], 0.2)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_the_command_is_found_on_the_path_of_the_environment_it_is_given(tmp_path):
    """As subprocess: argv[0] is looked up on the child's PATH, not this process's."""
    tool = tmp_path / "pve-gpu-only-here"
    tool.write_text("#!/bin/sh\necho found\n")
    tool.chmod(0o755)
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    env = {"PATH": f"/nonexistent:{tmp_path}:/bin:/usr/bin"}
    assert ct_run.run([tool.name], 10, env=env) == {"rc": 0, "stdout": "found\n", "stderr": ""}
    assert ct_run.run([tool.name], 10, env={"PATH": "/bin:/usr/bin"})["missing"] is True
    assert ct_run.run(["not-executable"], 10, env=env)["missing"] is True  # as subprocess: skipped on PATH


def test_a_file_that_cannot_be_run_is_named_and_leaks_no_descriptor(tmp_path):
    script = tmp_path / "no-x-bit"
    script.write_text("#!/bin/sh\n")
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(PermissionError):
        subprocess.run([str(script)], check=False)
    done = ct_run.run([str(script)], 10)
    assert (done["rc"], done["missing"], done["stderr"]) == (127, True, f"{script}: cannot run it: Permission denied")
    assert set(os.listdir("/proc/self/fd")) <= before


def test_the_command_starts_in_a_session_of_its_own_with_default_sigpipe():
    """As subprocess's start_new_session=True and restore_signals=True: its own session and process group (killed
    whole at the deadline), SIGPIPE and SIGXFSZ at their defaults though this process ignores them (Python does)."""
    leader, stat = ct_run.run(["sh", "-c", "echo $$; cat /proc/self/stat"], 10)["stdout"].split("\n", 1)
    process_group, session = stat.rsplit(")", 1)[1].split()[2:4]  # after the name: state, ppid, pgrp, session
    assert process_group == session == leader != str(os.getsid(0))
    status = ct_run.run(["cat", "/proc/self/status"], 10)["stdout"]
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (13 - 1)) == 0, "SIGPIPE ignored in the child"
    assert ignored & (1 << (25 - 1)) == 0, "SIGXFSZ ignored in the child"


def test_each_stream_keeps_its_first_cap_bytes_of_a_command_that_prints_without_end():
    done = ct_run.run(["sh", "-c", "yes out | head -c 300000; yes err | head -c 5 >&2"], 30, cap=1000)
    assert (done["stdout"], done["stderr"], done["rc"], done["truncated"]) == ("out\n" * 250, "err\ne", 0, True)
    assert "truncated" not in ct_run.run(["sh", "-c", "printf 12345"], 30, cap=5)
    endless = ct_run.run(["yes"], 0.5, cap=1000)  # a deadline still ends it; nothing kept past the cap
    assert (endless["rc"], endless.get("timed_out")) == (124, True)


def test_bytes_as_they_came_when_asked_for_and_its_own_messages_as_bytes_too():
    done = ct_run.run(["printf", "a\\r\\n\\377"], 10, text=False)
    assert done == {"rc": 0, "stdout": b"a\r\n\xff", "stderr": b""}
    missing = ct_run.run(["no-such-command-pve-gpu"], 10, text=False)
    assert (missing["stdout"], missing["stderr"]) == (b"", b"no-such-command-pve-gpu: command not found")
    late = ct_run.run(["sleep", "5"], 0.2, text=False)
    assert (late["rc"], late["stdout"], late["stderr"]) == (124, b"", b"sleep timed out after 0.2 s")


def test_what_a_killed_command_printed_comes_back_with_why_it_ended():
    done = ct_run.run(["sh", "-c", "echo started; echo warming >&2; exec sleep 30"], 1)
    assert (done["rc"], done["timed_out"], done["stdout"]) == (124, True, "started\n")
    assert done["stderr"] == "warming\nsh timed out after 1 s"


def test_a_command_silent_for_its_stall_is_killed_long_before_its_deadline_and_one_that_talks_is_not():
    """ct/proc.py's reader prints after each file: a file it is stuck on ends it after ``stall`` seconds."""
    started = time.monotonic()
    done = ct_run.run(["sh", "-c", "echo one; sleep 0.2; echo two; exec sleep 30"], 60, stall=0.6)
    assert time.monotonic() - started < 5
    assert (done["rc"], done["timed_out"], done["stalled"], done["stdout"]) == (124, True, True, "one\ntwo\n")
    assert done["stderr"] == "sh printed nothing for 0.6 s"
    talking = ct_run.run(["sh", "-c", "for i in 1 2 3 4 5 6; do echo $i; sleep 0.2; done"], 60, stall=0.6)
    assert talking == {"rc": 0, "stdout": "1\n2\n3\n4\n5\n6\n", "stderr": ""}
    late = ct_run.run(["sleep", "30"], 0.3, stall=10)
    assert (late["timed_out"], "stalled" in late, late["stderr"]) == (True, False, "sleep timed out after 0.3 s")


def state_of(pid):
    """A process's state letter from /proc (Z: a zombie, dead and not yet reaped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_command_past_its_deadline_is_killed_with_everything_it_started(tmp_path):
    """Its whole process group: a child it forked (git's remote helper, uv's resolver) dies with it."""
    pid_file = tmp_path / "child"
    done = ct_run.run(["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], 1)
    assert done["timed_out"]
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        if state_of(child) == "Z":  # killed, waiting for its new parent to reap it
            break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{child}"), "the child survived its group's SIGKILL"


@pytest.mark.skipif(os.geteuid() != 0, reason="switching user needs root")
def test_a_command_runs_as_the_user_it_is_given_with_their_groups():
    nobody = pwd.getpwnam("nobody")
    done = ct_run.run(["id"], 10, user=(nobody.pw_uid, nobody.pw_gid, [nobody.pw_gid]))
    assert done["rc"] == 0 and done["stdout"].startswith(f"uid={nobody.pw_uid}(nobody) gid={nobody.pw_gid}"), done
    assert "groups=" in done["stdout"] and "root" not in done["stdout"], done


def test_on_output_hears_each_chunk_and_a_tick_while_the_command_is_silent(monkeypatch):
    monkeypatch.setattr(ct_run, "TICK", 0.1)
    heard = []
    done = ct_run.run(["sh", "-c", "echo one; sleep 0.5; echo two >&2"], 10, on_output=heard.append)
    assert done == {"rc": 0, "stdout": "one\n", "stderr": "two\n"}
    chunks = [chunk for chunk in heard if chunk is not None]
    assert chunks == [b"one\n", b"two\n"]
    assert heard.index(b"one\n") < heard.index(None) < heard.index(b"two\n")  # silent half second: ticks


END_WITH_ME = """
import sys, time
sys.path.insert(0, sys.argv[1])
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
ct_run.end_with_me()
ct_run.run(["sh", "-c", "echo $$ > " + sys.argv[2] + "; exec sleep 300"], 300)
"""


def test_an_acting_script_that_is_ended_ends_what_it_started(tmp_path):
    """The timeout around a pct exec signals the script's process group; what the script started runs in sessions
    of their own, so end_with_me ends them with it."""
    from tests.conftest import ROOT  # noqa: PLC0415

    pid_file = tmp_path / "command"
    script = subprocess.Popen([sys.executable, "-c", END_WITH_ME, str(ROOT / "collections"), str(pid_file)])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    command = int(pid_file.read_text())
    script.send_signal(signal.SIGTERM)
    assert script.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{command}") and time.monotonic() < deadline:
        if state_of(command) == "Z":
            break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{command}"), "the script's command outlived it"


def test_the_preflight_probe_runs_nvidia_smi_in_the_c_locale(monkeypatch):
    monkeypatch.setenv("LANG", "de_DE.UTF-8")
    done = preflight_probe._run(["sh", "-c", 'echo "$LC_ALL $LANG"'], 10)
    assert done["stdout"] == "C C\n"
