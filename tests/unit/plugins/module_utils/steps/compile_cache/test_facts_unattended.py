"""Unattended, a stale compile cache in use by a live process is left for a window instead of failing the run:
the facts (cache_facts) and the acting script against real directories and a real process."""

import os
import subprocess

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import script

from tests.unit.plugins.module_utils.steps.compile_cache.test_facts import (
    CU128,
    CU130,
    HOMES,
    LABEL,
    MB,
    UNSTAMPED,
    answer_of,
    context,
    facts_of,
    root_of,
)
from tests.unit.plugins.module_utils.steps.compile_cache.test_facts import STALE as STALE_ROOT

USERS = {"/tmp/torchinductor_root": [{"pid": 4711, "name": "python3", "how": ["cwd", "mapped"]}]}
WINDOW = (
    f"{LABEL}: compile cache /tmp/torchinductor_root is stale (stamped for torch 2.11.0+cu130, now 2.11.0+cu128; "
    "152 MB) but in use by pid 4711 (python3: cwd, mapped): not purged under a live process; purging it needs a "
    "window (stop the job, or run recover.yml without recover_unattended)"
)


# -- the facts -------------------------------------------------------------------------------------------------
def test_unattended_a_stale_cache_in_use_needs_a_window_instead_of_a_problem():
    found = facts_of(answer_of(STALE_ROOT, users=USERS), unattended=True)
    assert (found["problems"], found["changes"], found["pending"]) == ([], [], False)
    assert found["needs_window"] == [WINDOW]
    assert found["diff"]["before"] == found["diff"]["after"]
    assert (found["roots"][0]["verdict"], found["roots"][0]["window"]) == ("stale", True)


def test_attended_a_stale_cache_in_use_is_a_problem_as_before():
    found = facts_of(answer_of(STALE_ROOT, users=USERS))
    assert found["problems"] == [
        f"{LABEL}: cannot purge /tmp/torchinductor_root: in use by pid 4711 (python3: cwd, mapped); a purge never "
        "runs under a live process (a running compile): stop it and run again"
    ]
    assert (found["needs_window"], found["pending"]) == ([], False)


def test_unattended_the_other_roots_are_still_handled_and_no_warm_up_runs():
    found = facts_of(answer_of(STALE_ROOT, UNSTAMPED, users=USERS), unattended=True, warmup=["python3", "/srv/w.py"])
    assert found["needs_window"] == [WINDOW]
    assert [c.split(" (")[0] for c in found["changes"]] == ["stamp /root/.triton/cache"]
    assert (found["pending"], found["warmup"]["planned"]) == (True, False)
    spec = dict(cache_facts.SPEC_DEFAULTS, unattended=True)
    payload = cache_facts.act_payload(spec, found, answer_of(STALE_ROOT, UNSTAMPED), 60)
    assert [r["action"] for r in payload["roots"]] == [None, "stamp"]
    assert payload["unattended"] is True


def test_unattended_no_warm_up_runs_while_a_cache_it_would_fill_is_in_use():
    other = root_of("/root/.triton/cache", stamp=CU130, size=12 * MB)  # stale too, and nobody uses it
    found = facts_of(answer_of(STALE_ROOT, other, users=USERS), unattended=True, warmup=["python3", "/srv/w.py"])
    assert [c.split(" ")[:2] for c in found["changes"]] == [
        ["purge", "/root/.triton/cache"],
        ["stamp", "/root/.triton/cache"],
    ]
    assert (found["pending"], found["warmup"]["planned"]) == (True, False)
    nobody = facts_of(answer_of(STALE_ROOT, other), unattended=True, warmup=["python3", "/srv/w.py"])
    assert nobody["warmup"]["planned"] is True


def test_unattended_a_process_the_gpu_step_ends_first_does_not_hold_the_purge_back():
    gpu = {"pending": True, "processes": [{"pid": 90411, "ns_pid": 4711}], "launchers": []}
    found = facts_of(answer_of(STALE_ROOT, users=USERS), context(gpu_processes=gpu), unattended=True)
    assert (found["needs_window"], found["pending"]) == ([], True)
    assert found["changes"][0].startswith("purge /tmp/torchinductor_root")


# -- the acting script: real directories, a real process -------------------------------------------------------
def test_the_script_unattended_leaves_a_root_in_use_and_purges_the_others(tmp_path):
    busy, idle = tmp_path / "inductor", tmp_path / "triton"
    for root in (busy, idle):
        root.mkdir()
        (root / "graph").write_text("g")
    sleeper = subprocess.Popen(["sleep", "30"], cwd=busy)
    payload = {
        "roots": [{"path": str(p), "real_path": os.path.realpath(p), "action": "purge"} for p in (busy, idle)],
        "fingerprint": CU128,
        "stamp_name": cache_facts.STAMP_NAME,
        "homes": HOMES,
        "uid": 0,
        "warmup": {"argv": ["false"]},  # would fail the act if it ran
        "timeout": 30,
        "unattended": True,
    }
    try:
        done = script.probe(payload)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert "error" not in done
    assert done["needs_window"] == [
        {"path": str(busy), "real_path": str(busy), "users": [{"pid": sleeper.pid, "name": "sleep", "how": ["cwd"]}]}
    ]
    assert (busy / "graph").read_text() == "g"  # neither purged nor stamped
    assert not (busy / cache_facts.STAMP_NAME).exists()
    assert not (idle / "graph").exists()
    assert (idle / cache_facts.STAMP_NAME).exists()
    assert done["warmup"] is None  # the warm-up (`false`) never ran: the caches it would fill are in use
    assert [r["action"] for r in done["roots"]] == [None, "purge"]
