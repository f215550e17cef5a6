"""Guards that no other test would notice missing (issue 8): exactly min_free_gib free is enough for a new venv, one
byte less is not."""

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts


# -- the disk-space boundary ---------------------------------------------------------------------------------------
def disk_check(free_bytes, min_free_gib=20):
    facts = {
        "devices": [{"path": path, "char": True} for path in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")],
        "nvidia_smi_failure": None,
        "nvml_library_versions": ["580.159.04"],
        "target_driver_version": "580.159.04",
        "gpu_uuids": [],
        "space": {"free_bytes": free_bytes, "existing": "/opt"},
    }
    checks = preflight_facts.evaluate(
        "CT 200 on pve1",
        "pve1",
        facts,
        container=True,
        node_driver_version="580.159.04",
        min_free_gib=min_free_gib,
        expected_gpu_count=1,
        space_path="/opt/venvs",
    )
    return next(c for c in checks if c["name"] == "disk")


def test_exactly_min_free_gib_is_enough():
    check = disk_check(20 * preflight_facts.GIB)
    assert check["ok"] is True
    assert check["detail"].endswith("enough for a new venv")


def test_one_byte_less_than_min_free_gib_is_not():
    check = disk_check(20 * preflight_facts.GIB - 1)
    assert check["ok"] is False
    assert check["detail"].endswith("a new venv needs 20 GiB: free space there or lower preflight_min_free_gib")


def test_a_fractional_minimum_has_the_same_boundary():
    assert disk_check(int(2.5 * preflight_facts.GIB), min_free_gib=2.5)["ok"] is True
    assert disk_check(int(2.5 * preflight_facts.GIB) - 1, min_free_gib=2.5)["ok"] is False
