"""drift/playbook.py, a long step's progress in the journal: which of ansible-runner's events carry it (the line a
step's action prints, a verbose event of that step's task; Ansible's own poll of a playbook that polls the module),
and a real ansible-runner run of the venv role whose build the action follows, its lines picked from the events."""

import tempfile

import pytest

from drift.playbook import progress_line
from tests.unit.roles.test_step_progress_cost import REBUILD, make_project

TASK = {"task": "Build the venv", "task_action": "pve_gpu.recover.training_venv"}
LINE = "train200: training_venv: installing the lock with `uv pip sync` (4m12s): Downloading torch (846.0MiB)"


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        ({"event": "verbose", "stdout": LINE, "event_data": dict(TASK, resolved_action=TASK["task_action"])}, LINE),
        ({"event": "verbose", "stdout": LINE, "event_data": TASK}, LINE),  # a core that does not resolve it
        # The report callback's own last line, a warning, a line naming another step: not progress.
        ({"event": "verbose", "stdout": "train200: failed, report /r/train200/x.json", "event_data": {}}, ""),
        ({"event": "verbose", "stdout": "[WARNING]: train200: training_venv: x", "event_data": TASK}, ""),
        ({"event": "verbose", "stdout": LINE.replace(": training_venv:", ": compile_cache:"), "event_data": TASK}, ""),
        ({"event": "verbose", "stdout": LINE, "event_data": {"task_action": "ansible.builtin.debug"}}, ""),
        ({"event": "runner_on_ok", "stdout": LINE, "event_data": TASK}, ""),
        # A line is one line in the journal, whatever was printed.
        ({"event": "verbose", "stdout": LINE + "\nforged", "event_data": TASK}, LINE + "\\nforged"),
    ],
)
def test_which_events_carry_a_long_steps_progress(event, expected):
    assert progress_line(event) == expected


def test_ansible_polls_of_a_playbook_that_polls_the_module_itself():
    progress = {"step": "compile_cache", "phase": "warming up", "line": "layer 3/40\x1b[2J", "elapsed_seconds": 75}
    event = {
        "event": "runner_on_async_poll",
        "event_data": {"host": "train200", "res": {"pve_gpu_recover_progress": progress}},
    }
    assert progress_line(event) == "train200: compile_cache: warming up (1m15s): layer 3/40\\x1b[2J"
    assert progress_line({"event": "runner_on_async_poll", "event_data": {"host": "x", "res": {"finished": 0}}}) == ""


def test_a_real_run_through_ansible_runner_gives_the_actions_lines_as_events(tmp_path):
    ansible_runner = pytest.importorskip("ansible_runner")
    play, inventory, env = make_project(tmp_path, REBUILD, uv_seconds=4, training_venv_progress_interval=1)
    env.pop("ANSIBLE_CALLBACKS_ENABLED")  # the counting callback is the other tests'
    lines = []
    with tempfile.TemporaryDirectory() as private:
        done = ansible_runner.run(
            private_data_dir=private,
            project_dir=str(play.parent),
            playbook=str(play),
            inventory=str(inventory),
            envvars={key: value for key, value in env.items() if key.startswith(("ANSIBLE_", "PVE_GPU_", "PATH"))},
            quiet=True,
            event_handler=lambda event: lines.append(progress_line(event)) or True,
            settings={"pexpect_timeout": 1, "suppress_ansible_output": True},
        )
    assert (done.status, done.rc) == ("failed", 2)  # the stand-in uv fails the build in the end
    lines = [line for line in lines if line]
    assert len(lines) >= 2, lines
    assert all(line.startswith("target: training_venv: ") for line in lines), lines
    assert any("installing the lock with `uv pip sync` (" in line and "Downloading torch" in line for line in lines)
