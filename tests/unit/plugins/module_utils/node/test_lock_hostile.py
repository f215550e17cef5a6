"""The run lock against a hostile node (issue 8): unsafe directories, planted files, odd content, racing takers."""

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock as node_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock import LockError, change_lock


def take(lock_dir, run_id="run-1", **kwargs):
    return change_lock("present", lock_dir=str(lock_dir), vmid=200, run_id=run_id, **kwargs)


def lock_file(lock_dir):
    return lock_dir / "ct-200.lock"


def write_lock(lock_dir, **content):
    lock_file(lock_dir).write_text(json.dumps(content))


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


# -- the lock directory ---------------------------------------------------------------------------------------
def test_a_missing_directory_is_created_only_writable_by_its_owner(tmp_path):
    lock_dir = tmp_path / "run" / "locks"
    assert take(lock_dir)["action"] == "taken"
    info = lock_dir.stat()
    assert (info.st_uid, info.st_mode & 0o022) == (os.geteuid(), 0)


def test_a_symlinked_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (tmp_path / "locks").symlink_to(real)
    with pytest.raises(LockError) as error:
        take(tmp_path / "locks")
    assert error.value.kind == "unsafe"
    assert str(error.value) == (
        f"the lock directory {tmp_path}/locks is a symbolic link: it must be a directory only root can write"
    )
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    lock_dir.chmod(mode)
    for check_mode in (False, True):
        with pytest.raises(LockError, match=r"is writable by group or others \(mode") as error:
            take(lock_dir, check_mode=check_mode)
        assert error.value.kind == "unsafe"
        assert "chmod 755" in error.value.hint
    assert list(lock_dir.iterdir()) == []


def test_a_directory_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir(mode=0o755)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(LockError, match=rf"is owned by uid {lock_dir.stat().st_uid}, not by uid 4242") as error:
        take(lock_dir)
    assert error.value.kind == "unsafe"


def test_a_file_where_the_directory_should_be_is_refused(tmp_path):
    (tmp_path / "locks").write_text("")
    with pytest.raises(LockError, match=r"is not a directory \(a regular file\)"):
        take(tmp_path / "locks")


# -- what is found at the lock's name -------------------------------------------------------------------------
def test_a_symlink_at_the_lock_name_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"run_id": "forged", "created": time.time(), "ttl": 60}))
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir(mode=0o755)
    lock_file(lock_dir).symlink_to(elsewhere)
    for state in ("present", "absent"):
        with pytest.raises(LockError) as error:
            change_lock(state, lock_dir=str(lock_dir), vmid=200, run_id="forged")
        assert error.value.kind == "unsafe"
        assert (
            str(error.value)
            == f"{lock_dir}/ct-200.lock is a symbolic link, not a lock file; remove it as root on this node"
        )
    assert elsewhere.exists()


def test_a_fifo_at_the_lock_name_is_refused_without_hanging(tmp_path):
    os.mkfifo(lock_file(tmp_path))
    started = time.monotonic()
    with pytest.raises(LockError, match=r"ct-200\.lock is a FIFO, not a lock file") as error:
        take(tmp_path)
    assert time.monotonic() - started < 10  # an open that blocked would never return: any bound tells them apart
    assert error.value.kind == "unsafe"


def test_a_directory_at_the_lock_name_is_refused(tmp_path):
    lock_file(tmp_path).mkdir()
    with pytest.raises(LockError, match=r"ct-200\.lock is a directory, not a lock file") as error:
        take(tmp_path, check_mode=True)
    assert error.value.kind == "unsafe"


def test_a_planted_symlink_at_the_old_temp_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir(mode=0o755)
    (lock_dir / f"ct-200.lock.{os.getpid()}.tmp").symlink_to(victim)  # the name the temp file used to have
    assert take(lock_dir)["action"] == "taken"
    assert victim.read_text() == "precious\n"
    assert json.loads(lock_file(lock_dir).read_text())["run_id"] == "run-1"


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ('["run-x"]', "a JSON list, not an object"),
        ('"run-x"', "a JSON string, not an object"),
        ("null", "a JSON null, not an object"),
        ('{"run_id": 7, "created": 1, "ttl": 60}', "run_id 7 is not a non-empty string"),
        ('{"run_id": "x", "created": "yesterday", "ttl": 60}', "created 'yesterday' is not a time from 1970 to 9999"),
        ('{"run_id": "x", "created": true, "ttl": 60}', "created True is not a time from 1970 to 9999"),
        ('{"run_id": "x", "created": 1e308, "ttl": 60}', "created 1e+308 is not a time from 1970 to 9999"),
        ('{"run_id": "x", "created": 1' + "0" * 400 + ', "ttl": 60}', "created 1000000000000000000000000000000"),
        ('{"run_id": "x", "created": 1e400, "ttl": 60}', "created inf is not a time"),
        ('{"run_id": "x", "created": NaN, "ttl": 60}', "not JSON (NaN is not a JSON number)"),
        ('{"run_id": "x", "created": 1, "ttl": 1e308}', "ttl 1e+308 is not a number of seconds from 1 to 2592000"),
        ('{"run_id": "x", "created": 1, "ttl": Infinity}', "not JSON (Infinity is not a JSON number)"),
        ('{"run_id": "x", "created": 1, "ttl": -5}', "ttl -5 is not a number of seconds"),
        ('{"run_id": "x", "created": 1, "ttl": 60, "controller_pid": -1}', "controller_pid -1 is not a process id"),
        ("[" * 60_000, "not JSON ("),
        ("\udcff", "not JSON ("),
        ("{" + " " * 70_000 + "}", f"more than {node_lock.MAX_LOCK_BYTES} bytes"),
    ],
)
def test_unexpected_content_is_reported_as_found_never_a_traceback(tmp_path, text, found):
    lock_file(tmp_path).write_bytes(text.encode(errors="surrogateescape"))
    with pytest.raises(LockError) as error:
        take(tmp_path)
    assert error.value.kind == "locked"
    assert str(error.value).startswith("CT 200 is locked by run unknown (unreadable lock file) of unknown (started ")
    assert f"; the lock file holds {found}" in str(error.value)
    assert error.value.details["holder"]["problem"].startswith(found)


def test_unexpected_content_still_expires_after_the_ttl_from_its_modification_time(tmp_path):
    lock_file(tmp_path).write_text('["run-x"]')
    os.utime(lock_file(tmp_path), (time.time() - 7300, time.time() - 7300))
    warnings = []
    assert take(tmp_path, warn=warnings.append)["action"] == "taken_over"
    assert "the lock file holds a JSON list, not an object" in warnings[0]


def test_a_created_time_far_in_the_future_cannot_hold_for_ever(tmp_path):
    write_lock(tmp_path, run_id="future", owner="x", created=time.time() + 86400, ttl=60)
    warnings = []
    result = take(tmp_path, warn=warnings.append)
    assert result["action"] == "taken_over"
    assert warnings[0].endswith("s in the future")
    assert json.loads(lock_file(tmp_path).read_text())["run_id"] == "run-1"


def test_a_created_time_a_little_ahead_is_clock_skew_and_holds(tmp_path):
    write_lock(tmp_path, run_id="other", owner="x", created=time.time() + 30, ttl=60)
    with pytest.raises(LockError) as error:
        take(tmp_path)
    assert error.value.kind == "locked"


# -- a run that is provably gone ------------------------------------------------------------------------------
def test_the_controller_host_and_pid_are_recorded(tmp_path):
    result = take(tmp_path, controller="ctl1", controller_pid=4321)
    on_disk = json.loads(lock_file(tmp_path).read_text())
    assert (on_disk["controller"], on_disk["controller_pid"]) == ("ctl1", 4321)
    assert result["holder"] == on_disk


def test_without_controller_the_lock_is_as_before(tmp_path):
    take(tmp_path)
    assert set(json.loads(lock_file(tmp_path).read_text())) == {"run_id", "owner", "created", "ttl", "pid", "pid_start"}


def test_a_lock_whose_controller_on_this_machine_is_gone_is_taken_over_before_its_ttl(tmp_path):
    pid = dead_pid()
    write_lock(
        tmp_path,
        run_id="dead",
        owner="x",
        created=time.time(),
        ttl=7200,
        controller=socket.gethostname(),
        controller_pid=pid,
    )
    warnings = []
    assert take(tmp_path, warn=warnings.append)["action"] == "taken_over"
    assert warnings[0].endswith(f"its controller (pid {pid} on {socket.gethostname()}) is gone")


def test_a_lock_whose_controller_lives_holds(tmp_path):
    write_lock(
        tmp_path,
        run_id="alive",
        owner="x",
        created=time.time(),
        ttl=7200,
        controller=socket.gethostname(),
        controller_pid=os.getpid(),
    )
    with pytest.raises(LockError, match="is locked by run alive"):
        take(tmp_path)


def test_a_lock_of_a_controller_elsewhere_holds_until_its_ttl(tmp_path):
    write_lock(
        tmp_path,
        run_id="remote",
        owner="x",
        created=time.time(),
        ttl=7200,
        controller="not-" + socket.gethostname(),
        controller_pid=dead_pid(),
    )
    with pytest.raises(LockError, match="is locked by run remote"):
        take(tmp_path)


@pytest.mark.parametrize("pid", [0, -1, True, "12", 10**9])
def test_a_controller_pid_that_is_no_pid_is_refused(tmp_path, pid):
    with pytest.raises(LockError, match="controller_pid must be a process id") as error:
        take(tmp_path, controller="ctl1", controller_pid=pid)
    assert error.value.kind == "invalid"


def test_a_ttl_beyond_what_a_reader_believes_is_refused(tmp_path):
    with pytest.raises(LockError, match="ttl must be at most 2592000 seconds") as error:
        take(tmp_path, ttl=10**9)
    assert error.value.kind == "invalid"


# -- two runs and one stale lock --------------------------------------------------------------------------------
def stale(lock_dir):
    write_lock(lock_dir, run_id="dead", owner="x", created=1, ttl=60)


def holders(lock_dir):
    return [json.loads(p.read_text())["run_id"] for p in lock_dir.iterdir() if p.name == "ct-200.lock"]


def test_two_runs_racing_for_a_stale_lock_one_wins_even_without_the_directory_guard(tmp_path, monkeypatch):
    """B takes the stale lock over between A's read and A's takeover (as a writer without flock could)."""
    stale(tmp_path)
    monkeypatch.setattr(node_lock, "guard", lambda *args, **kwargs: contextlib.nullcontext())
    real_read = node_lock.read_entry
    outcome = {}

    def read_then_let_b_run(dir_fd, name, path):
        found = real_read(dir_fd, name, path)
        if not outcome:
            outcome["b"] = "running"
            outcome["b"] = take(tmp_path, run_id="run-B")["action"]
        return found

    monkeypatch.setattr(node_lock, "read_entry", read_then_let_b_run)
    with pytest.raises(LockError, match=r"CT 200 was locked by run run-B of unknown .* a moment ago") as error:
        take(tmp_path, run_id="run-A")
    assert error.value.kind == "locked"
    assert outcome["b"] == "taken_over"
    assert holders(tmp_path) == ["run-B"]  # A moved B's lock aside, saw it was not the stale one, and put it back
    stale_files = [p for p in tmp_path.iterdir() if ".stale." in p.name]
    assert [json.loads(p.read_text())["run_id"] for p in stale_files] == ["dead"]


def test_two_runs_racing_for_a_stale_lock_are_serialized_by_the_directory_guard(tmp_path, monkeypatch):
    """Two threads: B starts while A is between its read and its write, and must wait for A, then see A's lock."""
    stale(tmp_path)
    real_read = node_lock.read_entry
    a_has_read = threading.Event()
    results = {}

    def slow_read_for_a(dir_fd, name, path):
        found = real_read(dir_fd, name, path)
        if threading.current_thread().name == "A":
            a_has_read.set()
            time.sleep(0.3)  # B runs meanwhile, as far as it can
        return found

    def run(name):
        if name == "B":
            a_has_read.wait(2)
        try:
            results[name] = take(tmp_path, run_id=f"run-{name}")["action"]
        except LockError as error:
            results[name] = error.kind

    monkeypatch.setattr(node_lock, "read_entry", slow_read_for_a)
    threads = [threading.Thread(target=run, args=(n,), name=n) for n in ("A", "B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert results == {"A": "taken_over", "B": "locked"}
    assert holders(tmp_path) == ["run-A"]


def test_a_guard_held_too_long_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(node_lock, "GUARD_TIMEOUT", 0.1)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(LockError, match="another run has been changing a lock in") as error:
            take(tmp_path)
        assert error.value.kind == "busy"
    finally:
        os.close(fd)
    assert take(tmp_path)["action"] == "taken"


def test_release_keeps_another_runs_lock_and_removes_its_own(tmp_path):
    take(tmp_path, run_id="run-1")
    other = change_lock("absent", lock_dir=str(tmp_path), vmid=200, run_id="run-2")
    assert other["action"] == "held_by_other"
    mine = change_lock("absent", lock_dir=str(tmp_path), vmid=200, run_id="run-1")
    assert mine["action"] == "released"
    assert list(tmp_path.iterdir()) == []


# -- why a lock still holds (issue 8, item 7): what a person reads before removing it by hand --------------------
HOLDER = {"run_id": "r1", "owner": "alice@ctl", "created": 1000.0, "ttl": 7200}


def test_a_lock_of_a_live_run_on_this_machine_says_it_is_still_working():
    holder = dict(HOLDER, controller="node1", controller_pid=4242)
    assert node_lock.why_held(holder, 1060.0, 7200, "node1", lambda pid: pid == 4242) == (
        "that run is still working (its controller pid 4242 lives on this machine)"
    )


def test_a_lock_of_a_controller_elsewhere_says_it_may_have_been_cut_off_and_when_it_expires():
    holder = dict(HOLDER, controller="laptop", controller_pid=4242)
    assert node_lock.why_held(holder, 1060.0, 7200, "node1", lambda pid: True) == (
        "if that run was cut off (its node unreachable, its controller laptop gone), nothing here can tell: the "
        "lock expires in 119 min"
    )
    assert "controller laptop pid 4242" in node_lock.describe_holder(holder, 1060.0)


def test_a_lock_without_controller_only_says_when_it_expires():
    assert node_lock.why_held(HOLDER, 1060.0, 7200, "node1", lambda pid: True) == "the lock expires in 119 min"
