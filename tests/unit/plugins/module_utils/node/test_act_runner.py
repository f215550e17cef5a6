"""plugins/module_utils/node/act_runner.py: the acting modules' one runner.

The sequence on a stand-in step (every hook records that it ran): options, read, problems, check mode, act, prove,
result, verdict, and the failure's shape; then the five acting modules against it: each is its docs, its argument
spec and a step, the runner's copies are gone, and a stopped CT is named once in every module's message.
"""

import ast
import inspect
import json
import socket
from types import SimpleNamespace

import compile_cache
import gpu_processes
import pytest
import training_code
import training_venv
import verify
from ansible.module_utils.testing import patch_module_args
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import act_runner
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import (
    ActingStep,
    Run,
    leftover,
    run_step,
    wrong_option,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.command import CommandResult
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target, TargetError

from tests.fakes import assert_documented

ACTING = [gpu_processes, training_code, training_venv, compile_cache, verify]


class DemoError(RecoverError):
    pass


DEMO_FACTS = SimpleNamespace(
    NAME="demo",
    SPEC={"size": {"type": "int", "default": 1}},
    check_spec=lambda spec: "size is 0; give at least 1" if spec["size"] == 0 else "",
)


class Demo(ActingStep):
    """A step whose hooks record what ran; ``facts``: the first read's, ``after``: the re-read's."""

    facts = DEMO_FACTS
    error = DemoError
    at_least = {"wait": (1, "give the wait at least 1 second")}

    def __init__(self, before, after=None, verdict=""):
        self.before, self.after, self.why, self.ran = before, after, verdict, []

    def read(self, run):
        self.ran.append("read")
        return self.before

    def act(self, run, before):
        self.ran.append("act")
        return {"did": "it"}, self.after

    def prove(self, run, after, done):
        self.ran.append("prove")
        return (
            ("still out: " + "; ".join(leftover(after)), {"left": len(leftover(after))})
            if leftover(after)
            else (
                "",
                {},
            )
        )

    def result(self, run, before, after, done):
        return {"done": done, "after": (after or {}).get("changes")}

    def verdict(self, run, before, result):
        self.ran.append("verdict")
        return self.why


def facts(pending=True, changes=("grow demo",), problems=(), diff=None):
    return {"pending": pending, "changes": list(changes), "problems": list(problems), "diff": diff}


def execute(step, check_mode=False, **params):
    module = SimpleNamespace(
        params={"vmid": None, "node_name": "gpu1", "timeout": 60, "size": 1, "wait": 5, **params},
        check_mode=check_mode,
        warn=lambda message: None,
    )
    run = Run(module, step)
    return run_step(step, run, act_runner.time.monotonic()), run


def test_check_mode_reads_and_evaluates_exactly_as_a_real_run_and_stops_there():
    step = Demo(facts(diff={"before": "a\n", "after": "b\n"}))
    result, run = execute(step, check_mode=True)
    assert step.ran == ["read", "verdict"]
    assert run.target.label == "host gpu1"
    assert (result["changed"], result["changes"], result["diff"]) == (
        True,
        ["grow demo"],
        {"before": "a\n", "after": "b\n"},
    )
    assert (result["done"], result["after"]) == (None, None)
    assert isinstance(result["seconds"], float)


def test_a_real_run_with_work_acts_then_proves_and_keeps_the_first_reads_changes():
    step = Demo(facts(), after=facts(pending=False, changes=()))
    result = execute(step)[0]
    assert step.ran == ["read", "act", "prove", "verdict"]
    assert (result["changed"], result["changes"], result["done"], result["after"]) == (
        True,
        ["grow demo"],
        {"did": "it"},
        [],
    )
    assert "diff" not in result  # a step without a diff returns none


def test_a_converged_target_is_read_once_and_nothing_else():
    step = Demo(facts(pending=False, changes=()))
    result = execute(step)[0]
    assert step.ran == ["read", "verdict"]
    assert (result["changed"], result["changes"]) == (False, [])


def test_a_re_read_still_out_of_spec_fails_with_the_kind_verify_and_what_the_step_adds():
    step = Demo(facts(), after=facts(changes=("grow demo",), problems=("demo is broken",)))
    with pytest.raises(DemoError) as caught:
        execute(step)
    assert (str(caught.value), caught.value.kind) == ("still out: demo is broken; grow demo", "verify")
    assert caught.value.details == {"left": 2}


def test_problems_of_the_first_read_fail_before_anything_is_done():
    step = Demo(facts(problems=("CT 200 on pve1: a", "CT 200 on pve1: b")))
    with pytest.raises(DemoError) as caught:
        execute(step)
    assert (str(caught.value), caught.value.kind) == ("CT 200 on pve1: a; CT 200 on pve1: b", "problems")
    assert step.ran == ["read"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"size": 0}, "size is 0; give at least 1; fix the demo_* variable of that name"),
        ({"wait": 0}, "wait is 0; give the wait at least 1 second; fix the demo_* variable of that name"),
    ],
)
def test_an_option_that_cannot_work_fails_before_the_target_is_reached(params, message):
    step = Demo(facts())
    with pytest.raises(DemoError) as caught:
        execute(step, **params)
    assert (str(caught.value), caught.value.kind, step.ran) == (message, "invalid", [])


def test_an_unset_minimum_is_not_checked():
    assert wrong_option(Demo(facts()), {"size": 1, "wait": None}) == ""


def test_a_verdict_fails_with_the_whole_result():
    step = Demo(facts(pending=False, changes=()), verdict="CT 200 on pve1: 7 GPUs, expected 8")
    with pytest.raises(DemoError) as caught:
        execute(step)
    assert (caught.value.kind, caught.value.details["changed"], caught.value.details["changes"]) == (
        "verify",
        False,
        [],
    )
    assert "seconds" in caught.value.details


def test_a_failure_names_the_target_once():
    target = Target(200, node="pve1")
    stopped = TargetError("CT 200 on pve1 is not running (pct: ...)", kind="stopped")
    assert act_runner.failure(stopped, target)["msg"] == "CT 200 on pve1 is not running (pct: ...)"
    assert act_runner.failure(DemoError("no repo", kind="x"), target) == {
        "msg": "CT 200 on pve1: no repo",
        "error": "x",
    }
    assert act_runner.failure(DemoError("bad option", kind="invalid"), None)["msg"] == "bad option"


def test_a_part_that_raised_is_a_probe_error_naming_it():
    parts = {"reset": {"error": "ValueError: x", "seconds": 0.1}, "training_code": {"answer": {}, "seconds": 0.1}}
    assert act_runner.part_answer(parts, "training_code", "CT 200 on pve1") == {}
    with pytest.raises(TargetError) as caught:
        act_runner.part_answer(parts, "reset", "CT 200 on pve1")
    assert (str(caught.value), caught.value.kind) == ("CT 200 on pve1: the reset part failed: ValueError: x", "probe")


class ProbeRecorder:
    """A target whose run_probes records what it was called with (an act and its re-read)."""

    label = "CT 200 on pve1"

    def __init__(self):
        self.calls = []

    def run_probes(self, parts, **kwargs):
        self.calls.append((parts, kwargs))
        return {name: {"answer": {}, "seconds": 0.0} for name in parts}


@pytest.mark.parametrize("job_file", [True, False], ids=["async job", "plain call"])
def test_a_long_steps_act_is_followed_only_when_it_runs_as_an_async_job(tmp_path, monkeypatch, job_file):
    """The progress hook lives in the runner once: a step that names its first phase (``progress``) gets its
    script's progress into the job's status file while it acts; a plain call, or a step without ``progress``, runs
    the act exactly as before (no reader, nothing asked of the script)."""
    status = tmp_path / "j1.2"
    status.write_text(json.dumps({"started": 1, "finished": 0, "ansible_job_id": "j1.2"}))
    monkeypatch.setattr(act_runner.node_progress, "async_job_file", lambda: str(status) if job_file else None)
    module = SimpleNamespace(params={"size": 1}, check_mode=False, warn=lambda message: None)
    for long_step, progress in ((True, "starting the demo"), (False, None)):
        step = Demo(facts())
        step.progress = progress
        run = Run(module, step)
        run.target, run.read_part = ProbeRecorder(), ("reader", {"path": "/x"})
        payload = {"size": 1}
        run.act_and_reread("act", "script", payload, 30)
        ((parts, kwargs),) = run.target.calls
        assert parts == {"act": ("script", payload), "demo": ("reader", {"path": "/x"})}
        followed = long_step and job_file
        assert ("on_output" in kwargs, payload.get("progress")) == (followed, True if followed else None)
        if followed:
            told = json.loads(status.read_text())["pve_gpu_recover_progress"]
            assert (told["step"], told["target"], told["phase"]) == ("demo", "CT 200 on pve1", "starting the demo")
    assert (training_venv.TrainingVenv.progress, compile_cache.CompileCache.progress) == (
        "starting the build",
        "starting the purge and warm-up",
    )
    assert [m.__name__ for m in ACTING if getattr(module_step(m), "progress", None)] == [
        "training_venv",
        "compile_cache",
    ]


def module_step(module):
    """The ActingStep class of an acting module."""
    return next(
        v for v in vars(module).values() if isinstance(v, type) and issubclass(v, ActingStep) and v is not ActingStep
    )


def test_a_stamp_sorts_by_time():
    assert len(act_runner.utc_stamp()) == len("20261203T101500Z")
    assert act_runner.utc_stamp().endswith("Z")


# -- the five acting modules ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ACTING, ids=[m.__name__ for m in ACTING])
def test_each_acting_module_is_its_docs_its_spec_and_a_step(module):
    """library/<step>.py is its documentation, its argument spec and main(): the runner on the step's ActingStep,
    which lives in the step's package (steps/<step>/acting.py) with the rest of its logic."""
    tree = ast.parse(inspect.getsource(module))
    functions = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert functions == ["main"]
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    (call,) = main.body
    step_class = call.value.args[0].func.id
    assert ast.unparse(call) == f"run_step_module({step_class}(ARGUMENT_SPEC))"
    where = getattr(module, step_class).__module__
    assert where.endswith(f".steps.{module.__name__}.acting"), where
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not names & {"AnsibleModule", "fail_json", "exit_json"}  # only the runner builds, fails and exits
    assert getattr(module, step_class)(module.ARGUMENT_SPEC).argument_spec is module.ARGUMENT_SPEC


class Stopped:
    """Every command finds the CT stopped, as pct answers it."""

    def __call__(self, argv, *, stdin=None, timeout=None, env=None):
        return CommandResult(argv, 255, "", "container '200' not running!\n", 0.01, False)

    def assert_done(self):
        pass


CT_PARAMS = {
    training_code: {"vmid": 200, "commit": "4f3c2a1b0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b"},
    training_venv: {"vmid": 200, "lock": "six==1.17.0 --hash=sha256:" + "a" * 64 + "\n"},
    compile_cache: {"vmid": 200},
    verify: {"vmid": 200},
}


@pytest.mark.parametrize("module", list(CT_PARAMS), ids=[m.__name__ for m in CT_PARAMS])
def test_a_stopped_ct_is_named_once_with_its_error_kind(module, monkeypatch, capsys):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    monkeypatch.setattr(node_target, "run_local", Stopped())
    with patch_module_args(CT_PARAMS[module]), pytest.raises(SystemExit):
        module.main()
    result = json.loads(capsys.readouterr().out)
    assert_documented(module, result)
    assert (result["failed"], result["error"]) == (True, "stopped")
    assert result["msg"].startswith("CT 200 on pve1 is not running (pct: container '200' not running!)")
