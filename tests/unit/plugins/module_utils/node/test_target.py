"""The one target: exact pct argvs, Proxmox's failures as clear errors, payloads that stay inert."""

import functools
import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git_paths as ct_git_paths
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import command as node_command
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import probes as node_probes
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target, TargetError
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import probe as preflight_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import git_runner as code_git_runner
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import worktree as code_worktree

from tests.conftest import other_python, unavailable
from tests.fakes import FakeRunner
from tests.unit.plugins.module_utils.steps.compile_cache.test_facts import CU130, SPEC, fake_venv, write_stamp

CT_PREFIX = ["pct", "exec", "200", "--keep-env", "0", "--", "timeout", "-k", "5", "60", "env", "LC_ALL=C", "LANG=C"]


def ct(runner, **kwargs):
    return Target(200, node="pve1", runner=runner, **kwargs)


# -- argv shapes ---------------------------------------------------------------------------------------------
def test_container_argv_is_pct_exec_with_clear_env_and_a_deadline_inside():
    assert ct(None).command_argv(["nvidia-smi", "-L"]) == [*CT_PREFIX, "nvidia-smi", "-L"]


def test_host_argv_only_adds_the_deadline():
    assert Target(node="gpu1").command_argv(["nvidia-smi", "-L"], timeout=5) == [
        "timeout",
        "-k",
        "5",
        "5",
        "nvidia-smi",
        "-L",
    ]


def test_extra_environment_is_passed_through_env_not_a_shell():
    argv = ct(None).command_argv(["python3", "-V"], env={"HOME": "/root", "A_B": "x y"})
    assert argv[-5:] == ["LANG=C", "A_B=x y", "HOME=/root", "python3", "-V"]


@pytest.mark.parametrize("name", ["A B", "1X", "X;Y", ""])
def test_bad_environment_names_are_rejected(name):
    with pytest.raises(TargetError, match="invalid environment variable name"):
        ct(None).command_argv(["true"], env={name: "v"})


def test_a_command_that_looks_like_an_assignment_is_rejected():
    with pytest.raises(TargetError, match="contains '='"):
        ct(None).command_argv(["A=B", "true"])


@pytest.mark.parametrize("vmid", ["200; touch /tmp/x", "$(touch /tmp/x)", "200", 99, 1_000_000_000, True, 200.0])
def test_vmid_payloads_and_out_of_range_ids_are_rejected_before_any_command(vmid):
    with pytest.raises(TargetError, match="vmid must be an integer from 100 to 999999999") as error:
        Target(vmid, runner=FakeRunner())
    assert error.value.kind == "invalid"


def test_labels():
    assert ct(None).label == "CT 200 on pve1"
    assert Target(node="gpu1").label == "host gpu1"


# -- Proxmox failures ----------------------------------------------------------------------------------------
def test_stopped_container():
    runner = FakeRunner(([*CT_PREFIX, "true"], (255, "", "container '200' not running!\n")))
    with pytest.raises(TargetError) as error:
        ct(runner).run(["true"])
    assert error.value.kind == "stopped"
    assert str(error.value) == (
        "CT 200 on pve1 is not running (pct: container '200' not running!); start it with "
        "`pct start 200` on pve1 and run again"
    )


NO_CONFIG = "Configuration file 'nodes/pve1/lxc/200.conf' does not exist\n"


def cluster(tmp_path, monkeypatch, **nodes):
    """A /etc/pve/nodes as pmxcfs shows it on every node of a cluster: ``pve2=[200]`` is pve2/lxc/200.conf."""
    for node, vmids in nodes.items():
        (tmp_path / node / "lxc").mkdir(parents=True)
        for vmid in vmids:
            (tmp_path / node / "lxc" / f"{vmid}.conf").write_text("arch: amd64\n")
    monkeypatch.setattr(node_target, "PVE_NODES", str(tmp_path))


def test_missing_container(tmp_path, monkeypatch):
    cluster(tmp_path, monkeypatch, pve1=[201], pve2=[300])  # nowhere in the cluster either
    runner = FakeRunner(
        ([*CT_PREFIX, "true"], (255, "", "Configuration file 'nodes/pve1/lxc/200.conf' does not exist\n"))
    )
    with pytest.raises(TargetError) as error:
        ct(runner).run(["true"])
    assert error.value.kind == "missing"
    assert "CT 200 does not exist on node pve1 (nodes/pve1/lxc/200.conf is missing)" in str(error.value)
    assert "pve_vmid and pve_node" in str(error.value)


@pytest.mark.parametrize("call", ["run", "status"])
def test_a_ct_that_migrated_to_another_node_is_named_where_it_lives_now(call, tmp_path, monkeypatch):
    cluster(tmp_path, monkeypatch, pve1=[201], pve2=[200, 300], pve3=[])
    argv = [*CT_PREFIX, "true"] if call == "run" else ["pct", "status", "200"]
    target = ct(FakeRunner((argv, (255, "", NO_CONFIG))))
    with pytest.raises(TargetError) as error:
        target.run(["true"]) if call == "run" else target.status()
    assert error.value.kind == "moved"
    assert str(error.value) == (
        "CT 200 lives on node pve2 now (moved from pve1): set pve_node to pve2 or use the community.proxmox.proxmox "
        "inventory plugin"
    )


def test_a_ct_two_nodes_hold_names_both(tmp_path, monkeypatch):
    cluster(tmp_path, monkeypatch, pve2=[200], pve3=[200])
    with pytest.raises(TargetError) as error:
        ct(FakeRunner(([*CT_PREFIX, "true"], (255, "", NO_CONFIG)))).run(["true"])
    assert str(error.value).startswith("CT 200 lives on nodes pve2 and pve3 now (moved from pve1): set pve_node to ")


def test_the_cluster_is_read_only_when_pct_finds_no_ct(monkeypatch):
    def never(*_args):
        raise AssertionError("the cluster's configs were read for a CT pct found")

    monkeypatch.setattr(node_target, "nodes_holding", never)
    runner = FakeRunner(
        ([*CT_PREFIX, "true"], (0, "", "")),
        ([*CT_PREFIX, "false"], (1, "", "")),
        (["pct", "status", "200"], (0, "status: running\n", "")),
        ([*CT_PREFIX, "true"], (255, "", "container '200' not running!\n")),
    )
    target = ct(runner)
    target.run(["true"])
    target.run(["false"], check=False)
    assert target.status() == "running"
    with pytest.raises(TargetError, match="is not running"):
        target.run(["true"])
    runner.assert_done()


def test_nodes_holding_reads_the_cluster_tree(tmp_path):
    (tmp_path / "pve2" / "lxc").mkdir(parents=True)
    (tmp_path / "pve2" / "lxc" / "200.conf").write_text("")
    (tmp_path / "pve3" / "lxc" / "200.conf").mkdir(parents=True)  # not a file: no config
    assert node_target.nodes_holding(200, str(tmp_path)) == ["pve2"]
    assert node_target.nodes_holding(201, str(tmp_path)) == []
    assert node_target.nodes_holding(200, str(tmp_path / "absent")) == []  # a node of no cluster


def test_pct_missing_on_the_node():
    runner = FakeRunner(([*CT_PREFIX, "true"], FileNotFoundError("pct")))
    with pytest.raises(TargetError, match="pct not found in PATH of node pve1: this is not a Proxmox VE node") as e:
        ct(runner).run(["true"])
    assert e.value.kind == "no_pct"


@pytest.mark.parametrize(
    "stderr",
    [
        "lxc-attach: 200: ../src/lxc/attach.c: lxc_attach_run_command: 1841 No such file or directory - Failed to exec "
        '"nvidia-smi"\n',
        "env: 'nvidia-smi': No such file or directory\n",
        "timeout: failed to run command \u2018nvidia-smi\u2019: No such file or directory\n",
    ],
)
def test_command_missing_inside(stderr):
    runner = FakeRunner(([*CT_PREFIX, "nvidia-smi"], (127, "", stderr)))
    with pytest.raises(TargetError) as error:
        ct(runner).run(["nvidia-smi"])
    assert error.value.kind == "not_found"
    assert str(error.value).startswith("CT 200 on pve1: `nvidia-smi` not found inside CT 200")


def test_inner_exit_127_of_another_command_is_just_a_failure():
    runner = FakeRunner(([*CT_PREFIX, "sh", "-c", "x"], (127, "", "sh: 1: x: not found\n")))
    with pytest.raises(TargetError) as error:
        ct(runner).run(["sh", "-c", "x"])
    assert error.value.kind == "failed"


def test_timeout_inside_the_container():
    runner = FakeRunner(([*CT_PREFIX[:-4], "1", *CT_PREFIX[-3:], "sleep", "9"], (124, "", "", 1.02)))
    with pytest.raises(TargetError, match=r"`sleep 9` timed out after 1 s and was killed") as error:
        ct(runner).run(["sleep", "9"], timeout=1)
    assert error.value.kind == "timeout"


def test_nonzero_exit_with_check_names_the_command_and_its_first_error_line():
    runner = FakeRunner(([*CT_PREFIX, "false"], (1, "", "boom\nmore\n")))
    with pytest.raises(TargetError) as error:
        ct(runner).run(["false"])
    result = error.value.to_result()
    assert result["msg"] == "CT 200 on pve1: `false` failed with exit code 1: boom"
    assert result["rc"] == 1
    assert result["stderr_tail"] == "boom\nmore"
    assert result["cmd"] == [*CT_PREFIX, "false"]


def test_nonzero_exit_without_check_is_returned():
    runner = FakeRunner(([*CT_PREFIX, "false"], (1, "", "")))
    assert ct(runner).run(["false"], check=False).rc == 1


def test_run_on_node_never_uses_pct():
    runner = FakeRunner((["timeout", "-k", "5", "60", "nvidia-smi", "-L"], (0, "GPU 0\n", "")))
    assert ct(runner).run_on_node(["nvidia-smi", "-L"]).stdout == "GPU 0\n"


# -- status, files, probes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["running", "stopped"])
def test_status(state):
    runner = FakeRunner((["pct", "status", "200"], (0, f"status: {state}\n", "")))
    assert ct(runner).status() == state


def test_status_of_a_missing_container(tmp_path, monkeypatch):
    cluster(tmp_path, monkeypatch)
    runner = FakeRunner(
        (["pct", "status", "200"], (255, "", "Configuration file 'nodes/pve1/lxc/200.conf' does not exist\n"))
    )
    with pytest.raises(TargetError) as error:
        ct(runner).status()
    assert error.value.kind == "missing"


def test_probe_in_a_container_is_one_pct_exec_with_sources_and_payloads_on_stdin():
    calls = []

    def runner(argv, *, stdin=None, timeout=None, env=None):
        calls.append((argv, stdin))
        return node_command.CommandResult(argv=argv, rc=0, stdout='{"preflight": {"answer": {"ok": 1}}}', stderr="")

    assert ct(runner).run_probe(preflight_probe, {"a": 1}) == {"ok": 1}
    [(argv, stdin)] = calls
    # The argv is fixed, whatever the payload: the data travels on stdin (issue 25 item 8).
    assert argv == [*CT_PREFIX, "python3", "-I", "-S", "-c", node_target.PROBES_MAIN]
    given = json.loads(stdin)
    assert given["payloads"] == {"preflight": {"a": 1}}
    assert "def probe(payload):" in given["sources"]["preflight"]


def test_probe_failure_says_which_probe_and_why():
    runner = FakeRunner(
        ([*CT_PREFIX, "python3", "-I", "-", '{"preflight": {}}'], (1, "", "Traceback\nKeyError: 'x'\n"))
    )
    with pytest.raises(TargetError, match=r"the preflight probe failed \(exit 1\): KeyError: 'x'"):
        ct(runner).run_probe(preflight_probe, {})


def test_a_failed_probe_shows_its_argv_with_the_program_named_never_its_source_and_says_the_fix():
    """A failed fact pass printed PROBES_MAIN (about 3 KB of Python) as `cmd` (issue 43, item 7)."""

    def runner(argv, **_kwargs):  # the argv as it ran, PROBES_MAIN in it
        return node_command.CommandResult(argv=list(argv), rc=1, stdout="", stderr="Traceback\nMemoryError\n")

    with pytest.raises(TargetError) as error:
        ct(runner).run_probe(preflight_probe, {})
    result = error.value.to_result()
    assert result["cmd"] == [*CT_PREFIX, "python3", "-I", "-S", "-c", "<probe program>"]
    assert "import json" not in json.dumps(result)
    first = result["msg"].splitlines()[0]
    assert first.startswith("CT 200 on pve1: the preflight probe failed (exit 1): MemoryError;")
    assert "Python 3.9+" in first
    assert "`pct exec 200 -- python3 -V` on pve1" in first
    assert "set preflight_python" in first


def test_any_program_in_an_argv_is_shown_by_a_short_name():
    assert node_target.shown_argv(["python3", "-c", "import os\nprint(1)", "x"]) == ["python3", "-c", "<program>", "x"]


@pytest.mark.parametrize(
    "stdout",
    ["[1, 2]", '{"other": {}}', '{"preflight": "yes"}', '{"preflight": {"error": 5}}', "not json"],
    ids=["list", "no_part", "part_not_a_dict", "error_not_a_string", "not_json"],
)
def test_a_probe_answer_of_the_wrong_shape_is_a_clear_error(stdout):
    runner = FakeRunner(([*CT_PREFIX, "python3", "-I", "-", '{"preflight": {}}'], (0, stdout, "")))
    with pytest.raises(TargetError, match=r"CT 200 on pve1: the preflight probe") as error:
        ct(runner).run_probe(preflight_probe, {})
    assert error.value.kind == "probe"


def run_in_real_python(argv, *, stdin=None, timeout=None, env=None, python=sys.executable):
    """The CT's side of a probes call, for real: the ``python3 -I -S -c PROBES_MAIN`` of ``argv`` run with its stdin,
    by ``python`` (this test's interpreter unless given)."""
    inner = argv[argv.index("python3") :]
    inner[0] = str(python)
    done = subprocess.run(inner, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    return node_command.CommandResult(argv=argv, rc=done.returncode, stdout=done.stdout, stderr=done.stderr)


def sources_of(monkeypatch, getsource):
    """The probe input's sources from ``getsource``, with none kept from another test (module_source's cache)."""
    monkeypatch.setattr(node_probes.inspect, "getsource", getsource)
    monkeypatch.setattr(node_probes, "_SOURCES", {})


def test_the_probes_program_runs_every_part_in_one_real_python_and_isolates_failures(monkeypatch):
    """The program fed to the CT's python, run for real: two parts, one raising, each in its own namespace."""
    good = types.ModuleType("pve_probe_good")
    bad = types.ModuleType("pve_probe_bad")
    good_source = "HELPER = 'good'\n\ndef probe(payload):\n    return {'echo': payload, 'helper': HELPER}\n"
    bad_source = "HELPER = 'bad'\n\ndef probe(payload):\n    raise ValueError('broken ' + HELPER)\n"
    sources = {good: good_source, bad: bad_source}

    sources_of(monkeypatch, lambda module: sources[module])
    answers = ct(run_in_real_python).run_probes({"good": (good, {"x": [1]}), "bad": (bad, {})})
    assert answers["good"]["answer"] == {"echo": {"x": [1]}, "helper": "good"}
    assert answers["bad"]["error"] == "ValueError: broken bad"


def test_the_probes_program_runs_no_pth_file_of_the_cts_python(monkeypatch, tmp_path):
    """A package's .pth file in the CT python's site-packages (here one that prints) never runs before the parts:
    its output would come before the answer's JSON on stdout. A real venv's python stands for the CT's."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_packages = next(venv.glob("lib/python3*/site-packages"))
    (site_packages / "noisy.pth").write_text("import sys; sys.stdout.write('noise from a .pth file\\n')\n")
    started = subprocess.run([venv / "bin/python", "-I", "-c", "pass"], capture_output=True, text=True, check=True)
    assert started.stdout.startswith("noise from a .pth file\n")  # any python started without -S prints it first
    part = types.ModuleType("pve_probe_plain")
    sources_of(monkeypatch, lambda module: "def probe(payload):\n    return {'echo': payload}\n")

    pct_exec = functools.partial(run_in_real_python, python=venv / "bin/python")
    assert ct(pct_exec).run_probes({"plain": (part, {"x": 1})})["plain"]["answer"] == {"echo": {"x": 1}}


def test_parts_with_shared_modules_answer_in_a_ct_exactly_as_on_a_bare_host(tmp_path):
    # The compile cache's probe imports ct_fs, the training code's ct_git: on a bare host Python imports
    # them; in a CT they travel in the same stdin, each once, before the parts, and the parts import them there.
    fake_venv(tmp_path / "venv")
    root = tmp_path / "inductor"
    root.mkdir()
    write_stamp(root, CU130)
    (tmp_path / "code").mkdir()
    spec = dict(SPEC, venv=str(tmp_path / "venv"), roots=[str(root), str(tmp_path / "link")])
    (tmp_path / "link").symlink_to(root)
    parts = {
        "compile_cache": (cache_probe, cache_facts.probe_payload(spec, 30)),
        "training_code": (code_probe, {"path": str(tmp_path / "code"), "commit": "ab" * 20}),
    }
    calls = []

    def one_pct_exec(argv, **kwargs):
        calls.append(kwargs["stdin"])
        return run_in_real_python(argv, **kwargs)

    in_ct = ct(one_pct_exec).run_probes(parts)
    on_host = Target(runner=FakeRunner()).run_probes(parts)
    assert len(calls) == 1
    assert list(json.loads(calls[0])["shared"]) == [
        ct_fs.__name__,
        ct_run.__name__,
        ct_proc.__name__,
        ct_venv.__name__,
        ct_act.__name__,
        ct_git_paths.__name__,
        ct_git.__name__,
        code_worktree.__name__,
        code_git_runner.__name__,
    ]
    for name in parts:
        assert "error" not in in_ct[name], in_ct[name]
        assert dict(in_ct[name]["answer"], pid=None) == dict(on_host[name]["answer"], pid=None)  # pid: its own
    assert in_ct["compile_cache"]["answer"]["roots"][0]["stamp"]["fingerprint"] == CU130
    assert "is a symlink" in in_ct["compile_cache"]["answer"]["roots"][1]["unsafe"]  # ct_fs.open_root ran


def test_shared_modules_go_once_with_their_own_dependencies_first():
    base, fs, git = (types.ModuleType(f"ansible.module_utils.pve_ct_{n}") for n in ("base", "fs", "git"))
    fs.SHARED = (base,)
    first, second = types.ModuleType("first"), types.ModuleType("second")
    first.SHARED, second.SHARED = (fs,), (git, fs)
    assert node_probes.shared_modules([first, second, types.ModuleType("plain")]) == [base, fs, git]
    # At any depth: a part names what it imports, not what that imports in turn.
    runner, lean = (
        types.ModuleType("git_runner"),
        types.ModuleType("ansible_collections.pve_gpu.recover.plugins.module_utils.ct.run"),
    )
    git.SHARED, runner.SHARED = (lean,), (git,)
    script = types.ModuleType("script")
    script.SHARED = (runner,)
    assert node_probes.shared_modules([script]) == [lean, git, runner]


def test_a_part_never_imports_an_ansible_found_where_it_runs(monkeypatch):
    # The python running this test has ansible installed, as a CT might: a part gets only what was shipped.
    part = types.ModuleType("pve_probe_greedy")
    source = "def probe(payload):\n    from ansible.module_utils import basic\n    return 1\n"
    sources_of(monkeypatch, lambda module: source)
    answers = ct(run_in_real_python).run_probes({"greedy": (part, {})})
    assert answers["greedy"]["error"].startswith("ImportError: cannot import name 'basic'"), answers


def test_a_part_never_imports_a_module_of_ours_that_was_not_shipped_with_it(monkeypatch):
    # A CT may hold a copy of this collection (an older one): a part gets only the modules its SHARED names.
    part = types.ModuleType("pve_probe_greedy")
    source = (
        "def probe(payload):\n"
        "    from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock\n"
        "    return 1\n"
    )
    sources_of(monkeypatch, lambda module: source)
    answers = ct(run_in_real_python).run_probes({"greedy": (part, {})})
    assert answers["greedy"]["error"].startswith("ModuleNotFoundError: No module named"), answers


def test_probe_on_a_bare_host_runs_in_process(tmp_path):
    payload = {
        "device_globs": [str(tmp_path / "nvidia*")],
        "kernel_version_file": str(tmp_path / "none"),
        "library_globs": [],
        "nvidia_smi_argv": ["true"],
        "space_path": str(tmp_path / "new" / "dir"),
    }
    answer = Target(runner=FakeRunner()).run_probe(preflight_probe, payload)
    assert answer["devices"] == []
    assert answer["kernel_version_text"] is None
    assert answer["nvidia_smi"]["rc"] == 0
    assert answer["space"]["existing"] == str(tmp_path)


# -- the real runner -----------------------------------------------------------------------------------------
def test_real_runner_returns_exit_code_and_output():
    result = Target().run(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert (result.rc, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_real_runner_kills_the_whole_group_on_timeout(tmp_path):
    marker = tmp_path / "child.pid"
    started = time.monotonic()
    result = node_target.run_local(["sh", "-c", f"sleep 30 & echo $! > {marker}; wait"], timeout=1)
    assert result.timed_out
    assert time.monotonic() - started < 10
    child = int(marker.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not Path(f"/proc/{child}").exists()


def test_real_runner_passes_payload_paths_literally(tmp_path):
    pwned = tmp_path / "pwned"
    weird = f"$(touch {pwned}); touch {pwned}"
    result = Target().run(["ls", "--", weird], check=False)
    assert result.rc != 0
    assert "No such file or directory" in result.stderr
    assert not pwned.exists()


def test_real_runner_missing_command_on_a_host():
    with pytest.raises(TargetError) as error:
        Target(node="gpu1").run(["no-such-command-pgr"])
    assert error.value.kind == "not_found"
    assert "`no-such-command-pgr` not found on host gpu1" in str(error.value)


def test_c_locale_is_forced():
    result = Target().run(["sh", "-c", "echo $LC_ALL"])
    assert result.stdout == "C\n"


@pytest.mark.parametrize("timeout", [0, -1, 1.5, True])
def test_a_timeout_that_would_mean_no_deadline_is_rejected(timeout):
    with pytest.raises(TargetError, match="timeout must be a whole number of seconds, at least 1"):
        Target(200, timeout=timeout)


# pct before pve-container 5.0.9 (Proxmox VE 8.1) rejects --keep-env before it runs anything.
OLD_PCT_ERROR = "Unknown option: keep-env\n400 unable to parse option\npct exec <vmid> [<extra-args>] [OPTIONS]\n"
NEW_ARGV = ["pct", "exec", "200", "--keep-env", "0", "--", "timeout", "-k", "5", "60", "env", "LC_ALL=C", "LANG=C"]
OLD_ARGV = ["pct", "exec", "200", "--", "timeout", "-k", "5", "60", "env", "-i", f"PATH={node_target.CT_PATH}"]


def test_an_old_pct_without_keep_env_is_detected_and_the_env_cleared_inside_instead():
    runner = FakeRunner(
        ([*NEW_ARGV, "id", "-u"], (255, "", OLD_PCT_ERROR)),
        ([*OLD_ARGV, "LC_ALL=C", "LANG=C", "id", "-u"], (0, "0\n", "")),
        # Learnt once: the next command goes the old way at once, no second rejection.
        ([*OLD_ARGV, "LC_ALL=C", "LANG=C", "true"], (0, "", "")),
    )
    target = Target(200, node="pve1", runner=runner)
    assert target.run(["id", "-u"]).stdout == "0\n"
    target.run(["true"])
    runner.assert_done()
    assert target.pct_keep_env is False


def test_another_pct_parameter_error_is_not_taken_for_an_old_pct():
    error = "400 Parameter verification failed.\nvmid: value must have a minimum value of 100\n"
    runner = FakeRunner(([*NEW_ARGV, "true"], (255, "", error)))
    with pytest.raises(TargetError) as raised:
        Target(200, node="pve1", runner=runner).run(["true"])
    assert raised.value.kind == "invalid"
    runner.assert_done()


def test_module_sources_are_read_once_and_never_by_two_threads_at_once(monkeypatch):
    """The passes of one node's targets build their probe input in threads. Reading a source from AnsiballZ's
    zip in two threads at once made inspect fail with "could not get source code" (linecache is not safe from
    threads; the fleet bench saw it at 16 CTs): here a getsource that fails whenever two threads are in it."""
    inside, calls, errors = [], [], []

    def getsource(module):
        if inside:
            raise OSError("could not get source code")
        inside.append(module)
        calls.append(module.__name__)
        time.sleep(0.01)
        inside.pop()
        return f"# {module.__name__}\n"

    sources_of(monkeypatch, getsource)
    modules = [types.ModuleType(f"probe_{index}") for index in range(4)]
    barrier = threading.Barrier(16)
    found = []

    def read(module):
        barrier.wait()
        try:
            found.append(node_probes.module_source(module))
        except OSError as error:
            errors.append(error)

    threads = [threading.Thread(target=read, args=(modules[i % 4],)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert sorted(calls) == [f"probe_{index}" for index in range(4)]  # each read once
    assert sorted(found) == sorted(f"# probe_{i % 4}\n" for i in range(16))


# The probe program reads its stdin and writes its answer with json: whatever a part answers comes back as
# json.dumps wrote it, on the node's Python and on a CT's 3.9.
AWKWARD = {
    "strings": ["", 'quote " and \\ backslash', "\x00\x1f\x7f controls", "é € 😀", "\udcff lone surrogate", "\t\n\r"],
    "numbers": [0, -1, 2**70, 1.5, -0.0, 1e300, 5e-324, float("nan"), float("inf"), float("-inf")],
    "constants": [True, False, None],
    "nested": {"a": [{"b": [[], {}]}], "": {"c": "d"}},
}


def run_probes_program(python, parts):
    """The probe program's stdout on ``python`` with ``parts``."""
    done = subprocess.run(
        node_target.probes_argv(str(python)),
        input=node_target.probes_input(parts),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


@pytest.mark.parametrize("minor", [None, "3.9"], ids=["this_python", "python3.9"])
def test_the_probes_program_answers_what_json_dumps_writes(monkeypatch, minor):
    python = sys.executable if minor is None else other_python(minor)
    if python is None:
        unavailable(f"no python{minor} here")
    echo = types.ModuleType("pve_probe_echo")
    keys = types.ModuleType("pve_probe_keys")
    sources = {
        echo: "def probe(payload):\n    return {'payload': payload, 'tuple': ('x', 1)}\n",
        keys: "def probe(payload):\n    return {1: 'one', None: 'none'}\n",
    }
    sources_of(monkeypatch, lambda module: sources[module])
    written = run_probes_program(python, {"echo": (echo, AWKWARD), "keys": (keys, {})})
    answers = json.loads(written)
    assert written == json.dumps(answers)  # byte for byte
    assert json.dumps(answers["echo"]["answer"]["payload"]) == json.dumps(AWKWARD)  # NaN compares unequal to itself
    assert answers["echo"]["answer"]["tuple"] == ["x", 1]
    assert answers["keys"]["answer"] == {"1": "one", "null": "none"}
