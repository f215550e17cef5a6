"""drift/runner.py's own files where other users may reach (issue 25 item 12): nothing is opened, written or
removed through a link someone planted in the reports directory, and a directory that invites one is refused."""

import os
import stat
import time
import types

import pytest

from tests.unit.drift.conftest import (
    FakeAnsibleRunner,
    fact_pass,
    make_report,
    project_with_unattended,
    run_main,
    step_facts,
)

VICTIM_TEXT = "precious: never truncated\n"


@pytest.fixture
def victim(tmp_path):
    """A file the runner must never write: where a planted link points."""
    path = tmp_path / "victim" / "etc-shadow"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def untouched(victim):
    return victim.read_text() == VICTIM_TEXT and sorted(p.name for p in victim.parent.iterdir()) == [victim.name]


# -- the lock ---------------------------------------------------------------------------------------------------------
def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_untouched(runner, tmp_path, victim):
    lock = tmp_path / "reports" / "drift.lock"
    lock.parent.mkdir()
    lock.symlink_to(victim)
    with pytest.raises(runner.DriftError, match=r"refusing the lock file .*drift\.lock: it is a symbolic link"):
        runner.acquire_lock(lock)
    assert untouched(victim)
    assert lock.is_symlink()


def test_a_lock_file_that_is_a_hard_link_to_another_file_is_refused(runner, tmp_path, victim):
    lock = tmp_path / "drift.lock"
    os.link(victim, lock)
    with pytest.raises(runner.DriftError, match="it has 2 hard links"):
        runner.acquire_lock(lock)
    assert victim.read_text() == VICTIM_TEXT


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_path_that_is_not_a_regular_file_is_refused_clearly(runner, tmp_path, kind):
    lock = tmp_path / "drift.lock"
    lock.mkdir() if kind == "directory" else os.mkfifo(lock)
    with pytest.raises(runner.DriftError, match=r"refusing the lock file .*: it is not a regular file"):
        runner.acquire_lock(lock)


def test_the_runners_own_lock_file_is_reused_and_its_record_replaced(runner, tmp_path):
    lock = tmp_path / "drift.lock"
    lock.write_text("4242 2026-01-01T00:00:00Z and a longer record of an older run\n")
    handle = runner.acquire_lock(lock, clock=lambda: 0)
    try:
        assert lock.read_text() == f"{os.getpid()} 1970-01-01T00:00:00Z\n"
        assert os.get_inheritable(handle) is False
        assert os.get_blocking(handle)
    finally:
        os.close(handle)


# -- the reports directory --------------------------------------------------------------------------------------------
def fake_check():
    report = make_report("ok201", fact_pass(gpu_processes=step_facts()))
    return FakeAnsibleRunner({"check": ([report], [], "successful", 0)})


def test_a_reports_dir_that_is_a_symlink_is_refused_and_nothing_is_written_where_it_points(
    runner, tmp_path, victim, capsys
):
    project, inventory = project_with_unattended(tmp_path)
    reports = tmp_path / "shared" / "reports"
    reports.parent.mkdir()
    reports.symlink_to(victim.parent, target_is_directory=True)
    fake = fake_check()
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(reports)]
    code, out, err = run_main(runner, argv, capsys, ansible_runner=fake)
    assert (code, out) == (1, "")
    assert f"drift: refusing the directory {reports}: it is a symbolic link;" in err
    assert fake.calls == []
    assert untouched(victim)


def test_a_reports_dir_other_users_can_write_is_refused(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    reports = tmp_path / "reports"
    reports.mkdir()
    reports.chmod(0o1777)
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(reports)]
    code, _, err = run_main(runner, argv, capsys, ansible_runner=fake_check())
    assert code == 1
    assert "it is writable by every user (mode 1777)" in err
    assert list(reports.iterdir()) == []


def test_a_missing_reports_dir_is_made_private(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    reports = tmp_path / "state" / "reports"
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(reports)]
    code, _, _ = run_main(runner, argv, capsys, ansible_runner=fake_check())
    assert code == 0
    assert stat.S_IMODE(reports.stat().st_mode) & 0o027 == 0


def test_a_run_directory_planted_under_the_runs_name_is_never_written_through(runner, tmp_path, victim, capsys):
    """The run's name is its start time and pid: a link made under that name beforehand is refused."""
    project, inventory = project_with_unattended(tmp_path)
    reports = tmp_path / "reports"
    reports.mkdir(mode=0o750)
    started = 1_764_835_200.0
    planted = reports / (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started)) + f"-{os.getpid()}")
    planted.symlink_to(victim.parent, target_is_directory=True)
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(reports)]
    code, _, err = run_main(runner, argv, capsys, ansible_runner=fake_check(), clock=lambda: started)
    assert code == 1
    assert f"drift: {planted} exists already: refusing to write a run into a directory the runner did not make" in err
    assert untouched(victim)


# -- the textfile, the summary, pruning (already safe: kept so) ------------------------------------------------------
def test_a_textfile_or_summary_planted_as_a_symlink_is_replaced_never_written_through(runner, tmp_path, victim):
    for name in ("pve_gpu_recover.prom", "summary.json"):
        path = tmp_path / name
        path.symlink_to(victim)
        runner.write_atomic(path, "new\n")
        assert not path.is_symlink()
        assert path.read_text() == "new\n"
    assert untouched(victim)


def test_pruning_never_follows_a_link_named_like_a_run_nor_one_inside_a_run(runner, tmp_path, victim):
    reports = tmp_path / "reports"
    old, newer, newest = (reports / f"2026120{n}T000000Z-1" for n in (1, 2, 3))
    for run in (old, newer, newest):
        run.mkdir(parents=True)
    (old / "check").symlink_to(victim.parent, target_is_directory=True)
    (old / "summary.json").symlink_to(victim)
    link = reports / "20261130T000000Z-9"  # the oldest name of all, a link to the victim's directory
    link.symlink_to(victim.parent, target_is_directory=True)
    runner.prune_runs(reports, 2)
    assert sorted(p.name for p in reports.iterdir()) == sorted([link.name, newer.name, newest.name])
    assert untouched(victim)


def test_what_makes_a_directory_or_a_lock_file_unsafe(runner):
    from drift import files  # noqa: PLC0415 (after ROOT is on sys.path)

    def info(kind, mode, uid, nlink=1):
        return types.SimpleNamespace(st_mode=kind | mode, st_uid=uid, st_nlink=nlink)

    assert files.dir_problem(info(stat.S_IFDIR, 0o750, 1000), 1000) is None
    assert files.dir_problem(info(stat.S_IFDIR, 0o755, 0), 1000) is None  # root's: trusted
    assert files.dir_problem(info(stat.S_IFDIR, 0o770, 1000), 1000) is None  # the group is the owner's choice
    assert files.dir_problem(info(stat.S_IFDIR, 0o750, 1001), 1000) == (
        "is owned by uid 1001, neither this user (uid 1000) nor root"
    )
    assert files.dir_problem(info(stat.S_IFDIR, 0o1777, 0), 1000) == "is writable by every user (mode 1777)"
    assert files.dir_problem(info(stat.S_IFLNK, 0o777, 1000), 1000) == "is a symbolic link"
    assert files.lock_problem(info(stat.S_IFREG, 0o644, 1000), 1000) is None
    assert files.lock_problem(info(stat.S_IFREG, 0o644, 1001), 1000).startswith("is owned by uid 1001")
    assert files.lock_problem(info(stat.S_IFREG, 0o644, 1000, nlink=2), 1000) == "has 2 hard links"
