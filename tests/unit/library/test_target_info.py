"""library/target_info.py: preflight verdicts (pure) and the module replayed through test_target_info.yaml."""

import json
import socket
from pathlib import Path

import pytest
import target_info
import yaml

from tests.conftest import FIXTURES
from tests.fakes import FakeRunner, run_module

CASES = yaml.safe_load((Path(__file__).with_suffix(".yaml")).read_text())["cases"]


def runner_for(case):
    calls = []
    for call in case["calls"]:
        # One pct exec runs the probe parts; payloads and answers are keyed by part (Target.run_probes).
        argv = [*call["argv"], json.dumps({"preflight": call["payload"]})] if "payload" in call else call["argv"]
        stdout = json.dumps({"preflight": {"answer": call["probe"]}}) if "probe" in call else call.get("stdout", "")
        calls.append((argv, (call["rc"], stdout, call.get("stderr", ""))))
    return FakeRunner(*calls)


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_module(case, check_mode, monkeypatch, capsys):
    node_version = case["node_version"]
    path = Path(node_version.format(fixtures=FIXTURES)) if node_version else None
    monkeypatch.setattr(
        target_info,
        "read_node_driver_version",
        lambda _p: target_info.parse_kernel_driver_version(path.read_text()) if path else None,
    )
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    result = run_module(target_info, case["params"], runner_for(case), monkeypatch, capsys, check_mode=check_mode)
    for key, want in case["expect"].items():
        assert result.get(key, False if key == "failed" else None) == want, key
    if not result.get("failed"):
        assert result["problems"] == [c["detail"] for c in result["checks"] if not c["ok"]]


def test_read_node_driver_version():
    assert target_info.read_node_driver_version(FIXTURES / "h200" / "proc_driver_nvidia_version.txt") == "580.159.04"
    assert target_info.read_node_driver_version("/nonexistent/version") is None


def test_a_healthy_target_has_all_checks_ok():
    answer = yaml.safe_load((Path(__file__).with_suffix(".yaml")).read_text())["anchors"]["healthy"]
    facts = target_info.parse_probe(answer)
    checks = target_info.evaluate(
        "CT 200 on pve1",
        "pve1",
        facts,
        container=True,
        node_driver_version="580.159.04",
        min_free_gib=20,
        expected_gpu_count=2,
        space_path="/opt",
    )
    assert [(c["name"], c["ok"]) for c in checks] == [
        ("node_driver", True),
        ("devices", True),
        ("driver", True),
        ("disk", True),
    ]
    assert checks[2]["detail"] == (
        "NVML in CT 200 on pve1 reports 580.159.04, the node's kernel module, with 2 GPUs visible"
    )


def evaluate(label, *, container=True, libraries=("580.159.04",)):
    """Verdicts for a target with no device nodes, plenty of disk and the given NVML library versions."""
    facts = {
        "devices": [],
        "nvidia_smi_failure": None,
        "nvml_library_versions": list(libraries),
        "target_driver_version": "580.159.04",
        "gpu_uuids": [],
        "space": {"existing": "/", "free_bytes": 100 * 1024**3},
    }
    return target_info.evaluate(
        label,
        label.split()[-1],
        facts,
        container=container,
        node_driver_version="580.159.04",
        min_free_gib=20,
        expected_gpu_count=None,
        space_path="/opt",
    )


def test_bare_host_devices_hint_is_about_the_driver_not_lxc():
    checks = evaluate("host gpu1", container=False)
    assert "nvidia-modprobe" in checks[1]["detail"]
    assert "lxc" not in checks[1]["detail"]


def test_library_newer_than_the_loaded_module_is_caught_before_nvml_fails():
    checks = evaluate("CT 200 on pve1", libraries=["580.200.01"])
    assert not checks[2]["ok"]
    assert "userspace library 580.200.01 differs from the node's kernel module 580.159.04" in checks[2]["detail"]
