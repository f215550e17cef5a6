"""The fact pass never waits without a deadline (issue 25 item 6): a node read stuck in the kernel is a named
problem, and the run lock is released, within the target's budget."""

import json
import threading
import time
from pathlib import Path

import target_facts
import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import facts as code_facts

from tests.fakes import FakeRunner, run_module

ROOT = Path(__file__).resolve().parents[5]
ANCHORS = yaml.safe_load((ROOT / "tests/unit/library/test_target_facts.yaml").read_text())["anchors"]


def test_a_wedged_node_read_is_a_named_problem_and_the_lock_is_released(tmp_path, monkeypatch):
    monkeypatch.setattr(step_registry, "node_read_budget", lambda timeout: 0.5, raising=False)  # absent before issue 25
    monkeypatch.setattr(preflight_facts, "read_node_driver_version", lambda path: "580.159.04")
    stuck = threading.Event()
    # gpu_processes' node reads as a /proc read of a process with a file on a hung mount sees them: never back.
    monkeypatch.setattr(gpu_facts, "read_node", lambda *args: stuck.wait())
    argv = [*ANCHORS["probe_argv"], json.dumps({"preflight": ANCHORS["payload"]})]
    runner = FakeRunner((argv, (0, json.dumps({"preflight": {"answer": ANCHORS["healthy"]}}), "")))
    specs = step_registry.validate_specs({"preflight": {"expected_gpu_count": 2}, "gpu_processes": {}})
    lock = {"lock_dir": str(tmp_path), "run_id": "run-1", "owner": "alice@ctl", "ttl": 7200}
    done = {}

    def fact_pass():
        done["facts"] = step_registry.fact_pass(Target(200, node="pve1", runner=runner), specs, lock=lock)

    worker = threading.Thread(target=fact_pass, daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(10)
    stuck.set()
    assert not worker.is_alive(), "the fact pass waited for a wedged node read without a deadline"
    assert time.monotonic() - started < 5
    facts = done["facts"]
    step = facts["gpu_processes"]
    assert step["error_kind"] == "wedged"
    assert facts["problems"] == [
        "CT 200 on pve1: the gpu_processes facts could not be read: wedged: its node-side reads gave no answer "
        "within 0.5 s (something on node pve1 is stuck: a process in state D, a hung NFS/FUSE mount); they were "
        "abandoned"
    ]
    assert facts["lock"]["held"] is False
    assert list(tmp_path.iterdir()) == []  # the lock is gone now, not after its 2 h ttl
    runner.assert_done()


def test_low_disk_is_a_warning_of_the_pass_before_it_is_a_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preflight_facts, "read_node_driver_version", lambda path: "580.159.04")
    answer = dict(ANCHORS["healthy"], space={"path": "/opt", "existing": "/", "free_bytes": 30 * 1024**3})
    argv = [*ANCHORS["probe_argv"], json.dumps({"preflight": ANCHORS["payload"]})]
    runner = FakeRunner((argv, (0, json.dumps({"preflight": {"answer": answer}}), "")))
    args = {"run_id": "run-1", "owner": "alice@ctl", "lock_dir": str(tmp_path), "vmid": 200}
    result = run_module(
        target_facts, dict(args, steps={"preflight": {"expected_gpu_count": 2}}), runner, monkeypatch, capsys
    )
    assert not result.get("failed")
    facts = result["ansible_facts"]["pve_gpu_recover"]
    assert facts["problems"] == []
    shown = [w["event"]["msg"] if isinstance(w, dict) else w for w in result["warnings"]]
    assert shown == facts["preflight"]["warnings"]
    assert "below the warning threshold of 40 GiB (preflight_warn_free_gib)" in shown[0]


def test_a_pending_step_beside_another_steps_problem_leaves_no_lock(tmp_path, monkeypatch):
    # The run stops at the fact pass's assert when any step has a problem, so no later task would release the
    # lock: the pass must release it itself even though another step has work (issue 20 item 7: a keep rule of
    # `bool(pending)` alone passed every test before this one).
    monkeypatch.setattr(preflight_facts, "read_node_driver_version", lambda path: "580.159.04")
    monkeypatch.setattr(gpu_facts, "read_node", lambda *args: {})
    work = {"changes": ["end pid 4242 (python3)"], "problems": [], "diff": {"before": "", "after": ""}}
    monkeypatch.setattr(gpu_facts, "evaluate_step", lambda *args: dict(work, pending=True))
    # The code step reads nothing in this pass and finds a problem (say, its repository is missing).
    monkeypatch.setattr(code_facts, "probe_payload", lambda *args: None)
    monkeypatch.setattr(code_facts, "read_node", lambda *args, **kwargs: {})
    problem = {"changes": [], "problems": ["CT 200: /srv/train is not a git repository"], "diff": {}}
    monkeypatch.setattr(code_facts, "evaluate_step", lambda *args: dict(problem, pending=False))
    argv = [*ANCHORS["probe_argv"], json.dumps({"preflight": ANCHORS["payload"]})]
    runner = FakeRunner((argv, (0, json.dumps({"preflight": {"answer": ANCHORS["healthy"]}}), "")))
    specs = step_registry.validate_specs(
        {"preflight": {"expected_gpu_count": 2}, "gpu_processes": {}, "training_code": {"commit": "a" * 40}}
    )
    lock = {"lock_dir": str(tmp_path), "run_id": "run-1", "owner": "alice@ctl", "ttl": 7200}
    facts = step_registry.fact_pass(Target(200, node="pve1", runner=runner), specs, lock=lock)
    assert facts["pending"] == ["gpu_processes"]
    assert facts["problems"] == ["CT 200: /srv/train is not a git repository"]
    assert facts["lock"]["held"] is False
    assert list(tmp_path.iterdir()) == []
    runner.assert_done()
