"""plugins/modules/target_facts.py: the fact pass replayed through test_target_facts.yaml, its lock rules and its
steps."""

import json
import socket
import threading
from pathlib import Path

import pytest
import target_facts
import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock as node_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import ProcessInfo
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import facts as gpu_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts

from tests.conftest import FIXTURES
from tests.fakes import ANSIBLE_CORE, FakeRunner, run_module

DOC = yaml.safe_load((Path(__file__).with_suffix(".yaml")).read_text())
CASES = DOC["cases"]
ANCHORS = DOC["anchors"]
TARGET_KEYS = ("failed", "error", "msg", "changed")
NODE_VERSION = FIXTURES / "h200" / "proc_driver_nvidia_version.txt"
APPS_ARGV = [
    "timeout",
    "-k",
    "5",
    "60",
    "nvidia-smi",
    "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
    "--format=csv",
]


def probe_call(parts, answers, rc=0, stdout=None, stderr=""):
    """The one pct exec of the fact pass: every part's payload on the argv, every part's answer on stdout."""
    argv = [*ANCHORS["probe_argv"], json.dumps(parts)]
    out = json.dumps({name: {"answer": answer} for name, answer in answers.items()}) if stdout is None else stdout
    return argv, (rc, out, stderr)


def runner_for(case):
    calls = []
    for call in case["calls"]:
        stdout = json.dumps({"preflight": {"answer": call["probe"]}}) if "probe" in call else call.get("stdout", "")
        calls.append(
            ([*call["argv"], json.dumps({"preflight": call["payload"]})], (call["rc"], stdout, call.get("stderr", "")))
        )
    return FakeRunner(*calls)


def node_version(monkeypatch, path):
    text = path.read_text() if path else None
    monkeypatch.setattr(
        preflight_facts,
        "read_node_driver_version",
        lambda _p: preflight_facts.parse_kernel_driver_version(text) if text else None,
    )


@pytest.fixture(autouse=True)
def node_named_pve1(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")


def params(tmp_path, **extra):
    return {"run_id": "run-1", "owner": "alice@ctl", "lock_dir": str(tmp_path), **extra}


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_preflight_cases(case, check_mode, tmp_path, monkeypatch, capsys):
    path = Path(case["node_version"].format(fixtures=FIXTURES)) if case["node_version"] else None
    node_version(monkeypatch, path)
    target_params = {k: v for k, v in case["params"].items() if k == "vmid"}
    preflight = {k: v for k, v in case["params"].items() if k != "vmid"}
    args = params(tmp_path, steps={"preflight": preflight}, **target_params)
    result = run_module(target_facts, args, runner_for(case), monkeypatch, capsys, check_mode=check_mode)
    facts = facts_of(result)
    for key, want in case["expect"].items():
        if key in TARGET_KEYS:
            assert result.get(key, False if key in ("failed", "changed") else None) == want, key
        elif key == "target":
            assert facts["target"] == want
        else:
            assert facts["preflight"][key] == want, key
    # A preflight-only pass has no work: the lock is released in the same execution, failed or not.
    assert list(tmp_path.iterdir()) == []
    if facts:
        assert facts["lock"] == {
            "path": str(tmp_path / "ct-200.lock"),
            "held": False,
            "action": "taken",
            "who": {"owner": "alice@ctl", "controller": None, "controller_pid": None},
        }
        assert facts["problems"] == facts["preflight"]["problems"]
        failed = [c for c in facts["preflight"]["checks"] if not c["ok"]]
        assert facts["preflight"]["problems"] == [c["detail"] for c in failed if c["severity"] == "fail"]
        assert facts["preflight"]["warnings"] == [c["detail"] for c in failed if c["severity"] == "warn"]
        assert result["changed"] is False
        # A problem fails the pass itself, with every problem at once; the facts come back all the same.
        if facts["problems"]:
            assert (result["failed"], result["error"]) == (True, "problems")
            assert result["msg"] == " | ".join(facts["problems"])
        else:
            assert not result.get("failed")


def facts_of(result):
    return result.get("ansible_facts", {}).get("pve_gpu_recover", {})


class NodeProcesses:
    """The node's /proc as the gpu_processes part reads it: a CT 200 training process holding GPU 0."""

    def __init__(self, monkeypatch, holders):
        self.holders = holders
        monkeypatch.setattr(gpu_facts, "read_process", self.holders.get)
        monkeypatch.setattr(gpu_facts, "device_holders", lambda owner, owners=None: [])
        monkeypatch.setattr(gpu_facts, "process_owners", dict)


TRAIN = ProcessInfo(
    pid=516, ns_pid=41, comm="python3", state="S", owner="ct:200", cmdline=["python3", "train.py"], start_time=10
)
NEIGHBOUR = ProcessInfo(
    pid=777, ns_pid=7, comm="python3", state="S", owner="ct:201", cmdline=["python3"], start_time=12
)
UUID0 = "GPU-bf580366-c11c-e730-752a-e9ca8716b7fa"


def two_step_runner(apps_stdout, healthy=None):
    payload = {"preflight": ANCHORS["payload"]}
    return FakeRunner(
        probe_call(payload, {"preflight": healthy or ANCHORS["healthy"]}),
        (APPS_ARGV, (0, apps_stdout, "")),
    )


def apps(*rows):
    return "pid, process_name, used_gpu_memory [MiB], gpu_uuid\n" + "".join(f"{r}\n" for r in rows)


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_holders_make_gpu_processes_pending_and_keep_the_lock(check_mode, tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {516: TRAIN})
    runner = two_step_runner(apps(f"516, python3, 20000 MiB, {UUID0}"))
    args = params(tmp_path, vmid=200, steps={"preflight": {"expected_gpu_count": 2}, "gpu_processes": {}})
    result = run_module(target_facts, args, runner, monkeypatch, capsys, check_mode=check_mode)
    facts = result["ansible_facts"]["pve_gpu_recover"]
    assert facts["pending"] == ["gpu_processes"]
    assert facts["gpu_processes"]["changes"] == ["end pid 516 (python3, pid 41 inside) on GPU 0, 20000 MiB"]
    assert facts["gpu_processes"]["diff"]["before"] == "pid 516 (python3, pid 41 inside) on GPU 0, 20000 MiB\n"
    # Work is pending: the lock stays held for the step, then recover.yml releases it.
    assert facts["lock"]["held"] is True
    assert json.loads((tmp_path / "ct-200.lock").read_text())["run_id"] == "run-1"
    assert result["changed"] is False


def test_a_neighbour_on_the_targets_gpu_is_a_problem_and_the_lock_is_released(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {777: NEIGHBOUR})
    runner = two_step_runner(apps(f"777, python3, 3000 MiB, {UUID0}"))
    args = params(tmp_path, vmid=200, steps={"gpu_processes": {}})
    result = run_module(target_facts, args, runner, monkeypatch, capsys)
    facts = facts_of(result)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert facts["pending"] == []
    assert facts["gpu_processes"]["problems"] == [
        "CT 200 on pve1: cannot free its GPUs: pid 777 (python3, pid 7 inside) on GPU 0, 3000 MiB belongs to CT 201, "
        "not to this target. Nothing was ended. Stop those processes yourself, or give this target "
        "GPUs of its own"
    ]
    assert facts["problems"] == facts["gpu_processes"]["problems"]
    assert facts["lock"]["held"] is False
    assert list(tmp_path.iterdir()) == []


def test_converged_target_costs_one_probe_and_one_node_query(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {})
    runner = two_step_runner(apps())
    args = params(tmp_path, vmid=200, steps={"gpu_processes": {}})
    facts = run_module(target_facts, args, runner, monkeypatch, capsys)["ansible_facts"]["pve_gpu_recover"]
    assert (facts["pending"], facts["problems"], facts["lock"]["held"]) == ([], [], False)
    assert facts["target"] == {"label": "CT 200 on pve1", "vmid": 200, "node": "pve1", "hostname": "ct200"}


def test_node_reads_that_fail_name_the_step_and_do_not_hide_preflight(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {})
    runner = FakeRunner(
        probe_call({"preflight": ANCHORS["payload"]}, {"preflight": ANCHORS["healthy"]}),
        (APPS_ARGV, (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "")),
    )
    args = params(tmp_path, vmid=200, steps={"gpu_processes": {}})
    facts = run_module(target_facts, args, runner, monkeypatch, capsys)["ansible_facts"]["pve_gpu_recover"]
    assert facts["preflight"]["problems"] == []
    assert facts["gpu_processes"]["problems"][0].startswith(
        "CT 200 on pve1: the gpu_processes facts could not be read:"
    )
    assert "exit 9" in facts["gpu_processes"]["problems"][0]
    assert facts["lock"]["held"] is False


class Handshake:
    """A FakeRunner whose probe call (``pct exec``) and node query (``nvidia-smi`` compute apps) wait for each other
    through events, so a test sees whether the two ran at once (no sleeps: a wait returns as soon as it is met)."""

    def __init__(self, runner, *, probe_waits_for_apps=False, apps_waits_for_probe=False):
        self.runner = runner
        self.probe_waits_for_apps, self.apps_waits_for_probe = probe_waits_for_apps, apps_waits_for_probe
        self.apps_started, self.apps_done, self.probe_returned = threading.Event(), threading.Event(), threading.Event()
        self.overlapped = None

    def __call__(self, argv, **kwargs):
        if argv == APPS_ARGV:
            self.apps_started.set()
            if self.apps_waits_for_probe:
                self.probe_returned.wait(10)
            result = self.runner(argv, **kwargs)
            self.apps_done.set()
            return result
        if self.probe_waits_for_apps:
            self.overlapped = self.apps_started.wait(10)  # False only if the node query waits for the probe
        result = self.runner(argv, **kwargs)
        self.probe_returned.set()
        return result

    def assert_done(self):
        self.runner.assert_done()


def test_the_node_reads_run_while_the_probe_runs_in_the_target(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {516: TRAIN})
    runner = Handshake(two_step_runner(apps(f"516, python3, 20000 MiB, {UUID0}")), probe_waits_for_apps=True)
    args = params(tmp_path, vmid=200, steps={"gpu_processes": {}})
    facts = facts_of(run_module(target_facts, args, runner, monkeypatch, capsys))
    assert runner.overlapped is True  # the node query started while the probe was still running
    assert facts["gpu_processes"]["changes"] == ["end pid 516 (python3, pid 41 inside) on GPU 0, 20000 MiB"]


def test_a_failed_probe_waits_for_the_node_reads_before_it_releases_the_lock(tmp_path, monkeypatch, capsys):
    NodeProcesses(monkeypatch, {})
    runner = Handshake(
        FakeRunner(
            probe_call({"preflight": ANCHORS["payload"]}, {}, rc=1, stdout="", stderr="Segmentation fault"),
            (APPS_ARGV, (0, apps(), "")),
        ),
        apps_waits_for_probe=True,  # still running when the probe has failed
    )
    released = []
    release = node_lock.change_lock

    def change_lock(state, **kwargs):
        if state == "absent":
            released.append(runner.apps_done.is_set())
        return release(state, **kwargs)

    monkeypatch.setattr(node_lock, "change_lock", change_lock)
    args = params(tmp_path, vmid=200, steps={"gpu_processes": {}})
    result = run_module(target_facts, args, runner, monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "probe")
    assert released == [True]  # released once, after the node query had finished
    assert list(tmp_path.iterdir()) == []


def test_a_node_read_that_runs_a_command_nobody_expected_fails_the_test_harness(tmp_path, monkeypatch, capsys):
    """The harness itself: a call from the node-read thread that matches no expected call is never lost, even
    when the step's facts are never looked at (here preflight fails, so gpu_processes' read is not evaluated)."""
    NodeProcesses(monkeypatch, {})
    runner = FakeRunner(
        probe_call({"preflight": ANCHORS["payload"]}, {}, rc=1, stdout="", stderr="Segmentation fault"),
    )
    args = params(tmp_path, vmid=200, steps={"gpu_processes": {}})
    with pytest.raises(AssertionError, match="unexpected calls from other threads"):
        run_module(target_facts, args, runner, monkeypatch, capsys)


def test_another_runs_lock_fails_before_anything_is_read(tmp_path, monkeypatch, capsys):
    node_lock.change_lock("present", lock_dir=str(tmp_path), vmid=200, run_id="other", owner="bob@ctl")
    result = run_module(target_facts, params(tmp_path, vmid=200), FakeRunner(), monkeypatch, capsys)
    assert result["failed"]
    assert result["error"] == "locked"
    assert result["msg"].startswith("CT 200 is locked by run other of bob@ctl")
    assert json.loads((tmp_path / "ct-200.lock").read_text())["run_id"] == "other"


def test_a_probe_that_fails_after_the_lock_was_taken_releases_it(tmp_path, monkeypatch, capsys):
    runner = FakeRunner(probe_call({"preflight": ANCHORS["payload"]}, {}, rc=1, stdout="", stderr="Segmentation fault"))
    result = run_module(target_facts, params(tmp_path, vmid=200), runner, monkeypatch, capsys)
    assert result["failed"]
    assert result["error"] == "probe"
    assert "Segmentation fault" in result["msg"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (
            {"training_wheels": {}},
            "unknown step(s) training_wheels; the steps are preflight, gpu_processes, training_code, training_venv, "
            "compile_cache",
        ),
        (
            {"gpu_processes": {"poll_interval": 0}},
            "settings of step gpu_processes: poll_interval must be more than 0 seconds, got 0",
        ),
        ({"gpu_processes": {"grace": "soon"}}, "settings of step gpu_processes: argument 'grace' is of type"),
        (
            {"preflight": {"min_free": 1}},
            "settings of step preflight: unknown setting(s) min_free; known: expected_gpu_count,",
        ),
    ],
)
def test_wrong_step_settings_fail_before_any_call_or_lock(steps, message, tmp_path, monkeypatch, capsys):
    result = run_module(target_facts, params(tmp_path, vmid=200, steps=steps), FakeRunner(), monkeypatch, capsys)
    assert result["failed"]
    assert result["msg"].startswith(message)
    assert list(tmp_path.iterdir()) == []


def test_the_lock_records_the_controller_so_a_later_run_can_tell_why_it_holds(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {516: TRAIN})
    runner = two_step_runner(apps(f"516, python3, 20000 MiB, {UUID0}"))
    args = params(tmp_path, vmid=200, steps={"gpu_processes": {}}, controller="laptop", controller_pid=4242)
    run_module(target_facts, args, runner, monkeypatch, capsys)
    held = json.loads((tmp_path / "ct-200.lock").read_text())
    assert (held["controller"], held["controller_pid"], held["owner"]) == ("laptop", 4242, "alice@ctl")
    # Another run meets it: who holds it, from where, and why it still holds.
    other = run_module(target_facts, dict(args, run_id="run-2"), FakeRunner(), monkeypatch, capsys)
    assert "controller laptop pid 4242" in other["msg"]
    assert "if that run was cut off (its node unreachable, its controller laptop gone)" in other["msg"]


def loaded_by(call):
    """The module_utils that ``call`` (Python, on ``step_registry``) imports, in a fresh interpreter."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from tests.conftest import ROOT  # noqa: PLC0415

    script = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'collections')!r});"
        "from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry;"
        f"{call};"
        "prefix = 'ansible_collections.pve_gpu.recover.plugins.module_utils.';"
        "print(' '.join(sorted(m[len(prefix):] for m in sys.modules if m.startswith(prefix))))"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()


def test_the_pass_imports_only_the_steps_it_reads():
    # Every import is paid on the node on every run: steps that are off must not be imported at all.
    loaded = loaded_by("step_registry.validate_specs({'gpu_processes': {}})")
    gpu = [m for m in loaded if m.startswith("steps.gpu_processes.")]
    # The step's fact-pass modules; its acting half (acting, ending) is the gpu_processes module's alone.
    assert gpu == [f"steps.gpu_processes.{m}" for m in ("facts", "guard", "messages", "plan", "probe")], loaded
    assert "steps.preflight.facts" in loaded, loaded
    for off in ("compile_cache", "training_code", "training_venv", "verify"):
        assert not any(m.startswith(f"steps.{off}.") for m in loaded), loaded


def test_the_steps_after_the_gpu_step_import_only_its_handoff():
    # The venv, code and cache steps read the pids the GPU step ends: with the GPU step off, that costs one small
    # module, not the step.
    loaded = loaded_by("step_registry.steps_in(dict.fromkeys(['training_code', 'training_venv', 'compile_cache']))")
    assert [m for m in loaded if m.startswith("steps.gpu_processes.")] == ["steps.gpu_processes.handoff"], loaded
    assert "node.process_job" not in loaded, loaded  # the GPU step's rules for a holder's job


def test_fail_on_problems_false_returns_the_facts_without_failing(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {777: NEIGHBOUR})
    runner = two_step_runner(apps(f"777, python3, 3000 MiB, {UUID0}"))
    args = params(tmp_path, vmid=200, steps={"gpu_processes": {}}, fail_on_problems=False)
    result = run_module(target_facts, args, runner, monkeypatch, capsys)
    assert not result.get("failed")
    assert facts_of(result)["problems"][0].startswith("CT 200 on pve1: cannot free its GPUs: pid 777")


@pytest.mark.parametrize(
    "modes",
    [(False, False, False), (False, True, True), (True, False, True)],
    ids=["real-run", "check-run-task-forced-real", "module-check-mode"],
)
def test_a_check_run_is_planned_as_one_although_the_task_runs_for_real(modes, tmp_path, monkeypatch, capsys):
    check_mode, check_run, planned_as_check = modes
    # The fact pass task runs with check_mode false (it takes the lock); check_run tells it the run is a --check,
    # so that verify does not import torch after changes a check run only planned (seen on the H200: it failed
    # on a stray holder's memory that gpu_processes had only planned to free).
    seen = {}

    def fake_fact_pass(target, specs, *, lock, python, check_mode, warn, shared):
        seen["check_mode"] = check_mode
        return {"pending": [], "problems": [], "lock": {"held": False}}

    monkeypatch.setattr(target_facts, "fact_pass", fake_fact_pass)
    args = params(tmp_path, vmid=200, check_run=check_run)
    run_module(target_facts, args, FakeRunner(), monkeypatch, capsys, check_mode=check_mode)
    assert seen["check_mode"] is planned_as_check


# -- batch: the targets of one node in one execution (the action's per_node) -----------------------------------------
def probe_of(vmid, rc=0, stderr=""):
    """CT ``vmid``'s one probe, healthy or failing with ``rc`` and ``stderr``."""
    argv = [str(vmid) if a == "200" else a for a in ANCHORS["probe_argv"]]
    out = json.dumps({"preflight": {"answer": ANCHORS["healthy"]}}) if rc == 0 else ""
    return [*argv, json.dumps({"preflight": ANCHORS["payload"]})], (rc, out, stderr)


def test_a_batch_reads_each_target_once_side_by_side_and_each_keeps_its_own_result(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    stopped = probe_of(202, rc=255, stderr="container '202' not running!\n")
    runner = FakeRunner(probe_of(200), probe_of(201), stopped, probe_of(203))
    batch = [
        params(tmp_path, vmid=201, run_id="run-1", owner="bob@ctl"),
        params(tmp_path, vmid=202),
        params(tmp_path, vmid=203, steps={"nope": {}}),  # its own mistake: fails alone, before any call of its own
        params(tmp_path, vmid=203),
    ]
    result = run_module(target_facts, params(tmp_path, vmid=200, batch=batch), runner, monkeypatch, capsys)
    assert result["changed"] is False and not result.get("failed")
    assert facts_of(result)["target"]["vmid"] == 200
    first, stopped_one, wrong, last = result["batch"]
    assert facts_of(first)["target"]["label"] == "CT 201 on pve1"
    assert facts_of(first)["lock"]["who"]["owner"] == "bob@ctl"  # each item's own options
    assert (stopped_one["failed"], stopped_one["error"]) == (True, "stopped")
    assert stopped_one["msg"].startswith("CT 202 on pve1 is not running")
    assert (wrong["failed"], wrong["error"]) == (True, "invalid_step")
    assert facts_of(last)["target"]["vmid"] == 203 and not last.get("failed")
    assert all(item["changed"] is False for item in result["batch"])


def test_a_batch_item_with_wrong_options_fails_alone(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    runner = FakeRunner(probe_of(200))
    batch = [
        {"vmid": "two hundred", "run_id": "run-1"},  # a wrong type
        {"vmid": 201},  # no run_id, and none named as the task's
        {"vmid": 202, "same_as_task": ["run_id", "nope"]},  # names an option the task does not have
        {"vmid": 203, "same_as_task": "run_id"},  # not a list
    ]
    result = run_module(target_facts, params(tmp_path, vmid=200, batch=batch), runner, monkeypatch, capsys)
    assert not result.get("failed")
    assert [item["error"] for item in result["batch"]] == ["invalid"] * 4
    for said, item in zip(("vmid", "run_id", "same_as_task", "same_as_task"), result["batch"], strict=True):
        assert said in item["msg"], item["msg"]


def test_a_batch_item_takes_the_options_it_names_from_the_task_and_defaults_for_the_rest(tmp_path, monkeypatch, capsys):
    """The action sends of each other target only what differs from the task's own options and names the rest
    (a hashed lock that every target shares travels once). An option a target left out is not the task's: it has
    its default, as in that target's own task."""
    node_version(monkeypatch, NODE_VERSION)
    runner = FakeRunner(probe_of(200), probe_of(201), probe_of(202), probe_of(203))
    batch = [
        {"vmid": 201, "same_as_task": ["run_id", "owner", "lock_dir"]},
        {"vmid": 202, "owner": "bob@ctl", "same_as_task": ["run_id", "lock_dir"]},
        {"vmid": 203, "same_as_task": ["run_id", "lock_dir"]},  # its task left the owner out
    ]
    result = run_module(target_facts, params(tmp_path, vmid=200, batch=batch), runner, monkeypatch, capsys)
    read = [facts_of(item) for item in result["batch"]]
    assert [(f["target"]["vmid"], f["lock"]["who"]["owner"]) for f in read] == [
        (201, "alice@ctl"),  # the task's, named
        (202, "bob@ctl"),  # its own
        (203, "unknown"),  # the option's default, not the task's
    ]
    assert {f["run_id"] for f in read} == {"run-1"}
    assert all(Path(f["lock"]["path"]).parent == tmp_path for f in read)  # the task's lock_dir, named


def test_the_invocation_shows_the_tasks_own_options_never_the_batch(tmp_path, monkeypatch, capsys):
    """The batch would come back in the invocation only for the action to drop it, and where the targets' options
    differ (a hashed lock of over 100 KB each), it is most of what a node's execution returns."""
    node_version(monkeypatch, NODE_VERSION)
    # From ansible-core 2.21 the invocation is added only when asked; older versions always add it.
    asks = {"_ansible_inject_invocation": True} if ANSIBLE_CORE >= (2, 21) else {}
    args = params(tmp_path, vmid=200, batch=[{"vmid": 201, "same_as_task": ["run_id", "owner", "lock_dir"]}], **asks)
    result = run_module(target_facts, args, FakeRunner(probe_of(200), probe_of(201)), monkeypatch, capsys)
    echoed = result["invocation"]["module_args"]
    assert "batch" not in echoed and (echoed["vmid"], echoed["owner"]) == (200, "alice@ctl")
    assert facts_of(result["batch"][0])["target"]["vmid"] == 201


def test_the_tasks_own_failure_still_returns_every_batch_result(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    runner = FakeRunner(probe_of(200, rc=255, stderr="container '200' not running!\n"), probe_of(201))
    args = params(tmp_path, vmid=200, batch=[params(tmp_path, vmid=201)])
    result = run_module(target_facts, args, runner, monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "stopped")
    assert facts_of(result["batch"][0])["target"]["vmid"] == 201 and not result["batch"][0].get("failed")


def test_batch_passes_run_side_by_side(tmp_path, monkeypatch, capsys):
    """Four targets' probes all run at once (a barrier of four that one at a time would never pass)."""
    node_version(monkeypatch, NODE_VERSION)
    barrier = threading.Barrier(4, timeout=5)

    class Meeting(FakeRunner):
        def __call__(self, argv, **kwargs):
            barrier.wait()  # every probe is running at once, or this times out and fails the test
            return super().__call__(argv, **kwargs)

    runner = Meeting(*(probe_of(vmid) for vmid in (200, 201, 202, 203)))
    batch = [params(tmp_path, vmid=vmid) for vmid in (201, 202, 203)]
    result = run_module(target_facts, params(tmp_path, vmid=200, batch=batch), runner, monkeypatch, capsys)
    assert [facts_of(r)["target"]["vmid"] for r in [result, *result["batch"]]] == [200, 201, 202, 203]


def test_without_a_batch_the_result_has_no_batch_key(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    result = run_module(target_facts, params(tmp_path, vmid=200), FakeRunner(probe_of(200)), monkeypatch, capsys)
    assert "batch" not in result and facts_of(result)["target"]["vmid"] == 200


def test_a_batch_reads_the_nodes_gpu_processes_once_and_each_target_judges_them_as_its_own(
    tmp_path, monkeypatch, capsys
):
    """Four CTs of one node, one execution: ONE nvidia-smi query of the node's compute processes and ONE walk of
    its processes' owners (the runner allows a single query; a second would fail it), and each CT reads that
    answer as its own: CT 200's training process is its work, the same process a neighbour on the GPUs of the
    others (this fake gives every CT the same two GPUs)."""
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {516: TRAIN})
    walks = []
    monkeypatch.setattr(gpu_facts, "process_owners", lambda: walks.append(1) or {516: "ct:200"})
    runner = FakeRunner(
        *(probe_of(vmid) for vmid in (200, 201, 202, 203)),
        (APPS_ARGV, (0, apps(f"516, python3, 20000 MiB, {UUID0}"), "")),
    )
    steps = {"preflight": {"expected_gpu_count": 2}, "gpu_processes": {}}
    batch = [params(tmp_path, vmid=vmid, steps=steps) for vmid in (201, 202, 203)]
    result = run_module(target_facts, params(tmp_path, vmid=200, steps=steps, batch=batch), runner, monkeypatch, capsys)
    assert walks == [1]
    own = facts_of(result)
    assert own["pending"] == ["gpu_processes"] and own["problems"] == []
    assert own["gpu_processes"]["changes"] == ["end pid 516 (python3, pid 41 inside) on GPU 0, 20000 MiB"]
    for vmid, other in zip((201, 202, 203), result["batch"], strict=True):
        assert other["failed"] is True and other["error"] == "problems"
        assert other["msg"].startswith(f"CT {vmid} on pve1: cannot free its GPUs: pid 516"), other["msg"]


def test_a_batch_whose_one_node_query_fails_fails_the_step_of_every_target_alike(tmp_path, monkeypatch, capsys):
    node_version(monkeypatch, NODE_VERSION)
    NodeProcesses(monkeypatch, {})
    runner = FakeRunner(
        *(probe_of(vmid) for vmid in (200, 201)),
        (APPS_ARGV, (9, "", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")),
    )
    steps = {"preflight": {"expected_gpu_count": 2}, "gpu_processes": {}}
    args = params(tmp_path, vmid=200, steps=steps, batch=[params(tmp_path, vmid=201, steps=steps)])
    result = run_module(target_facts, args, runner, monkeypatch, capsys)
    for vmid, each in ((200, result), (201, result["batch"][0])):
        assert each["failed"] is True
        assert each["msg"].startswith(f"CT {vmid} on pve1: the gpu_processes facts could not be read"), each["msg"]
        assert each["msg"].endswith("the NVIDIA kernel driver is not loaded (nvidia-smi exit 9)"), each["msg"]


def test_a_pass_that_never_ends_is_named_and_the_others_answer(monkeypatch):
    """Each pass ends within its own deadlines; the module's wait for them is bounded all the same (a pass stuck in
    a bug would otherwise hang the node's module and every target of it)."""
    stuck = threading.Event()
    monkeypatch.setattr(target_facts, "read_target", lambda own, check_mode, shared=None: {"changed": False, "own": 1})
    monkeypatch.setattr(target_facts, "read_batch_item", lambda item, check_mode, shared, own: stuck.wait(60))
    monkeypatch.setattr(target_facts, "node_read_budget", lambda timeout: 0)
    monkeypatch.setattr(target_facts, "KILL_GRACE", 0)
    try:
        own, others = target_facts.read_targets({"timeout": 1}, [{"vmid": 201}], False)
    finally:
        stuck.set()
    assert own == {"changed": False, "own": 1}
    assert [(o["failed"], o["error"]) for o in others] == [(True, "wedged")]
    assert "gave no answer within 1 s" in others[0]["msg"]
