"""drift/runner.py: the summary from recover_report's reports and ansible-runner's events, the exit code, the
atomic write, the lock, the CLI's errors, and main() with a stand-in ansible-runner (the textfile's families:
test_metrics.py)."""

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from drift import metrics
from tests.conftest import ROOT
from tests.unit.drift.conftest import (
    RUN_ID,
    FakeAnsibleRunner,
    event,
    fact_pass,
    make_report,
    parse_exposition,
    probe_events,
    project_with_unattended,
    run_main,
    step_facts,
    summary_of,
    write_report,
)

RUNNER = ROOT / "drift" / "runner.py"
CT_STOPPED = "CT 200 on pve1: container '200' not running (pct status: stopped); start it: pct start 200"
UNREACHABLE = (
    "Task failed: Failed to connect to the host via ssh: ssh: connect to host pve1.example.org port 22: "
    "Connection refused"
)


def summarize(runner, tmp_path, reports, events=(), **kwargs):
    """Reports written where the callback writes them, read back by the runner, summarized."""
    for report in reports:
        write_report(tmp_path, report)
    return runner.summarize_phase(runner.load_reports(tmp_path), list(events), **kwargs)


# -- check runs: in spec, each kind of drift, failed, unreachable ------------------------------------------------
def test_a_converged_target_is_in_spec_and_a_step_that_is_off_is_left_out(runner, tmp_path):
    before = fact_pass(gpu_processes=step_facts(processes=[]), training_venv=step_facts())
    targets = summarize(runner, tmp_path, [make_report("train200", before)])
    target = targets["train200"]
    assert (target["status"], target["reason"]) == ("in_spec", None)
    assert target["report"] == str(tmp_path / "train200" / f"{RUN_ID}.json")
    assert (target["run_id"], target["node"], target["vmid"]) == (RUN_ID, "pve1", 200)
    # training_code and compile_cache are off (no facts): not steps of this target.
    assert sorted(target["steps"]) == ["gpu_processes", "preflight", "training_venv"]
    assert target["steps"]["training_venv"] == {
        "drift": False,
        "status": "skipped",
        "changes": [],
        "diff": {},
        "problems": [],
        "needs_window": [],
        "corrected": False,
    }
    assert runner.exit_code(targets) == 0


DRIFT = {
    "gpu_processes": step_facts(
        ["end pid 1193 (python3) on GPU 0, 21090 MiB", "end pid 1194 (python3) on GPU 0, 21090 MiB"],
        processes=[{"pid": 1193, "gpus": [0], "memory_mib": 21090, "name": "python3"}],
    ),
    "training_code": step_facts(["save 1 modified file, then check out 4f3c2a1 (on main at 9e8d7c6)"]),
    "training_venv": step_facts(["torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)"]),
    "compile_cache": step_facts(
        [
            "purge /tmp/torchinductor_root (stamped for torch 2.11.0+cu128, now 2.11.0+cu130; 1.0 MB)",
            "stamp /tmp/torchinductor_root for torch 2.11.0+cu130 (CUDA 13.0), triton 3.6.0, NVIDIA H200",
        ]
    ),
}


@pytest.mark.parametrize("step", sorted(DRIFT))
def test_each_kind_of_drift_names_its_step_and_what_a_run_would_change(runner, tmp_path, step):
    steps = {name: step_facts() for name in DRIFT}
    steps[step] = DRIFT[step]
    targets = summarize(runner, tmp_path, [make_report("train200", fact_pass(**steps))])
    target = targets["train200"]
    assert (target["status"], target["reason"]) == ("drift", f"drift in {step}")
    assert [name for name, entry in target["steps"].items() if entry["drift"]] == [step]
    assert target["steps"][step]["changes"] == DRIFT[step]["changes"]
    assert target["steps"][step]["status"] == "changed"  # the module ran in check mode and said so
    assert runner.exit_code(targets) == 2


def test_the_diff_names_the_exact_item_line_by_line(runner):
    diff = {"before": "HEAD 9e8d7c6\n M model.py\n?? scratch notes.txt\n", "after": "HEAD 4f3c2a1\n"}
    step = runner.summarize_step(step_facts(["save 1 modified file"], diff=diff))
    assert step["diff"] == {
        "before": ["HEAD 9e8d7c6", " M model.py", "?? scratch notes.txt"],
        "after": ["HEAD 4f3c2a1"],
    }
    assert runner.summarize_step(step_facts(diff=None))["diff"] == {}
    # A step in spec carries no diff, even when its facts hold one.
    assert runner.summarize_step(step_facts(diff=diff, pending=False))["diff"] == {}


def test_a_long_diff_keeps_the_lines_that_differ_and_says_how_many_it_left_out(runner):
    freeze = [f"pkg{i:03d}==1.0" for i in range(200)]
    before = "\n".join([*freeze, "torch==2.11.0+cu130", "sglang==0.5.4"]) + "\n"
    after = "\n".join([*freeze, "torch==2.11.0+cu128"]) + "\n"
    step = runner.summarize_step(
        step_facts(["torch 2.11.0+cu130 -> 2.11.0+cu128"], diff={"before": before, "after": after})
    )
    assert step["diff"] == {"before": ["torch==2.11.0+cu130", "sglang==0.5.4"], "after": ["torch==2.11.0+cu128"]}
    extra = {"before": "\n".join(f"x{i}" for i in range(80)), "after": ""}
    lines = runner.diff_lines(extra, limit=50)["before"]
    assert (
        lines[:49] == [f"x{i}" for i in range(49)]
        and lines[49] == "... 31 more lines (the run's report has the whole diff)"
    )


def test_what_a_correction_would_leave_to_a_window_is_drift_too(runner, tmp_path):
    venv = step_facts(
        ["torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)"],
        needs_window=["swap /opt/venvs/train: pid 4242 (python3 train.py) runs from it"],
    )
    target = summarize(runner, tmp_path, [make_report("train200", fact_pass(training_venv=venv))])["train200"]
    assert target["status"] == "drift"
    assert target["reason"] == "drift in training_venv; needs a window: training_venv"
    assert target["needs_window"] == {"training_venv": venv["needs_window"]}


def test_a_hardware_run_report_reads_as_drift(runner, tmp_path):
    """A report the callback wrote on the H200 (docs/hardware): check mode, two processes holding GPU 0."""
    reports = json.loads((ROOT / "docs" / "hardware" / "2026-12-03" / "gpu-reports.json").read_text())
    check = next(r for r in reports if r["check_mode"] and r["status"] == "changed")
    target = summarize(runner, tmp_path, [check])["localhost"]
    assert target["status"] == "drift"
    assert target["steps"]["gpu_processes"]["changes"][0].startswith("end pid 1193 (python3) on GPU 0")
    # The exact items, as --diff shows them: the holders' pids.
    assert target["steps"]["gpu_processes"]["diff"]["before"][0].startswith("pid 1193 (python3) on GPU 0")
    assert target["steps"]["gpu_processes"]["diff"]["after"] == []
    assert not target["steps"]["preflight"]["drift"]


def test_a_fact_pass_problem_fails_the_target_with_the_sentence_and_wins_over_drift(runner, tmp_path):
    stopped = fact_pass(
        preflight=step_facts(problems=[CT_STOPPED]), gpu_processes=step_facts(pending=False, skipped=True)
    )
    error = {"step": "preflight", "task": "preflight : Assert no step found a problem", "msg": CT_STOPPED}
    drifting = fact_pass(gpu_processes=DRIFT["gpu_processes"])
    drifting["target"] = {"label": "CT 201 on pve1", "vmid": 201, "node": "pve1", "hostname": "t2"}
    targets = summarize(
        runner,
        tmp_path,
        [make_report("train200", stopped, error=error, failed_step="preflight"), make_report("train201", drifting)],
    )
    assert targets["train200"]["status"] == "failed"
    assert targets["train200"]["reason"] == f"preflight : Assert no step found a problem: {CT_STOPPED}"
    assert targets["train200"]["steps"]["preflight"]["problems"] == [CT_STOPPED]
    assert targets["train201"]["status"] == "drift"
    assert runner.exit_code(targets) == 1


def test_a_failed_fact_pass_still_names_the_step_it_failed_in(runner, tmp_path):
    error = {"step": "preflight", "task": "preflight : Read what every step needs", "msg": "run lock held by run X"}
    report = make_report("train200", {}, error=error, failed_step="preflight")
    target = summarize(runner, tmp_path, [report])["train200"]
    assert (target["status"], target["reason"]) == (
        "failed",
        "preflight : Read what every step needs: run lock held by run X",
    )
    assert target["steps"]["preflight"]["status"] == "failed"


LOCKED = (
    "CT 200 on pve1 is locked by run 20261203T075500Z-def456 of ops@ctl (started 2026-12-03T07:55:00Z, 5 min ago, "
    "controller ctl pid 4242): another recover run is working on it (that run is still working (its controller pid "
    "4242 lives on this machine)); wait for it to finish or, if you know it is gone, remove "
    "/run/lock/pve-gpu-recover/ct-200.lock on this node"
)
READ_TASK = "preflight : Read what every step needs, holding the run lock"


def locked_result(kind="locked"):
    """target_facts' failed result when another run holds the lock (errors.to_result with the lock's details)."""
    holder = {"run_id": "20261203T075500Z-def456", "owner": "ops@ctl", "created": 1796367300.0, "ttl": 7200}
    return {
        "failed": True,
        "msg": LOCKED,
        "error": kind,
        "lock": {"path": "/run/lock/pve-gpu-recover/ct-200.lock", "holder": holder, "action": "locked"},
    }


def test_a_target_another_run_holds_is_busy_naming_that_run_and_still_fails_the_run(runner, tmp_path):
    error = {"step": "preflight", "task": READ_TASK, "action": "target_facts", "msg": LOCKED, "kind": "locked"}
    report = make_report("train200", {}, error=error, failed_step="preflight")
    events = [
        event("runner_on_start", "train200", task=READ_TASK),
        event("runner_on_failed", "train200", task=READ_TASK, task_action="target_facts", res=locked_result()),
    ]
    targets = summarize(runner, tmp_path, [report, make_report("ok201", fact_pass())], events)
    target = targets["train200"]
    assert (target["status"], target["reason"]) == ("busy", f"{READ_TASK}: {LOCKED}")
    assert "run 20261203T075500Z-def456 of ops@ctl" in target["reason"]
    assert target["held_by"] == "20261203T075500Z-def456"
    assert target["report"] is not None
    assert targets["ok201"]["held_by"] is None
    # Busy is a failure: exit 1, counted under its own status, target_failed 1 (but reached: target_up 1).
    assert runner.exit_code(targets) == 1
    assert runner.count_statuses(targets) == {"in_spec": 1, "drift": 0, "failed": 0, "busy": 1, "unreachable": 0}
    families = parse_exposition(metrics.render_textfile(summary_of(runner, targets))[0])
    failed = {s[0]["target"]: s[1] for s in families["pve_gpu_recover_target_failed"]["samples"]}
    up = {s[0]["target"]: s[1] for s in families["pve_gpu_recover_target_up"]["samples"]}
    assert (failed, up) == ({"train200": 1, "ok201": 0}, {"train200": 1, "ok201": 1})
    lines = runner.human_lines(summary_of(runner, targets) | {"status": "failed", "errors": []})
    assert next(line for line in lines if line.startswith("train200:")).startswith(
        f"train200: busy: {READ_TASK}: CT 200 on pve1 is locked by run"
    )


@pytest.mark.parametrize("kind", ["locked", "busy"])
def test_the_report_alone_says_busy_from_the_error_kind(runner, tmp_path, kind):
    error = {"step": "preflight", "task": READ_TASK, "action": "target_facts", "msg": LOCKED, "kind": kind}
    report = make_report("train200", {}, error=error, failed_step="preflight")
    target = summarize(runner, tmp_path, [report])["train200"]
    assert target["status"] == "busy"
    assert target["held_by"] is None  # only the event carries the lock's holder


def test_a_compile_cache_in_use_is_a_failure_not_another_runs_lock(runner, tmp_path):
    # compile_cache's ActError kind is "busy" too (a live process uses a cache to purge): the target was checked
    # and something on it is wrong, so it is failed, whether the report or only the event says so.
    in_use = "nothing was purged: a live process uses a cache to purge: pid 4242 (python3)"
    error = {"step": "caches", "task": "Purge stale compile caches", "action": "compile_cache", "msg": in_use}
    report = make_report("train200", {}, error=dict(error, kind="busy"), failed_step="caches")
    assert summarize(runner, tmp_path / "a", [report])["train200"]["status"] == "failed"
    res = {"failed": True, "msg": in_use, "error": "busy"}
    events = [event("runner_on_failed", "train200", task=error["task"], task_action="compile_cache", res=res)]
    target = summarize(runner, tmp_path / "b", [], events)["train200"]
    assert (target["status"], target["reason"]) == ("failed", f"Purge stale compile caches: {in_use}")


def test_the_events_alone_say_busy_when_no_report_was_written(runner, tmp_path):
    events = [event("runner_on_failed", "train200", task=READ_TASK, task_action="target_facts", res=locked_result())]
    target = summarize(runner, tmp_path, [], events)["train200"]
    assert (target["status"], target["held_by"]) == ("busy", "20261203T075500Z-def456")
    assert target["reason"] == f"{READ_TASK}: {LOCKED}"


def test_any_other_error_kind_stays_failed_and_unreachable_wins_over_busy(runner, tmp_path):
    error = {"step": "preflight", "task": READ_TASK, "msg": "the lock directory is unsafe", "kind": "unsafe"}
    report = make_report("train200", {}, error=error, failed_step="preflight")
    assert summarize(runner, tmp_path / "a", [report])["train200"]["status"] == "failed"
    locked = make_report("train200", {}, error=dict(error, kind="locked"), failed_step="preflight")
    events = [event("runner_on_unreachable", "train200", task=READ_TASK, res={"msg": UNREACHABLE})]
    assert summarize(runner, tmp_path / "b", [locked], events)["train200"]["status"] == "unreachable"


def test_an_unreachable_target_is_named_from_the_events_alone(runner, tmp_path):
    events = [
        event("runner_on_start", "train200", task="Read what every step needs, holding the run lock"),
        event(
            "runner_on_unreachable",
            "train200",
            task="Read what every step needs, holding the run lock",
            res={"unreachable": True, "msg": UNREACHABLE},
        ),
        event("playbook_on_stats", processed={"train200": 1}, dark={"train200": 1}, failures={}),
    ]
    targets = summarize(runner, tmp_path, [], events)
    assert targets["train200"]["status"] == "unreachable"
    assert targets["train200"]["reason"] == UNREACHABLE
    assert (targets["train200"]["report"], targets["train200"]["steps"]) == (None, {})
    assert runner.exit_code(targets) == 1


def test_unreachable_wins_over_the_report_the_callback_wrote_for_it(runner, tmp_path):
    error = {"step": "preflight", "task": "preflight : Read", "msg": UNREACHABLE}
    report = make_report("train200", {}, error=error, failed_step="preflight")
    events = [event("runner_on_unreachable", "train200", task="Read", res={"msg": UNREACHABLE, "unreachable": True})]
    target = summarize(runner, tmp_path, [report], events)["train200"]
    assert (target["status"], target["reason"]) == ("unreachable", UNREACHABLE)
    assert target["report"] is not None


def test_a_target_that_failed_before_any_step_is_named_with_the_task_and_message(runner, tmp_path):
    events = [
        event("runner_on_start", "train203", task="Name this run"),
        event("runner_on_failed", "train203", task="Check ignored", ignore_errors=True, res={"msg": "ignored"}),
        event("runner_on_failed", "train203", task="Name this run", res={"msg": "boom\n  on two lines"}),
    ]
    target = summarize(runner, tmp_path, [], events)["train203"]
    # One line that shows what was there: the newline escaped, never a second line.
    assert (target["status"], target["reason"]) == ("failed", "Name this run: boom\\n  on two lines")


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        ("timeout", "the run timed out after 600 s before train200's report was written"),
        ("canceled", "the run was canceled (SIGTERM or SIGINT) before train200's report was written"),
        ("failed", "no report was written for train200 (the run's log: /x/check.log)"),
    ],
)
def test_a_run_cut_off_before_the_reports_fails_each_target_it_started(runner, tmp_path, status, reason):
    events = [event("runner_on_start", "train200", task="Read")]
    targets = summarize(runner, tmp_path, [], events, run_status=status, timeout=600, log="/x/check.log")
    assert targets["train200"] == dict(targets["train200"], status="failed", reason=reason)


def test_an_unreadable_report_fails_its_target_naming_the_file(runner, tmp_path):
    (tmp_path / "train200").mkdir()
    (tmp_path / "train200" / "run.json").write_text("{half a rep")
    target = runner.summarize_phase(runner.load_reports(tmp_path), [])["train200"]
    assert target["status"] == "failed"
    assert target["reason"].startswith(f"unreadable report {tmp_path / 'train200' / 'run.json'}: ")


@pytest.mark.parametrize(
    ("statuses", "errors", "code"),
    [
        (["in_spec", "in_spec"], [], 0),
        (["in_spec", "drift"], [], 2),
        (["drift", "failed"], [], 1),
        (["drift", "unreachable"], [], 1),
        (["in_spec"], ["the check run's ansible-playbook exited 1"], 1),
        ([], [], 1),  # no target at all is never "in spec"
    ],
)
def test_exit_codes_failure_wins_over_drift(runner, statuses, errors, code):
    targets = {f"t{i}": {"status": s} for i, s in enumerate(statuses)}
    assert runner.exit_code(targets, errors) == code


def test_run_errors_explain_what_no_target_does(runner):
    run = {"phase": "check", "status": "failed", "rc": 1, "error": None, "log": "/r/check.log", "timeout": 60}
    assert runner.run_errors(run, {}) == ["the check run's ansible-playbook exited 1 (failed); see /r/check.log"]
    ok = dict(run, status="successful", rc=0)
    assert runner.run_errors(ok, {})[0].startswith("the check run reached no target")
    assert runner.run_errors(dict(run, status="timeout", rc=254), {"t": {"status": "failed"}}) == [
        "the run timed out after 60 s (check run)"
    ]
    assert runner.run_errors(dict(run, rc=2), {"t": {"status": "failed"}}) == []


# -- --correct ---------------------------------------------------------------------------------------------------
def corrected_targets(runner, tmp_path, venv_result):
    """train200 drifts in gpu_processes and training_venv; the correction ends the processes, and the venv step
    does what ``venv_result`` says."""
    steps = {"gpu_processes": DRIFT["gpu_processes"], "training_venv": DRIFT["training_venv"]}
    checked = summarize(runner, tmp_path / "check", [make_report("train200", fact_pass(**steps))])
    killed = {
        "changed": True,
        "killed": [{"pid": 1193, "signal": "SIGTERM"}],
        "changes": DRIFT["gpu_processes"]["changes"],
    }
    report = make_report(
        "train200",
        fact_pass(**steps),
        check_mode=False,
        results={"gpu_processes": killed, "training_venv": venv_result},
    )
    corrected = summarize(runner, tmp_path / "correct", [report], corrected_run=True)
    return checked, runner.merge_correction(checked, corrected)


def test_a_correction_that_did_everything_leaves_the_target_in_spec(runner, tmp_path):
    checked, merged = corrected_targets(
        runner, tmp_path, {"changed": True, "changes": DRIFT["training_venv"]["changes"]}
    )
    target = merged["train200"]
    assert (target["status"], target["reason"]) == ("in_spec", "corrected gpu_processes, training_venv")
    assert target["corrected"] == {
        "gpu_processes": DRIFT["gpu_processes"]["changes"],
        "training_venv": DRIFT["training_venv"]["changes"],
    }
    assert target["check"] == {
        "status": "drift",
        "reason": "drift in gpu_processes, training_venv",
        "report": checked["train200"]["report"],
        "run_id": RUN_ID,
        "drift": ["gpu_processes", "training_venv"],
    }
    assert target["report"].startswith(str(tmp_path / "correct"))
    assert runner.exit_code(merged) == 0


def test_what_needs_a_window_keeps_the_target_drifting_after_a_correction(runner, tmp_path):
    window = ["swap /opt/venvs/train: pid 4242 (python3 train.py) runs from it"]
    _, merged = corrected_targets(runner, tmp_path, {"changed": False, "needs_window": window})
    target = merged["train200"]
    assert target["status"] == "drift"
    assert target["reason"] == "still drifts after the correction: training_venv; needs a window: training_venv"
    assert target["needs_window"] == {"training_venv": window}
    assert list(target["corrected"]) == ["gpu_processes"]
    assert runner.exit_code(merged) == 2


def test_a_step_with_work_that_changed_nothing_is_not_counted_as_corrected(runner, tmp_path):
    _, merged = corrected_targets(runner, tmp_path, {"changed": False})
    assert merged["train200"]["status"] == "drift"
    assert merged["train200"]["steps"]["training_venv"]["drift"] is True


def test_a_drifting_target_the_correction_never_reached_is_failed(runner, tmp_path):
    checked = summarize(runner, tmp_path, [make_report("train200", fact_pass(gpu_processes=DRIFT["gpu_processes"]))])
    merged = runner.merge_correction(checked, {})
    assert (merged["train200"]["status"], merged["train200"]["reason"]) == (
        "failed",
        "the correction run did not reach it",
    )


# -- files: the atomic write, the lock, pruning ---------------------------------------------------------------------
def test_the_atomic_write_replaces_the_file_leaves_no_temp_file_and_is_0644(runner, tmp_path):
    path = tmp_path / "pve_gpu_recover.prom"
    path.write_text("old\n")
    old_umask = os.umask(0o077)
    try:
        runner.write_atomic(path, "new\n")
    finally:
        os.umask(old_umask)
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pve_gpu_recover.prom"]


def test_a_failed_atomic_write_keeps_the_old_file_and_removes_its_temp_file(runner, tmp_path, monkeypatch):
    path = tmp_path / "pve_gpu_recover.prom"
    path.write_text("old\n")

    def replace(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner.os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        runner.write_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pve_gpu_recover.prom"]


HOLD = textwrap.dedent("""\
    import sys
    sys.path.insert(0, {root!r})
    from drift import runner
    runner.acquire_lock({lock!r})
    print("held", flush=True)
    sys.stdin.read()
""")


def test_a_second_process_is_refused_naming_the_holder_pid(runner, tmp_path):
    lock = tmp_path / "drift.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(root=str(ROOT), lock=str(lock))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(runner.LockHeld, match=rf"another drift run holds {lock} \(pid {holder.pid}, since "):
            runner.acquire_lock(lock)
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    # Gone with its process: the next run takes it.
    os.close(runner.acquire_lock(lock))


def test_the_cli_refuses_to_run_while_another_run_holds_the_lock(runner, tmp_path):
    lock = tmp_path / "drift.lock"
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all: {}\n")
    handle = runner.acquire_lock(lock)
    try:
        done = subprocess.run(
            [sys.executable, str(RUNNER), "--inventory", str(inventory), "--lock-file", str(lock)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(handle)
    assert done.returncode == 1, done.stderr
    assert f"another drift run holds {lock} (pid {os.getpid()}, since " in done.stderr
    assert done.stdout == ""


def test_host_key_checking_stays_as_ansible_playbook_alone_would_have_it(runner, tmp_path, monkeypatch):
    """ansible-runner turns it off unless told: the runner tells it the environment's, ansible.cfg's, or on."""
    monkeypatch.delenv("ANSIBLE_HOST_KEY_CHECKING", raising=False)
    assert runner.host_key_checking(tmp_path) == "True"
    (tmp_path / "ansible.cfg").write_text("[defaults]\nhost_key_checking = False\n")
    assert runner.host_key_checking(tmp_path) == "False"
    monkeypatch.setenv("ANSIBLE_HOST_KEY_CHECKING", "True")
    assert runner.host_key_checking(tmp_path) == "True"


def test_the_nested_run_finds_the_projects_own_collection_first(runner, tmp_path, monkeypatch):
    """recover.yml imports pve_gpu.recover.recover: a checkout's collections/ (its link to itself), else the copy the
    runner belongs to (installed: AWX, an execution environment), then what the run would have used anyway."""
    import drift  # noqa: PLC0415 (after ROOT is on sys.path)
    from drift import playbook  # noqa: PLC0415 (after ROOT is on sys.path)

    monkeypatch.delenv("ANSIBLE_COLLECTIONS_PATH", raising=False)
    (tmp_path / "ansible.cfg").write_text("[defaults]\ncollections_path = collections:/opt/more\n")
    args = types.SimpleNamespace(project=tmp_path)
    installed = playbook.environment(args, tmp_path / "reports")["ANSIBLE_COLLECTIONS_PATH"]
    assert installed == f"{drift.COLLECTIONS}:{tmp_path}/collections:/opt/more"
    (tmp_path / "collections").mkdir()
    assert playbook.environment(args, tmp_path)["ANSIBLE_COLLECTIONS_PATH"] == f"{tmp_path}/collections:/opt/more"
    # An AWX job's path (relative entries are its project's, the directory it runs in) replaces ansible.cfg's.
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", "/runner/requirements_collections:collections")
    monkeypatch.chdir(tmp_path)
    assert playbook.environment(args, tmp_path)["ANSIBLE_COLLECTIONS_PATH"] == (
        f"{tmp_path}/collections:/runner/requirements_collections"
    )
    (tmp_path / "ansible.cfg").unlink()
    monkeypatch.delenv("ANSIBLE_COLLECTIONS_PATH")
    assert drift.collections_path("/x", tmp_path) == "/x:~/.ansible/collections:/usr/share/ansible/collections"


def test_only_the_oldest_run_directories_are_pruned(runner, tmp_path):
    names = ["20261201T000000Z-1", "20261202T000000Z-7", "20261203T000000Z-3", "keep-me", "summary.json"]
    for name in names[:4]:
        (tmp_path / name).mkdir()
    (tmp_path / names[4]).write_text("{}")
    runner.prune_runs(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


# -- the CLI's errors ------------------------------------------------------------------------------------------------
def test_a_missing_inventory_says_what_to_pass(runner, tmp_path, capsys):
    code, _, err = run_main(runner, ["--inventory", str(tmp_path / "nope")], capsys)
    assert code == 1
    assert f"drift: inventory {tmp_path / 'nope'} not found" in err
    assert "e.g. --inventory" in err


def test_a_project_without_recover_yml_is_refused(runner, tmp_path, capsys):
    (tmp_path / "hosts").write_text("")
    code, _, err = run_main(runner, ["-i", str(tmp_path / "hosts"), "--project", str(tmp_path)], capsys)
    assert code == 1
    assert f"drift: {tmp_path / 'recover.yml'} not found: --project must be the pve_gpu.recover collection" in err


def test_without_ansible_runner_the_error_gives_the_fix(runner, tmp_path, capsys, monkeypatch):
    (tmp_path / "hosts").write_text("")
    monkeypatch.setitem(sys.modules, "ansible_runner", None)  # import fails as if it were not installed
    code, _, err = run_main(runner, ["-i", str(tmp_path / "hosts"), "--lock-file", str(tmp_path / "l")], capsys)
    assert code == 1
    assert "ansible-runner is not importable by" in err
    assert_installs_the_floors(err)


def test_a_usage_error_exits_1_never_2_which_means_drift(runner, capsys):
    with pytest.raises(SystemExit) as exited:
        runner.main(["--forks", "many"])
    assert exited.value.code == 1
    with pytest.raises(SystemExit) as exited:
        runner.main([])
    assert exited.value.code == 1
    assert "--inventory" in capsys.readouterr().err


# -- main() with a stand-in for ansible-runner -------------------------------------------------------------------------
def test_main_checks_corrects_the_drifting_targets_only_and_writes_summary_and_textfile(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    steps = {"gpu_processes": DRIFT["gpu_processes"], "training_venv": DRIFT["training_venv"]}
    window = ["swap /opt/venvs/train: pid 4242 (python3 train.py) runs from it"]
    killed = {"changed": True, "killed": [{"pid": 1193, "signal": "SIGTERM"}]}
    fake = FakeAnsibleRunner(
        {
            "check": (
                [
                    make_report("train200", fact_pass(**steps)),
                    make_report("ok201", fact_pass(gpu_processes=step_facts())),
                ],
                [event("runner_on_start", "train200"), event("runner_on_start", "ok201")],
                "successful",
                0,
            ),
            "correct": (
                [
                    make_report(
                        "train200",
                        fact_pass(**steps),
                        check_mode=False,
                        results={"gpu_processes": killed, "training_venv": {"changed": False, "needs_window": window}},
                    )
                ],
                [event("runner_on_start", "train200")],
                "successful",
                0,
            ),
        }
    )
    textfile = tmp_path / "textfile" / "pve_gpu_recover.prom"
    textfile.parent.mkdir()
    argv = [
        *("--inventory", str(inventory), "--project", str(project), "--correct"),
        *("--textfile", str(textfile), "--summary", str(tmp_path / "summary.json"), "--limit", "train*:ok*"),
        *("-e", "preflight_expected_gpu_count=8", "--forks", "5", "--reports-dir", str(tmp_path / "runs")),
    ]
    code, out, err = run_main(runner, argv, capsys, ansible_runner=fake)
    assert code == 2, err
    assert out == ""
    probe, check, correct = fake.calls
    # The checkout was proven to run unattended first: its own copy, in check mode, recover_unattended=true.
    assert (probe["ident"], probe["cmdline"]) == ("unattended", "--check")
    assert probe["extravars"] == {"recover_unattended": True}
    assert probe["project_dir"] != str(project)
    assert check["cmdline"] == "--check --diff -e preflight_expected_gpu_count=8"
    assert (check["limit"], check["extravars"], check["forks"]) == ("train*:ok*", None, 5)
    assert correct["cmdline"] == "--diff -e preflight_expected_gpu_count=8"
    assert (correct["limit"], correct["extravars"]) == ("train200", {"recover_unattended": True})
    for call in (check, correct):
        assert call["playbook"] == str(project / "recover.yml")
        assert call["inventory"] == [str(inventory)]
        assert call["envvars"]["ANSIBLE_CONFIG"] == str(project / "ansible.cfg")
        assert "ANSIBLE_CALLBACK_PLUGINS" not in call["envvars"]  # ansible-runner's own stays; ours is the collection's
        assert "pve_gpu.recover.recover_report" in call["envvars"]["ANSIBLE_CALLBACKS_ENABLED"].split(",")
        assert 1 <= call["timeout"] <= 3000
    report_dirs = {call["envvars"]["PVE_GPU_RECOVER_REPORT_DIR"] for call in (check, correct)}
    assert len(report_dirs) == 2  # a fresh directory per run

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["mode"], summary["status"], summary["exit_code"]) == ("correct", "drift", 2)
    assert summary["counts"] == {"in_spec": 1, "drift": 1, "failed": 0, "busy": 0, "unreachable": 0}
    assert summary["run_ids"] == [RUN_ID, RUN_ID]
    assert [run["phase"] for run in summary["runs"]] == ["check", "correct"]
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "check.log").read_text() == "PLAY RECAP (check)\n"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    target = summary["targets"]["train200"]
    assert target["status"] == "drift"
    assert target["corrected"] == {"gpu_processes": DRIFT["gpu_processes"]["changes"]}
    assert target["needs_window"] == {"training_venv": window}
    assert target["check"]["drift"] == ["gpu_processes", "training_venv"]
    assert target["report"].startswith(str(run_dir / "correct"))
    assert summary["targets"]["ok201"]["status"] == "in_spec"

    families = parse_exposition(textfile.read_text())
    corrected = {(s[0]["target"], s[0]["step"]): s[1] for s in families["pve_gpu_recover_corrected"]["samples"]}
    assert corrected[("train200", "gpu_processes")] == 1
    assert corrected[("train200", "training_venv")] == 0
    assert stat.S_IMODE(textfile.stat().st_mode) == 0o644
    assert sorted(p.name for p in textfile.parent.iterdir()) == ["pve_gpu_recover.prom"]
    assert "train200: drift: still drifts after the correction: training_venv" in err
    assert f"  training_venv needs a window: {window[0]}" in err


def test_main_does_not_correct_when_nothing_drifts_and_prints_the_summary_on_stdout(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    fake = FakeAnsibleRunner(
        {"check": ([make_report("ok201", fact_pass(gpu_processes=step_facts()))], [], "successful", 0)}
    )
    argv = ["-i", str(inventory), "--project", str(project), "--correct", "--reports-dir", str(tmp_path / "r")]
    code, out, _ = run_main(runner, argv, capsys, ansible_runner=fake)
    assert code == 0
    assert [call["ident"] for call in fake.calls] == ["unattended", "check"]
    assert json.loads(out)["targets"]["ok201"]["status"] == "in_spec"


def test_a_crashed_run_with_no_target_fails_with_the_run_error(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    fake = FakeAnsibleRunner({"check": ([], [], "failed", 1)})
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(tmp_path / "r")]
    code, out, err = run_main(runner, argv, capsys, ansible_runner=fake)
    summary = json.loads(out)
    assert code == 1
    assert summary["errors"] == [f"the check run's ansible-playbook exited 1 (failed); see {summary['runs'][0]['log']}"]
    assert "error: the check run's ansible-playbook exited 1" in err


def test_correct_is_refused_when_the_checkout_does_not_pass_unattended_on_and_nothing_runs(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    fake = FakeAnsibleRunner({"unattended": ([], probe_events(unattended="false"), "successful", 0)})
    argv = ["-i", str(inventory), "--project", str(project), "--correct", "--reports-dir", str(tmp_path / "r")]
    code, out, err = run_main(runner, argv, capsys, ansible_runner=fake)
    assert (code, out) == (1, "")
    assert "drift: --correct refused:" in err
    assert "the gpu_processes module ran with unattended='false'" in err
    assert "the fact pass got training_venv's settings with unattended='false'" in err
    # Refused before the check: no target was touched, no run directory made.
    assert [call["ident"] for call in fake.calls] == ["unattended"]
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["drift.lock"]


# -- what the runner keeps and tells beyond the summary ---------------------------------------------------------------
def test_a_newer_report_schema_fails_its_target_naming_both_versions(runner, tmp_path):
    report = dict(make_report("train200", fact_pass()), schema_version=2)
    target = summarize(runner, tmp_path, [report])["train200"]
    assert target["status"] == "failed"
    assert target["reason"] == (
        f"the report {tmp_path / 'train200' / f'{RUN_ID}.json'} has schema_version 2 and this runner reads 1: update "
        "the checkout the runner runs from (drift/) to the one the report callback comes from"
    )
    # A report from before the field: the same shape, read as it is.
    old = make_report("train201", fact_pass())
    del old["schema_version"]
    assert summarize(runner, tmp_path / "old", [old])["train201"]["status"] == "in_spec"


def test_a_long_steps_progress_goes_to_the_journal_as_ansible_polls_it(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    progress = {
        "step": "training_venv",
        "target": "CT 200 on pve1",
        "phase": "installing the lock with `uv pip sync`",
        "line": "Downloading torch (846.0MiB)\x1b[2J",  # what the CT printed: escaped, one line
        "elapsed_seconds": 252.4,
    }
    polls = [
        event("runner_on_async_poll", "train200", res={"started": True, "finished": False, "ansible_job_id": "j1.2"}),
        event("runner_on_async_poll", "train200", res={"finished": False, "pve_gpu_recover_progress": progress}),
    ]
    report = make_report("train200", fact_pass(gpu_processes=step_facts()))
    fake = FakeAnsibleRunner({"check": ([report], polls, "successful", 0)})
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(tmp_path / "r")]
    code, _, err = run_main(runner, argv, capsys, ansible_runner=fake)
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("train200: training_venv")]
    assert lines == [
        "train200: training_venv: installing the lock with `uv pip sync` (4m12s): Downloading torch (846.0MiB)\\x1b[2J"
    ]


def test_last_success_and_drift_survive_a_run_that_cannot_reach_the_target(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    textfile = tmp_path / "pve_gpu_recover.prom"
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(tmp_path / "r")]
    argv += ["--textfile", str(textfile)]
    drifting = make_report("train200", fact_pass(gpu_processes=DRIFT["gpu_processes"]))
    fake = FakeAnsibleRunner({"check": ([drifting], [], "successful", 0)})
    assert run_main(runner, argv, capsys, ansible_runner=fake, clock=lambda: 1796371200.0)[0] == 2
    state = json.loads((tmp_path / "r" / metrics.STATE_FILE).read_text())
    assert state["targets"]["train200"]["last_success"] == 1796371200.0
    assert stat.S_IMODE((tmp_path / "r" / metrics.STATE_FILE).stat().st_mode) == 0o640

    down = [event("runner_on_unreachable", "train200", task="Read", res={"msg": UNREACHABLE})]
    fake = FakeAnsibleRunner({"check": ([], down, "failed", 4)})
    assert run_main(runner, argv, capsys, ansible_runner=fake, clock=lambda: 1796374800.0)[0] == 1
    families = parse_exposition(textfile.read_text())
    drift = {(s[0]["target"], s[0]["step"]): s[1] for s in families["pve_gpu_recover_drift"]["samples"]}
    assert drift[("train200", "gpu_processes")] == 1  # still there: the alert on it does not resolve
    last = {s[0]["target"]: s[1] for s in families["pve_gpu_recover_last_success_timestamp_seconds"]["samples"]}
    assert last == {"train200": 1796371200.0}
    status = {s[0]["status"]: s[1] for s in families["pve_gpu_recover_target_status"]["samples"]}
    assert status["unreachable"] == 1


def test_without_prometheus_client_the_error_gives_the_fix_before_anything_runs(runner, tmp_path, capsys, monkeypatch):
    (tmp_path / "hosts").write_text("")
    monkeypatch.setattr(metrics, "MISSING", "No module named 'prometheus_client'")
    fake = FakeAnsibleRunner({})
    argv = ["-i", str(tmp_path / "hosts"), "--lock-file", str(tmp_path / "l")]
    code, _, err = run_main(runner, argv, capsys, ansible_runner=fake)
    assert code == 1
    assert "prometheus_client is not importable by" in err
    assert_installs_the_floors(err)
    assert fake.calls == []


def assert_installs_the_floors(err):
    """What a collection user installs: the floors of requirements/ee.txt (never the checkout's hashed dev lock),
    into the Python that lacks them or into a venv of the runner's own with ansible-core's range."""
    floors = {
        line.split(">=")[0]: line.strip()
        for line in (ROOT / "requirements" / "ee.txt").read_text().splitlines()
        if ">=" in line and not line.startswith("#")
    }
    wanted = f"'{floors['ansible-runner']}' '{floors['prometheus-client']}'"
    assert f"{sys.executable} -m pip install {wanted}" in err
    requires = re.search(r'requires_ansible: "([^"]+)"', (ROOT / "meta" / "runtime.yml").read_text()).group(1)
    assert f"/opt/pve-gpu-drift/venv/bin/pip install 'ansible-core{requires}' {wanted}" in err
    assert "dev.lock" not in err and "make setup" in err and "drift_timer_python" in err
