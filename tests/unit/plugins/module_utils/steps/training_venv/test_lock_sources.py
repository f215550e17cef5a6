"""Where the venv's lock comes from (issue 21, item 4): a PEP 751 pylock.toml beside requirements locks, and the lock
committed in the training repository, read inside the target at the pinned commit.

pylock.toml files are written by the real uv (``uv pip compile --format pylock.toml``) from a local PEP 503 index on
loopback (tests/lab/wheelhouse.py), and by hand from PEP 751 for what uv does not write (``index`` keys, markers,
sdists, refused sources). The repository is a real git repository in tmp_path; the probe reads it as the fact pass
ships it. The builds run on a bare host with the real uv. No test reaches PyPI or imports torch.
"""

import functools
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import training_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import acting as venv_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import lock as venv_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import VenvError

from tests.conftest import FIXTURES, ROOT, unavailable
from tests.fakes import FakeRunner, run_module, run_probes_program

sys.path.insert(0, str(ROOT / "tests" / "lab"))
import wheelhouse

UV = str(ROOT / ".venv" / "bin" / "uv")
SYSTEM_PYTHON = "/usr/bin/python3.11"
CONTEXT = {"target": {"label": "CT 200 on pve1", "node": "pve1", "vmid": 200}, "check_mode": False, "steps": {}}
PINS = {"idna": "3.10", "six": "1.17.0", "torch": "2.11.0+cu128"}
REQUIREMENTS = "six\nidna\ntorch==2.11.0+cu128\n"
SHA = "0123456789abcdef0123456789abcdef01234567"
STAMPS = iter(f"20261204T1{hour:01d}{minute:02d}00Z" for hour in range(10) for minute in range(60))


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """One PEP 503 index on loopback (plain HTTP) with six, idna and torch's cu128 build; its simple URL."""
    root = tmp_path_factory.mktemp("index")
    torch_files = {
        "torch/__init__.py": wheelhouse.GUARD,
        "torch/version.py": wheelhouse.torch_version_py("2.11.0+cu128", "12.8"),
    }
    wheels = [
        wheelhouse.build_wheel(root / "w", "six", "1.17.0"),
        wheelhouse.build_wheel(root / "w", "idna", "3.10"),
        wheelhouse.build_wheel(root / "w", "torch", "2.11.0+cu128", torch_files),
    ]
    wheelhouse.write_index(root / "www", wheels)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root / "www"))
    handler.log_message = lambda *_args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()


@pytest.fixture(scope="module")
def compiled(index, tmp_path_factory):
    """``{format: lock text}``: the same requirements compiled by the real uv as requirements.txt and pylock.toml;
    ``smaller``: six and idna alone (requirements.txt)."""
    if not Path(UV).exists():
        unavailable(f"needs {UV}")
    cache = tmp_path_factory.mktemp("uv-cache")
    env = dict(os.environ, UV_NO_CONFIG="1", UV_CACHE_DIR=str(cache), UV_PYTHON_DOWNLOADS="never")
    locks = {}
    for name, fmt, requirements in (
        ("requirements.txt", "requirements.txt", REQUIREMENTS),
        ("pylock.toml", "pylock.toml", REQUIREMENTS),
        ("smaller", "requirements.txt", "six\nidna\n"),
    ):
        done = subprocess.run(
            [
                UV,
                "pip",
                "compile",
                "--quiet",
                "--generate-hashes",
                "--format",
                fmt,
                "--python-version",
                "3.11",
                "--python-platform",
                "x86_64-manylinux_2_28",
                "--index-url",
                index,
                "--emit-index-url",
                "-",
            ],
            input=requirements,
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        locks[name] = done.stdout
    return locks


# -- PEP 751 pylock.toml ---------------------------------------------------------------------------------------
def test_uvs_pylock_reads_as_the_requirements_lock_of_the_same_resolution(compiled):
    pylock, requirements = compiled["pylock.toml"], compiled["requirements.txt"]
    assert (venv_lock.lock_format(pylock), venv_lock.lock_format(requirements)) == ("pylock", "requirements")
    from_pylock, from_requirements = venv_lock.parse_lock(pylock), venv_lock.parse_lock(requirements)
    assert from_pylock["distributions"] == from_requirements["distributions"] == PINS
    assert from_pylock["python"] == from_requirements["python"] == "3.11"  # uv's header names --python-version
    assert set(from_pylock) == set(from_requirements)  # the same form: every consumer reads both alike
    assert (from_pylock["find_links"], from_pylock["no_index"], from_pylock["markers"]) == ([], False, {})


PEP_751 = (FIXTURES / "venv" / "pylock_two_indexes.toml").read_text()


def test_a_pylock_written_by_the_spec_gives_pins_indexes_markers_and_torchs_index():
    assert venv_lock.parse_lock(PEP_751) == {
        "distributions": {"torch": "2.11.0+cu128", "typing-extensions": "4.15.0", "six": "1.17.0"},
        "indexes": ["https://download.pytorch.org/whl/cu128", "https://pypi.org/simple"],
        "torch_index": "https://download.pytorch.org/whl/cu128",
        "find_links": [],
        "no_index": False,
        "sources": {
            "torch": "https://download.pytorch.org/whl/cu128",
            "typing-extensions": "https://pypi.org/simple",
            "six": "https://pypi.org/simple",
        },
        "markers": {"typing-extensions": "python_version < '3.13'"},
        "python": None,  # requires-python is a range, not the minor the venv must have
    }


def package(**table):
    lines = ["[[packages]]"] + [f"{key} = {value}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


HASHED = '[{url = "https://idx/six.whl", hashes = {sha256 = "' + "a" * 64 + '"}}]'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('lock-version = "2.0"\n' + package(name='"six"', version='"1"', wheels=HASHED), "has lock-version '2.0'"),
        ('lock-version = "1.0"\npackages = []\n', r"lists no package"),
        ('lock-version = "1.0"\n[[packages]\n', r"is not valid TOML"),
        (
            'lock-version = "1.0"\n' + package(name='"six"', vcs='{type = "git", commit-id = "ab"}'),
            r"package 1 \(six\) is a direct reference \(vcs\), not an index's file",
        ),
        (
            'lock-version = "1.0"\n' + package(name='"app"', directory='{path = "."}'),
            r"package 1 \(app\) is a direct reference \(directory\)",
        ),
        ('lock-version = "1.0"\n' + package(name='"six"', wheels=HASHED), r"package 1 \(six\) has no exact version"),
        (
            'lock-version = "1.0"\n' + package(name='"six"', version='"1.17.0"', wheels='[{url = "https://i/s.whl"}]'),
            r"package 1 \(six\) lists no wheel or sdist, or one without hashes",
        ),
        (
            'lock-version = "1.0"\n'
            + package(name='"six"', version='"1.17.0"', wheels=HASHED)
            + package(name='"Six"', version='"1.16.0"', wheels=HASHED),
            r"package 2 \(six\): six is listed twice \(1.17.0 and 1.16.0, for different environments\?\)",
        ),
        (
            'lock-version = "1.0"\n'
            + package(
                name='"six"', version='"1.17.0"', index='"https://ci:s3cr3t@pypi.internal/simple"', wheels=HASHED
            ),
            r"https://\*\*\*\*\*\*\*\*@pypi.internal/simple carries credentials",
        ),
    ],
)
def test_a_pylock_that_cannot_say_what_to_install_is_refused_naming_the_package(text, message):
    with pytest.raises(VenvError, match=message) as raised:
        venv_lock.parse_lock(text)
    assert "s3cr3t" not in str(raised.value)
    assert venv_facts.check_spec(dict(venv_facts.SPEC_DEFAULTS, lock=text))  # the settings are refused too


def test_the_venv_is_compared_with_a_pylock_as_with_any_lock():
    answer = {
        "path": "/opt/venvs/train",
        "exists": True,
        "python": "3.11",
        "pyvenv": {"home": "/usr/bin", "version_info": "3.11.2"},
        "interpreter": {"path": "/usr/bin/python3.11", "exists": True},
        "distributions": [
            {"name": "torch", "version": "2.11.0+cu130"},
            {"name": "six", "version": "1.17.0"},
            {"name": "typing_extensions", "version": "4.15.0"},
        ],
        "broken": [],
        "torch_version_py": {"version": "2.11.0+cu130"},
        "errors": [],
    }
    facts = venv_facts.evaluate_step(dict(venv_facts.SPEC_DEFAULTS, lock=PEP_751), answer, {}, CONTEXT)
    assert facts["changes"] == ["torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)"]
    assert facts["lock"]["torch_index"] == "https://download.pytorch.org/whl/cu128"


# -- builds on a bare host -------------------------------------------------------------------------------------
@pytest.fixture
def host(tmp_path, monkeypatch):
    if not (Path(UV).exists() and Path(SYSTEM_PYTHON).exists()):
        unavailable(f"needs {UV} and {SYSTEM_PYTHON}")
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu1")
    monkeypatch.setattr(venv_acting, "utc_stamp", lambda: next(STAMPS))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    (tmp_path / "venvs").mkdir()
    path = tmp_path / "venvs" / "train"

    def run(capsys, check_mode=False, **params):
        args = {"path": str(path), "python_version": "3.11", "uv": UV, **params}
        return run_module(training_venv, args, FakeRunner(), monkeypatch, capsys, check_mode=check_mode)

    run.path = path
    return run


def test_uv_builds_the_venv_from_a_pylock_and_a_second_run_finds_it_in_spec(host, capsys, compiled):
    built = host(capsys, lock=compiled["pylock.toml"])
    assert built["changed"] is True, built.get("msg")
    assert (built["installed"], built["missing"], built["extra"], built["wrong"]) == (PINS, [], [], [])
    assert Path(built["lock_file"]).read_text() == compiled["pylock.toml"]  # the record beside the version
    again = host(capsys, lock=compiled["pylock.toml"])
    assert (again["changed"], again["changes"]) == (False, [])


def test_a_pylock_without_uv_is_one_clear_error(host, capsys, compiled):
    result = host(capsys, lock=compiled["pylock.toml"], uv="/nonexistent/uv")
    assert (result["failed"], result["error"]) == (True, "no_builder")
    assert "the lock is a pylock.toml, which only uv installs here, and there is no uv" in result["msg"]
    assert "training_venv_uv_wheel" in result["msg"]
    assert list(host.path.parent.iterdir()) == []


# -- the lock in the training repository -----------------------------------------------------------------------
def git(repo, *args):
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.email=t@example.org", "-c", "user.name=t", *args],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path, compiled):
    """A training repository: commit ``one`` locks six and idna, commit ``two`` adds torch (a pylock.toml, like a
    project that moved to the standard format); HEAD is ``two`` and the work tree's lock has a local edit."""
    top = tmp_path / "srv" / "train"
    (top / "env").mkdir(parents=True)
    git(top, "init", "-q")
    smaller = compiled["smaller"]
    (top / "env" / "train.lock").write_text(smaller)
    (top / "train.py").write_text("print('train')\n")
    git(top, "add", "-A")
    git(top, "commit", "-qm", "one")
    one = git(top, "rev-parse", "HEAD")
    (top / "env" / "train.lock").write_text(compiled["pylock.toml"])
    git(top, "commit", "-qam", "two")
    two = git(top, "rev-parse", "HEAD")
    (top / "env" / "train.lock").write_text("torch>=2\n")  # a local edit: never what the venv is compared with
    return {"top": top, "one": one, "two": two, "smaller": smaller}


def source(repo, commit, path="env/train.lock"):
    return {"repo": str(repo["top"]), "commit": repo[commit], "path": path, "git": "git"}


def test_the_probe_reads_the_lock_at_the_pinned_commit_not_the_work_tree(repo, compiled):
    spec = dict(venv_facts.SPEC_DEFAULTS, lock_from_repo=source(repo, "one"))
    payload = venv_facts.probe_payload(spec, 30)
    assert payload["lock_from_repo"] == source(repo, "one")
    found = venv_probe.probe(payload)["repo_lock"]
    assert found == {"text": repo["smaller"], "missing": None, "error": None}
    resolved, deferred = venv_lock.resolve_lock(spec, {"repo_lock": found}, may_defer=False)
    assert (resolved["lock"], resolved["lock_from_repo"], deferred) == (repo["smaller"], None, False)
    two = venv_probe.probe(dict(payload, lock_from_repo=source(repo, "two")))["repo_lock"]
    assert two["text"] == compiled["pylock.toml"]


def test_the_probe_reads_it_as_the_fact_pass_ships_it(repo):
    # ct_git travels with the probe part (SHARED) to the target's python, which has nothing of ours.
    payload = venv_facts.probe_payload(dict(venv_facts.SPEC_DEFAULTS, lock_from_repo=source(repo, "one")), 30)
    answers = run_probes_program(SYSTEM_PYTHON, {venv_facts.NAME: (venv_probe, payload)})
    assert answers[venv_facts.NAME]["answer"]["repo_lock"]["text"] == repo["smaller"]


@pytest.mark.parametrize(
    ("path", "found"),
    [
        ("env/missing.lock", {"text": None, "missing": "path", "error": None}),
        ("env", {"error": "env in commit {short} of {top} is a directory, not a regular file"}),
        ("train.py/x", {"text": None, "missing": "path", "error": None}),
    ],
)
def test_what_is_no_file_at_that_commit_is_named(repo, path, found):
    got = ct_git.read_at_commit("git", str(repo["top"]), repo["one"], path, deadline=time.monotonic() + 30)
    expected = {
        k: v.format(short=repo["one"][:12], top=repo["top"]) if isinstance(v, str) else v for k, v in found.items()
    }
    assert {k: got[k] for k in expected} == expected


def test_a_lock_missing_at_that_commit_stops_the_step_naming_the_fix(repo):
    spec = dict(venv_facts.SPEC_DEFAULTS, lock_from_repo=source(repo, "one", "env/missing.lock"))
    answer = venv_probe.probe(venv_facts.probe_payload(spec, 30))
    with pytest.raises(VenvError) as raised:
        venv_facts.evaluate_step(spec, answer, {}, CONTEXT)
    assert str(raised.value) == (
        f"the lock env/missing.lock at commit {repo['one'][:12]} of {repo['top']} does not exist: commit the lock at "
        "that path, or fix training_venv_lock_from_repo (a path relative to training_code_path)"
    )


def test_a_lock_in_the_repo_that_is_no_lock_is_named_with_where_it_was_read(repo):
    git(repo["top"], "commit", "-qam", "three")  # the local edit: `torch>=2`
    spec = dict(
        venv_facts.SPEC_DEFAULTS, lock_from_repo=dict(source(repo, "one"), commit=git(repo["top"], "rev-parse", "HEAD"))
    )
    answer = venv_probe.probe(venv_facts.probe_payload(spec, 30))
    with pytest.raises(
        VenvError, match=r"the lock env/train.lock at commit \w{12} of .*: the lock, line 1: `torch>=2`"
    ):
        venv_facts.evaluate_step(spec, answer, {}, CONTEXT)


def test_a_commit_not_fetched_yet_is_compared_once_the_code_step_fetched_it(repo):
    spec = dict(venv_facts.SPEC_DEFAULTS, lock_from_repo=dict(source(repo, "one"), commit=SHA))
    answer = venv_probe.probe(venv_facts.probe_payload(spec, 30))
    assert answer["repo_lock"] == {"text": None, "missing": "commit", "error": None}
    line = (
        f"compare the venv at /opt/venvs/train with the lock env/train.lock at commit {SHA[:12]} of {repo['top']} "
        "once the training code step has fetched that commit, and rebuild it if it is not that lock"
    )
    code_resets = dict(CONTEXT, steps={"training_code": {"pending": True}})
    for context in (dict(CONTEXT, check_mode=True), code_resets):  # check mode; a fact pass whose code step fetches
        facts = venv_facts.evaluate_step(spec, answer, venv_facts.read_node(spec, None, answer, context), context)
        assert (facts["pending"], facts["changes"], facts["lock"], facts["prune"]) == (True, [line], None, [])
    with pytest.raises(VenvError, match="the repository does not have that commit; the training code step fetches it"):
        venv_facts.evaluate_step(spec, answer, {}, CONTEXT)  # a real run after the code step: it must be there


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"commit": ""}, "lock_from_repo reads the lock at the commit the training code step pins, and that step is"),
        ({"commit": "abc123"}, "lock_from_repo's commit is 'abc123'; expected the full sha that training_code_commit"),
        ({"path": "../outside.lock"}, "training_venv_lock_from_repo is '../outside.lock'; expected the lock's path"),
        ({"path": "/etc/train.lock"}, "training_venv_lock_from_repo is '/etc/train.lock'; expected the lock's path"),
        ({"path": "env/./train.lock"}, "training_venv_lock_from_repo is 'env/./train.lock'; expected the lock's path"),
        ({"repo": "srv/train"}, "lock_from_repo's repo is 'srv/train'; expected the absolute path"),
    ],
)
def test_lock_from_repo_settings_that_cannot_work_are_named(changed, message):
    spec = dict(
        venv_facts.SPEC_DEFAULTS, lock_from_repo={"repo": "/srv/train", "commit": SHA, "path": "a.lock", **changed}
    )
    assert venv_facts.check_spec(spec).startswith(message), venv_facts.check_spec(spec)


def test_a_lock_is_given_exactly_one_way():
    both = dict(
        venv_facts.SPEC_DEFAULTS, lock="six==1.17.0\n", lock_from_repo={"repo": "/r", "commit": SHA, "path": "a"}
    )
    assert venv_facts.check_spec(both).startswith("lock and lock_from_repo are both set; give the lock one way")
    assert venv_facts.check_spec(dict(venv_facts.SPEC_DEFAULTS)).startswith("no lock: give training_venv_lock_file")
    assert venv_facts.check_spec(dict(both, lock=None)) == ""


def test_the_module_builds_from_the_lock_committed_at_the_pinned_commit_and_follows_the_pin(host, capsys, repo):
    first = host(capsys, lock_from_repo=source(repo, "one"))
    assert first["changed"] is True, first.get("msg")
    assert first["installed"] == {"idna": "3.10", "six": "1.17.0"}
    assert Path(first["lock_file"]).read_text() == repo["smaller"]
    drift = host(capsys, check_mode=True, lock_from_repo=source(repo, "two"))  # the pin moved: torch comes in
    assert drift["changes"] == ["install torch 2.11.0+cu128 (missing)"]
    second = host(capsys, lock_from_repo=source(repo, "two"))
    assert (second["changed"], second["installed"]) == (True, PINS)
    assert json.loads(json.dumps(second))["builder"]["name"] == "uv"


def test_the_module_in_check_mode_defers_a_commit_the_repository_lacks_and_a_real_run_fails(host, capsys, repo):
    checked = host(capsys, check_mode=True, lock_from_repo=dict(source(repo, "one"), commit=SHA))
    assert checked["changed"] is True
    assert checked["changes"][0].startswith("compare the venv at")
    failed = host(capsys, lock_from_repo=dict(source(repo, "one"), commit=SHA))
    assert (failed["failed"], failed["error"]) == (True, "lock")
    assert "the repository does not have that commit" in failed["msg"]
    assert list(host.path.parent.iterdir()) == []


def test_while_the_code_step_waits_for_a_window_the_venv_waits_with_it(repo):
    # Unattended, a live job keeps the repository at its commit: a venv rebuilt from the new commit's lock would
    # no longer match the code that runs.
    spec = dict(venv_facts.SPEC_DEFAULTS, unattended=True, lock_from_repo=source(repo, "two"))
    answer = venv_probe.probe(venv_facts.probe_payload(spec, 30))
    waits = "CT 200 on pve1: the repository at /srv/train needs a reset but pid 41 works in it"
    context = dict(CONTEXT, steps={"training_code": {"pending": False, "needs_window": [waits]}})
    assert venv_facts.read_node(spec, None, answer, context) == {}
    facts = venv_facts.evaluate_step(spec, answer, {}, context)
    assert (facts["pending"], facts["changes"], facts["rebuild"], facts["prune"]) == (False, [], False, [])
    assert facts["needs_window"] == [
        f"CT 200 on pve1: the venv at /opt/venvs/train follows the lock env/train.lock at commit {repo['two'][:12]} "
        f"of {repo['top']}, and the training code step waits for a window ({waits}): the venv waits with the code"
    ]
    assert sorted(facts) == sorted(
        venv_facts.evaluate_step(dict(spec, lock_from_repo=None, lock="six==1\n"), answer, {}, CONTEXT)
    )
