"""plugins/modules/target_facts.py: a step that cannot do its work stops the run in the fact pass, before any step
changes anything (issue 21, item 3), and a CT that migrated to another node of the cluster is named where it
lives now (item 6). The fact pass is driven through the fake runner: every argv, and the number of calls, is
pinned, so no acting call can hide."""

import pytest
import target_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target

from tests.fakes import FakeRunner, run_module
from tests.unit.library.test_target_facts import (
    ANCHORS,
    NODE_VERSION,
    facts_of,
    node_named_pve1,  # noqa: F401 (an autouse fixture: the node is pve1)
    node_version,
    params,
    probe_call,
)
from tests.unit.plugins.module_utils.steps.training_code import test_facts as code
from tests.unit.plugins.module_utils.steps.training_venv import test_facts as venv
from tests.unit.plugins.module_utils.steps.training_venv.test_facts_preconditions import NO_UV, build

CODE_SPEC = {"path": "/srv/train", "commit": code.PINNED}
CODE_PAYLOAD = {
    "path": "/srv/train",
    "commit": code.PINNED,
    "git": "git",
    "timeout": 60,
    "backup_dir": "/var/backups/pve-gpu-recover/training_code",
}
VENV_SPEC = {"lock": venv.LOCK}
VENV_PAYLOAD = {"path": "/opt/venvs/train", "timeout": 60, "uv": "uv", "python": "3.11"}


def two_steps(venv_build):
    """A target whose training code is on another commit (a reset is due) and whose venv is missing (a build is
    due); ``venv_build``: what the venv probe found would build it."""
    parts = {"preflight": ANCHORS["payload"], "training_code": CODE_PAYLOAD, "training_venv": VENV_PAYLOAD}
    answers = {
        "preflight": ANCHORS["healthy"],
        "training_code": code.answer(),
        "training_venv": dict(venv.ABSENT, build=venv_build),
    }
    return FakeRunner(probe_call(parts, answers))


def steps(**extra):
    return {"preflight": {"expected_gpu_count": 2}, "training_code": CODE_SPEC, "training_venv": VENV_SPEC, **extra}


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_a_venv_the_target_cannot_build_fails_the_pass_before_the_code_is_reset(
    check_mode, tmp_path, monkeypatch, capsys
):
    node_version(monkeypatch, NODE_VERSION)
    runner = two_steps(build(**NO_UV, ensurepip=False))  # the one probe call, and nothing after it
    result = run_module(
        target_facts, params(tmp_path, vmid=200, steps=steps()), runner, monkeypatch, capsys, check_mode=check_mode
    )
    facts = facts_of(result)
    assert (result["failed"], result["error"], result["changed"]) == (True, "problems", False)
    problem = facts["training_venv"]["problems"][0]
    assert problem.startswith("CT 200 on pve1: the venv at /opt/venvs/train needs a rebuild but the target cannot")
    assert facts["problems"] == [problem]
    assert result["msg"] == problem
    # The code step's facts are sound and it has work, but nothing acts: the pass failed, the lock is released,
    # and a failed fact pass ends the play for this target before tasks/steps.yml.
    assert facts["training_code"]["changes"] == [f"check out {code.PINNED[:12]} (HEAD is {code.OTHER[:12]} on main)"]
    assert facts["training_venv"]["pending"] is False
    assert facts["lock"]["held"] is False
    assert list(tmp_path.iterdir()) == []


def test_with_a_builder_both_steps_have_work_and_the_lock_is_kept(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    runner = two_steps(build())
    result = run_module(target_facts, params(tmp_path, vmid=200, steps=steps()), runner, monkeypatch, capsys)
    facts = facts_of(result)
    assert not result.get("failed")
    assert (facts["pending"], facts["problems"], facts["lock"]["held"]) == (
        ["training_code", "training_venv"],
        [],
        True,
    )


def test_the_settings_that_name_the_builder_reach_the_probe(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    parts = {
        "preflight": ANCHORS["payload"],
        # Where the wheel's uv goes, from its name: the probe says whether it is there.
        "training_venv": dict(
            VENV_PAYLOAD, uv="/root/.local/bin/uv", wheel_uv="/usr/local/lib/pve-gpu-recover/uv-0.9.0/uv"
        ),
    }
    answers = {
        "preflight": ANCHORS["healthy"],
        "training_venv": dict(venv.ABSENT, build=build(**NO_UV, ensurepip=False)),
    }
    spec = dict(VENV_SPEC, uv="/root/.local/bin/uv", uv_wheel="/home/me/uv-0.9.0-py3-none-manylinux_2_28_x86_64.whl")
    args = params(tmp_path, vmid=200, steps={"preflight": {"expected_gpu_count": 2}, "training_venv": spec})
    facts = facts_of(run_module(target_facts, args, FakeRunner(probe_call(parts, answers)), monkeypatch, capsys))
    # No uv and no ensurepip in the target, but the role installs the wheel's uv: the build can be done.
    assert (facts["problems"], facts["pending"]) == ([], ["training_venv"])


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_a_ct_that_migrated_is_named_where_it_lives_now(check_mode, tmp_path, monkeypatch, capsys):
    nodes = tmp_path / "pve-nodes"
    for node, vmids in {"pve1": [201], "pve2": [200]}.items():
        (nodes / node / "lxc").mkdir(parents=True)
        for vmid in vmids:
            (nodes / node / "lxc" / f"{vmid}.conf").write_text("arch: amd64\n")
    monkeypatch.setattr(node_target, "PVE_NODES", str(nodes))
    locks = tmp_path / "locks"
    locks.mkdir()
    stderr = "Configuration file 'nodes/pve1/lxc/200.conf' does not exist\n"
    runner = FakeRunner(probe_call({"preflight": ANCHORS["payload"]}, {}, rc=255, stdout="", stderr=stderr))
    result = run_module(target_facts, params(locks, vmid=200), runner, monkeypatch, capsys, check_mode=check_mode)
    assert (result["failed"], result["error"]) == (True, "moved")
    assert result["msg"] == (
        "CT 200 lives on node pve2 now (moved from pve1): set pve_node to pve2 or use the community.proxmox.proxmox "
        "inventory plugin"
    )
    assert list(locks.iterdir()) == []  # the lock it took is released
    assert result["rc"] == 255  # pct's own exit, apart from the message
