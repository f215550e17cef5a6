"""plugins/modules/gpu_info.py summarize(): the health words a person reads at a glance must not go missing (issue
8)."""

import gpu_info
import pytest


def gpu(**health):
    row = {
        "index": 0,
        "name": "NVIDIA H200",
        "uuid": "GPU-bf580366-c11c-e730-752a-e9ca8716b7fa",
        "bus_id": "00000000:18:00.0",
        "memory_used_mib": 0,
        "memory_total_mib": 143771,
        "temperature_c": 31,
        "ecc_uncorrected_volatile": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        "recovery_action": "None",
        "pcie_link_gen": 5,
        "pcie_link_width": 16,
        "pcie_link_gen_max": 5,
        "pcie_link_width_max": 16,
        "persistence_mode": True,
    }
    return dict(row, **health)


def test_a_failed_row_remap_is_said_in_the_summary():
    line = gpu_info.summarize([gpu(remapped_rows_failure=True)], [])[0]
    assert "row remap FAILED" in line
    assert line == (
        "GPU 0 NVIDIA H200 GPU-bf580366-c11c-e730-752a-e9ca8716b7fa 00000000:18:00.0: 0/143771 MiB, 31 C, ECC 0, "
        "row remap FAILED, PCIe 5x16, persistence on"
    )


@pytest.mark.parametrize("failure", [False, None])  # None: an old driver that does not report it
def test_no_failed_row_remap_is_not_said(failure):
    assert "row remap FAILED" not in gpu_info.summarize([gpu(remapped_rows_failure=failure)], [])[0]


def test_a_failed_and_a_pending_remap_are_both_said():
    line = gpu_info.summarize([gpu(remapped_rows_failure=True, remapped_rows_pending=True)], [])[0]
    assert "ECC 0, row remap PENDING (reset needed), row remap FAILED, PCIe" in line
