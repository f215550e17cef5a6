"""library/step_job_status.py: a long step's status call, on real status files as async_wrapper writes them: it
waits on the node until the job ends (seen within a tick) or its wait passes, answers as async_status does and
removes a finished job's file."""

import json
import os
import threading
import time

import pytest
import step_job_status
from ansible.module_utils.testing import patch_module_args
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import progress as node_progress

from tests.fakes import assert_documented

JID = "j955916282008.11713"
PROGRESS = {"step": "training_venv", "phase": "installing the lock with `uv pip sync`", "line": "Downloading torch"}


def call(args, capsys):
    started = time.monotonic()
    with patch_module_args(args), pytest.raises(SystemExit):
        step_job_status.main()
    return json.loads(capsys.readouterr().out), time.monotonic() - started


def jwrite(path, status):
    """As async_wrapper writes its status: a .tmp file renamed over the job's."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(status))
    os.rename(temp, path)


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "async" / JID
    path.parent.mkdir()
    jwrite(path, {"started": True, "finished": False, "ansible_job_id": JID, node_progress.KEY: PROGRESS})
    return path


def test_a_running_job_answers_its_progress_after_the_wait(job, capsys):
    result, seconds = call({"jid": JID, "wait": 0.3, "async_dir": str(job.parent)}, capsys)
    running = {"changed": False, "started": True, "finished": False, "ansible_job_id": JID, node_progress.KEY: PROGRESS}
    assert {k: v for k, v in result.items() if k != "invocation"} == running
    assert 0.3 <= seconds < 2
    assert job.exists()
    assert_documented(step_job_status, result)


def test_a_job_that_ends_while_the_call_waits_is_seen_at_once_and_its_file_removed(job, capsys):
    answer = {"changed": True, "changes": ["torch 2.11.0+cu130 -> 2.11.0+cu128"], "invocation": {"module_args": {}}}
    timer = threading.Timer(0.3, jwrite, (job, answer))
    timer.start()
    try:
        result, seconds = call({"jid": JID, "wait": 30, "async_dir": str(job.parent)}, capsys)
    finally:
        timer.cancel()
    # The module's own answer, as async_status reads it, under `job`: its invocation is the module's, not the call's.
    assert (result["finished"], result["ansible_job_id"], result["job"]) == (True, JID, answer)
    assert seconds < 0.3 + node_progress.TICK + 0.5, seconds  # not the 30 s it was willing to wait
    assert not job.exists()
    assert_documented(step_job_status, result)


@pytest.mark.parametrize(
    "answer",
    [
        {"msg": "Timeout exceeded", "failed": True, "child_pid": 4242},  # async_wrapper killed the module
        {"failed": True, "msg": "building the venv failed", "started": True, "finished": True},
    ],
)
def test_a_finished_job_answers_at_once_whatever_it_says(job, capsys, answer):
    jwrite(job, answer)
    result, seconds = call({"jid": JID, "wait": 30, "async_dir": str(job.parent)}, capsys)
    assert (result["finished"], result["job"]) == (True, answer) and not result.get("failed")
    assert seconds < 1 and not job.exists()


def test_a_status_being_written_reads_as_running(job, capsys):
    job.write_text('{"started": tr')  # half a status (a writer that does not rename): async_status's "running"
    result, _ = call({"jid": JID, "wait": 0, "async_dir": str(job.parent)}, capsys)
    assert (result["started"], result["finished"], "job" in result) == (True, False, False)


def test_no_such_job_fails_naming_it(tmp_path, capsys):
    result, _ = call({"jid": JID, "wait": 0.1, "async_dir": str(tmp_path)}, capsys)
    assert result["failed"] and result["finished"]
    assert result["msg"] == f"could not find job {JID} in {tmp_path / JID}"


@pytest.mark.parametrize("jid", ["../../etc/passwd", "j1", "j1.2/../x", ""])
def test_a_job_id_async_wrapper_never_gives_is_refused_before_any_path_is_read(tmp_path, capsys, jid):
    result, _ = call({"jid": jid, "wait": 5, "async_dir": str(tmp_path)}, capsys)
    assert result["failed"] and "is not one async_wrapper gives" in result["msg"]
