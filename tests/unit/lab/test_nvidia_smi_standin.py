"""The lab's nvidia-smi stand-in against the real H200 captures in tests/fixtures/h200, byte for byte.

Every test builds a private lab (state directory, view configs, a fake kernel version file and NVML library)
under tmp_path with proc_root=/proc, runs the stand-in as a subprocess like the collection does, and compares
with blocks cut out of the capture logs. Holders are real processes; each one is killed and reaped afterwards.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import FIXTURES, NVIDIA_SMI, STANDINS, gpulab

# The 20 fields of capture-1.log's query-gpu blocks, asked with the old alias clocks_throttle_reasons.active.
CAPTURE_FIELDS = (
    "index,name,uuid,pci.bus_id,driver_version,memory.total,memory.used,memory.free,utilization.gpu,"
    "temperature.gpu,persistence_mode,compute_mode,ecc.errors.uncorrected.volatile.total,"
    "clocks_throttle_reasons.active,pcie.link.gen.current,pcie.link.width.current,power.draw,mig.mode.current,"
    "retired_pages.pending,remapped_rows.pending"
)
APPS_FIELDS = "pid,process_name,used_memory,gpu_uuid"
LOST = "Unable to determine the device handle for GPU {}: GPU is lost.  Reboot the system to recover this GPU\n"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
    "NVIDIA driver is installed and running.\n\n"
)
NO_LIBRARY = (
    "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the NVIDIA Display "
    "Driver is properly installed and present in your system.\nPlease also try adding directory that contains "
    "libnvidia-ml.so to your system PATH.\n"
)


def capture_sections(name: str) -> dict[str, list[str]]:
    """{section title: its lines} of a capture log, where each section starts with a line "== title"."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in (FIXTURES / name).read_text().split("\n"):
        if line.startswith("== "):
            current = line[3:]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sections


CAPTURE_1 = capture_sections("capture-1.log")


def text(lines) -> str:
    return "".join(f"{line}\n" for line in lines)


# ---------------------------------------------------------------------------------------------- captures


def test_query_gpu_csv_matches_capture(lab):
    gpulab.write_fixture_config(lab.state)
    result = lab.smi(f"--query-gpu={CAPTURE_FIELDS}", "--format=csv")
    assert result.returncode == 0
    assert result.stdout == text(CAPTURE_1["query-gpu csv"][:2])
    assert result.stderr == ""


def test_query_gpu_noheader_nounits_matches_capture(lab):
    gpulab.write_fixture_config(lab.state, overrides={"power.draw": 123.98})
    result = lab.smi("--query-gpu", CAPTURE_FIELDS, "--format", "csv,noheader,nounits")
    assert (result.returncode, result.stdout) == (0, text(CAPTURE_1["query-gpu noheader nounits"][:1]))


def test_seed_query(lab):
    gpulab.write_fixture_config(lab.state)
    result = lab.smi("--query-gpu=index,memory.used", "--format=csv,noheader")
    assert (result.returncode, result.stdout) == (0, text(CAPTURE_1["seed query"][:1]))
    assert result.stdout == "0, 0 MiB\n"


def test_bad_field_exits_2(lab):
    gpulab.write_fixture_config(lab.state)
    result = lab.smi("--query-gpu=index,bogus.field", "--format=csv")
    block = CAPTURE_1["bad field"]
    assert block[2] == "rc=2"
    assert (result.returncode, result.stdout) == (2, text(block[:2]))


def test_compute_apps_idle(lab):
    gpulab.write_fixture_config(lab.state)
    with_header = lab.smi(f"--query-compute-apps={APPS_FIELDS}", "--format=csv")
    block = CAPTURE_1["compute apps idle"]
    assert block[1] == "rc=0"
    assert (with_header.returncode, with_header.stdout) == (0, text(block[:1]))
    noheader = lab.smi(f"--query-compute-apps={APPS_FIELDS}", "--format=csv,noheader")
    assert (noheader.returncode, noheader.stdout) == (0, "")


def test_plain_idle_table(lab):
    gpulab.write_fixture_config(lab.state)
    result = lab.smi()
    expected = (FIXTURES / "nvsmi_plain_idle.txt").read_text().split("\n")
    lines = result.stdout.split("\n")
    assert result.returncode == 0
    assert lines[1:] == expected[1:]
    # The date line: asctime() of now plus the same 7 trailing spaces.
    assert re.fullmatch(r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", lines[0])
    stamp = time.mktime(time.strptime(lines[0].strip(), "%a %b %d %H:%M:%S %Y"))
    assert abs(stamp - time.time()) < 60
    assert re.fullmatch(r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", expected[0])


def test_list_gpus(lab):
    gpulab.write_fixture_config(lab.state)
    expected = [line for line in CAPTURE_1["nvidia-smi plain"] if line.startswith("GPU 0:")]
    for flag in ("-L", "--list-gpus"):
        assert lab.smi(flag).stdout == text(expected)


def test_busy_with_one_holder_matches_capture(lab):
    # The busy table was read at 35 C, 90 W, 1 %; the csv blocks at other moments do not show those fields.
    gpulab.write_fixture_config(lab.state, overrides={"temperature.gpu": 35, "power.draw": 90.4, "utilization.gpu": 1})
    _, pid = lab.hold("--gpu", "0", "--mib", "20998", argv0="python3")
    block = CAPTURE_1["hold memory, then kill (TERM)"]
    assert block[0] == "held 516"

    apps = lab.smi(f"--query-compute-apps={APPS_FIELDS}", "--format=csv")
    expected = (FIXTURES / "nvsmi_apps_busy.csv").read_text().replace("516, ", f"{pid}, ")
    assert (apps.returncode, apps.stdout) == (0, expected)
    assert text(block[1:3]).replace("516, ", f"{pid}, ") == expected

    nounits = lab.smi(f"--query-compute-apps={APPS_FIELDS}", "--format=csv,noheader,nounits")
    assert nounits.stdout == text(block[3:4]).replace("516, ", f"{pid}, ")

    assert lab.smi("--query-gpu=index,memory.used", "--format=csv,noheader").stdout == text(block[24:25])
    assert block[24] == "0, 21007 MiB"

    table = lab.smi().stdout.split("\n")
    expected_table = (FIXTURES / "nvsmi_plain_busy.txt").read_text().replace(f"{516:>16}", f"{pid:>16}")
    assert table[1:] == expected_table.split("\n")[1:]
    assert text(block[4:24]).split("\n")[1:] == (FIXTURES / "nvsmi_plain_busy.txt").read_text().split("\n")[1:]


def test_two_holders_match_capture_2(lab):
    gpulab.write_fixture_config(lab.state, capture=2)
    _, small = lab.hold("--gpu", "0", "--mib", "5638", argv0="python3")
    _, large = lab.hold("--gpu", "0", "--mib", "7686", argv0="python3")
    result = lab.smi(f"--query-compute-apps={APPS_FIELDS},gpu_bus_id", "--format=csv,noheader")
    fixture = (FIXTURES / "nvsmi_apps_two.csv").read_text()
    expected = fixture.replace("457, ", f"{small}, ").replace("458, ", f"{large}, ")
    assert result.returncode == 0
    assert sorted(result.stdout.splitlines()) == sorted(expected.splitlines())
    # capture-2.log: the ansible seed task printed "0, 13339 MiB" with these two holders.
    assert lab.smi("--query-gpu=index,memory.used", "--format=csv,noheader").stdout == "0, 13339 MiB\n"


def test_help_query_texts_are_the_real_ones(lab):
    assert lab.smi("--help-query-gpu").stdout == (FIXTURES / "nvsmi_help_query_gpu.txt").read_text()
    assert lab.smi("--help-query-compute-apps").stdout == (FIXTURES / "nvsmi_help_query_apps.txt").read_text()
    for name in ("nvsmi_help_query_gpu.txt", "nvsmi_help_query_apps.txt"):
        assert (STANDINS / "data" / name).read_bytes() == (FIXTURES / name).read_bytes()


# ---------------------------------------------------------------------------------------------- fields


def test_more_simulated_fields(lab):
    gpulab.write_fixture_config(lab.state)
    fields = (
        "remapped_rows.failure,gpu_recovery_action,pcie.link.gen.max,pcie.link.width.max,count,serial,pstate,"
        "utilization.memory,power.limit,memory.reserved,gpu_name,gpu_uuid,gpu_bus_id"
    )
    result = lab.smi(f"--query-gpu={fields}", "--format=csv")
    header, row = result.stdout.splitlines()
    assert header == (
        "remapped_rows.failure, gpu_recovery_action, pcie.link.gen.max, pcie.link.width.max, count, serial, pstate, "
        "utilization.memory [%], power.limit [W], memory.reserved [MiB], name, uuid, pci.bus_id"
    )
    assert row == (
        "No, None, 5, 16, 1, 1653724058384, P0, 0 %, 700.00 W, 616 MiB, NVIDIA H200, "
        "GPU-bf580366-c11c-e730-752a-e9ca8716b7fa, 00000000:00:06.0"
    )


def test_unsimulated_fields_print_na_and_aliases_take_canonical_headers(lab):
    gpulab.write_fixture_config(lab.state)
    result = lab.smi("--query-gpu=fabric.state,clocks.gr,fan.speed,retired_pages.sbe", "--format=csv")
    assert result.stdout == (
        "fabric.state, clocks.current.graphics [MHz], fan.speed [%], retired_pages.single_bit_ecc.count\n"
        "[N/A], 345 MHz, [N/A], [N/A]\n"
    )


def test_timestamp_field(lab):
    gpulab.write_fixture_config(lab.state)
    result = lab.smi("--query-gpu=timestamp,index", "--format=csv,noheader")
    assert re.fullmatch(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d{3}, 0\n", result.stdout)


def test_update_gpu_changes_what_is_reported(lab):
    gpulab.write_fixture_config(lab.state)
    gpulab.update_gpu(lab.state, 0, {"remapped_rows.pending": "Yes", "gpu_recovery_action": "Reset"})
    result = lab.smi("--query-gpu=remapped_rows.pending,gpu_recovery_action", "--format=csv,noheader")
    assert result.stdout == "Yes, Reset\n"


def test_leak_shows_without_process(lab):
    gpulab.write_fixture_config(lab.state)
    gpulab.set_leak(lab.state, 0, 1234)
    result = lab.smi("--query-gpu=memory.used,memory.free", "--format=csv,noheader,nounits")
    assert result.stdout == f"1234, {143771 - 615 - 1234}\n"
    assert lab.smi(f"--query-compute-apps={APPS_FIELDS}", "--format=csv,noheader").stdout == ""
    gpulab.clear_leaks(lab.state)
    assert lab.used() == "0 MiB\n"


def test_unimplemented_options_fail_honestly(lab):
    gpulab.write_fixture_config(lab.state)
    for args in (["--gpu-reset", "-i", "0"], ["-q", "-x"], ["--query-gpu=index"], ["--format=csv"]):
        result = lab.smi(*args)
        assert result.returncode == 2
        assert result.stdout == ""
        assert result.stderr == f"stand-in: {' '.join(args)} is not implemented by the pve-gpu-recover lab\n"


# ---------------------------------------------------------------------------------------------- views


@pytest.fixture
def eight(lab):
    """Eight H200s; CT 200 has the node's GPUs 2 and 5."""
    config = gpulab.write_config(lab.state, 8, views={"ct200": [2, 5]})
    return [g["uuid"] for g in config["gpus"]]


def test_generated_gpus_are_distinct_and_realistic(eight):
    gpus = gpulab.make_gpus(8)
    assert [g["uuid"] for g in gpus] == eight  # deterministic
    assert (
        len({g["uuid"] for g in gpus}) == len({g["pci.bus_id"] for g in gpus}) == len({g["serial"] for g in gpus}) == 8
    )
    for g in gpus:
        assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", g["uuid"])
        assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:00\.0", g["pci.bus_id"])
    assert gpus[0]["pci.bus_id"] == "00000000:18:00.0"


def test_container_view_lists_only_its_gpus_reindexed(lab, eight):
    node = lab.smi("-L").stdout.splitlines()
    assert node == [f"GPU {i}: NVIDIA H200 (UUID: {u})" for i, u in enumerate(eight)]
    ct = lab.smi("--query-gpu=index,uuid,pci.bus_id,count", "--format=csv,noheader", view="ct200")
    assert ct.stdout == f"0, {eight[2]}, 00000000:3A:00.0, 2\n1, {eight[5]}, 00000000:AB:00.0, 2\n"
    assert lab.smi("-L", view="ct200").stdout == (
        f"GPU 0: NVIDIA H200 (UUID: {eight[2]})\nGPU 1: NVIDIA H200 (UUID: {eight[5]})\n"
    )


def test_container_holder_is_seen_by_node_with_host_index(lab, eight):
    _, pid = lab.hold("--gpu", "1", "--mib", "1000", view="ct200")
    ct_apps = lab.smi("--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader", view="ct200")
    assert ct_apps.stdout == f"{pid}, {eight[5]}, 1000 MiB\n"
    node = lab.smi("--query-gpu=index,memory.used", "--format=csv,noheader,nounits").stdout.splitlines()
    assert node == [f"{i}, {1009 if i == 5 else 0}" for i in range(8)]
    assert lab.smi("--query-gpu=memory.used", "--format=csv,noheader", "-i", "1", view="ct200").stdout == "1009 MiB\n"
    table = lab.smi(view="ct200").stdout
    assert f"|    1   N/A  N/A{pid:>16}      C   " in table


def test_id_selection(lab, eight):
    query = ("--query-gpu=index", "--format=csv,noheader")
    assert lab.smi(*query, "-i", "2").stdout == "2\n"
    assert lab.smi(*query, "--id=5,1").stdout == "1\n5\n"
    assert lab.smi(*query, "-i", eight[3]).stdout == "3\n"
    assert lab.smi(*query, "-i", "0000:2A:00.0").stdout == "1\n"
    missing = lab.smi(*query, "-i", "9")
    assert (missing.returncode, missing.stdout) == (6, "No devices were found\n")


def test_view_without_gpus_finds_no_devices(lab, eight):
    result = lab.smi("-L", view="ct999")
    assert (result.returncode, result.stdout) == (6, "No devices were found\n")


def test_table_with_eight_gpus(lab, eight):
    lines = lab.smi().stdout.split("\n")
    separator = "+-----------------------------------------+------------------------+----------------------+"
    body = lines[
        lines.index("|=========================================+========================+======================|") + 1 :
    ]
    blocks = body[: body.index("")]
    assert len(blocks) == 8 * 4
    assert blocks[3::4] == [separator] * 8
    assert [line[:7] for line in blocks[0::4]] == [f"|{i:>4}  " for i in range(8)]
    assert all(len(line) == 91 for line in lines[1:] if line)
    assert "|  No running processes found" in lines[-3]


# ---------------------------------------------------------------------------------------------- faults


def test_driver_not_loaded(lab):
    gpulab.write_fixture_config(lab.state)
    lab.kernel_file.unlink()
    for args in ([], ["--query-gpu=index,memory.used", "--format=csv,noheader"], ["-L"]):
        result = lab.smi(*args)
        assert (result.returncode, result.stdout) == (9, NO_DRIVER)


def test_nvml_library_missing(lab):
    gpulab.write_fixture_config(lab.state)
    shutil.rmtree(lab.lib_dir)
    result = lab.smi("--query-gpu=index", "--format=csv")
    assert (result.returncode, result.stdout) == (12, NO_LIBRARY)


def test_dangling_nvml_link_counts_as_missing(lab):
    gpulab.write_fixture_config(lab.state)
    (lab.lib_dir / f"libnvidia-ml.so.{gpulab.DRIVER_VERSION}").unlink()
    assert (lab.lib_dir / "libnvidia-ml.so.1").is_symlink()
    assert lab.smi("-L").returncode == 12


@pytest.mark.parametrize("open_module", [True, False], ids=["open-module", "proprietary-module"])
def test_driver_library_version_mismatch(lab, open_module):
    gpulab.write_fixture_config(lab.state)
    gpulab.write_kernel_version_file(lab.kernel_file, "580.159.04", open_module=open_module)
    assert lab.smi("--query-gpu=index", "--format=csv,noheader").stdout == "0\n"
    shutil.rmtree(lab.lib_dir)
    gpulab.write_nvml_library(lab.lib_dir, "580.95.05")
    result = lab.smi("--query-gpu=index", "--format=csv,noheader")
    assert result.returncode == 18
    assert result.stdout == "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.95\n"


def test_kernel_version_file_forms():
    open_line = (
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
        "(dvs-builder@U22-I3-AF03-09-1)  Thu Oct 30 01:02:03 UTC 2025\n"
    )
    proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue Sep 23 10:11:12 UTC 2025\n"
    assert gpulab.KERNEL_MODULE_RE.search(open_line).group(1) == "580.159.04"
    assert gpulab.KERNEL_MODULE_RE.search(proprietary).group(1) == "580.95.05"


@pytest.fixture
def two(lab):
    config = gpulab.write_config(lab.state, 2)
    return [g["uuid"] for g in config["gpus"]]


def test_gpu_lost(lab, two):
    gpulab.set_fault(lab.state, "node", "gpu_lost", gpu=0)
    lost = LOST.format("00000000:18:00.0")
    query = lab.smi("--query-gpu=index,memory.used", "--format=csv")
    assert (query.returncode, query.stdout) == (15, "index, memory.used [MiB]\n" + lost + "1, 0 MiB\n")
    apps = lab.smi(f"--query-compute-apps={APPS_FIELDS}", "--format=csv")
    assert (apps.returncode, apps.stdout) == (15, lost + "pid, process_name, used_gpu_memory [MiB], gpu_uuid\n")
    assert lab.smi().stdout == lost
    assert lab.smi("-L").stdout == lost + f"GPU 1: NVIDIA H200 (UUID: {two[1]})\n"
    # Faults are per view: a container without the fault is unaffected; clearing restores the node.
    assert lab.smi("-L", view="other").returncode == 6
    gpulab.clear_faults(lab.state, "node")
    assert lab.smi("--query-gpu=index", "--format=csv,noheader").stdout == "0\n1\n"


def test_inforom_warning_then_normal_output(lab, two):
    gpulab.set_fault(lab.state, "node", "inforom", gpu=two[1])
    result = lab.smi("--query-gpu=index,memory.used", "--format=csv,noheader")
    assert result.returncode == 14
    assert result.stdout == "WARNING: infoROM is corrupted at gpu 00000000:2A:00.0\n0, 0 MiB\n1, 0 MiB\n"


def test_no_permission(lab, two):
    gpulab.set_fault(lab.state, "node", "no_permission")
    result = lab.smi("--query-gpu=index", "--format=csv")
    assert (result.returncode, result.stdout) == (4, "Failed to initialize NVML: Insufficient Permissions\n")
    gpulab.clear_faults(lab.state)
    assert lab.smi("--query-gpu=index", "--format=csv").returncode == 0


def test_fault_modes_are_checked():
    with pytest.raises(ValueError, match="fault mode"):
        gpulab.set_fault("/nonexistent", "node", "melted")


# ---------------------------------------------------------------------------------------------- runtimes


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3")
def test_runs_on_system_python(lab):
    """The containers run Debian bookworm's /usr/bin/python3 (3.11)."""
    gpulab.write_fixture_config(lab.state)
    result = lab.smi("--query-gpu=index,memory.used", "--format=csv,noheader", python="/usr/bin/python3")
    assert (result.returncode, result.stdout, result.stderr) == (0, "0, 0 MiB\n", "")


def test_lab_config_option_instead_of_environment(lab):
    gpulab.write_fixture_config(lab.state)
    env = {k: v for k, v in os.environ.items() if k != gpulab.LAB_CONFIG_ENV}
    result = subprocess.run(
        [sys.executable, str(NVIDIA_SMI), "--lab-config", str(lab.view_config("node")), "-L"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.stdout == "GPU 0: NVIDIA H200 (UUID: GPU-bf580366-c11c-e730-752a-e9ca8716b7fa)\n"


def test_missing_device_nodes_hide_gpus(lab, eight):
    """With dev_dir set, a view sees only the GPUs whose /dev/nvidia<minor> exists (LXC without the bind mount)."""
    dev = lab.root / "ct-dev"
    dev.mkdir()
    for minor in (2, 5):
        (dev / f"nvidia{minor}").write_text("")
    config = lab.root / "view-ct200-dev.json"
    gpulab.write_view_config(
        config,
        "ct200",
        lab.state,
        kernel_version_file=str(lab.kernel_file),
        nvml_library_glob=str(lab.lib_dir / "libnvidia-ml.so.*"),
        dev_dir=str(dev),
    )
    query = ("--lab-config", str(config), "--query-gpu=index,uuid", "--format=csv,noheader")
    assert lab.smi(*query).stdout == f"0, {eight[2]}\n1, {eight[5]}\n"
    (dev / "nvidia2").unlink()
    assert lab.smi(*query).stdout == f"0, {eight[5]}\n"
    (dev / "nvidia5").unlink()
    result = lab.smi(*query)
    assert (result.returncode, result.stdout) == (6, "No devices were found\n")


def test_labctl_helpers(lab, eight):
    assert [gpulab.global_index(lab.state, uuid) for uuid in eight] == list(range(8))
    assert gpulab.holder_pids(lab.state) == []
    gpulab.register_holder(lab.state, os.getpid(), gpulab.read_proc_stat("/proc", os.getpid())[1], {eight[0]: 1})
    gpulab.register_holder(lab.state, 2**22 + 1, 1, {eight[0]: 1})  # beyond pid_max: dead
    assert gpulab.holder_pids(lab.state) == [os.getpid()]
    gpulab.reset_state(lab.state)
    assert gpulab.holder_pids(lab.state) == []
    assert gpulab.read_faults(lab.state) == {}
    assert gpulab.read_leaks(lab.state) == {}


def test_project_query_matches_the_hardware_run_capture(lab):
    # bench/hardware_run.sh on an H200, 2026-12-02: the exact query gpu_info makes, extra fields included.
    captured = (FIXTURES / "nvsmi_query_gpu_project.csv").read_text()
    fields = captured.splitlines()[0]
    asked = ",".join(f.split(" [")[0] for f in fields.split(", "))
    overrides = {"uuid": "GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff9", "temperature.gpu": 40, "power.draw": 77.48}
    gpulab.write_fixture_config(lab.state, overrides=overrides)
    result = lab.smi(f"--query-gpu={asked}", "--format=csv")
    assert result.returncode == 0
    assert result.stdout == captured


def test_two_20g_holders_match_the_hardware_run_capture(lab):
    captured = (FIXTURES / "nvsmi_apps_two_holders_20g.csv").read_text()
    gpulab.write_fixture_config(lab.state, overrides={"uuid": "GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff9"})
    _, first = lab.hold("--gpu", "0", "--mib", "21090", argv0="python3")
    _, second = lab.hold("--gpu", "0", "--mib", "21090", argv0="python3")
    result = lab.smi(f"--query-compute-apps={APPS_FIELDS}", "--format=csv")
    expected = captured.replace("673, ", f"{first}, ").replace("674, ", f"{second}, ")
    assert sorted(result.stdout.splitlines()) == sorted(expected.splitlines())
    # The same run read memory.used 42195 MiB: 2 x 21090 plus the driver's 15 MiB for two contexts.
    assert lab.smi("--query-gpu=index,memory.used", "--format=csv,noheader").stdout == "0, 42195 MiB\n"
