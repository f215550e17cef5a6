"""pve_ct_lean: subprocess.run and glob.glob as the fact pass's parts use them, without their imports. Real
processes, a real directory tree; what they return is compared with the standard library's own answer."""

import fnmatch
import glob
import os
import random
import subprocess
import sys
import threading

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_lean
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_target as target_module
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import probe as preflight_probe


# -- run -------------------------------------------------------------------------------------------------------
def test_run_answers_like_subprocess_run_with_text_output():
    argv = ["sh", "-c", 'printf "out\\r\\nline\\n"; printf "err\\n" >&2; exit 3']
    done = pve_ct_lean.run(argv, 10)
    real = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done == {"rc": 3, "stdout": real.stdout, "stderr": real.stderr}
    assert done["stdout"] == "out\nline\n"


def test_run_gives_the_command_no_stdin_and_the_environment_it_is_given():
    done = pve_ct_lean.run(["sh", "-c", 'cat; echo "[$PROBE_VALUE]"'], 10, env={"PROBE_VALUE": "x y", "PATH": "/bin"})
    assert done == {"rc": 0, "stdout": "[x y]\n", "stderr": ""}


def test_a_command_killed_by_a_signal_has_its_negative_number_as_subprocess_says():
    assert pve_ct_lean.run(["sh", "-c", "kill -9 $$"], 10)["rc"] == -9


def test_output_larger_than_a_pipe_on_both_streams_at_once_is_read_whole():
    script = "import sys; sys.stdout.write('o' * 300000); sys.stderr.write('e' * 300000)"
    done = pve_ct_lean.run([sys.executable, "-c", script], 30)
    assert (len(done["stdout"]), len(done["stderr"]), done["rc"]) == (300000, 300000, 0)


def test_bytes_that_are_not_utf8_are_replaced_not_an_error():
    done = pve_ct_lean.run(["printf", "GPU \\377 0\\n"], 10)
    assert done["stdout"] == "GPU \ufffd 0\n"


def test_a_command_that_is_not_found_is_rc_127_and_named():
    done = pve_ct_lean.run(["no-such-command-pve-gpu"], 10)
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
        threading.Thread(target=lambda n=n: answers.append(pve_ct_lean.run(["echo", str(n)], 30)["stdout"]))
        for n in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(answers) == sorted(f"{n}\n" for n in range(16))


def test_no_descriptor_is_left_open_after_a_run_or_a_timeout():
    before = set(os.listdir("/proc/self/fd"))
    pve_ct_lean.run(["true"], 10)
    pve_ct_lean.run(["no-such-command-pve-gpu"], 10)
    pve_ct_lean.run(["sleep", "5"], 0.2)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_the_command_is_found_on_the_path_of_the_environment_it_is_given(tmp_path):
    """As subprocess: argv[0] is looked up on the child's PATH, not this process's."""
    tool = tmp_path / "pve-gpu-only-here"
    tool.write_text("#!/bin/sh\necho found\n")
    tool.chmod(0o755)
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    env = {"PATH": f"/nonexistent:{tmp_path}:/bin:/usr/bin"}
    assert pve_ct_lean.run([tool.name], 10, env=env) == {"rc": 0, "stdout": "found\n", "stderr": ""}
    assert pve_ct_lean.run([tool.name], 10, env={"PATH": "/bin:/usr/bin"})["missing"] is True
    assert pve_ct_lean.run(["not-executable"], 10, env=env)["missing"] is True  # as subprocess: skipped on PATH


def test_a_file_that_cannot_be_run_raises_as_subprocess_did_and_leaks_no_descriptor(tmp_path):
    script = tmp_path / "no-x-bit"
    script.write_text("#!/bin/sh\n")
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(PermissionError):
        subprocess.run([str(script)], check=False)
    with pytest.raises(PermissionError):
        pve_ct_lean.run([str(script)], 10)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_the_command_starts_in_a_session_of_its_own_with_default_sigpipe():
    """As subprocess's start_new_session=True and restore_signals=True: its own session and process group (killed
    whole at the deadline), SIGPIPE and SIGXFSZ at their defaults though this process ignores them (Python does)."""
    leader, stat = pve_ct_lean.run(["sh", "-c", "echo $$; cat /proc/self/stat"], 10)["stdout"].split("\n", 1)
    process_group, session = stat.rsplit(")", 1)[1].split()[2:4]  # after the name: state, ppid, pgrp, session
    assert process_group == session == leader != str(os.getsid(0))
    status = pve_ct_lean.run(["cat", "/proc/self/status"], 10)["stdout"]
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (13 - 1)) == 0, "SIGPIPE ignored in the child"
    assert ignored & (1 << (25 - 1)) == 0, "SIGXFSZ ignored in the child"


def test_each_stream_keeps_its_first_cap_bytes_of_a_command_that_prints_without_end():
    done = pve_ct_lean.run(["sh", "-c", "yes out | head -c 300000; yes err | head -c 5 >&2"], 30, cap=1000)
    assert (done["stdout"], done["stderr"], done["rc"], done["truncated"]) == ("out\n" * 250, "err\ne", 0, True)
    assert "truncated" not in pve_ct_lean.run(["sh", "-c", "printf 12345"], 30, cap=5)
    endless = pve_ct_lean.run(["yes"], 0.5, cap=1000)  # a deadline still ends it; nothing kept past the cap
    assert (endless["rc"], endless.get("timed_out")) == (124, True)


def test_bytes_as_they_came_when_asked_for_and_its_own_messages_as_bytes_too():
    done = pve_ct_lean.run(["printf", "a\\r\\n\\377"], 10, text=False)
    assert done == {"rc": 0, "stdout": b"a\r\n\xff", "stderr": b""}
    missing = pve_ct_lean.run(["no-such-command-pve-gpu"], 10, text=False)
    assert (missing["stdout"], missing["stderr"]) == (b"", b"no-such-command-pve-gpu: command not found")
    late = pve_ct_lean.run(["sleep", "5"], 0.2, text=False)
    assert (late["rc"], late["stdout"], late["stderr"]) == (124, b"", b"sleep timed out after 0.2 s")


def test_the_preflight_probe_runs_nvidia_smi_in_the_c_locale(monkeypatch):
    monkeypatch.setenv("LANG", "de_DE.UTF-8")
    done = preflight_probe._run(["sh", "-c", 'echo "$LC_ALL $LANG"'], 10)
    assert done["stdout"] == "C C\n"


# -- glob ------------------------------------------------------------------------------------------------------
NAMES = [
    "nvidia0",
    "nvidia1",
    "nvidia12",
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-caps",
    ".hidden",
    "libnvidia-ml.so",
    "libnvidia-ml.so.1",
    "libnvidia-ml.so.580.159.04",
    "a]b",
    "x!y",
]
PATTERNS = [
    "nvidia[0-9]*",
    "nvidia*",
    "*",
    ".*",
    "*/x.so*",
    "*/*",
    "dir?/.y",
    "*/",
    "lib*.so*",
    "libnvidia-ml.so",
    "libnvidia-ml.so.[0-9]*",
    "missing",
    "dangl*",
    "dangling",
    "dir*",
    "[!n]*",
    "nvidia[0-9]",
    "*[.]*",
    "d*/x.so",
    "*/nothing",
    "nvidia[]",
    "[a-",
    "a[]]b",
    "x[!]y",
    "**/x.so",
    "dir1/",
    "dir*/",
    "nvidia\\*",
    "nvidia[!0-9]*",
]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("glob")
    for name in NAMES:
        (root / name).write_text("")
    for name in ("dir1", "dir2", ".hdir"):
        (root / name).mkdir()
        (root / name / "x.so.1").write_text("")
        (root / name / ".y").write_text("")
    (root / "dangling").symlink_to("missing")
    (root / "dirlink").symlink_to("dir1")
    return root


@pytest.mark.parametrize("pattern", PATTERNS)
def test_glob_finds_what_glob_glob_finds(tree, pattern, monkeypatch):
    absolute = os.path.join(tree, pattern)
    assert sorted(pve_ct_lean.glob(absolute)) == sorted(glob.glob(absolute))
    monkeypatch.chdir(tree)  # a relative pattern too
    assert sorted(pve_ct_lean.glob(pattern)) == sorted(glob.glob(pattern))


def test_the_preflight_defaults_are_read_without_the_glob_module(tree):
    """The patterns every CT reads on every run are ones this module reads itself (no fallback to glob)."""
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts  # noqa: PLC0415

    for pattern in (*facts.DEVICE_GLOBS, *facts.LIBRARY_GLOBS):
        assert pve_ct_lean._glob(pattern, False) is not None, pattern


def test_names_match_as_fnmatchcase_says_for_every_pattern_read_here():
    """20,000 random patterns of the characters that mean something to fnmatch, each against random names:
    every pattern this module reads itself answers as fnmatch.fnmatchcase does (the others go to glob.glob)."""
    chooser = random.Random(20261207)  # noqa: S311 (reproducible test data, not a secret)
    read_here = 0
    for _pattern_number in range(20000):
        pattern = "".join(chooser.choice("ab.-!^*?[]\\0") for _char in range(chooser.randint(0, 8)))
        tokens = pve_ct_lean._tokens(pattern)
        if tokens is None:
            continue
        read_here += 1
        for _name_number in range(5):
            name = "".join(chooser.choice("ab.-!^[]0") for _char in range(chooser.randint(0, 7)))
            assert pve_ct_lean._match(tokens, name) == fnmatch.fnmatchcase(name, pattern), (pattern, name)
    assert read_here > 10000


# -- what every CT's python imports ----------------------------------------------------------------------------
# The fact pass of a converged CT (the parts that read every run: preflight, gpu_processes, verify) imports none of
# these: each costs a CT's python milliseconds on every run (re and enum alone about 5 ms).
NOT_IMPORTED = ("re", "enum", "json", "subprocess", "glob", "fnmatch", "signal", "threading", "locale", "warnings")


def test_the_converged_fact_pass_imports_no_pure_python_module_of_cost(tmp_path):
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import (  # noqa: PLC0415
        probe as gpu_probe,
    )
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import (  # noqa: PLC0415
        probe as verify_probe,
    )

    venv = tmp_path / "venv"
    (venv / "lib" / "python3.11" / "site-packages" / "torch").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("version = 3.11.2\n")
    (venv / "lib" / "python3.11" / "site-packages" / "torch" / "version.py").write_text(
        "__version__ = '2.11.0+cu128'\ncuda: Optional[str] = '12.8'\n"
    )
    parts = {
        "preflight": (
            preflight_probe,
            {
                "device_globs": ["/dev/nvidia[0-9]*", "/dev/nvidiactl"],
                "kernel_version_file": "/proc/driver/nvidia/version",
                "library_globs": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so*"],
                "nvidia_smi_argv": ["sh", "-c", "echo GPU 0"],
                "space_path": str(tmp_path),
                "timeout": 10,
            },
        ),
        "gpu_processes": (gpu_probe, {}),
        "verify": (verify_probe, {"venv": str(venv)}),
    }
    program = target_module.PROBES_MAIN + "\nsys.stderr.write(' '.join(sorted(sys.modules)))\n"
    done = subprocess.run(
        [*target_module.probes_argv(sys.executable)[:-1], program],
        input=target_module.probes_input(parts),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answers = target_module.json.loads(done.stdout)
    assert answers["preflight"]["answer"]["nvidia_smi"] == {"rc": 0, "stdout": "GPU 0\n", "stderr": ""}
    assert answers["verify"]["answer"]["torch_version_py"] == {
        "version": "2.11.0+cu128",
        "cuda": "12.8",
        "git_version": None,
    }
    loaded = set(done.stderr.split())
    assert sorted(loaded & set(NOT_IMPORTED)) == []
