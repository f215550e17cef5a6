"""The one nvidia-smi parser, against the real H200 captures in tests/fixtures/h200 (byte for byte copies)."""

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import nvidia_smi as smi
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.command import CommandResult

from tests.conftest import FIXTURES

H200 = FIXTURES / "h200"
# The 20 fields capture-1.log asked for, in its order (GPU_FIELDS starts with exactly these).
CAPTURE_FIELDS = smi.GPU_FIELDS[:20]


def capture_block(name, title):
    """Lines of a `== title` block of a capture log, up to the next `==` line."""
    text = (H200 / name).read_text()
    block = text.split(f"== {title}\n", 1)[1]
    return block.split("\n==", 1)[0] + "\n"


IDLE_FACTS = {
    "index": 0,
    "name": "NVIDIA H200",
    "uuid": "GPU-bf580366-c11c-e730-752a-e9ca8716b7fa",
    "bus_id": "00000000:00:06.0",
    "driver_version": "580.159.04",
    "memory_total_mib": 143771,
    "memory_used_mib": 0,
    "memory_free_mib": 143156,
    "utilization_gpu_pct": 0,
    "temperature_c": 36,
    "persistence_mode": True,
    "compute_mode": "Default",
    "ecc_uncorrected_volatile": 0,
    "clocks_event_reasons_active": "0x0000000000000001",
    "pcie_link_gen": 5,
    "pcie_link_width": 16,
    "power_draw_w": 123.99,
    "mig_mode": "Disabled",
    "retired_pages_pending": None,
    "remapped_rows_pending": False,
}


def test_gpu_fields_start_with_the_captured_query():
    header = capture_block("capture-1.log", "query-gpu csv").splitlines()[0]
    assert [smi.canonical_field(h) for h in header.split(", ")] == [f[0] for f in CAPTURE_FIELDS]


def test_query_gpu_csv_with_header_and_units():
    text = capture_block("capture-1.log", "query-gpu csv")
    assert smi.parse_gpus(text, CAPTURE_FIELDS) == [IDLE_FACTS]


def test_query_gpu_noheader_nounits_gives_the_same_facts():
    text = capture_block("capture-1.log", "query-gpu noheader nounits")
    assert smi.parse_gpus(text, CAPTURE_FIELDS, header=False) == [dict(IDLE_FACTS, power_draw_w=123.98)]


def test_seed_query():
    fields = (("index", "index", "int"), ("memory.used", "memory_used_mib", "int"))
    assert smi.parse_gpus(capture_block("capture-1.log", "seed query"), fields, header=False) == [
        {"index": 0, "memory_used_mib": 0}
    ]


def test_compute_apps_with_header():
    apps = smi.parse_apps((H200 / "nvsmi_apps_busy.csv").read_text())
    assert apps == [
        {
            "pid": 516,
            "process_name": "python3",
            "used_memory_mib": 20998,
            "gpu_uuid": "GPU-bf580366-c11c-e730-752a-e9ca8716b7fa",
        }
    ]


def test_compute_apps_noheader_with_bus_id():
    fields = (*smi.APP_FIELDS, ("gpu_bus_id", "gpu_bus_id", "str"))
    apps = smi.parse_apps((H200 / "nvsmi_apps_two.csv").read_text(), fields, header=False)
    assert [(a["pid"], a["used_memory_mib"], a["gpu_bus_id"]) for a in apps] == [
        (458, 7686, "00000000:00:06.0"),
        (457, 5638, "00000000:00:06.0"),
    ]


def test_compute_apps_idle_is_only_a_header():
    idle = capture_block("capture-1.log", "compute apps idle").split("rc=")[0]
    assert idle == "pid, process_name, used_gpu_memory [MiB], gpu_uuid\n"
    assert smi.parse_apps(idle) == []
    assert smi.parse_apps("", header=False) == []


def test_throttle_alias_is_accepted_under_its_new_header_name():
    fields = (("index", "index", "int"), ("clocks_throttle_reasons.active", "reasons", "str"))
    text = "index, clocks_event_reasons.active\n0, 0x0000000000000001\n"
    assert smi.parse_gpus(text, fields) == [{"index": 0, "reasons": "0x0000000000000001"}]


def test_a_header_that_does_not_match_the_fields_is_an_error():
    with pytest.raises(smi.NvidiaSmiError, match=r"expected the fields index, memory\.used") as error:
        smi.parse_gpus("index, uuid\n0, GPU-x\n", (("index", "i", "int"), ("memory.used", "m", "int")))
    assert error.value.kind == "format"


def test_a_row_with_a_wrong_cell_count_is_an_error():
    with pytest.raises(smi.NvidiaSmiError, match="has 1 cells, expected 2"):
        smi.parse_gpus("0\n", (("index", "i", "int"), ("memory.used", "m", "int")), header=False)


@pytest.mark.parametrize("raw", ["[N/A]", "[Not Supported]", "[Unknown Error]", "[GPU is lost]"])
def test_markers_without_a_value_become_none(raw):
    assert smi.parse_value(raw) is None


def test_units_are_stripped_only_from_numbers():
    assert smi.parse_value("143771 MiB") == "143771"
    assert smi.parse_value("123.99 W") == "123.99"
    assert smi.parse_value("0 %") == "0"
    assert smi.parse_value("my W") == "my W"


def test_a_process_name_with_comma_space_stays_one_cell():
    text = "pid, process_name, used_gpu_memory [MiB], gpu_uuid\n7, train, v2, 10 MiB, GPU-a\n"
    assert smi.parse_apps(text) == [{"pid": 7, "process_name": "train, v2", "used_memory_mib": 10, "gpu_uuid": "GPU-a"}]


def test_hex_and_float_conversion():
    assert smi.convert("0x0000000000000004", "int") == 4
    assert smi.convert("123.99", "float") == 123.99
    assert smi.convert("Enabled", "enabled") is True
    assert smi.convert("Disabled", "enabled") is False
    assert smi.convert(None, "int") is None


# -- failures ------------------------------------------------------------------------------------------------
def test_bad_field_from_the_capture():
    text = capture_block("capture-1.log", "bad field").split("rc=")[0]
    error = smi.classify_failure(2, text, "")
    assert error.kind == "bad_field"
    assert error.details == {"field": "bogus.field"}
    assert "'bogus.field'" in str(error)


@pytest.mark.parametrize(
    ("rc", "stdout", "kind", "words"),
    [
        (
            9,
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
            "NVIDIA driver is installed and running.\n\n",
            "driver_not_loaded",
            "kernel driver is not loaded",
        ),
        (12, "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system.\n", "no_nvml", "libnvidia-ml.so"),
        (4, "Failed to initialize NVML: Insufficient Permissions\n", "no_permission", "permission"),
        (255, "Unknown Error\n", "internal", "internal"),
        (42, "", "failed", "exit code 42"),
    ],
)
def test_exit_codes_become_named_errors(rc, stdout, kind, words):
    error = smi.classify_failure(rc, stdout, "")
    assert error.kind == kind
    assert words in str(error)
    assert error.rc == rc


def test_driver_library_mismatch_is_found_by_its_message():
    out = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.95\n"
    for rc in (18, 255):
        error = smi.classify_failure(rc, out, "")
        assert error.kind == "driver_mismatch"
        assert "NVML library 580.95" in str(error)
        assert "install the node's driver version" in error.hint


def test_gpu_fallen_off_the_bus_names_the_gpu_and_keeps_other_rows():
    out = (
        "0, 0 MiB\n"
        "Unable to determine the device handle for GPU 00000000:19:00.0: GPU is lost.  Reboot the system to "
        "recover this GPU\n"
        "2, 0 MiB\n"
    )
    error = smi.classify_failure(15, out, "")
    assert error.kind == "gpu_lost"
    assert "GPU 00000000:19:00.0 has fallen off the bus" in str(error)
    assert error.details["lost_bus_ids"] == ["00000000:19:00.0"]
    data, notices = smi.split_notices(out)
    assert data == ["0, 0 MiB", "2, 0 MiB"]
    assert notices[0]["kind"] == "gpu_lost"


def test_inforom_warning_is_not_a_failure_and_is_kept_as_a_notice():
    out = "WARNING: infoROM is corrupted at gpu 00000000:18:00.0\nindex, memory.used [MiB]\n0, 0 MiB\n"
    assert smi.classify_failure(14, out, "") is None
    data, notices = smi.split_notices(out)
    assert len(data) == 2
    assert notices == [{"kind": "inforom", "bus_id": "00000000:18:00.0", "message": out.splitlines()[0]}]


def test_success_is_not_a_failure():
    assert smi.classify_failure(0, "0, 0 MiB\n", "") is None


def test_error_result_keeps_msg_apart_from_output():
    error = smi.classify_failure(
        9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", ""
    )
    result = error.to_result(prefix="CT 200 on pve1: ")
    assert result["msg"].startswith("CT 200 on pve1: the NVIDIA kernel driver is not loaded (nvidia-smi exit 9)")
    assert "modprobe nvidia" in result["msg"]
    assert result["rc"] == 9
    assert "stdout_tail" in result


# -- versions ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Nov 11 09:53:03 UTC 2025\n",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)  Tue\n",
    ],
)
def test_kernel_module_version(text):
    assert smi.parse_kernel_driver_version(text) == "580.159.04"


def test_no_kernel_module_version():
    assert smi.parse_kernel_driver_version(None) is None
    assert smi.parse_kernel_driver_version("garbage") is None


def test_library_version_from_file_name():
    assert smi.parse_library_version("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.159.04") == "580.159.04"
    assert smi.parse_library_version("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1") is None


# -- the runner ----------------------------------------------------------------------------------------------
class FakeRun:
    """Replays (argv, rc, stdout) in order and fails on any other argv: round trips are the cost."""

    def __init__(self, calls):
        self.calls = list(calls)

    def __call__(self, argv, timeout=None, check=True):
        assert self.calls, f"unexpected extra call {argv}"
        want, rc, out = self.calls.pop(0)
        assert argv == want
        return CommandResult(argv=argv, rc=rc, stdout=out, stderr="")


def test_argv_shapes():
    assert smi.query_gpu_argv(smi.MEMORY_FIELDS) == ["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv"]
    assert smi.query_apps_argv() == [
        "nvidia-smi",
        "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
        "--format=csv",
    ]


HEADER_UNITS = {
    "memory.total": "MiB",
    "memory.used": "MiB",
    "memory.free": "MiB",
    "utilization.gpu": "%",
    "power.draw": "W",
}


def csv_header(fields):
    return ", ".join(f"{f[0]} [{HEADER_UNITS[f[0]]}]" if f[0] in HEADER_UNITS else f[0] for f in fields)


def test_an_old_driver_without_optional_fields_is_asked_again_once():
    full = smi.query_gpu_argv(smi.GPU_FIELDS)
    without = [f for f in smi.GPU_FIELDS if f[0] != "gpu_recovery_action"]
    # The captured row, then remapped_rows.failure, pcie.link.gen.max, pcie.link.width.max and the aggregate ECC
    # count (nvsmi_q_x_idle.xml's aggregate dram_uncorrectable).
    row = capture_block("capture-1.log", "query-gpu csv").splitlines()[1] + ", No, 5, 16, 0"
    run = FakeRun(
        [
            (full, 2, 'Field "gpu_recovery_action" is not a valid field to query.\n\n'),
            (smi.query_gpu_argv(without), 0, f"{csv_header(without)}\n{row}\n"),
        ]
    )
    gpus = smi.NvidiaSmi(run).gpus()
    assert run.calls == []
    assert gpus[0]["recovery_action"] is None
    assert gpus[0]["remapped_rows_failure"] is False
    assert gpus[0]["pcie_link_width_max"] == 16


def test_a_required_bad_field_is_not_retried():
    run = FakeRun([(smi.query_gpu_argv(smi.GPU_FIELDS), 2, 'Field "memory.used" is not a valid field to query.\n')])
    with pytest.raises(smi.NvidiaSmiError) as error:
        smi.NvidiaSmi(run).gpus()
    assert error.value.kind == "bad_field"
    assert error.value.cmd == smi.query_gpu_argv(smi.GPU_FIELDS)


def test_the_project_query_on_a_real_h200():
    # bench/hardware_run.sh, 2026-12-02: the exact query gpu_info makes, on an H200 (driver 580.159.04); its last
    # column, the aggregate ECC count, added in 3.0.0 (tests/fixtures/h200/README.md).
    gpus = smi.parse_gpus((H200 / "nvsmi_query_gpu_project.csv").read_text())
    assert gpus == [
        dict(
            IDLE_FACTS,
            uuid="GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff9",
            temperature_c=40,
            power_draw_w=77.48,
            remapped_rows_failure=False,
            pcie_link_gen_max=5,
            pcie_link_width_max=16,
            recovery_action="None",
            ecc_uncorrected_aggregate=0,
        )
    ]


def test_two_holders_of_the_hardware_run():
    apps = smi.parse_apps((H200 / "nvsmi_apps_two_holders_20g.csv").read_text())
    assert [(a["pid"], a["used_memory_mib"]) for a in apps] == [(673, 21090), (674, 21090)]


def test_the_open_kernel_module_version_file_of_the_h200():
    assert smi.parse_kernel_driver_version((H200 / "proc_driver_nvidia_version.txt").read_text()) == "580.159.04"
