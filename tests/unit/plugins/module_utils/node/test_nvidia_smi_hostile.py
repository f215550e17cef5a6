"""nvidia-smi values a wedged driver or a hostile container prints (issue 8): never a traceback, never "free"."""

import socket
from pathlib import Path

import gpu_processes
import pytest
import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import nvidia_smi as smi
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import acting as gpu_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import ending as gpu_ending
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import messages as gpu_messages
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import plan as gpu_plan

from tests.fakes import FakeRunner, run_module

UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
HEADER = "index, uuid, memory.used [MiB]\n"
MARKERS = [
    "[N/A]",
    "[Not Supported]",
    "[Unknown Error]",
    "[Insufficient Permissions]",
    "[GPU is lost]",
    "[GPU requires reset]",
]


@pytest.mark.parametrize("marker", MARKERS)
def test_a_marker_in_memory_used_is_none_and_kept_as_printed(marker):
    rows = smi.parse_gpus(f"{HEADER}0, {UUID_A}, {marker}\n1, {UUID_B}, 12 MiB\n", smi.MEMORY_FIELDS)
    assert rows == [
        {"index": 0, "uuid": UUID_A, "memory_used_mib": None, "unreadable": {"memory_used_mib": marker}},
        {"index": 1, "uuid": UUID_B, "memory_used_mib": 12},
    ]


@pytest.mark.parametrize("cell", ["12x MiB", "lots", "0x", "inf", "nan"])
def test_a_number_that_is_not_one_is_none_and_kept_as_printed(cell):
    rows = smi.parse_gpus(f"{HEADER}0, {UUID_A}, {cell}\n", smi.MEMORY_FIELDS)
    assert rows[0]["memory_used_mib"] is None
    assert rows[0]["unreadable"] == {"memory_used_mib": cell}


def test_optional_health_fields_keep_n_a_quiet_and_note_other_markers():
    fields = (
        ("index", "index", "int"),
        ("uuid", "uuid", "str"),
        ("temperature.gpu", "temperature_c", "int"),
        ("power.draw", "power_draw_w", "float"),
        ("retired_pages.pending", "retired_pages_pending", "yes_no"),
    )
    text = f"0, {UUID_A}, [Unknown Error], [N/A], [Not Supported]\n"
    rows = smi.parse_gpus(text, fields, header=False)
    assert rows == [
        {
            "index": 0,
            "uuid": UUID_A,
            "temperature_c": None,
            "power_draw_w": None,
            "retired_pages_pending": None,
            "unreadable": {"temperature_c": "[Unknown Error]"},
        }
    ]


# -- the GPU UUID is checked before it can reach a message or advice -----------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff9",
        "GPU-BF580366-C11C-E730-752A-E9CA8716B7FA",
        "GPU-a",
    ],
)
def test_valid_uuids(text):
    assert smi.valid_uuid(text)


@pytest.mark.parametrize(
    "text",
    [
        "GPU-1; reboot",
        "GPU-$(touch /tmp/x)",
        "GPU-`id`",
        "GPU-abc\n",
        "GPU-",
        "gpu-abc",
        "MIG-993fc641-cebc-abe5-5c7f-fa80fed8aff9",  # --query-gpu prints GPU UUIDs only
        "GPU-" + "a" * 200,
        "",
        None,
        42,
    ],
)
def test_invalid_uuids(text):
    assert not smi.valid_uuid(text)


@pytest.mark.parametrize("uuid", ["GPU-1`reboot`", "[N/A]", "x"])
def test_a_bad_uuid_from_the_target_is_refused_naming_the_row(uuid):
    text = f"{HEADER}0, {UUID_A}, 0 MiB\n1, {uuid}, 0 MiB\n"
    with pytest.raises(smi.NvidiaSmiError) as error:
        smi.parse_gpus(text, smi.MEMORY_FIELDS)
    assert error.value.kind == "probe"
    assert f"nvidia-smi row 2 names GPU 1 with uuid {uuid!r}, which is not a GPU UUID" in str(error.value)
    assert error.value.details["bad_row"] == repr(f"1, {uuid}, 0 MiB")


def test_output_that_is_not_text_is_a_probe_error():
    with pytest.raises(smi.NvidiaSmiError, match="nvidia-smi output is a int, not text") as error:
        smi.parse_gpus(7, smi.MEMORY_FIELDS)
    assert error.value.kind == "probe"


# -- callers: unknown memory is never free ------------------------------------------------------------------
def test_a_gpu_whose_memory_use_is_unknown_is_busy():
    rows = [
        {"index": 0, "uuid": UUID_A, "memory_used_mib": None, "unreadable": {"memory_used_mib": "[N/A]"}},
        {"index": 1, "uuid": UUID_B, "memory_used_mib": 0},
    ]
    assert gpu_plan.busy_gpus(rows, {UUID_A, UUID_B}, 0) == [rows[0]]
    assert gpu_plan.busy_gpus(rows, {UUID_B}, 0) == []  # not the target's GPU


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_the_memory_wait_never_takes_unknown_for_free():
    clock = Clock()
    unknown = [{"index": 0, "uuid": UUID_A, "memory_used_mib": None}]
    _, polls, free = gpu_ending.wait_for_memory(
        lambda: unknown, {UUID_A}, threshold=0, timeout=1, poll_interval=0.5, clock=clock, sleep=clock.sleep
    )
    assert (polls, free) == (3, False)


def test_no_holder_error_names_the_gpu_and_the_raw_value():
    held = [
        {"index": 3, "uuid": UUID_A, "memory_used_mib": None, "unreadable": {"memory_used_mib": "[GPU requires reset]"}}
    ]
    error = gpu_messages.no_holder_error("CT 200 on pve1", held, 0, {})
    assert str(error) == (
        f"CT 200 on pve1: GPU 3 ({UUID_A}) reports memory.used as '[GPU requires reset]', and no process holds it: "
        "a GPU whose memory use cannot be read is not counted as free (the driver cannot say it released it). "
        f"Reset the GPU on the node with nothing using it (`nvidia-smi --gpu-reset -i {UUID_A}`) or reboot the node"
    )


def test_no_holder_error_with_known_and_unknown_gpus():
    held = [
        {"index": 0, "uuid": UUID_A, "memory_used_mib": 500},
        {"index": 1, "uuid": UUID_B, "memory_used_mib": None, "unreadable": {"memory_used_mib": "[N/A]"}},
    ]
    message = str(gpu_messages.no_holder_error("host gpu1", held, 100, {}, waited=30))
    assert message.startswith(
        f"host gpu1: GPU 0 ({UUID_A}) has 500 MiB used (above 100 MiB); GPU 1 ({UUID_B}) reports memory.used as "
        "'[N/A]' 30 s after its last holder exited, and no process holds it"
    )
    assert f"`nvidia-smi --gpu-reset -i {UUID_A}` `nvidia-smi --gpu-reset -i {UUID_B}`" in message


def test_the_reset_advice_never_carries_a_uuid_that_is_not_one():
    bad = "GPU-1; reboot"
    held = [{"index": 0, "uuid": bad, "memory_used_mib": 500}]
    message = str(gpu_messages.no_holder_error("CT 200 on pve1", held, 0, {}))
    assert "--gpu-reset -i GPU-1" not in message
    assert f"GPU 0 (no valid UUID: {bad!r})" in message
    assert "find its UUID with `nvidia-smi -L` on the node, then `nvidia-smi --gpu-reset -i <UUID>`" in message


# -- the module: a GPU that cannot say how much memory it uses is not reported free ------------------------
CASES = yaml.safe_load((Path(__file__).parents[3] / "library" / "test_gpu_processes.yaml").read_text())


def test_the_module_fails_naming_a_gpu_whose_memory_use_is_unknown(monkeypatch, capsys):
    anchors = CASES["anchors"]
    ct_memory = dict(anchors["ct_memory"], stdout=f"{HEADER}0, {UUID_A}, [N/A]\n1, {UUID_B}, 0 MiB\n")
    no_apps = dict(anchors["node_apps"], stdout="pid, process_name, used_gpu_memory [MiB], gpu_uuid\n")
    runner = FakeRunner(*[(c["argv"], (0, c["stdout"], "")) for c in (ct_memory, no_apps)])
    monkeypatch.setattr(gpu_acting, "device_holders", lambda owner, proc_root="/proc", exclude=(): [])
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    result = run_module(gpu_processes, {"vmid": 200}, runner, monkeypatch, capsys)
    assert result["failed"]
    assert result["msg"].startswith(f"CT 200 on pve1: GPU 0 ({UUID_A}) reports memory.used as '[N/A]'")
    assert f"`nvidia-smi --gpu-reset -i {UUID_A}`" in result["msg"]
    assert UUID_B not in result["msg"]
