"""plugins/modules/verify.py: the acting module end to end, and the verify role's files against the step's SPEC.

On a CT the module is replayed through FakeRunner: its two ``pct exec`` calls (nvidia-smi, then the venv's python
with the torch script on stdin) are asserted argv by argv. On a bare host the torch script really runs, in a venv
made here whose ``torch`` is a stub (no test imports the real one). nvidia-smi's output is the real H200 capture
with single cells replaced (tests/unit/plugins/module_utils/steps/verify/test_facts.py builds it).
"""

import hashlib
import inspect
import json
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
import target_facts
import verify
import yaml
from ansible.module_utils.common import warnings as ansible_warnings
from ansible.module_utils.testing import patch_module_args
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import command as node_command
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import query_gpu_argv
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import facts as verify_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import gpu_checks as verify_gpu_checks
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import probe as verify_probe

from tests.conftest import FIXTURES, ROOT
from tests.fakes import FakeRunner, run_module
from tests.unit.plugins.module_utils.steps.verify.test_facts import eight, smi, stub_venv

PCT = ["pct", "exec", "200", "--keep-env", "0", "--", "timeout", "-k", "5"]
ENV = ["env", "LC_ALL=C", "LANG=C"]
SMI_ARGV = [*PCT, "60", *ENV, *query_gpu_argv()]
TORCH_ARGV = [*PCT, "180", *ENV, "PYTHONDONTWRITEBYTECODE=1", "/opt/venvs/train/bin/python", "-I", "-B", "-"]
KNOWN_GOOD = {"vmid": 200, "torch_version": "2.11.0+cu128", "cuda_version": "12.8", "gpu_count": 8}
VERIFY = FIXTURES / "verify"
ROLE = ROOT / "roles" / "verify"


def torch_out(name="torch_probe_cu128_8x.json", **changed):
    return json.dumps(dict(json.loads((VERIFY / name).read_text()), **changed))


def calls(smi_out=None, torch=None):
    """The module's two commands on CT 200: nvidia-smi, then the venv's python (omitted when ``torch`` is False)."""
    made = [(SMI_ARGV, (0, smi_out or eight(), ""))]
    if torch is not False:
        made.append((TORCH_ARGV, torch or (0, torch_out(), "")))
    return made


@pytest.fixture(autouse=True)
def on_pve1(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    ansible_warnings._global_warnings.clear()  # module.warn() collects process-wide: one module run per test


def warned(result):
    """The messages of the result's warnings (ansible-core returns them as WarningSummary objects)."""
    return [w["event"]["msg"] if isinstance(w, dict) else w for w in result.get("warnings", [])]


def run(params, runner, monkeypatch, capsys, check_mode=False):
    return run_module(verify, params, runner, monkeypatch, capsys, check_mode=check_mode)


# -- a CT, replayed ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_the_known_good_state_passes_in_two_pct_execs_and_changes_nothing(check_mode, monkeypatch, capsys):
    runner = FakeRunner(*calls())
    result = run(KNOWN_GOOD, runner, monkeypatch, capsys, check_mode)
    assert (result.get("failed", False), result["changed"]) == (False, False)
    assert all(c["ok"] is True for c in result["checks"])
    assert [c["name"] for c in result["checks"]][-6:] == [
        "torch_import",
        "torch_version",
        "cuda_version",
        "cuda_available",
        "torch_device_count",
        "torch_device_names",
    ]
    torch = result["torch"]
    assert (torch["version"], torch["cuda"], torch["available"], torch["device_count"]) == (
        "2.11.0+cu128",
        "12.8",
        True,
        8,
    )
    assert torch["python"] == "/opt/venvs/train/bin/python"
    assert len(result["gpus"]) == 8 and result["gpus"][0]["name"] == "NVIDIA H200"
    assert result["expected"]["health"] == verify_gpu_checks.HEALTH_DEFAULTS
    assert "warnings" not in result
    # nvidia-smi first (the memory it reads is the jobs', not the script's), no stdin; then the script on stdin.
    assert runner.stdin == [None, inspect.getsource(verify_probe)]


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_every_failed_assertion_is_in_one_failure_with_its_cause(check_mode, monkeypatch, capsys):
    stdout = eight(5, **{"ecc.errors.uncorrected.volatile.total": "3"})
    torch = (0, torch_out(torch="2.11.0+cu130", cuda="13.0", dist_version="2.11.0"), "")
    result = run(KNOWN_GOOD, FakeRunner(*calls(stdout, torch)), monkeypatch, capsys, check_mode)
    failed = [c["detail"] for c in result["checks"] if c["ok"] is False]
    assert [c["name"] for c in result["checks"] if c["ok"] is False] == ["ecc", "torch_version", "cuda_version"]
    assert (result["failed"], result.get("changed", False), result["error"]) == (True, False, "verify")
    assert result["msg"] == " | ".join(failed)
    assert failed[1] == (
        "CT 200 on pve1: torch is 2.11.0+cu130 (torch.__version__ in /opt/venvs/train), expected 2.11.0+cu128; the "
        "other CUDA build of torch (cu130, expected cu128); take torch from https://download.pytorch.org/whl/cu128 "
        "(an --extra-index-url of the training_venv lock)"
    )
    assert result["torch"]["version"] == "2.11.0+cu130"


def test_the_gpus_the_guarded_job_keeps_are_left_out_of_the_memory_check_and_only_those(monkeypatch, capsys):
    # An unattended run left the guarded training job on GPU 4 (the role passes gpu_processes' kept_gpus).
    stdout = eight(4, **{"memory.used": "20480 MiB"})
    kept = run(dict(KNOWN_GOOD, memory_kept_gpus=[4]), FakeRunner(*calls(stdout)), monkeypatch, capsys)
    assert kept.get("failed", False) is False, kept.get("msg")
    memory = next(c for c in kept["checks"] if c["name"] == "memory")
    assert memory["ok"] is True and "except GPU 4, which the guarded training job keeps" in memory["detail"]
    other = run(dict(KNOWN_GOOD, memory_kept_gpus=[3]), FakeRunner(*calls(stdout)), monkeypatch, capsys)
    assert other["failed"] is True and "uses 20480 MiB, expected at most 0 MiB" in other["msg"]


def test_a_warn_level_finding_warns_and_passes(monkeypatch, capsys):
    stdout = eight(2, **{"pcie.link.width.current": "8"})
    result = run(KNOWN_GOOD, FakeRunner(*calls(stdout)), monkeypatch, capsys)
    assert result.get("failed", False) is False
    assert warned(result) == [
        "CT 200 on pve1: PCIe link width below its maximum: GPU 2 (GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff2): x8 of "
        "x16; expected the maximum width on every GPU; a degraded link (a loose card or riser, a bad slot): reseat it; "
        "transfers between host and GPU run at a fraction of the bandwidth"
    ]
    strict = run(dict(KNOWN_GOOD, health={"pcie_width": "fail"}), FakeRunner(*calls(stdout)), monkeypatch, capsys)
    assert strict["failed"] is True and strict["msg"] == warned(result)[0]


def test_fabric_manager_down_fails_naming_it(monkeypatch, capsys):
    torch = (0, torch_out("torch_probe_802.json"), "")
    result = run(KNOWN_GOOD, FakeRunner(*calls(torch=torch)), monkeypatch, capsys)
    assert result["failed"] is True
    assert "CUDA error 802 (system not yet initialized): the NVIDIA fabric manager is not running" in result["msg"]


def test_never_importing_torch_costs_one_pct_exec_and_counts_what_nvidia_smi_lists(monkeypatch, capsys):
    params = {"vmid": 200, "import_torch": "never"}
    result = run(params, FakeRunner(*calls(smi(*eight().splitlines()[1:8]), torch=False)), monkeypatch, capsys)
    assert (result.get("failed", False), result["torch"], result["expected"]["gpu_count"]) == (False, None, 7)
    assert not [c for c in result["checks"] if c["name"].startswith(("torch", "cuda"))]


def test_without_gpu_count_the_device_nodes_torch_saw_are_the_gpus_passed_through(monkeypatch, capsys):
    seven = [f"/dev/nvidia{i}" for i in range(7)]
    torch = (0, torch_out(devices=seven, count=7, names=["NVIDIA H200"] * 7), "")
    result = run({"vmid": 200}, FakeRunner(*calls(torch=torch)), monkeypatch, capsys)
    assert result["expected"]["gpu_count"] == 7
    assert result["msg"] == (
        "CT 200 on pve1: nvidia-smi sees 8 GPUs, expected 7 (the target's /dev/nvidiaN nodes); more GPUs are passed "
        "through than expected (set verify_gpu_count, or fix the target's GPU entries)"
    )


def test_a_venv_without_python_is_a_failed_check_not_a_crash(monkeypatch, capsys):
    torch = (127, "", "env: '/opt/venvs/train/bin/python': No such file or directory\n")
    result = run(KNOWN_GOOD, FakeRunner(*calls(torch=torch)), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "verify")
    assert result["msg"] == (
        "CT 200 on pve1: /opt/venvs/train/bin/python not found: there is no venv at /opt/venvs/train; the "
        "training_venv step builds it (or set verify_venv)"
    )
    assert result["torch"]["failure"] == "not_found"


def test_an_import_past_its_deadline_is_named_with_the_setting_to_raise(monkeypatch, capsys):
    torch = (124, "", "", 185.0, True)
    params = dict(KNOWN_GOOD, torch_timeout=30)
    argv = [*PCT, "30", *ENV, "PYTHONDONTWRITEBYTECODE=1", "/opt/venvs/train/bin/python", "-I", "-B", "-"]
    runner = FakeRunner((SMI_ARGV, (0, eight(), "")), (argv, torch))
    result = run(params, runner, monkeypatch, capsys)
    assert result["msg"].startswith(
        "CT 200 on pve1: importing torch and starting CUDA did not finish within 30 s and was killed"
    )
    assert (result["torch"]["failure"], result["torch"]["timeout"]) == ("timeout", 30)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            (0, "hello from a sitecustomize\n", ""),
            "CT 200 on pve1: the torch probe printed no JSON answer: 'hello from",
        ),
        ((0, torch_out(count="8"), ""), "CT 200 on pve1: the torch probe answered 'count' as '8', not int"),
        ((0, json.dumps({"torch": "2.11.0"}), ""), "CT 200 on pve1: the torch probe answered no 'cuda'"),
    ],
)
def test_an_answer_that_is_not_the_scripts_fails_clearly(answer, message, monkeypatch, capsys):
    result = run(KNOWN_GOOD, FakeRunner(*calls(torch=answer)), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "probe")
    assert result["msg"].startswith(message)
    assert "Traceback" not in result["msg"]


def test_a_stopped_ct_fails_at_the_first_command(monkeypatch, capsys):
    runner = FakeRunner((SMI_ARGV, (255, "", "container '200' not running!\n")))
    result = run(KNOWN_GOOD, runner, monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "stopped")
    assert result["msg"].startswith("CT 200 on pve1 is not running")


def test_a_lost_gpu_fails_with_nvidia_smis_message(monkeypatch, capsys):
    lost = "Unable to determine the device handle for GPU0000:19:00.0: GPU is lost.  Reboot the system to recover.\n"
    result = run(KNOWN_GOOD, FakeRunner((SMI_ARGV, (15, lost, ""))), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "nvidia_smi_gpu_lost")
    assert result["lost_bus_ids"] == ["0000:19:00.0"]
    assert result["msg"].startswith("CT 200 on pve1: GPU 0000:19:00.0 has fallen off the bus")


def test_options_that_cannot_work_fail_before_any_command(monkeypatch, capsys):
    result = run(dict(KNOWN_GOOD, cuda_version="13.0"), FakeRunner(), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "invalid")
    assert result["msg"] == (
        "torch_version 2.11.0+cu128 is a CUDA 12.8 build but cuda_version is 13.0; fix the verify_* variable of that "
        "name"
    )
    assert run(dict(KNOWN_GOOD, torch_timeout=0), FakeRunner(), monkeypatch, capsys)["msg"].startswith(
        "torch_timeout is 0; give torch at least 1 second"
    )


def test_nvidia_smis_own_notices_become_warnings(monkeypatch, capsys):
    stdout = eight() + "WARNING: infoROM is corrupted at gpu 0000:19:00.0\n"
    result = run(KNOWN_GOOD, FakeRunner(*calls(stdout)), monkeypatch, capsys)
    assert warned(result) == ["CT 200 on pve1: WARNING: infoROM is corrupted at gpu 0000:19:00.0"]


# -- a bare host: the torch script really runs -------------------------------------------------------------------
class HostRunner:
    """nvidia-smi answered from the capture; the venv's python really run (run_local) with the stub torch."""

    def __init__(self, smi_out):
        self.smi_out = smi_out
        self.argvs = []
        self.envs = []

    def __call__(self, argv, *, stdin=None, timeout=None, env=None):
        self.argvs.append(argv)
        if "nvidia-smi" in argv:
            return node_command.CommandResult(argv=argv, rc=0, stdout=self.smi_out, stderr="")
        self.envs.append(env)
        stub = {"STUB_CUDA": "12.8", "STUB_COUNT": "8"}
        return REAL_RUN_LOCAL(argv, stdin=stdin, timeout=timeout, env={**(env or {}), **stub})


REAL_RUN_LOCAL = node_target.run_local


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_a_bare_host_runs_the_script_in_the_venvs_own_python(check_mode, tmp_path, monkeypatch, capsys):
    venv = stub_venv(tmp_path / "train")
    runner = HostRunner(eight())
    monkeypatch.setattr(node_target, "run_local", runner)
    params = {"venv": str(venv), "torch_version": "2.11.0+cu128", "cuda_version": "12.8"}
    with patch_module_args(dict(params, _ansible_check_mode=check_mode)), pytest.raises(SystemExit):
        verify.main()
    result = json.loads(capsys.readouterr().out)
    assert result.get("failed", False) is False, result.get("msg")
    assert runner.argvs == [
        ["timeout", "-k", "5", "60", *query_gpu_argv()],
        ["timeout", "-k", "5", "180", f"{venv}/bin/python", "-I", "-B", "-"],
    ]
    assert (result["torch"]["version"], result["torch"]["python_version"]) == (
        "2.11.0+cu128",
        sys.version.split()[0],
    )
    assert result["expected"]["gpu_count"] == 8  # nvidia-smi's GPUs: this test machine has no /dev/nvidiaN


def tree(root):
    """Every path under ``root`` with its kind, size, mtime and content hash: what a verify must leave as it was."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(directory, name)
            info = os.lstat(full)
            digest = hashlib.sha256(Path(full).read_bytes()).hexdigest() if stat.S_ISREG(info.st_mode) else None
            found[os.path.relpath(full, root)] = (stat.S_IFMT(info.st_mode), info.st_size, info.st_mtime_ns, digest)
    return found


def test_importing_torch_to_verify_leaves_the_venv_byte_identical(tmp_path, monkeypatch, capsys):
    venv = stub_venv(tmp_path / "train")
    # A submodule too: the import of a package writes a __pycache__ beside each module it compiles.
    (next(venv.glob("lib/python3.*/site-packages")) / "torch" / "version.py").write_text("__version__ = 'x'\n")
    before = tree(venv)
    runner = HostRunner(eight())
    monkeypatch.setattr(node_target, "run_local", runner)
    with patch_module_args({"venv": str(venv), "import_torch": "always"}), pytest.raises(SystemExit):
        verify.main()
    result = json.loads(capsys.readouterr().out)
    assert result["torch"]["version"] == "2.11.0+cu128", result.get("msg")
    assert runner.envs[-1] == {"PYTHONDONTWRITEBYTECODE": "1"}
    assert tree(venv) == before


def test_a_bare_host_without_the_venv_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(node_target, "run_local", HostRunner(eight()))
    params = {"venv": str(tmp_path / "none"), "gpu_count": 8}
    with patch_module_args(params), pytest.raises(SystemExit):
        verify.main()
    result = json.loads(capsys.readouterr().out)
    assert result["msg"] == (
        f"host pve1: {tmp_path}/none/bin/python not found: there is no venv at {tmp_path}/none; the training_venv step "
        "builds it (or set verify_venv)"
    )


# -- the role's files against the step's SPEC ----------------------------------------------------------------------
def load(path):
    return yaml.safe_load((ROLE / path).read_text())


def test_every_setting_has_a_role_variable_with_the_same_default_and_an_argument_spec():
    defaults = load("defaults/main.yml")
    options = load("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    for name, rules in verify_facts.SPEC.items():
        want = verify_facts.SPEC_DEFAULTS[name]
        if name == "venv":  # one venv variable: the training venv's path, the module's default without it
            want = f"{{{{ training_venv_path | default('{want}') }}}}"
        assert defaults[f"verify_{name}"] == want, name
        assert options[f"verify_{name}"]["type"] == rules["type"], name
        assert options[f"verify_{name}"].get("default") == want, name
        assert options[f"verify_{name}"].get("choices") == rules.get("choices"), name
    health = options["verify_health"]["options"]
    assert {k: v["default"] for k, v in health.items()} == verify_gpu_checks.HEALTH_DEFAULTS
    assert all(v["choices"] == list(verify_gpu_checks.LEVELS) for v in health.values())
    for name in ("torch_timeout", "timeout"):
        assert (
            defaults[f"verify_{name}"] == verify.ARGUMENT_SPEC[name]["default"] == options[f"verify_{name}"]["default"]
        )
    # Every variable in defaults is described, and nothing else is.
    assert set(defaults) == set(options) - {"pve_vmid", "pve_node"}


def test_the_fact_pass_reads_every_setting_and_the_acting_task_passes_them():
    asked = []

    def variable(name):
        asked.append(name)
        if name == "verify_enabled":
            return True
        raise KeyError(name)

    assert step_registry.settings_from_variables(["verify"], variable) == {"verify": {}}
    assert asked == ["verify_enabled"] + [f"verify_{name}" for name in verify_facts.SPEC]
    tasks = load("tasks/main.yml")
    (acting,) = [t for t in tasks if "pve_gpu.recover.verify" in t]
    assert set(acting["pve_gpu.recover.verify"]) == set(verify.ARGUMENT_SPEC)
    assert acting["when"] == ["verify_enabled | bool", "ansible_facts.pve_gpu_recover.verify.pending | default(true)"]
    assert acting["changed_when"] is False
    assert acting["delegate_to"] == "{{ pve_node | default(inventory_hostname) }}"


# -- the fact pass with verify registered last -------------------------------------------------------------------
FACTS_DOC = yaml.safe_load((ROOT / "tests/unit/library/test_target_facts.yaml").read_text())["anchors"]


@pytest.fixture
def registered(monkeypatch):
    assert step_registry.STEP_NAMES[-1] == "verify"
    monkeypatch.setattr(preflight_facts, "read_node_driver_version", lambda _path: "580.159.04")


def fact_pass(tmp_path, monkeypatch, capsys, smi_stdout, verify_settings, *, check_mode=False):
    """target_facts on CT 200 with preflight and verify: ONE pct exec carries both parts, nothing else runs."""
    healthy = dict(FACTS_DOC["healthy"], nvidia_smi={"rc": 0, "stdout": smi_stdout, "stderr": ""})
    payloads = {"preflight": FACTS_DOC["payload"], "verify": {"venv": "/opt/venvs/train"}}
    version_py = (FIXTURES / "venv" / "version_py_cu130.txt").read_text().replace("cu130", "cu128")
    verify_answer = {
        "venv": "/opt/venvs/train",
        "exists": True,
        "python": True,
        "site_packages": "/opt/venvs/train/lib/python3.11/site-packages",
        "torch_version_py": verify_probe.parse_torch_version_py(version_py.replace("'13.0'", "'12.8'")),
    }
    out = json.dumps({"preflight": {"answer": healthy}, "verify": {"answer": verify_answer}})
    runner = FakeRunner(([*FACTS_DOC["probe_argv"], json.dumps(payloads)], (0, out, "")))
    params = {"run_id": "run-1", "owner": "alice@ctl", "lock_dir": str(tmp_path), "vmid": 200}
    params["steps"] = {"preflight": {"expected_gpu_count": 2}, "verify": verify_settings}
    result = run_module(target_facts, params, runner, monkeypatch, capsys, check_mode=check_mode)
    return result["ansible_facts"]["pve_gpu_recover"]


@pytest.mark.usefixtures("registered")
@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_a_converged_target_is_verified_in_the_fact_pass_and_nothing_is_left_to_run(
    check_mode, tmp_path, monkeypatch, capsys
):
    stdout = FACTS_DOC["healthy"]["nvidia_smi"]["stdout"]
    settings = {"torch_version": "2.11.0+cu128", "cuda_version": "12.8", "gpu_count": 2}
    facts = fact_pass(tmp_path, monkeypatch, capsys, stdout, settings, check_mode=check_mode)
    verified = facts["verify"]
    assert (verified["problems"], verified["pending"], verified["changes"]) == ([], False, [])
    assert all(c["ok"] is True for c in verified["checks"])
    assert verified["torch"]["version"] == "2.11.0+cu128"
    # Nothing pending, no problem: the lock went back in the same execution; the role makes no remote call.
    assert (facts["pending"], facts["problems"], facts["lock"]["held"]) == ([], [], False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("registered")
def test_broken_hardware_stops_the_run_in_the_fact_pass(tmp_path, monkeypatch, capsys):
    header, *rows = FACTS_DOC["healthy"]["nvidia_smi"]["stdout"].splitlines()
    rows[1] = rows[1].replace(", No, No, 5, 16, None", ", Yes, No, 5, 16, None")  # GPU 1: a row remap pending
    facts = fact_pass(tmp_path, monkeypatch, capsys, "\n".join([header, *rows]) + "\n", {"import_torch": "always"})
    assert facts["problems"] == facts["verify"]["problems"]
    assert facts["problems"][0].startswith(
        "CT 200 on pve1: memory row remapping: GPU 1 (GPU-5c8d304e-f6b5-2ed9-0941-57901455451b): a row remap is pending"
    )
    assert (facts["verify"]["pending"], facts["lock"]["held"]) == (False, False)


@pytest.mark.usefixtures("registered")
def test_always_keeps_the_lock_for_the_module_to_run(tmp_path, monkeypatch, capsys):
    stdout = FACTS_DOC["healthy"]["nvidia_smi"]["stdout"]
    facts = fact_pass(tmp_path, monkeypatch, capsys, stdout, {"import_torch": "always"}, check_mode=True)
    assert (facts["pending"], facts["lock"]["held"]) == (["verify"], True)
