"""plugins/modules/compile_cache.py unattended on a CT through FakeRunner: a stale cache in use by a live process is
left
for a window (found by the module's read, or by the acting script just before the purge) and the task does not
fail; attended it fails before anything is deleted, as before."""

import json
import socket

import compile_cache
import pytest

from tests.fakes import FakeRunner, run_module
from tests.unit.library.test_compile_cache import (
    ACT_PAYLOAD,
    CT_PARAMS,
    CU128,
    PCT,
    READ_PAYLOAD,
    STALE,
    WRAPPER,
    read_call,
)

LABEL = "CT 200 on pve1"
UNATTENDED = dict(CT_PARAMS, unattended=True)
IN_USE = dict(STALE, users={"/tmp/torchinductor_root": [{"pid": 4711, "name": "python3", "how": ["cwd"]}]})
STAMPED = {"state": "ok", "fingerprint": CU128, "reason": None}


def window(users, found=""):
    return (
        f"{LABEL}: compile cache /tmp/torchinductor_root is stale (stamped for torch 2.11.0+cu130, now 2.11.0+cu128; "
        f"152 MB) but in use by {users}: not purged under a live process; purging it needs a window (stop the job, or "
        f"run recover.yml without recover_unattended){found}"
    )


def act_call(done, reread, payload):
    payloads = {"act": payload, "compile_cache": READ_PAYLOAD}
    out = json.dumps({"act": {"answer": done, "seconds": 0.8}, "compile_cache": {"answer": reread, "seconds": 0.02}})
    return [*PCT, "1020", *WRAPPER, json.dumps(payloads)], (0, out, "")


def done_of(payload, stamped, needs_window=()):
    """The script's answer: the first root left as it is, the second (unstamped) stamped."""
    return {
        "roots": [
            dict(
                payload["roots"][0],
                action=None,
                size_before=152_000_000,
                size_after=152_000_000,
                purged=None,
                stamped=False,
            ),
            dict(payload["roots"][1], size_before=12_000_000, size_after=12_000_000, purged=None, stamped=stamped),
        ],
        "warmup": None,
        "fingerprint": CU128,
        "needs_window": list(needs_window),
        "seconds": 0.1,
    }


@pytest.fixture(autouse=True)
def on_pve1(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_ct_unattended_a_cache_in_use_is_left_and_the_others_stamped(check_mode, monkeypatch, capsys):
    payload = dict(ACT_PAYLOAD, unattended=True)
    payload["roots"] = [dict(ACT_PAYLOAD["roots"][0], action=None), ACT_PAYLOAD["roots"][1]]
    reread = dict(IN_USE, roots=[IN_USE["roots"][0], dict(IN_USE["roots"][1], stamp=STAMPED)])
    calls = [read_call(IN_USE)] + ([] if check_mode else [act_call(done_of(payload, True), reread, payload)])
    result = run_module(compile_cache, UNATTENDED, FakeRunner(*calls), monkeypatch, capsys, check_mode=check_mode)
    assert "failed" not in result
    assert result["changed"] is True
    assert result["needs_window"] == [window("pid 4711 (python3: cwd)")]
    assert [c.split(" (")[0] for c in result["changes"]] == ["stamp /root/.triton/cache"]
    assert result["cache_roots"][0]["window"] is True


def test_ct_unattended_with_only_a_cache_in_use_nothing_is_done(monkeypatch, capsys):
    answer = dict(IN_USE, roots=[IN_USE["roots"][0], dict(IN_USE["roots"][1], stamp=STAMPED)])
    result = run_module(compile_cache, UNATTENDED, FakeRunner(read_call(answer)), monkeypatch, capsys)
    assert (result["changed"], result["changes"], len(result["needs_window"])) == (False, [], 1)


def test_ct_attended_a_cache_in_use_fails_before_anything_is_deleted(monkeypatch, capsys):
    result = run_module(compile_cache, CT_PARAMS, FakeRunner(read_call(IN_USE)), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert "cannot purge /tmp/torchinductor_root: in use by pid 4711 (python3: cwd)" in result["msg"]


def test_ct_a_root_the_script_finds_in_use_just_before_the_purge_is_left_without_failing(monkeypatch, capsys):
    payload = dict(ACT_PAYLOAD, unattended=True)
    left = {
        "path": "/tmp/torchinductor_root",
        "real_path": "/tmp/torchinductor_root",
        "users": [{"pid": 4800, "name": "python3", "how": ["open"]}],
    }
    # Read again after the act: the root is still stale (the process that used it may be gone by then).
    reread = dict(STALE, roots=[STALE["roots"][0], dict(STALE["roots"][1], stamp=STAMPED)])
    runner = FakeRunner(read_call(STALE), act_call(done_of(payload, True, [left]), reread, payload))
    result = run_module(compile_cache, UNATTENDED, runner, monkeypatch, capsys)
    assert "failed" not in result
    assert result["needs_window"] == [window("pid 4800 (python3: open)", " (found just before the purge)")]
