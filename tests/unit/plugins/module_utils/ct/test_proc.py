"""ct_proc: the one reader of /proc files that can block (one child for a whole pass, bounded in bytes and time) and
the one rule in the target for who uses a directory (issues 40 and 42).

A process stuck in the driver holds its mmap lock, and a read of its cmdline, environ or maps never returns: here a
FIFO in a fake /proc tree plays that file (a writer is held open and never writes, so a read waits for ever; one
with no writer at all blocks the reader's open). Real processes for the rest.
"""

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run

from tests.conftest import ROOT, other_python, unavailable

STALL = 0.5  # seconds a file may take in these tests (2 s in a run)


@contextlib.contextmanager
def blocking(path, *, writer=True):
    """A FIFO at ``path`` whose read never returns: a writer held open that never writes (``writer`` False: none,
    so that even its open blocks)."""
    os.mkfifo(path)
    held = os.open(path, os.O_RDWR) if writer else None
    try:
        yield path
    finally:
        if held is not None:
            os.close(held)
        else:  # let an open still waiting return (the reader was killed; this is only for safety)
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def fake(proc, pid, *, argv=("python3",), cwd="/", exe="/usr/bin/python3.11", fds=(), maps=(), environ=b"LANG=C\0"):
    """A /proc/<pid> as the target shows a process: comm, cwd, exe, fd/*, cmdline, environ, maps."""
    base = proc / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "comm").write_text(Path(argv[0]).name[:15] + "\n")
    os.symlink(cwd, base / "cwd")
    os.symlink(exe, base / "exe")
    for number, path in enumerate(["/dev/null", *fds]):
        os.symlink(path, base / "fd" / str(number))
    (base / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (base / "environ").write_bytes(environ)
    (base / "maps").write_text(
        "".join(f"7f{n:02x}0-7f{n:02x}1 r-xp 00000000 00:2a 1  {p}\n" for n, p in enumerate(maps))
    )
    return base


# -- the reader --------------------------------------------------------------------------------------------------
def test_one_reader_reads_every_file_bounded_and_names_the_one_that_blocks_then_reads_the_rest(tmp_path, monkeypatch):
    proc = tmp_path / "proc"
    for pid in (10, 11, 12, 13, 14):
        fake(proc, pid, argv=["python3", f"job-{pid}.py"])
    (proc / "10" / "maps").write_bytes(b"x" * (ct_proc.LIMITS["maps"] + 100))  # more than its limit
    (proc / "12" / "environ").unlink()  # the process ended while it was read
    calls, run = [], ct_run.run
    monkeypatch.setattr(ct_run, "run", lambda *a, **k: calls.append(a[0]) or run(*a, **k))
    paths = [str(proc / str(pid) / name) for pid in (10, 11, 12, 13, 14) for name in ct_proc.READS]
    with blocking(proc / "11" / "maps.fifo") as fifo:
        (proc / "11" / "maps").unlink()
        os.rename(fifo, proc / "11" / "maps")
        with blocking(proc / "13" / "cmdline.fifo", writer=False) as shut:
            (proc / "13" / "cmdline").unlink()
            os.rename(shut, proc / "13" / "cmdline")
            started = time.monotonic()
            found = ct_proc.read(paths, time.monotonic() + 30, stall=STALL)
            took = time.monotonic() - started
    assert took < 2 * STALL + 2 * ct_run.REAP_GRACE, took
    assert len(calls) == 3  # one reader, then one after each file that blocked: never one per file
    assert found[f"{proc}/10/maps"] == (b"x" * ct_proc.LIMITS["maps"], None)
    assert found[f"{proc}/10/cmdline"] == (b"python3\0job-10.py\0", None)
    assert found[f"{proc}/11/environ"] == (b"LANG=C\0", None)
    data, error = found[f"{proc}/11/maps"]
    assert data is None and error.startswith(f"no answer within {STALL:g} s reading {proc}/11/maps (the process is")
    assert "state D" in error
    assert found[f"{proc}/12/environ"] == (None, None)  # gone: not an error
    assert found[f"{proc}/12/maps"] == (b"", None)
    # Its open blocked: named, and its other files (the same process, the same lock) are not tried.
    said = found[f"{proc}/13/cmdline"][1]
    assert said.startswith(f"no answer within {STALL:g} s reading {proc}/13/cmdline")
    assert found[f"{proc}/13/environ"] == found[f"{proc}/13/maps"] == (None, said)
    assert found[f"{proc}/14/cmdline"] == (b"python3\0job-14.py\0", None)


def test_what_a_process_wrote_in_its_files_cannot_pass_for_a_frame_of_another(tmp_path):
    proc = tmp_path / "proc"
    forged = b"python3\0\n0 0 5\nevil!\n1 0 9\n/srv/train\nreader\n"
    fake(proc, 20)
    (proc / "20" / "cmdline").write_bytes(forged)
    fake(proc, 21)
    found = ct_proc.read([f"{proc}/20/cmdline", f"{proc}/21/cmdline"], time.monotonic() + 30)
    assert found == {f"{proc}/20/cmdline": (forged, None), f"{proc}/21/cmdline": (b"python3\0", None)}


def test_a_deadline_that_comes_first_leaves_the_rest_late_never_blamed(tmp_path):
    proc = tmp_path / "proc"
    fake(proc, 30)
    fake(proc, 31)
    paths = [f"{proc}/30/cmdline", f"{proc}/31/cmdline"]
    assert ct_proc.read(paths, time.monotonic() - 1) == {path: (None, ct_proc.LATE) for path in paths}
    with blocking(proc / "30" / "maps.fifo") as fifo:
        (proc / "30" / "maps").unlink()
        os.rename(fifo, proc / "30" / "maps")
        found = ct_proc.read([f"{proc}/30/maps", *paths], time.monotonic() + 0.5, stall=10)
    assert found == {f"{proc}/30/maps": (None, ct_proc.LATE), **{path: (None, ct_proc.LATE) for path in paths}}


def test_each_reader_prints_at_most_its_budget_and_the_next_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(ct_proc, "BATCH", 1000)
    proc = tmp_path / "proc"
    for pid in range(40, 46):
        fake(proc, pid)
        (proc / str(pid) / "environ").write_bytes(bytes([65 + pid - 40]) * 700)
    found = ct_proc.read([f"{proc}/{pid}/environ" for pid in range(40, 46)], time.monotonic() + 30)
    assert [found[f"{proc}/{pid}/environ"] for pid in range(40, 46)] == [
        (bytes([65 + n]) * 700, None) for n in range(6)
    ]


# -- who uses a directory ----------------------------------------------------------------------------------------
REPO = "/srv/train"


def test_each_way_a_process_uses_a_root_is_named_cheapest_first(tmp_path):
    proc = tmp_path / "proc"
    fake(proc, 100, argv=["python3", "train.py"], cwd=f"{REPO}/runs", maps=[f"{REPO}/ext.so"])
    fake(proc, 101, argv=["tail", "-f", "x.log"], exe="/usr/bin/tail", fds=[f"{REPO}/logs/x.log (deleted)"])
    fake(proc, 102, argv=["python3", f"{REPO}/train.py"], cwd="/root")
    fake(proc, 103, argv=["python3", "worker.py"], cwd="/home/alice", environ=b"PYTHONPATH=/srv/train/src\0")
    fake(proc, 104, argv=["python3", "-m", "train.main"], cwd="/srv")
    fake(proc, 105, argv=["python3", "serve.py"], cwd="/opt", maps=[f"{REPO}/lib/_C.so (deleted)"])
    fake(proc, 106, argv=[f"{REPO}/bin/tool"], exe=f"{REPO}/bin/tool")
    fake(proc, 107, argv=["python3", "/srv/train2/train.py"], cwd="/srv/train2")  # another directory
    fake(proc, 108, argv=["python3", "-m", "train.main"], cwd="/home/alice")  # another train package
    (proc / "109").mkdir()  # a kernel thread: no exe, no files
    (proc / "109" / "comm").write_text("kworker/0:1\n")
    found = ct_proc.scan([REPO], proc=str(proc), stall=STALL)
    assert (found["unreadable"], found["late"]) == ([], [])
    assert [(u["pid"], u["name"], u["uses"]) for u in found["users"]] == [
        (100, "python3", [["cwd", REPO, f"{REPO}/runs"], ["mapped", REPO, f"{REPO}/ext.so"]]),
        (101, "tail", [["open", REPO, f"{REPO}/logs/x.log"]]),
        (102, "python3", [["argv", REPO, f"{REPO}/train.py"]]),
        (103, "python3", [["pythonpath", REPO, f"{REPO}/src"]]),
        (104, "python3", [["module", REPO, REPO]]),
        (105, "python3", [["mapped", REPO, f"{REPO}/lib/_C.so"]]),
        (106, "tool", [["exe", REPO, f"{REPO}/bin/tool"], ["argv", REPO, f"{REPO}/bin/tool"]]),
    ]
    assert ct_proc.per_root(found, [REPO, "/srv/other"]) == {
        REPO: [{"pid": u["pid"], "name": u["name"], "how": sorted(h for h, _, _ in u["uses"])} for u in found["users"]],
        "/srv/other": [],
    }


def test_a_process_whose_maps_blocks_is_named_and_every_other_one_is_still_read(tmp_path):
    proc = tmp_path / "proc"
    fake(proc, 200, argv=["python3", "train.py"], cwd=REPO)
    fake(proc, 201, argv=["python3", "stuck.py"], cwd="/root")
    for pid in range(202, 260):  # many processes after it, one of them a user
        fake(proc, pid, argv=["sleep", "60"], exe="/usr/bin/sleep", maps=[f"{REPO}/x.so"] if pid == 259 else [])
    with blocking(proc / "201" / "maps.fifo") as fifo:
        (proc / "201" / "maps").unlink()
        os.rename(fifo, proc / "201" / "maps")
        started = time.monotonic()
        found = ct_proc.scan([REPO], time.monotonic() + 30, proc=str(proc), stall=STALL)
    assert time.monotonic() - started < 2 * STALL + 2 * ct_run.REAP_GRACE
    assert [(u["pid"], u["uses"][0][0]) for u in found["users"]] == [(200, "cwd"), (259, "mapped")]
    (blocked,) = found["unreadable"]
    assert (blocked["pid"], blocked["name"]) == (201, "python3")
    assert blocked["error"].startswith(f"no answer within {STALL:g} s reading {proc}/201/maps")
    assert found["late"] == []


def test_processes_the_deadline_leaves_unread_are_late_never_users_nor_blamed(tmp_path):
    proc = tmp_path / "proc"
    fake(proc, 300, cwd=REPO)
    fake(proc, 301)
    found = ct_proc.scan([REPO], time.monotonic() - 1, proc=str(proc))
    assert found == {
        "users": [],
        "unreadable": [],
        "late": [{"pid": 300, "name": "python3"}, {"pid": 301, "name": "python3"}],
    }


def test_real_processes_by_cwd_open_file_argv_pythonpath_and_a_mapped_file(tmp_path):
    root = tmp_path / "cache"
    (root / "pkg").mkdir(parents=True)
    (root / "data.bin").write_bytes(b"\0" * 4096)
    env = {"PATH": os.environ["PATH"]}
    mapper = (
        "import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
        "f.close(); print('ready', flush=True); sys.stdin.read()"
    )
    jobs = [
        subprocess.Popen(["sleep", "60"], cwd=root, env=env),
        subprocess.Popen(["sleep", "60"], env=dict(env, PYTHONPATH=f"{root}/pkg")),
        subprocess.Popen(["sh", "-c", 'exec 3<"$1"; exec sleep 60', "sh", str(root / "data.bin")], env=env),
        subprocess.Popen(
            [sys.executable, "-c", mapper, str(root / "data.bin")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        ),
    ]
    try:
        assert jobs[3].stdout.readline() == "ready\n"
        found = {}
        for _ in range(100):  # until the shell has opened its file and exec'd sleep
            found = {u["pid"]: u["uses"] for u in ct_proc.scan([str(root)])["users"]}
            if found.get(jobs[2].pid, [[None]])[0][0] == "open" and len(found) == 4:
                break
            time.sleep(0.05)
        assert found == {
            jobs[0].pid: [["cwd", str(root), str(root)]],
            jobs[1].pid: [["pythonpath", str(root), f"{root}/pkg"]],
            jobs[2].pid: [["open", str(root), f"{root}/data.bin"]],
            jobs[3].pid: [  # python's mmap keeps a copy of the file's descriptor
                ["open", str(root), f"{root}/data.bin"],
                ["argv", str(root), f"{root}/data.bin"],
                ["mapped", str(root), f"{root}/data.bin"],
            ],
        }
    finally:
        for job in jobs:
            job.kill()
            job.wait()


def test_the_scan_runs_on_python_3_9_as_the_target_ships_it(tmp_path):
    python = other_python("3.9")
    if python is None:
        unavailable("no python3.9 here")
    proc = tmp_path / "proc"
    fake(proc, 400, cwd=REPO)
    fake(proc, 401, environ=b"PYTHONPATH=/srv/train\0")
    program = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc; "
        "print(json.dumps(proc.scan(['/srv/train'], proc=sys.argv[2])))"
    )
    collections = ROOT / "collections"
    done = subprocess.run(
        [python, "-c", program, str(collections), str(proc)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "users": [
            {"pid": 400, "name": "python3", "uses": [["cwd", REPO, REPO]]},
            {"pid": 401, "name": "python3", "uses": [["pythonpath", REPO, REPO]]},
        ],
        "unreadable": [],
        "late": [],
    }


@pytest.mark.parametrize(
    ("argv", "module"),
    [
        (["python3", "-u", "-m", "train.main"], "train.main"),
        (["python3", "-mtrain"], "train"),
        (["python3", "-W", "ignore", "-m", "x"], "x"),
        (["python3", "-c", "import x", "-m", "y"], None),
        (["python3", "train.py", "-m", "y"], None),
    ],
)
def test_the_module_of_a_python_command_line_is_read_as_python_reads_its_options(argv, module):
    assert ct_proc.module_of(argv) == module
