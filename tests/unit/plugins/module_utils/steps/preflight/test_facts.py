"""plugins/module_utils/steps/preflight/facts.py: the preflight part of the fact pass, fed the probe answers of
test_target_facts."""

from pathlib import Path

import pytest
import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import xid as node_xid
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import NvidiaSmiError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.shared_reads import SharedReads
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts

from tests.conftest import ROOT

ANCHORS = yaml.safe_load((ROOT / "tests/unit/library/test_target_facts.yaml").read_text())["anchors"]
CONTEXT = {"target": {"label": "CT 200 on pve1", "node": "pve1", "vmid": 200}}
XID_LOG = (ROOT / "tests" / "fixtures" / "kmsg" / "xid.kmsg").read_text()
real_read = node_xid.read_kernel_log
SPEC = dict(preflight_facts.SPEC_DEFAULTS, expected_gpu_count=2)


def test_a_healthy_target_gives_the_full_gpu_facts_and_no_problems():
    facts = preflight_facts.evaluate_step(SPEC, ANCHORS["healthy"], {"driver_version": "580.159.04"}, CONTEXT)
    assert facts["problems"] == []
    assert facts["changes"] == []
    assert [g["uuid"] for g in facts["gpus"]] == facts["gpu_uuids"]
    gpu = facts["gpus"][0]
    # One nvidia-smi in the probe answers everything the report and verify need.
    assert (gpu["name"], gpu["memory_used_mib"], gpu["remapped_rows_failure"], gpu["retired_pages_pending"]) == (
        "NVIDIA H200",
        0,
        False,
        None,
    )


def test_an_old_driver_answer_without_optional_fields_leaves_them_none():
    header = ", ".join(f[0] for f in preflight_facts.BASIC_GPU_FIELDS)
    full = ANCHORS["healthy"]["nvidia_smi"]["stdout"].splitlines()[1].split(", ")
    names = [f[0] for f in preflight_facts.GPU_FIELDS]
    row = ", ".join(c for n, c in zip(names, full, strict=True) if n not in preflight_facts.OPTIONAL_GPU_FIELDS)
    answer = dict(
        ANCHORS["healthy"], nvidia_smi={"rc": 0, "stdout": f"{header}\n{row}\n", "stderr": "", "fallback": True}
    )
    facts = preflight_facts.evaluate_step(
        dict(SPEC, expected_gpu_count=None), answer, {"driver_version": "580.159.04"}, CONTEXT
    )
    assert facts["gpus"][0]["recovery_action"] is None
    assert facts["gpus"][0]["remapped_rows_failure"] is None


@pytest.mark.parametrize("key", ["nvidia_smi", "devices", "nvml_libraries", "space"])
def test_a_probe_answer_missing_a_part_is_a_clear_error(key):
    answer = {k: v for k, v in ANCHORS["healthy"].items() if k != key}
    with pytest.raises(NvidiaSmiError, match=f"the preflight probe answered no '{key}'"):
        preflight_facts.parse_probe(answer)


def test_an_nvidia_smi_answer_cut_at_the_cap_is_named_not_parsed():
    """What prints more than ct_run's cap is untrusted: its first rows may parse, but it is not read."""
    smi = dict(ANCHORS["healthy"]["nvidia_smi"], truncated=True)
    facts = preflight_facts.evaluate_step(
        SPEC, dict(ANCHORS["healthy"], nvidia_smi=smi), {"driver_version": "580.159.04"}, CONTEXT
    )
    assert facts["gpus"] == []
    assert any("nvidia-smi printed more than 4 MiB" in p and "output was cut" in p for p in facts["problems"])


def test_the_node_part_reads_the_node_kernel_module_and_its_xids_once_for_its_cts(tmp_path: Path, monkeypatch):
    version = tmp_path / "version"
    version.write_text((ROOT / "tests/fixtures/h200/proc_driver_nvidia_version.txt").read_text())
    spec = dict(SPEC, kernel_version_file=str(version), kernel_log=str(ROOT / "tests/fixtures/kmsg/xid.kmsg"))
    reads = []
    monkeypatch.setattr(node_xid, "read_kernel_log", lambda path: reads.append(path) or real_read(path))
    context = dict(CONTEXT, shared=SharedReads())
    first = preflight_facts.read_node(spec, None, None, context)
    assert first["driver_version"] == "580.159.04"
    assert set(first["xids"]) == {"0000:1b:00", "0000:3b:00", "0000:00:06"}
    other_ct = dict(context, target=dict(CONTEXT["target"], vmid=201))  # same node, same module execution
    assert preflight_facts.read_node(spec, None, None, other_ct)["xids"] is first["xids"]
    assert reads == [spec["kernel_log"]]
    unreadable = dict(spec, kernel_log=str(tmp_path / "none"))
    assert preflight_facts.read_node(unreadable, None, None, dict(CONTEXT, shared=SharedReads()))["xids"] is None


def test_each_gpu_carries_the_xids_the_node_logged_for_its_pci_address():
    node = {"driver_version": "580.159.04", "xids": node_xid.parse_xids(XID_LOG, 1796600000)}
    facts = preflight_facts.evaluate_step(dict(SPEC, expected_gpu_count=None), ANCHORS["healthy"], node, CONTEXT)
    by_bus = {gpu["bus_id"]: gpu["xid_events"] for gpu in facts["gpus"]}
    assert by_bus == {
        "00000000:00:06.0": [{"xid": 13, "count": 1, "last_timestamp": 1796609300.0}],
        "00000000:00:07.0": [],  # the user facility's line is not the driver's
    }
    unread = preflight_facts.evaluate_step(
        dict(SPEC, expected_gpu_count=None), ANCHORS["healthy"], {"driver_version": "580.159.04", "xids": None}, CONTEXT
    )
    assert [gpu["xid_events"] for gpu in unread["gpus"]] == [None, None]


# -- disk: a warning before a failure (issue 25 item 13) -------------------------------------------------------
def with_free(gib):
    return dict(ANCHORS["healthy"], space={"path": "/opt", "existing": "/", "free_bytes": int(gib * 1024**3)})


def test_free_disk_between_the_thresholds_is_a_named_warning_not_a_problem():
    facts = preflight_facts.evaluate_step(SPEC, with_free(30), {"driver_version": "580.159.04"}, CONTEXT)
    assert facts["problems"] == []
    assert facts["warnings"] == [
        "CT 200 on pve1 has 30.0 GiB free at /opt (its filesystem at /); below the warning threshold of 40 GiB "
        "(preflight_warn_free_gib); a new venv fails under 20 GiB: free space there (old venv versions, caches) "
        "before it runs out"
    ]
    [disk] = [c for c in facts["checks"] if c["name"] == "disk"]
    assert (disk["ok"], disk["severity"]) == (False, "warn")


@pytest.mark.parametrize(
    ("gib", "warn", "problems", "warnings"),
    [(10, 40.0, 1, 0), (50, 40.0, 0, 0), (30, 0.0, 0, 0), (20, 40.0, 0, 1), (39, None, 0, 1), (41, None, 0, 0)],
    ids=["below_min_is_a_problem_only", "above_warn", "warning_off", "at_min_warns", "twice_min", "above_twice"],
)
def test_disk_thresholds(gib, warn, problems, warnings):
    spec = dict(SPEC, warn_free_gib=warn)
    facts = preflight_facts.evaluate_step(spec, with_free(gib), {"driver_version": "580.159.04"}, CONTEXT)
    assert (len(facts["problems"]), len(facts["warnings"])) == (problems, warnings)


def test_a_warning_threshold_below_the_minimum_is_refused():
    assert "warn_free_gib 10 is below min_free_gib 20" in preflight_facts.check_spec(dict(SPEC, warn_free_gib=10.0))
    assert preflight_facts.check_spec(SPEC) is None
    assert preflight_facts.check_spec(dict(SPEC, min_free_gib=100000.0)) is None  # unset: twice the minimum
