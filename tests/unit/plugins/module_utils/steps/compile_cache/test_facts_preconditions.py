"""Preconditions (issue 21, item 3) of the compile_cache step: what it needs to do its work (the warm-up's command) is
checked by the fact pass, so a run that cannot finish fails before any step changes anything, in --check as in the
real run."""

import re
import stat
import types

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.answer import CacheError

from tests.unit.plugins.module_utils.steps.compile_cache import test_facts as cache

LABEL = "CT 200 on pve1"
CT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def executable(path, text="#!/bin/sh\nexit 0\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


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
