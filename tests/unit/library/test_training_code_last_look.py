"""The code reset looks once more right before it resets (issue 40, item 5), as the venv step does before its swap:
unattended, a job started while the backup was written (which may take up to reset_timeout) is never reset under,
and a job that uses the repository through PYTHONPATH (its /proc/<pid>/environ, read bounded, untrusted) or
``-m`` from another directory counts as using it, in the fact pass's node-side read and in the script's last look
alike (ct/proc.py: one rule). Real processes and real repositories; the probe part and the reset
script run in-process (bare host).
"""

import subprocess

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import in_use, script

from tests.unit.library.test_training_code_untrusted import lab  # noqa: F401 (the fixture)
from tests.unit.plugins.module_utils.steps.training_code.test_facts_in_use import REPO, process


def test_pythonpath_and_dash_m_name_what_a_python_imports_from():
    environ = b"HOME=/root\0PYTHONPATH=/opt/lib:src::/srv/train/pkg\0"
    assert ct_proc.imports_from(["python3", "-m", "train.main"], environ, "/srv") == [
        ("pythonpath", "/opt/lib"),
        ("pythonpath", "/srv/src"),
        ("pythonpath", "/srv"),  # an empty entry is the working directory
        ("pythonpath", "/srv/train/pkg"),
        ("module", "/srv/train"),
        ("module", "/opt/lib/train"),
        ("module", "/srv/src/train"),
        ("module", "/srv/train/pkg/train"),
    ]
    assert ct_proc.imports_from(["python3", "-mtrain"], b"", "/srv") == [("module", "/srv/train")]
    assert ct_proc.imports_from(["python3", "train.py"], b"PYTHONPATHX=/srv/train\0", "/srv") == []
    assert ct_proc.imports_from(["python3", "-m", "../../etc"], b"", "/srv") == []  # no module name: nothing
    assert ct_proc.using(["python3", "-m", "train.main"], b"", "/srv", [REPO]) == ("module", "/srv/train")
    assert ct_proc.using(["sleep", "9"], b"PYTHONPATH=/srv/train/src\0", "/", [REPO]) == (
        "pythonpath",
        "/srv/train/src",
    )


def test_the_fact_pass_counts_a_job_on_pythonpath_or_run_with_dash_m_from_elsewhere(tmp_path):
    root = tmp_path / "proc"
    process(root, 516, argv=["python3", "-m", "train.main"], cwd="/srv")
    process(root, 517, argv=["python3", "worker.py"], cwd="/home/alice")
    (root / "517" / "environ").write_bytes(b"LANG=C\0PYTHONPATH=/srv/train\0")
    process(root, 518, argv=["python3", "-m", "train.main"], cwd="/home/alice")  # another train package
    found, unreadable = in_use.processes_in_repository("ct:200", [REPO], proc_root=str(root))
    assert [(info.pid, how, path) for info, how, path in found] == [
        (516, "module", "/srv/train"),
        (517, "pythonpath", "/srv/train"),
    ]
    assert unreadable == []


def test_unattended_a_job_started_during_the_backup_is_never_reset_under(lab, capsys, monkeypatch):  # noqa: F811
    lab.dirty()
    before = lab.status()
    started = []
    save = script.Reset.save

    def save_then_a_job_starts(self, *args):
        done = save(self, *args)
        # A job that imports the repository through PYTHONPATH, started in another directory.
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{lab.repo}"}
        started.append(subprocess.Popen(["sleep", "300"], cwd="/", env=env))
        return done

    monkeypatch.setattr(script.Reset, "save", save_then_a_job_starts)
    try:
        result = lab.run(capsys, unattended=True)
        assert started, result["in_use"]
        job = started[0]
        assert (result["changed"], result["changes"], result["backup"]) == (False, [], None), result
        (sentence,) = result["needs_window"]
        assert f"pid {job.pid} (sleep" in sentence and f"pythonpath {lab.repo})" in sentence, sentence
        assert "found just before the reset" in sentence, sentence
        assert lab.status() == before and not any(lab.backups.iterdir())  # this run's backup removed
    finally:
        for job in started:
            job.kill()
            job.wait()
    # Attended, the last look does not stop a reset.
    monkeypatch.setattr(script.Reset, "save", save)
    assert lab.run(capsys)["head"] == lab.pinned
