"""plugins/modules/target_lock.py: the plan (pure) and the module on a real lock directory."""

import json
import os

import pytest
import target_lock
from ansible.module_utils.testing import patch_module_args
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock as node_lock

from tests.fakes import assert_documented


def lock(args, capsys, check_mode=False):
    if check_mode:
        args = dict(args, _ansible_check_mode=True)
    with patch_module_args(args), pytest.raises(SystemExit):
        target_lock.main()
    result = json.loads(capsys.readouterr().out)
    assert_documented(target_lock, result)
    return result


@pytest.mark.parametrize(
    ("state", "current", "action", "changed"),
    [
        ("present", None, "taken", True),
        ("present", {"run_id": "a", "created": 1000, "ttl": 60}, "already_held", False),
        ("present", {"run_id": "b", "created": 1000, "ttl": 60}, "locked", False),
        ("present", {"run_id": "b", "created": 1000, "ttl": 10}, "taken_over", True),
        ("absent", None, "not_held", False),
        ("absent", {"run_id": "a", "created": 1000, "ttl": 60}, "released", True),
        ("absent", {"run_id": "b", "created": 1000, "ttl": 60}, "held_by_other", False),
    ],
)
def test_plan(state, current, action, changed):
    assert node_lock.plan_lock(state, current, "a", now=1030) == (action, changed)


def test_take_hold_and_release(tmp_path, capsys):
    base = {"vmid": 200, "run_id": "run-1", "owner": "alice@ctl", "lock_dir": str(tmp_path)}
    first = lock(base, capsys)
    assert (first["changed"], first["action"]) == (True, "taken")
    path = tmp_path / "ct-200.lock"
    assert json.loads(path.read_text())["run_id"] == "run-1"
    again = lock(base, capsys)
    assert (again["changed"], again["action"]) == (False, "already_held")
    released = lock(dict(base, state="absent"), capsys)
    assert (released["changed"], released["action"]) == (True, "released")
    assert not path.exists()


def test_another_run_is_refused_with_who_and_what_to_do(tmp_path, capsys):
    lock({"vmid": 200, "run_id": "run-1", "owner": "alice@ctl", "lock_dir": str(tmp_path)}, capsys)
    result = lock({"vmid": 200, "run_id": "run-2", "owner": "bob@ctl", "lock_dir": str(tmp_path)}, capsys)
    assert result["failed"]
    assert result["msg"].startswith("CT 200 is locked by run run-1 of alice@ctl (started ")
    assert "(the lock expires in 119 min); wait for it to finish" in result["msg"]
    assert f"remove {tmp_path}/ct-200.lock on this node" in result["msg"]
    assert json.loads((tmp_path / "ct-200.lock").read_text())["run_id"] == "run-1"


def test_release_never_removes_another_runs_lock(tmp_path, capsys):
    lock({"vmid": 200, "run_id": "run-1", "lock_dir": str(tmp_path)}, capsys)
    result = lock({"vmid": 200, "run_id": "run-2", "lock_dir": str(tmp_path), "state": "absent"}, capsys)
    assert (result["changed"], result["action"]) == (False, "held_by_other")
    assert (tmp_path / "ct-200.lock").exists()


def test_a_stale_lock_is_taken_over_and_kept_aside(tmp_path, capsys):
    (tmp_path / "ct-200.lock").write_text(json.dumps({"run_id": "dead", "owner": "x", "created": 1, "ttl": 60}))
    result = lock({"vmid": 200, "run_id": "run-1", "lock_dir": str(tmp_path)}, capsys)
    assert (result["changed"], result["action"]) == (True, "taken_over")
    assert "taking over the stale lock of run dead" in str(result["warnings"])
    created = int(json.loads((tmp_path / "ct-200.lock").read_text())["created"])
    assert [p.name for p in tmp_path.iterdir() if ".stale." in p.name] == [f"ct-200.lock.stale.{created}"]


def test_an_unreadable_lock_counts_as_held(tmp_path, capsys):
    (tmp_path / "host.lock").write_text("{half")
    result = lock({"run_id": "run-1", "lock_dir": str(tmp_path), "ttl": 7200}, capsys)
    assert result["failed"]
    assert "this host is locked by run unknown (unreadable lock file)" in result["msg"]


def test_check_mode_writes_nothing_and_says_what_it_would_do(tmp_path, capsys):
    result = lock({"vmid": 200, "run_id": "run-1", "lock_dir": str(tmp_path / "locks")}, capsys, check_mode=True)
    assert (result["changed"], result["action"]) == (True, "taken")
    assert not (tmp_path / "locks").exists()


def test_bad_vmid(tmp_path, capsys):
    result = lock({"vmid": 42, "run_id": "r", "lock_dir": str(tmp_path)}, capsys)
    assert result["failed"]
    assert "vmid must be an integer from 100 to 999999999" in result["msg"]


def test_two_creators_one_wins(tmp_path):
    path = str(tmp_path / "ct-200.lock")
    assert node_lock.create_lock(path, {"run_id": "a"})
    assert not node_lock.create_lock(path, {"run_id": "b"})
    with open(path) as handle:
        assert json.load(handle)["run_id"] == "a"
    assert os.listdir(tmp_path) == ["ct-200.lock"]


def test_a_ttl_of_zero_would_make_every_lock_stale(tmp_path, capsys):
    result = lock({"vmid": 200, "run_id": "r", "lock_dir": str(tmp_path), "ttl": 0}, capsys)
    assert result["failed"]
    assert result["msg"] == "ttl must be at least 1 second, got 0; fix preflight_lock_ttl"
    assert list(tmp_path.iterdir()) == []
