"""plugins/plugin_utils/long_step.py: when the action follows a job itself, and its loop of status calls (a fake
connection's answers, a fake clock): one progress line per call that finds the job running, the module's answer
as the result, a node that did not answer tried again sooner than the interval, the time limit kept. Real runs of
the action through ansible-playbook: tests/unit/roles/test_step_progress_cost.py."""

import importlib
import types

import pytest


@pytest.fixture(scope="module")
def long_step():
    """Imported only when these tests run: Ansible's action machinery changes how AnsibleModule's warnings reach
    the module tests that run in the same process (tests/unit/plugins/action/test_target_facts.py)."""
    return importlib.import_module("ansible_collections.pve_gpu.recover.plugins.plugin_utils.long_step")


def task(async_val=2130, poll=0):
    return types.SimpleNamespace(async_val=async_val, poll=poll, action="pve_gpu.recover.training_venv")


@pytest.mark.parametrize(
    ("async_val", "poll", "value", "expected"),
    [
        (2130, 0, "15", 15.0),  # the roles' real rebuild
        (2130, 0, 1, 1.0),
        (0, 0, "15", None),  # no async: check mode, pruning alone (one plain call)
        (2130, 10, "15", None),  # a playbook that polls itself: Ansible's polls
        (2130, 0, None, None),  # fire and forget: Ansible's, unchanged
    ],
)
def test_the_action_follows_only_an_async_task_that_asks_for_it(long_step, async_val, poll, value, expected):
    assert long_step.follow_interval(task(async_val, poll), value) == expected


@pytest.mark.parametrize("value", ["0", "0.5", "soon", -3])
def test_an_interval_below_a_second_is_refused_naming_the_variable(long_step, value):
    from ansible.errors import AnsibleActionFail  # noqa: PLC0415

    with pytest.raises(AnsibleActionFail, match=r"pve_gpu_recover_follow is .*: give the progress interval"):
        long_step.follow_interval(task(), value)


class Clock:
    def __init__(self):
        self.now = 0.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def follower(long_step, answers, clock, monkeypatch, async_val=2130):
    """The action with a fake connection: each status call takes the wait it asked for off ``answers`` (a status,
    or an exception to raise) and lets the clock run as the node would have waited."""
    shown = []
    monkeypatch.setattr(long_step.display, "display", lambda text, **kw: shown.append((text, kw)))
    action = object.__new__(long_step.LongStepAction)
    action._task = task(async_val)
    action._connection = types.SimpleNamespace(_shell=types.SimpleNamespace(tmpdir=None))
    action.get_shell_option = lambda name, default=None: default
    action._remove_tmp_path = lambda path: None
    calls = []

    def execute(module_name, module_args, task_vars):
        calls.append((module_name, module_args))
        answer = answers.pop(0)
        clock.now += module_args["wait"] if answer.get("finished") is False else 0.4
        if isinstance(answer.get("raise"), Exception):
            raise answer["raise"]
        return answer

    action._execute_module = execute
    return action, calls, shown


RUNNING = {"started": True, "finished": False, "ansible_job_id": "j1.2"}
PROGRESS = {"step": "training_venv", "phase": "installing the lock with `uv pip sync`", "line": "Downloading torch"}


def test_one_line_per_call_that_finds_the_job_running_then_the_modules_answer(long_step, monkeypatch):
    clock = Clock()
    job = {"changed": True, "changes": ["torch 2.11.0+cu130 -> 2.11.0+cu128"], "invocation": {"module_args": {}}}
    done = {"changed": False, "finished": True, "ansible_job_id": "j1.2", "job": job, "invocation": {"x": 1}}
    answers = [RUNNING, dict(RUNNING, pve_gpu_recover_progress=dict(PROGRESS, elapsed_seconds=252)), done]
    action, calls, shown = follower(long_step, answers, clock, monkeypatch)
    result = action._follow("j1.2", 15.0, {"inventory_hostname": "ct200"}, 0.0, clock=clock, sleep=clock.sleep)
    assert result == dict(job, ansible_job_id="j1.2")  # the module's answer; nothing of the status call's
    assert (
        calls
        == [("pve_gpu.recover.step_job_status", {"jid": "j1.2", "wait": 15.0, "async_dir": "~/.ansible_async"})] * 3
    )
    assert shown == [
        ("ct200: training_venv: running (15s)", {"stderr": True}),  # its module has not said anything yet
        ("ct200: training_venv: installing the lock with `uv pip sync` (4m12s): Downloading torch", {"stderr": True}),
    ]
    assert clock.slept == []  # the waiting is the node's, never the controller's


def test_a_failed_status_call_is_the_result(long_step, monkeypatch):
    clock = Clock()
    gone = {"failed": True, "finished": True, "msg": "could not find job j1.2 in /root/.ansible_async/j1.2"}
    action, _, shown = follower(long_step, [gone], clock, monkeypatch)
    result = action._follow("j1.2", 15.0, {"inventory_hostname": "ct200"}, 0.0, clock=clock, sleep=clock.sleep)
    assert result == dict(
        gone,
        msg="ct200: training_venv: could not find job j1.2 in /root/.ansible_async/j1.2; run again to see what the "
        "step did",
    )
    assert shown == []


def test_a_node_that_does_not_answer_is_asked_again_sooner_and_sooner_is_not_waited_for(long_step, monkeypatch):
    from ansible.errors import AnsibleConnectionFailure  # noqa: PLC0415

    clock = Clock()
    dropped = {"raise": AnsibleConnectionFailure("ssh: connection reset")}
    done = {"finished": True, "job": {"changed": False}}
    action, calls, _ = follower(long_step, [dropped, dropped, dropped, RUNNING, dropped, done], clock, monkeypatch)
    assert action._follow("j1.2", 1.0, {}, 0.0, clock=clock, sleep=clock.sleep) == {
        "changed": False,
        "ansible_job_id": "j1.2",
    }
    assert len(calls) == 6
    assert clock.slept == [0.25, 0.5, 1.0, 0.25]  # doubling up to the interval, from the start again after an answer


def test_a_job_that_outlives_its_time_limit_fails_naming_it(long_step, monkeypatch):
    clock = Clock()
    action, calls, shown = follower(long_step, [RUNNING] * 10, clock, monkeypatch, async_val=40)
    result = action._follow("j1.2", 15.0, {"inventory_hostname": "ct200"}, 0.0, clock=clock, sleep=clock.sleep)
    assert result["failed"] and result["ansible_job_id"] == "j1.2"
    assert result["msg"] == (
        "ct200: training_venv's job j1.2 did not answer within the task's async time limit (40 s), though "
        "async_wrapper ends it then; look at its status file in ~/.ansible_async on the node and at its processes "
        "there before running again"
    )
    # Waits of the interval until the limit (40 s) and one more interval for async_wrapper's own answer, the last
    # cut to what is left.
    assert [args["wait"] for _, args in calls] == [15.0, 15.0, 15.0, 10.0] and len(shown) == 4
