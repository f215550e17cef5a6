"""plugins/modules/gpu_info.py replayed through test_gpu_info.yaml, plus its pure helpers."""

import socket
from pathlib import Path

import gpu_info
import pytest
import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import ProcessInfo

from tests.fakes import FakeRunner, run_module

CASES = yaml.safe_load(Path(__file__).with_suffix(".yaml").read_text())["cases"]


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_module(case, check_mode, monkeypatch, capsys):
    runner = FakeRunner(*[(c["argv"], (c["rc"], c.get("stdout", ""), c.get("stderr", ""))) for c in case["calls"]])
    proc = {int(pid): ProcessInfo(pid=int(pid), **info) for pid, info in case["proc"].items()}
    monkeypatch.setattr(gpu_info, "read_process", proc.get)
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    result = run_module(gpu_info, case["params"], runner, monkeypatch, capsys, check_mode=check_mode)
    for key, want in case["expect"].items():
        assert result.get(key, False if key == "failed" else None) == want, key


def test_processes_of_other_gpus_are_not_the_targets():
    gpus = [{"uuid": "GPU-a", "index": 0}]
    apps = [{"pid": 1, "process_name": "x", "used_memory_mib": 5, "gpu_uuid": "GPU-b"}]
    assert gpu_info.map_processes(apps, gpus, {}) == []
