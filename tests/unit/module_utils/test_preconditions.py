"""Preconditions (issue 21, item 3): what a pending step needs to do its work is checked by the fact pass, so a run
that cannot finish fails before any step changes anything, in --check as in the real run.

Each step's probe part reads, inside the same ``pct exec`` and from files alone, what its acting script would
use; its pure evaluation turns a missing piece into one problem naming the fix:

* training_venv: a builder (uv as the build script finds it, the role's uv wheel, or ``python3.X -m venv`` with
  ``venv`` and ``ensurepip`` in its library) and the python the lock needs (pve_ct_venv.build_needs, which the
  build script's own choice of builder shares);
* training_code: a missing commit's remote, given by name, must be a remote of the repository;
* compile_cache: the planned warm-up's command (and its ``#!`` interpreter) must be there for its user.

Pure evaluations are fed fixture answers; the probes run for real against files in tmp_path (a PATH without uv, a
python whose library lacks ensurepip, a repository with remotes, warm-up scripts), in this process and as the
fact pass ships them. The fact pass itself is driven in tests/unit/library/test_target_facts_preconditions.py.
"""

import os
import re
import stat
import subprocess
import sys
import types

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_git, pve_ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.answer import CacheError
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import facts as code_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script as venv_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import VenvError

from tests.fakes import run_probes_program
from tests.unit.module_utils import test_pve_cache as cache
from tests.unit.module_utils import test_pve_code as code
from tests.unit.module_utils import test_pve_venv as venv

LABEL = "CT 200 on pve1"
CT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# -- training_venv: the pure rule ------------------------------------------------------------------------------
def build(**changed):
    """What the probe answers for a CT with uv and python3.11 (venv and ensurepip in its library)."""
    found = {
        "path": CT_PATH,
        "uv": "/usr/local/bin/uv",
        "uv_missing": None,
        "python": "python3.11",
        "base_python": "/usr/bin/python3.11",
        "venv": True,
        "ensurepip": True,
        "uv_python": "/usr/bin/python3.11",
        "own": "3.11",
    }
    found.update(changed)
    return found


NO_UV = {"uv": None, "uv_missing": f"uv is not on PATH ({CT_PATH})"}


def venv_step(answer, **spec):
    return venv_facts.evaluate_step(dict(venv.SPEC, **spec), answer, {}, venv.CONTEXT)


def test_a_target_with_uv_or_with_python3_venv_can_build_the_venv():
    for found in (build(), build(**NO_UV), build(**NO_UV, uv_python=None), build(uv_wheel=None)):
        facts = venv_step(dict(venv.ABSENT, build=found))
        assert (facts["problems"], facts["pending"], facts["rebuild"]) == ([], True, True)


def test_no_uv_and_no_ensurepip_is_a_problem_before_anything_changes():
    facts = venv_step(dict(venv.ABSENT, build=build(**NO_UV, ensurepip=False)))
    assert facts["problems"] == [
        f"{LABEL}: the venv at /opt/venvs/train needs a rebuild but the target cannot build it: no uv (uv is not on "
        f"PATH ({CT_PATH})) and `python3.11 -m venv` fails there, since /usr/bin/python3.11 has no ensurepip module; "
        "install it (apt install python3.11-venv), or install uv there (training_venv_uv: its path), or set "
        "training_venv_uv_wheel to PyPI's uv wheel on the controller"
    ]
    # What a run would change is still said; nothing is pending, nothing rebuilt.
    assert facts["changes"] == ["create venv at /opt/venvs/train (python 3.11, 26 distributions from the lock)"]
    assert (facts["pending"], facts["rebuild"]) == (False, False)


def test_a_library_without_venv_either_names_both():
    facts = venv_step(dict(venv.ABSENT, build=build(**NO_UV, venv=False, ensurepip=False)))
    assert "has no venv and no ensurepip module" in facts["problems"][0]


def test_the_uv_wheel_the_role_installs_is_a_builder():
    facts = venv_step(dict(venv.ABSENT, build=build(**NO_UV, ensurepip=False)), uv_wheel="/ctl/uv-0.9.0.whl")
    assert (facts["problems"], facts["pending"]) == ([], True)


def test_no_python_of_the_locks_minor_is_a_problem_with_uv_and_without():
    with_uv = venv_step(dict(venv.ABSENT, build=build(uv_python=None, base_python=None, own="3.9")))
    assert with_uv["problems"] == [
        f"{LABEL}: the venv at /opt/venvs/train needs a rebuild with python3.11, but uv (/usr/local/bin/uv) finds "
        f"none in the target (no python3.11 on PATH {CT_PATH}, no python3 or python of 3.11, none uv installed "
        "itself; uv downloads none during recovery): install python3.11 there, or compile the lock for a python the "
        "target has (its python3 is 3.9) and set training_venv_python_version to it"
    ]
    wheel = venv_step(dict(venv.ABSENT, build=build(**NO_UV, uv_python=None, base_python=None)), uv_wheel="/w.whl")
    assert "but the uv of training_venv_uv_wheel finds none in the target" in wheel["problems"][0]
    without = venv_step(dict(venv.ABSENT, build=build(**NO_UV, uv_python=None, base_python=None, own="3.9")))
    assert without["problems"] == [
        f"{LABEL}: the venv at /opt/venvs/train needs a rebuild but the target cannot build it: no uv (uv is not on "
        f"PATH ({CT_PATH})) and no python3.11 on PATH; install python3.11 there with its venv module (apt install "
        "python3.11 python3.11-venv), or compile the lock for a python the target has (its python3 is 3.9) and set "
        "training_venv_python_version to it"
    ]


def test_a_library_that_was_not_found_is_not_held_against_the_target():
    facts = venv_step(dict(venv.ABSENT, build=build(**NO_UV, venv=None, ensurepip=None)))
    assert (facts["problems"], facts["pending"]) == ([], True)


def test_nothing_to_build_needs_no_builder():
    nothing = build(**NO_UV, base_python=None, uv_python=None)
    assert venv_step(dict(venv.IN_SPEC, build=nothing))["problems"] == []
    # Old versions beyond keep are removed without a build: no builder needed either.
    versions = [f"{venv.PATH}.2026120{day}T101500Z" for day in range(1, 4)]
    pruning = dict(venv.IN_SPEC, build=nothing, versions=versions, real_path=versions[-1])
    facts = venv_step(pruning, keep=1)
    assert (facts["problems"], facts["pending"], facts["rebuild"]) == ([], True, False)
    assert len(facts["prune"]) == 2


def test_an_unattended_rebuild_left_for_a_window_needs_no_builder():
    nothing = build(**NO_UV, base_python=None, uv_python=None)
    user = {"pid": 516, "ns_pid": 41, "name": "python3", "command": "python3 train.py", "how": "exe", "file": "x"}
    answer = dict(venv.POLLUTED, build=nothing)
    facts = venv_facts.evaluate_step(dict(venv.SPEC, unattended=True), answer, {"users": [user]}, venv.CONTEXT)
    assert (facts["problems"], facts["pending"], len(facts["needs_window"])) == ([], False, 1)


def test_an_answer_without_build_is_not_judged_and_one_of_another_shape_is_refused():
    assert venv_step(venv.ABSENT)["pending"] is True  # an older probe's answer
    for wrong in ("uv", {"uv": 1}, build(venv="yes"), build(own=None)):
        with pytest.raises(VenvError, match="answered a build that is not what a build would use"):
            venv_step(dict(venv.ABSENT, build=wrong))


def test_what_the_target_chose_is_escaped_in_the_sentence():
    found = build(**NO_UV, ensurepip=False, base_python="/usr/bin/python3.11\nCT 201: all good")
    assert "/usr/bin/python3.11\\nCT 201: all good has no" in venv_step(dict(venv.ABSENT, build=found))["problems"][0]


def test_the_payload_asks_for_the_uv_setting_and_the_locks_python():
    assert venv_facts.probe_payload(dict(venv.SPEC, uv="/root/.local/bin/uv"), 30) == {
        "path": "/opt/venvs/train",
        "timeout": 30,
        "uv": "/root/.local/bin/uv",
        "python": "3.11",
    }
    assert venv_facts.probe_payload(dict(venv.SPEC, lock="six==1.17.0\n"), 30)["python"] is None


# -- training_venv: the probe against real files ----------------------------------------------------------------
def executable(path, text="#!/bin/sh\nexit 0\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_python(prefix, minor="3.11", *, ensurepip=True):
    """``<prefix>/bin/python<minor>`` with a standard library of its own in ``<prefix>/lib/python<minor>``: never run,
    only looked at (the probe reads files)."""
    library = prefix / "lib" / f"python{minor}"
    (library / "venv").mkdir(parents=True)
    (library / "os.py").write_text("")
    (library / "venv" / "__init__.py").write_text("")
    if ensurepip:
        (library / "ensurepip").mkdir()
        (library / "ensurepip" / "__init__.py").write_text("")
    return executable(prefix / "bin" / f"python{minor}")


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No uv-installed python of this machine's root counts."""
    monkeypatch.setenv("UV_PYTHON_INSTALL_DIR", str(tmp_path / "uv-pythons"))
    return tmp_path


def read_build(path, uv="uv", python="3.11"):
    return venv_probe.probe({"path": str(path / "venv"), "timeout": 10, "uv": uv, "python": python})["build"]


def test_the_probe_finds_no_uv_and_a_python_without_ensurepip(isolated, monkeypatch):
    python = fake_python(isolated / "usr", ensurepip=False)
    monkeypatch.setenv("PATH", str(python.parent))
    found = read_build(isolated)
    assert found == {
        "path": str(python.parent),
        "uv": None,
        "uv_missing": f"uv is not on PATH ({python.parent})",
        "python": "python3.11",
        "base_python": str(python),
        "venv": True,
        "ensurepip": False,
        "uv_python": str(python),
        "own": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }
    facts = venv_step(dict(venv.ABSENT, build=found))
    assert "`python3.11 -m venv` fails there, since" in facts["problems"][0]
    assert facts["pending"] is False


def test_the_probe_finds_uv_on_path_or_by_its_path(isolated, monkeypatch):
    python = fake_python(isolated / "usr", ensurepip=False)
    uv = executable(isolated / "tools" / "uv")
    monkeypatch.setenv("PATH", f"{uv.parent}:{python.parent}")
    assert (read_build(isolated)["uv"], read_build(isolated)["uv_missing"]) == (str(uv), None)
    monkeypatch.setenv("PATH", str(python.parent))
    assert read_build(isolated, uv=str(uv))["uv"] == str(uv)
    uv.chmod(0o644)
    assert read_build(isolated, uv=str(uv))["uv_missing"] == f"{uv} is not an executable file"


def test_uv_finds_a_python3_of_the_minor_or_one_it_installed(isolated, monkeypatch):
    python = fake_python(isolated / "opt" / "py311")
    alias = isolated / "bin" / "python3"
    alias.parent.mkdir()
    alias.symlink_to(python)  # python3 -> .../python3.11: its minor is in the name it resolves to
    monkeypatch.setenv("PATH", str(alias.parent))
    found = read_build(isolated)
    assert (found["uv_python"], found["base_python"]) == (str(alias), None)  # -m venv wants python3.11 itself
    assert read_build(isolated, python="3.12")["uv_python"] is None
    managed = isolated / "uv-pythons" / "cpython-3.12.4-linux-x86_64-gnu"
    managed.mkdir(parents=True)
    assert read_build(isolated, python="3.12")["uv_python"] == str(managed)
    assert read_build(isolated, python=None)["uv_python"] == str(alias)


def test_the_probes_own_interpreter_is_read_from_its_own_library(isolated, monkeypatch):
    here = isolated / "bin"
    here.mkdir()
    minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    (here / f"python{minor}").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setenv("PATH", str(here))
    found = read_build(isolated, python=minor)
    assert found["venv"] is True
    assert found["ensurepip"] is os.path.isfile(os.path.join(os.path.dirname(os.__file__), "ensurepip", "__init__.py"))


def test_the_build_script_chooses_the_builder_the_probe_found(isolated, monkeypatch):
    python = fake_python(isolated / "usr")
    monkeypatch.setenv("PATH", str(python.parent))
    payload = {"path": str(isolated / "venv"), "stamp": "20261203T101500Z", "lock": "", "expected": {}}
    found = read_build(isolated)
    assert venv_script.Build(payload).builder() == ("venv+pip", found["uv_missing"])
    assert venv_script.Build(dict(payload, python="3.11")).base_python() == found["base_python"]
    uv = executable(isolated / "tools" / "uv")
    monkeypatch.setenv("PATH", f"{uv.parent}:{python.parent}")
    assert venv_script.Build(payload).builder() == ("uv", read_build(isolated)["uv"])
    assert pve_ct_venv in venv_script.SHARED  # one piece of code, shipped with both


def test_the_probe_reads_it_in_the_ct_as_the_fact_pass_ships_it(isolated):
    python = fake_python(isolated / "usr", ensurepip=False)
    payload = {"path": str(isolated / "venv"), "timeout": 10, "uv": "uv", "python": "3.11"}
    env = ["env", "-i", f"PATH={python.parent}", f"UV_PYTHON_INSTALL_DIR={isolated / 'none'}"]
    done = run_probes_program(sys.executable, {"training_venv": (venv_probe, payload)}, prefix=env)
    found = done["training_venv"]["answer"]["build"]
    assert (found["uv"], found["base_python"], found["ensurepip"]) == (None, str(python), False)


# -- training_code ---------------------------------------------------------------------------------------------
PINNED = code.PINNED


def code_step(spec=None, **changed):
    return code_facts.evaluate_step(dict(code.SPEC, **(spec or {})), code.answer(**changed), {}, code.CONTEXT)


def test_a_missing_commit_from_a_remote_the_repository_lacks_is_a_problem():
    facts = code_step({"remote": "upstream"}, commit_present=False, remotes=["backup", "origin"])
    assert facts["problems"] == [
        f"{LABEL}: commit {PINNED} is not in the repository at /srv/train and training_code_remote upstream is not "
        "a remote of it (its remotes are backup, origin); set training_code_remote to one of them or to a URL, or "
        "add it there (git -C /srv/train remote add upstream <url>)"
    ]
    assert facts["pending"] is False
    lonely = code_step({"remote": "origin"}, commit_present=False, remotes=[])
    assert "training_code_remote origin is not a remote of it (it has no remote)" in lonely["problems"][0]


@pytest.mark.parametrize(
    "remote", ["origin", "https://git.example.org/train.git", "git@git.example.org:train.git", "/srv/up.git", "../up"]
)
def test_a_configured_remote_or_a_url_can_fetch(remote):
    facts = code_step({"remote": remote}, commit_present=False, remotes=["origin"])
    assert facts["problems"] == []
    assert facts["changes"][0] == f"fetch {PINNED[:12]} from {remote} (not in the repository)"
    assert facts["pending"] is True


def test_the_remote_matters_only_when_the_commit_is_missing_and_is_not_judged_unread():
    assert code_step({"remote": "upstream"}, commit_present=True, remotes=[])["problems"] == []
    assert code_step({"remote": "upstream"}, commit_present=False)["problems"] == []  # an older probe's answer
    with pytest.raises(code_facts.CodeError, match="'remotes'"):
        code_step(commit_present=False, remotes="origin")


@pytest.mark.parametrize(
    ("remote", "is_name"),
    [
        ("origin", True),
        ("team/upstream", True),
        ("https://h/r.git", False),
        ("git@h:r.git", False),
        ("/srv/r.git", False),
        ("./r", False),
        ("~/r", False),
    ],
)
def test_what_git_reads_as_a_remotes_name(remote, is_name):
    assert code_facts.names_a_remote(remote) is is_name


def git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, env=dict(os.environ, **code_env()))


def code_env():
    return {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}


def test_the_probe_names_the_remotes_of_the_repository(tmp_path):
    repo = tmp_path / "train"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    (repo / "train.py").write_text("print(1)\n")
    git("add", "train.py", cwd=repo)
    git("commit", "-q", "-m", "one", cwd=repo)
    git("remote", "add", "origin", "/srv/up.git", cwd=repo)
    git("remote", "add", "Team/Backup", "https://git.example.org/t.git", cwd=repo)
    git("config", "remote.pushonly.pushurl", "/srv/p.git", cwd=repo)  # no url: git cannot fetch from it
    answer = code_probe.probe({"path": str(repo), "commit": "ab" * 20, "git": "git", "timeout": 30})
    assert (answer["commit_present"], answer["remotes"]) == (False, ["Team/Backup", "origin"])
    assert (
        code_probe.probe({"path": str(tmp_path), "commit": "ab" * 20, "git": "git", "timeout": 30})["remotes"] is None
    )
    facts = code_facts.evaluate_step(dict(code.SPEC, path=str(repo), remote="upstream"), answer, {}, code.CONTEXT)
    assert (
        "training_code_remote upstream is not a remote of it (its remotes are Team/Backup, origin)"
        in (facts["problems"][0])
    )


def test_remote_names_come_from_the_url_keys():
    config = [
        ("core.bare", "false"),
        ("remote.origin.url", "/up"),
        ("remote.origin.fetch", "+refs/*"),
        ("remote..url", "x"),
    ]
    assert pve_ct_git.remote_names([*config, ("remote.a.b.url", "y")]) == ["a.b", "origin"]


# -- compile_cache: the warm-up --------------------------------------------------------------------------------
WARMUP = ["warmup-train", "--steps", "1"]


def warm(found=None, **answer):
    """The facts of a stale root (the warm-up planned after its purge) with the probe's read of the warm-up."""
    base = {"command": WARMUP[0], "file": None, "state": "missing", "mode": None}
    base.update(interpreter=None, interpreter_state=None)
    read = dict(base, **(found or {}))
    return cache.answer_of(cache.STALE, warmup=read, **answer)


def cache_step(answer, ctx=None, **spec):
    return cache.facts_of(answer, ctx, **dict({"warmup": WARMUP}, **spec))


def test_a_warm_up_command_that_is_nowhere_is_a_problem_before_any_purge():
    facts = cache_step(warm())
    path = "/opt/venvs/train/bin:" + CT_PATH
    assert facts["problems"] == [
        f"{LABEL}: the warm-up command warmup-train is not on the PATH it runs with ({path}); install it in the "
        "target or give compile_cache_warmup its full path, or set compile_cache_warmup to [] (no warm-up)"
    ]
    assert facts["warmup"]["planned"] is True
    assert facts["pending"] is False
    absolute = cache_step(warm({"command": "/srv/train/warm.sh"}), warmup=["/srv/train/warm.sh"])
    assert absolute["problems"] == [
        f"{LABEL}: the warm-up command /srv/train/warm.sh does not exist; install it there or correct its path, or "
        "set compile_cache_warmup to [] (no warm-up)"
    ]


def test_a_warm_up_its_user_may_not_run_or_whose_interpreter_is_gone_is_a_problem():
    denied = cache_step(warm({"file": "/srv/train/warm.sh", "state": "denied", "mode": "0644"}), user="root")
    assert denied["problems"] == [
        f"{LABEL}: the warm-up command /srv/train/warm.sh may not be run by root (mode 0644); make it an executable "
        "file root may run (chmod +x), or set compile_cache_warmup to [] (no warm-up)"
    ]
    gone = {"file": "/srv/train/warm.py", "state": "ok", "interpreter": "/usr/bin/python3.12"}
    facts = cache_step(warm(dict(gone, interpreter_state="missing")))
    assert facts["problems"] == [
        f"{LABEL}: the warm-up command /srv/train/warm.py starts with #!/usr/bin/python3.12, which does not exist; "
        "install that interpreter, correct the script's first line, or set compile_cache_warmup to [] (no warm-up)"
    ]
    assert (
        "which is not a program root may run" in cache_step(warm(dict(gone, interpreter_state="denied")))["problems"][0]
    )


def test_a_warm_up_that_can_start_or_is_not_planned_is_no_problem():
    ready = {"file": "/opt/venvs/train/bin/warmup-train", "state": "ok"}
    assert cache_step(warm(ready))["problems"] == []
    assert cache_step(warm(dict(ready, interpreter="/usr/bin/env", interpreter_state="ok")))["pending"] is True
    fresh = cache.answer_of(cache.FRESH, warmup={"command": "warmup-train", "file": None, "state": "missing"})
    facts = cache_step(fresh)
    assert (facts["warmup"]["planned"], facts["problems"]) == (False, [])
    assert cache_step(cache.answer_of(cache.STALE))["problems"] == []  # an older probe's answer


def test_what_the_venv_rebuilt_in_this_run_will_provide_is_not_held_against_it():
    rebuilt = {"path": "/opt/venvs/train", "pending": True, "lock": {"torch": "2.11.0+cu130"}, "problems": []}
    ctx = cache.context(training_venv=rebuilt)
    assert cache_step(warm(), ctx)["problems"] == []  # a bare name: the venv's bin comes first on its PATH
    inside = warm({"command": "/opt/venvs/train/bin/python"})
    assert cache_step(inside, ctx, warmup=["/opt/venvs/train/bin/python", "warm.py"])["problems"] == []
    script = {
        "file": "/srv/train/warm.py",
        "state": "ok",
        "interpreter": "/opt/venvs/train.20261201T101500Z/bin/python",
    }
    assert cache_step(warm(dict(script, interpreter_state="missing")), ctx)["problems"] == []
    elsewhere = warm({"command": "/srv/train/warm.sh"})
    assert cache_step(elsewhere, ctx, warmup=["/srv/train/warm.sh"])["problems"][0].startswith(
        f"{LABEL}: the warm-up command /srv/train/warm.sh does not exist"
    )


@pytest.mark.parametrize(
    ("found", "message"),
    [
        ("python", "warmup is 'python', not what read_warmup answers"),
        ({"state": "gone"}, "warmup is {'state': 'gone'}, not what read_warmup answers"),
        ({"state": "ok", "file": 1}, "warmup file is 1, not a string"),
        ({"state": "ok", "interpreter_state": "x"}, "warmup interpreter_state is 'x'"),
    ],
)
def test_a_warm_up_read_of_another_shape_is_refused(found, message):
    with pytest.raises(CacheError, match=re.escape(message)):
        cache_step(cache.answer_of(cache.STALE, warmup=found))


def test_the_payload_asks_for_the_warm_up_only_when_there_is_one():
    spec = dict(cache.SPEC, warmup=["python", "warm.py"], warmup_env={"PATH": "/opt/tools/bin:/usr/bin"})
    assert cache_facts.probe_payload(spec)["warmup"] == {"command": "python", "path": "/opt/tools/bin:/usr/bin"}
    assert "warmup" not in cache_facts.probe_payload(cache.SPEC)


def stat_of(mode, uid=0, gid=0):
    return types.SimpleNamespace(st_mode=stat.S_IFREG | mode, st_uid=uid, st_gid=gid)


@pytest.mark.parametrize(
    ("info", "uid", "groups", "runnable"),
    [
        (stat_of(0o700, uid=1000), 0, {0}, True),  # root: any x bit
        (stat_of(0o644), 0, {0}, False),
        (stat_of(0o744, uid=1000), 1000, {1000}, True),
        (stat_of(0o654, uid=1000), 1000, {1000}, False),  # its owner lacks x, whatever the group has
        (stat_of(0o750, gid=50), 1000, {1000, 50}, True),
        (stat_of(0o705, gid=50), 1000, {1000, 50}, False),
        (stat_of(0o701), 1000, {1000}, True),
        (types.SimpleNamespace(st_mode=stat.S_IFDIR | 0o755, st_uid=0, st_gid=0), 0, {0}, False),
    ],
)
def test_who_may_run_a_file_by_its_mode(info, uid, groups, runnable):
    assert cache_probe.runnable_by(info, uid, groups) is runnable


def read_warmup(tmp_path, command, path=CT_PATH, home=None):
    user = {"name": "root", "exists": True, "uid": 0, "gid": 0, "home": str(home or tmp_path)}
    return cache_probe.read_warmup({"command": command, "path": path}, user)


def test_the_probe_finds_the_warm_up_as_popen_would(tmp_path):
    tools = executable(tmp_path / "tools" / "warmup-train").parent
    assert read_warmup(tmp_path, "warmup-train", f"/nonexistent:{tools}") == {
        "command": "warmup-train",
        "file": str(tools / "warmup-train"),
        "state": "ok",
        "mode": None,
        "interpreter": "/bin/sh",
        "interpreter_state": "ok",
    }
    assert read_warmup(tmp_path, "warmup-train")["state"] == "missing"
    assert read_warmup(tmp_path, "tools/warmup-train")["file"] == str(tools / "warmup-train")  # from its home
    (tools / "warmup-train").chmod(0o644)
    assert read_warmup(tmp_path, str(tools / "warmup-train"))["state"] == "denied"
    assert read_warmup(tmp_path, str(tools))["state"] == "not_file"


def test_a_later_path_entry_that_can_run_wins_over_one_that_cannot(tmp_path):
    executable(tmp_path / "a" / "warm").chmod(0o644)
    executable(tmp_path / "b" / "warm")
    found = read_warmup(tmp_path, "warm", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert (found["file"], found["state"]) == (str(tmp_path / "b" / "warm"), "ok")


def test_the_probe_reads_the_interpreter_of_a_script(tmp_path):
    script = executable(tmp_path / "warm.py", "#!/nonexistent/bin/python -u\nprint(1)\n")
    found = read_warmup(tmp_path, str(script))
    assert (found["state"], found["interpreter"], found["interpreter_state"]) == (
        "ok",
        "/nonexistent/bin/python",
        "missing",
    )
    elf = executable(tmp_path / "warm.bin", "\x7fELF")
    assert read_warmup(tmp_path, str(elf))["interpreter"] is None


def test_the_probe_answers_the_warm_up_in_the_fact_pass_and_the_facts_judge_it(tmp_path):
    spec = dict(cache.SPEC, roots=[str(tmp_path / "cache")], warmup=["warmup-train"], venv=str(tmp_path / "venv"))
    cache.fake_venv(tmp_path / "venv")
    answer = cache_probe.probe(cache_facts.probe_payload(spec, 30))
    assert answer["warmup"]["state"] == "missing"
    facts = cache_facts.evaluate_step(spec, answer, {}, cache.context())
    assert facts["warmup"]["planned"] is True  # the root is missing: cold
    assert facts["problems"][0].startswith(f"{LABEL}: the warm-up command warmup-train is not on the PATH it runs with")
    executable(tmp_path / "venv" / "bin" / "warmup-train")  # the venv's bin comes first on its PATH
    answer = cache_probe.probe(cache_facts.probe_payload(spec, 30))
    assert cache_facts.evaluate_step(spec, answer, {}, cache.context())["problems"] == []
