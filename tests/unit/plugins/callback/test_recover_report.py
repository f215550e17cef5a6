"""plugins/callback/recover_report.py: the report's pure parts, and the callback inside a real ansible-playbook."""

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from ansible.module_utils import _internal as module_internal

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "plugins" / "callback"))
controller = module_internal.is_controller
import recover_report  # noqa: E402

# Importing controller code (the callback's base class) makes module_utils act as on the controller (warnings go to
# Display, not to the module's result); the module tests in this same process need module semantics back.
module_internal.is_controller = controller

GPU0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU1 = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
BEFORE = {
    "preflight": {"gpus": [{"uuid": GPU0, "memory_used_mib": 20009}, {"uuid": GPU1, "memory_used_mib": 0}]},
    "gpu_processes": {
        "processes": [{"pid": 516, "gpus": [0]}, {"pid": 517, "gpus": [0]}],
        "blockers": [{"pid": 777, "gpus": [1]}],
    },
}


def test_after_the_run_the_gpus_and_holders_reflect_what_the_step_did():
    steps = {
        "gpu_processes": {"killed": [{"pid": 516}, {"pid": 517}], "memory": [{"uuid": GPU0, "memory_used_mib": 0}]}
    }
    gpus, holders = recover_report.merge_after(BEFORE, steps)
    assert [g["memory_used_mib"] for g in gpus] == [0, 0]
    assert holders == [{"pid": 777, "gpus": [1]}]
    # Nothing read again: the before facts are not touched.
    assert BEFORE["preflight"]["gpus"][0]["memory_used_mib"] == 20009


def test_in_check_mode_nothing_ended_so_every_holder_is_still_there():
    gpus, holders = recover_report.merge_after(BEFORE, {"gpu_processes": {"killed": []}})
    assert [h["pid"] for h in holders] == [516, 517, 777]
    assert gpus[0]["memory_used_mib"] == 20009


@pytest.mark.parametrize(
    ("statuses", "want"),
    [
        ([("ok", False, False), ("skipped", False, True)], "skipped"),
        ([("ok", False, False), ("ok", True, True)], "changed"),
        ([("ok", False, True)], "ok"),
        ([("ok", False, True), ("failed", False, True)], "failed"),
        ([("unreachable", False, True)], "failed"),
    ],
)
def test_step_status(statuses, want):
    records = [{"status": s, "changed": c, "remote": r} for s, c, r in statuses]
    assert recover_report.step_status(records) == want


def test_summary_names_what_changed_and_what_was_ended():
    report = {
        "check_mode": False,
        "steps": {
            "preflight": {"changed": False, "changes": []},
            "gpu_processes": {
                "changed": False,  # a failed task loses `changed`; what it ended still counts
                "changes": ["end pid 516 (python3) on GPU 0, 20000 MiB"],
                "killed": [{"pid": 516, "signal": "SIGKILL"}],
            },
        },
    }
    assert recover_report.summary_lines(report) == [
        "gpu_processes changed: end pid 516 (python3) on GPU 0, 20000 MiB",
        "gpu_processes: ended 1 process(es) (pid 516 SIGKILL)",
    ]
    assert recover_report.summary_lines(dict(report, check_mode=True))[0].startswith("gpu_processes would change: end")


FAILING_STEP = """\
- name: Fail like a step that ended processes and then found the memory still held
  ansible.builtin.fail:
    msg: GPU 0 still holds 300 MiB
  when: fail_it | bool
"""


def run_playbook(tmp_path, *args, gpu_tasks=FAILING_STEP):
    """A playbook whose roles are named like recovery steps, run by a real ansible-playbook on localhost."""
    roles = tmp_path / "roles"
    (roles / "preflight" / "tasks").mkdir(parents=True, exist_ok=True)
    (roles / "gpu_processes" / "tasks").mkdir(parents=True, exist_ok=True)
    (roles / "preflight" / "tasks" / "main.yml").write_text(
        textwrap.dedent("""\
        - name: Read the facts (the fact pass's action names the run)
          target_facts:
        - name: A remote call
          ansible.builtin.command:
            argv: ["true"]
          changed_when: false
        """)
    )
    (roles / "gpu_processes" / "tasks" / "main.yml").write_text(gpu_tasks)
    # Stands in for the fact pass: returns the run's id as the real action adds it, and no facts.
    (tmp_path / "library").mkdir(exist_ok=True)
    (tmp_path / "library" / "target_facts.py").write_text(
        "from ansible.module_utils.basic import AnsibleModule\n"
        "AnsibleModule({}, supports_check_mode=True).exit_json(changed=False, run_id='run-test')\n"
    )
    playbook = tmp_path / "play.yml"
    playbook.write_text("- hosts: all\n  gather_facts: false\n  roles: [preflight, gpu_processes]\n")
    env = dict(
        os.environ,
        ANSIBLE_COLLECTIONS_PATH=str(ROOT / "collections"),
        ANSIBLE_CALLBACKS_ENABLED="pve_gpu.recover.recover_report",
        ANSIBLE_ROLES_PATH=str(roles),
        ANSIBLE_LIBRARY=str(tmp_path / "library"),
        PVE_GPU_RECOVER_REPORT_DIR=str(tmp_path / "reports"),
        ANSIBLE_NOCOLOR="1",
    )
    env.pop("ANSIBLE_CONFIG", None)
    command = [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", "-c", "local", *args]
    command += ["-e", f"ansible_python_interpreter={sys.executable}"]
    return subprocess.run([*command, str(playbook)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)


def test_a_failed_run_still_writes_its_report_and_prints_its_path(tmp_path):
    done = run_playbook(tmp_path, "-e", "fail_it=true")
    assert done.returncode == 2, done.stdout + done.stderr
    path = tmp_path / "reports" / "localhost" / "run-test.json"
    report = json.loads(path.read_text())
    assert f"localhost: failed, report {path}" in done.stdout
    assert report["status"] == "failed"
    assert report["error"] == {
        "step": "gpu_processes",
        "task": "gpu_processes : Fail like a step that ended processes and then found the memory still held",
        "action": "fail",
        "msg": "GPU 0 still holds 300 MiB",
    }
    assert report["steps"]["preflight"]["status"] == "ok"
    assert report["steps"]["gpu_processes"]["status"] == "failed"
    assert report["check_mode"] is False
    assert [(t["action"], t["remote"], t["status"]) for t in report["tasks"]] == [
        ("target_facts", True, "ok"),
        ("command", True, "ok"),
        ("fail", False, "failed"),
    ]


def test_a_check_run_is_marked_as_such(tmp_path):
    done = run_playbook(tmp_path, "--check", "-e", "fail_it=false")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "reports" / "localhost" / "run-test.json").read_text())
    assert (report["check_mode"], report["status"], report["error"]) == (True, "ok", None)
    assert report["steps"]["gpu_processes"]["status"] == "skipped"


@pytest.mark.parametrize("check", [False, True])
def test_a_run_that_fails_after_a_step_changed_the_target_says_so_and_a_check_that_fails_does_not(tmp_path, check):
    # Issue 43, break 3: a check run changes nothing, so "the run failed after X changed the target" is false there;
    # a step's changed in check mode is what it would change, already in the summary's "would change" lines.
    changes = textwrap.dedent("""\
        - name: Plan or make a change, as a step's module reports it (changed in check mode too)
          ansible.builtin.debug:
            msg: end pid 516
          changed_when: true
        """)
    flags = ["--check"] if check else []
    done = run_playbook(tmp_path, *flags, "-e", "fail_it=true", gpu_tasks=changes + FAILING_STEP)
    assert done.returncode == 2, done.stdout + done.stderr
    report = json.loads((tmp_path / "reports" / "localhost" / "run-test.json").read_text())
    step = report["steps"]["gpu_processes"]
    assert (report["check_mode"], report["status"], step["changed"]) == (check, "failed", True)
    said = "localhost: the run failed after gpu_processes changed the target; see the report"
    assert (said in " ".join((done.stdout + done.stderr).split())) is not check


def test_a_playbook_of_the_collection_run_by_its_name_reports_beside_the_user(tmp_path, monkeypatch):
    """`ansible-playbook pve_gpu.recover.recover` runs a playbook inside the (maybe installed) collection: a relative
    report_dir is then the current directory's, never the collection's; any other playbook's is beside it."""
    monkeypatch.setenv("PVE_GPU_RECOVER_CONTROLLER_PID", "1")  # the callback exports it; the test must not leak it
    monkeypatch.chdir(tmp_path)
    callback = recover_report.CallbackModule()
    linked = ROOT / "collections" / "ansible_collections" / "pve_gpu" / "recover" / "playbooks"
    for inside in (linked, ROOT / "playbooks"):
        callback.v2_playbook_on_start(types.SimpleNamespace(_basedir=str(inside)))
        assert callback.basedir == str(tmp_path)
    for beside in (ROOT, tmp_path / "site"):
        callback.v2_playbook_on_start(types.SimpleNamespace(_basedir=str(beside)))
        assert callback.basedir == str(beside)


def test_the_run_names_its_own_controller_even_under_another_run(tmp_path, monkeypatch):
    """A run started from another run's task inherits that run's PVE_GPU_RECOVER_CONTROLLER_PID: the callback
    replaces it with its own ansible-playbook's pid, the process the run lock must see alive."""
    monkeypatch.setenv("PVE_GPU_RECOVER_CONTROLLER_PID", "1")  # the outer run's
    monkeypatch.chdir(tmp_path)
    recover_report.CallbackModule().v2_playbook_on_start(types.SimpleNamespace(_basedir=str(tmp_path)))
    assert os.environ["PVE_GPU_RECOVER_CONTROLLER_PID"] == str(os.getpid())


def test_the_callback_documentation_renders():
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-doc")),
            "-t",
            "callback",
            "--json",
            "pve_gpu.recover.recover_report",
        ],
        cwd=ROOT,
        env={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)["pve_gpu.recover.recover_report"]["doc"]
    assert doc["options"]["report_dir"]["env"] == [{"name": "PVE_GPU_RECOVER_REPORT_DIR"}]


def test_a_step_that_queued_no_task_is_skipped_only_when_its_facts_showed_nothing_to_do():
    assert recover_report.unrun_status({"pending": False, "problems": [], "changes": []}) == "skipped"
    assert recover_report.unrun_status({"pending": True, "problems": []}) == "not_run"  # work that never ran
    assert recover_report.unrun_status({"pending": False, "problems": ["x"]}) == "not_run"
    assert recover_report.unrun_status({}) == "not_run"


# -- text a target chose, and files where others may plant links (issue 25 items 11, 12) --------------------------
EVIL = "python3\n\x1b[2Jok: [localhost] => all fine"


def test_a_change_naming_a_ct_chosen_process_is_one_escaped_line():
    report = {"check_mode": True, "steps": {"gpu_processes": {"changed": True, "changes": [f"end pid 516 ({EVIL})"]}}}
    assert recover_report.summary_lines(report) == [
        "gpu_processes would change: end pid 516 (python3\\n\\x1b[2Jok: [localhost] => all fine)"
    ]
    # A module's own escape is shown as it is, never escaped twice.
    report["steps"]["gpu_processes"]["changes"] = ["end pid 516 (python3\\n)"]
    assert recover_report.summary_lines(report) == ["gpu_processes would change: end pid 516 (python3\\n)"]


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim" / "authorized_keys"
    path.parent.mkdir()
    path.write_text("precious\n")
    return path


def test_a_temporary_file_planted_as_a_symlink_is_never_written_through(tmp_path, victim):
    """The old temporary name was predictable (<report>.json.tmp): a link there had the report written into
    whatever it pointed to."""
    target = tmp_path / "reports" / "localhost"
    target.mkdir(parents=True)
    (target / "run-test.json.tmp").symlink_to(victim)
    done = run_playbook(tmp_path, "--check", "-e", "fail_it=false")
    assert done.returncode == 0, done.stdout + done.stderr
    assert victim.read_text() == "precious\n"
    assert json.loads((target / "run-test.json").read_text())["check_mode"] is True
    # No temporary file of the callback's own is left behind.
    assert sorted(p.name for p in target.iterdir()) == ["run-test.json", "run-test.json.tmp"]


def test_a_report_directory_planted_as_a_symlink_is_refused_with_a_warning(tmp_path, victim):
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "localhost").symlink_to(victim.parent, target_is_directory=True)
    done = run_playbook(tmp_path, "--check", "-e", "fail_it=false")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is a symbolic link; refusing to write a report there" in done.stdout + done.stderr
    assert sorted(p.name for p in victim.parent.iterdir()) == ["authorized_keys"]
    assert victim.read_text() == "precious\n"


def test_the_report_is_written_whole_and_readable_with_no_temporary_file_left(tmp_path):
    report = {"target": "ct200", "steps": {}}
    path = recover_report.write_report(str(tmp_path / "reports"), "ct200", "run-1", report)
    assert json.loads(Path(path).read_text()) == report
    assert [p.name for p in (tmp_path / "reports" / "ct200").iterdir()] == ["run-1.json"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert not os.stat(tmp_path / "reports").st_mode & 0o027


# -- the report's schema and its pruning, a long step's progress (issue 23 items 4, 5) ------------------------------
def test_each_report_carries_its_schema_version(tmp_path):
    done = run_playbook(tmp_path, "--check", "-e", "fail_it=false")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "reports" / "localhost" / "run-test.json").read_text())
    assert report["schema_version"] == recover_report.SCHEMA_VERSION == 1


def test_docs_reports_md_documents_every_top_level_field(tmp_path):
    done = run_playbook(tmp_path, "-e", "fail_it=true")
    assert done.returncode == 2, done.stdout + done.stderr
    report = json.loads((tmp_path / "reports" / "localhost" / "run-test.json").read_text())
    documented = (ROOT / "docs" / "reports.md").read_text()
    for key in report:
        assert f"`{key}`" in documented, key
    for key in ("status", "changed", "seconds", "killed"):  # the rest of a step's entry is its module's RETURN
        assert key in report["steps"]["gpu_processes"] and f"`{key}`" in documented, key
    for key in report["tasks"][0]:
        assert f"`{key}`" in documented, key
    assert f"schema_version` is {recover_report.SCHEMA_VERSION}" in documented


def touch(path, age):
    path.write_text("{}")
    stamp = 1_700_000_000 - age  # long before any run of the test
    os.utime(path, (stamp, stamp))


def test_pruning_keeps_the_newest_reports_of_a_target_and_nothing_else_is_touched(tmp_path, victim):
    target = tmp_path / "ct200"
    target.mkdir()
    for age, name in enumerate(["r5.json", "r4.json", "r3.json", "r2.json", "r1.json"]):
        touch(target / name, age)
    (target / "notes.txt").write_text("mine")
    (target / ".r0.abc.tmp").write_text("")  # a write in progress of another run
    (target / "link.json").symlink_to(victim)  # the oldest name of all, a link
    assert sorted(recover_report.prune_reports(str(target), 2)) == ["r1.json", "r2.json", "r3.json"]
    assert sorted(p.name for p in target.iterdir()) == [".r0.abc.tmp", "link.json", "notes.txt", "r4.json", "r5.json"]
    assert victim.read_text() == "precious\n"
    assert recover_report.prune_reports(str(target), 0) == []  # 0 keeps every report


def test_a_manual_run_prunes_the_targets_old_reports_to_keep_reports(tmp_path, monkeypatch):
    target = tmp_path / "reports" / "localhost"
    target.mkdir(parents=True)
    for age in range(5):
        touch(target / f"old-{age}.json", 1000 + age)
    done = run_playbook(tmp_path, "--check", "-e", "fail_it=false")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(list(target.iterdir())) == 6  # the default keeps 48
    monkeypatch.setenv("PVE_GPU_RECOVER_REPORT_KEEP", "2")
    done = run_playbook(tmp_path, "--check", "-e", "fail_it=false")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in target.iterdir()) == ["old-0.json", "run-test.json"]


def test_a_long_steps_progress_is_one_line_at_each_poll():
    class Display:
        lines = []

        def display(self, text):
            self.lines.append(text)

    callback = recover_report.CallbackModule.__new__(recover_report.CallbackModule)
    callback._display = Display()
    progress = {"step": "compile_cache", "phase": "warming up", "line": "layer 3/40\nok: [x]", "elapsed_seconds": 75}
    host = type("Host", (), {"get_name": lambda self: "ct200"})()
    result = type("Result", (), {"_host": host, "_result": {"pve_gpu_recover_progress": progress}})()
    callback.v2_runner_on_async_poll(result)
    callback.v2_runner_on_async_poll(type("Result", (), {"_host": host, "_result": {"finished": False}})())
    assert Display.lines == ["ct200: compile_cache: warming up (1m15s): layer 3/40 ok: [x]"]
