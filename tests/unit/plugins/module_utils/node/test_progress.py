"""A long step's progress (issue 23 item 4): the script in the target tells it (ct_progress), the module on the
node reads it as it comes and puts it in its async job's status file (node_progress), which Ansible's polls hand to
the controller. Here: each piece, and the venv build's real script through Target in a CT (a local stand-in for
pct exec) and on a bare host, with a uv that downloads slowly."""

import json
import os
import sys
import textwrap
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import progress as ct_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import progress as node_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script as venv_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.acting import build_payload

from tests.conftest import FIXTURES

JOB = "j955916282008.11713"


@pytest.fixture(autouse=True)
def quiet_progress():
    """Progress state is module-global (a script runs once per process): each test starts and ends quiet."""
    ct_progress.start(False)
    ct_progress.sink = None
    yield
    ct_progress.start(False)
    ct_progress.sink = None


# -- what the target says, read on the node ------------------------------------------------------------------------
def test_a_progress_line_is_parsed_and_its_text_made_one_printable_line():
    line = ct_progress.MARK + json.dumps({"phase": "installing", "line": "a\x1b[2Jb\nforged", "phase_seconds": 3})
    assert node_progress.parse_line(line) == {"phase": "installing", "line": "a\\x1b[2Jb forged", "phase_seconds": 3.0}


@pytest.mark.parametrize(
    "line",
    [
        "Downloading torch (846.0MiB)",  # not ours
        ct_progress.MARK + "{half",
        ct_progress.MARK + json.dumps(["phase"]),
        ct_progress.MARK + json.dumps({"phase": 7}),
    ],
)
def test_anything_else_is_no_progress(line):
    assert node_progress.parse_line(line) is None


def test_what_people_read():
    assert node_progress.elapsed(3725) == "1h02m05s"
    assert node_progress.elapsed(252.4) == "4m12s"
    assert node_progress.elapsed(None) == "0s"
    progress = {"step": "training_venv", "phase": "`uv venv` with 3.11", "line": None, "elapsed_seconds": 9}
    assert node_progress.describe(progress) == "training_venv: `uv venv` with 3.11 (9s)"
    assert node_progress.describe("garbage") == ""


# -- finding the async job's status file -----------------------------------------------------------------------------
def fake_job(tmp_path, argv, files=(JOB,)):
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    jobs = tmp_path / "async"
    jobs.mkdir()
    for name in files:
        (jobs / name).write_text(json.dumps({"started": True, "finished": False, "ansible_job_id": name}))
    return {"ANSIBLE_ASYNC_DIR": str(jobs)}, proc, jobs


WRAPPER = ["/usr/bin/python3", "/root/.ansible/tmp/ansible-tmp-1/async_wrapper.py", "j955916282008", "60", "/m.py", "_"]


def test_the_job_file_is_found_from_async_wrappers_argv(tmp_path):
    environ, proc, jobs = fake_job(tmp_path, WRAPPER, files=(JOB, "j1.2", f"{JOB}.tmp"))
    assert node_progress.async_job_file(environ, 4242, str(proc)) == str(jobs / JOB)


@pytest.mark.parametrize(
    ("argv", "files", "environ"),
    [
        (["/usr/bin/python3", "/tmp/AnsiballZ_training_venv.py"], (JOB,), True),  # not an async job
        (WRAPPER, (), True),  # no status file
        (WRAPPER, (JOB, "j955916282008.9"), True),  # two: never guess
        ([*WRAPPER[:2], "1; rm -rf /", *WRAPPER[3:]], (JOB,), True),  # not a job id
        (WRAPPER, (JOB,), False),  # no ANSIBLE_ASYNC_DIR: not run by async_wrapper
    ],
)
def test_anything_unexpected_means_no_job_file_and_no_progress(tmp_path, argv, files, environ):
    env, proc, _ = fake_job(tmp_path, argv, files)
    assert node_progress.async_job_file(env if environ else {}, 4242, str(proc)) is None


# -- writing it ------------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def reporter(path, clock):
    return node_progress.Reporter("training_venv", "CT 200 on pve1", path=str(path), clock=clock, wall=lambda: 0)


def status(path):
    return json.loads(path.read_text())


def test_the_status_file_gets_the_progress_and_stays_an_unfinished_status(tmp_path):
    _, _, jobs = fake_job(tmp_path, WRAPPER)
    path, clock = jobs / JOB, Clock()
    progress = reporter(path, clock)
    progress.phase("starting the build")
    assert status(path) == {
        "started": True,
        "finished": False,
        "ansible_job_id": JOB,
        "pve_gpu_recover_progress": {
            "step": "training_venv",
            "target": "CT 200 on pve1",
            "phase": "starting the build",
            "line": None,
            "phase_seconds": 0.0,
            "elapsed_seconds": 0.0,
            "updated": "1970-01-01T00:00:00Z",
        },
    }
    clock.now += 30
    line = {"phase": "installing the lock with `uv pip sync`", "line": "Downloading torch", "phase_seconds": 1}
    # Chunks as they come: a line split over two reads is taken once it ends.
    text = ct_progress.MARK + json.dumps(line) + "\n"
    progress.feed("stderr", text[:20].encode())
    assert status(path)["pve_gpu_recover_progress"]["phase"] == "starting the build"
    progress.feed("stdout", text.encode())  # stdout is the answer, never progress
    progress.feed("stderr", text[20:].encode())
    written = status(path)["pve_gpu_recover_progress"]
    assert (written["phase"], written["line"], written["elapsed_seconds"]) == (line["phase"], line["line"], 30.0)
    # The same phase again within WRITE_INTERVAL: kept in memory, not written; a new phase is written at once.
    clock.now += 1
    progress.feed("stderr", (ct_progress.MARK + json.dumps(dict(line, line="Downloaded torch")) + "\n").encode())
    assert status(path)["pve_gpu_recover_progress"]["line"] == "Downloading torch"
    progress.feed("stderr", (ct_progress.MARK + json.dumps({"phase": "checking"}) + "\n").encode())
    assert status(path)["pve_gpu_recover_progress"]["phase"] == "checking"
    assert sorted(p.name for p in jobs.iterdir()) == [JOB]  # no temporary file left


def test_a_finished_or_foreign_status_is_never_written(tmp_path):
    _, _, jobs = fake_job(tmp_path, WRAPPER)
    path = jobs / JOB
    done = {"changed": True, "ansible_job_id": JOB, "finished": True}
    path.write_text(json.dumps(done))
    reporter(path, Clock()).phase("late")
    assert status(path) == done
    other = {"started": True, "finished": False, "ansible_job_id": "j1.2"}
    path.write_text(json.dumps(other))
    reporter(path, Clock()).phase("late")
    assert status(path) == other
    path.unlink()
    reporter(path, Clock()).phase("gone")  # async_wrapper cleaned up: nothing made
    assert not path.exists()


def test_follow_asks_for_progress_only_when_there_is_a_job_file(tmp_path, monkeypatch):
    payload = {"path": "/opt/venvs/train"}
    monkeypatch.setattr(node_progress, "async_job_file", lambda: None)
    assert node_progress.follow("training_venv", "CT 200 on pve1", payload) is None
    assert "progress" not in payload  # the payload the module's tests pin stays as it was
    _, _, jobs = fake_job(tmp_path, WRAPPER)
    monkeypatch.setattr(node_progress, "async_job_file", lambda: str(jobs / JOB))
    reader = node_progress.follow("training_venv", "CT 200 on pve1", payload, "starting the build")
    assert payload["progress"] is True and callable(reader)
    assert status(jobs / JOB)["pve_gpu_recover_progress"]["phase"] == "starting the build"


# -- the status call's wait on the node (library/step_job_status.py) ----------------------------------------------
def jwrite(path, status):
    """As async_wrapper writes its status: a .tmp file renamed over the job's."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(status))
    os.rename(temp, path)


@pytest.mark.parametrize(
    ("status", "finished"),
    [
        ({"started": True, "finished": False, "ansible_job_id": JOB}, False),  # async_wrapper's, or ours with progress
        ({}, False),  # a file that did not parse: running, as async_status reads it
        ({"changed": True, "changes": []}, True),  # the module's answer
        ({"msg": "Timeout exceeded", "failed": True, "child_pid": 42}, True),  # async_wrapper ended it
        ({"started": True, "finished": True}, True),
        (None, False),
    ],
)
def test_a_status_is_finished_by_async_status_rule(status, finished):
    assert node_progress.job_finished(status) is finished


def test_a_status_file_is_read_bounded_and_half_of_one_is_running(tmp_path, monkeypatch):
    path = tmp_path / JOB
    assert node_progress.read_job(str(path)) is None
    path.write_text('{"started": tr')
    assert node_progress.read_job(str(path)) == {}
    monkeypatch.setattr(node_progress, "JOB_FILE_CAP", 2 << 20)
    path.write_text(json.dumps({"changed": True, "changes": ["x" * (3 << 20)]}))
    # Past the cap: never parsed, and said as the job's failure (never a job that seems to run until its limit).
    too_big = node_progress.read_job(str(path))
    assert too_big == {"failed": True, "msg": f"the job's answer in {path} is over 2 MiB: not read"}
    assert node_progress.job_finished(too_big)


def test_the_wait_stats_the_file_and_reads_it_again_only_when_it_changed(tmp_path, monkeypatch):
    job = tmp_path / JOB
    jwrite(job, {"started": True, "finished": False, "ansible_job_id": JOB})
    reads = []
    real = node_progress.read_job
    monkeypatch.setattr(node_progress, "read_job", lambda path: reads.append(path) or real(path))
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds
        if len(reads) == 1 and now[0] > 1:  # a new progress, a second in
            jwrite(job, {"started": True, "finished": False, "ansible_job_id": JOB, node_progress.KEY: {"phase": "x"}})

    status = node_progress.wait_for_job(str(job), 3, clock=lambda: now[0], sleep=sleep)
    assert status[node_progress.KEY] == {"phase": "x"} and not node_progress.job_finished(status)
    assert len(reads) == 2 and now[0] == pytest.approx(3)  # 60 looks, two reads


def test_the_wait_ends_at_the_first_look_that_finds_the_answer(tmp_path):
    job = tmp_path / JOB
    jwrite(job, {"started": True, "finished": False, "ansible_job_id": JOB})
    now, looks = [0.0], []

    def sleep(seconds):
        now[0] += seconds
        looks.append(now[0])
        if len(looks) == 7:
            jwrite(job, {"changed": True})

    assert node_progress.wait_for_job(str(job), 15, clock=lambda: now[0], sleep=sleep) == {"changed": True}
    assert now[0] == pytest.approx(7 * node_progress.TICK)  # not the 15 s it was willing to wait


def test_a_job_file_that_never_comes_is_none_after_the_wait(tmp_path):
    now = [0.0]
    status = node_progress.wait_for_job(
        str(tmp_path / JOB), 0.2, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    assert status is None and now[0] == pytest.approx(0.2)


# -- telling it, in the target ---------------------------------------------------------------------------------------
def test_the_follower_tells_each_ended_line_as_it_comes(monkeypatch):
    """ct_progress.follow_output() is the on_output of the one runner (ct_run.run): each line a command ends is told
    as it comes, a line not ended yet only once it ends."""
    told = []
    monkeypatch.setattr(ct_progress, "INTERVAL", 0.0)
    ct_progress.sink = told.append
    ct_progress.start(True)
    ct_progress.phase("installing")
    code = """
        import sys, time
        print("Resolved 3 packages", file=sys.stderr, flush=True)
        time.sleep(0.3)
        sys.stderr.write("Downloading torch (846.0MiB)\\nhalf a li"); sys.stderr.flush()
        time.sleep(0.3)
        print("answer")
    """
    done = ct_run.run([sys.executable, "-c", textwrap.dedent(code)], 30, on_output=ct_progress.follow_output())
    assert done == {
        "rc": 0,
        "stdout": "answer\n",
        "stderr": "Resolved 3 packages\nDownloading torch (846.0MiB)\nhalf a li",
    }
    lines = [node_progress.parse_line(text) for text in told]
    assert lines[0] == {"phase": "installing", "line": None, "phase_seconds": 0.0}
    seen = [found["line"] for found in lines]
    assert "Resolved 3 packages" in seen and "Downloading torch (846.0MiB)" in seen
    assert "half a li" not in seen  # a line is told once it ends
    assert all(found["phase"] == "installing" for found in lines)


def test_the_follower_tells_a_silent_command_on_the_runners_tick(monkeypatch):
    """A command that prints nothing for a while is still told (its phase and how long it has run): the runner calls
    on_output(None) every TICK seconds of silence."""
    told = []
    monkeypatch.setattr(ct_progress, "INTERVAL", 0.0)
    monkeypatch.setattr(ct_run, "TICK", 0.1)
    ct_progress.sink = told.append
    ct_progress.start(True)
    ct_progress.phase("installing")
    done = ct_run.run(["sleep", "0.5"], 30, on_output=ct_progress.follow_output())
    assert done["rc"] == 0
    seconds = [node_progress.parse_line(text)["phase_seconds"] for text in told]
    assert len(seconds) >= 3 and seconds == sorted(seconds) and seconds[-1] >= 0.3


def test_nothing_is_told_unless_the_payload_asked():
    told = []
    ct_progress.sink = told.append
    ct_progress.start(None)
    ct_progress.phase("installing")
    ct_progress.note("Downloading torch")
    assert told == []


def test_a_secret_is_masked_before_the_line_is_cut(monkeypatch):
    """What the build's commands print may quote a secret (an index token, a URL's user information): masked as
    the script's answer is, before the line is cut to LINE_CHARS, so not even a part of one is told."""
    from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act  # noqa: PLC0415

    told = []
    monkeypatch.setattr(ct_progress, "INTERVAL", 0.0)
    ct_progress.sink = told.append
    secret = "t0ken-" + "x" * 40
    ct_progress.start(True, redact=lambda text: ct_act.redact(text, [secret]))
    ct_progress.phase(f"fetching with {secret}")
    cut = ct_progress.LINE_CHARS - 20  # the secret straddles the cut
    ct_progress.note("a" * cut + secret)
    ct_progress.note("Downloading https://bob:hunter2@idx.example/simple/torch")
    found = [node_progress.parse_line(text) for text in told]
    assert found[0]["phase"] == f"fetching with {ct_act.MASK}"
    assert found[1]["line"] == "a" * cut + ct_act.MASK
    assert found[2]["line"] == f"Downloading https://{ct_act.MASK}@idx.example/simple/torch"
    assert not any("t0ken" in text or "hunter2" in text for text in told)


# -- the venv build's own script, in a CT and on a bare host ----------------------------------------------------------
SLOW_UV = """#!/bin/sh
# uv as a slow index makes it look: `uv venv` makes the directory, `uv pip sync` downloads for a while, then fails.
case "$1" in
  venv) shift 4; mkdir -p "$1/bin"; echo "Using CPython 3.11"; exit 0 ;;
  pip) echo "Resolved 3 packages" >&2; sleep 0.2; echo "Downloading torch (846.0MiB)" >&2; sleep 2.6
       echo "error: Failed to download torch: connection closed" >&2; exit 2 ;;
esac
exit 1
"""


class Recording(node_progress.Reporter):
    """A reporter that keeps every progress it would write to the job's status file."""

    def __init__(self):
        super().__init__("training_venv", "CT 200 on pve1", path="status file")
        self.seen = []

    def write(self):
        self.seen.append(dict(self.progress))


def local_pct(argv, *, stdin=None, timeout=None, env=None, on_output=None):
    """``pct exec 200 ... -- <argv>`` run here as pct would run it in the CT: the argv after ``--``."""
    inner = argv[argv.index("--") + 1 :]
    return node_target.run_local(inner, stdin=stdin, timeout=timeout, env=env, on_output=on_output)


@pytest.mark.parametrize("where", ["ct", "bare host"])
def test_the_venv_build_tells_its_phases_and_what_uv_downloads_while_it_runs(tmp_path, monkeypatch, where):
    monkeypatch.setattr(node_progress, "WRITE_INTERVAL", 0.0)
    uv = tmp_path / "uv"
    uv.write_text(SLOW_UV)
    uv.chmod(0o755)
    spec = {"path": str(tmp_path / "venvs" / "train"), "lock": (FIXTURES / "venv" / "lock_cu128.txt").read_text()}
    spec.update(python_version="3.11", tooling="ignore", keep=None, unattended=False, unattended_keep=3)
    payload = build_payload(spec, {"uv": str(uv), "build_timeout": 60}, "20261203T101500Z")
    progress = Recording()
    payload["progress"] = True
    target = Target(200, node="pve1", runner=local_pct) if where == "ct" else Target(node="gpu1")
    started = time.monotonic()
    parts = target.run_probes({"build": (venv_script, payload)}, python="python3", timeout=60, on_output=progress.feed)
    assert time.monotonic() - started >= 2.5
    answer = parts["build"]["answer"]
    assert answer["error"] == "index_unreachable"  # the build failed as uv said, and was cleaned up
    phases = [seen["phase"] for seen in progress.seen]
    assert phases[0] == "`uv venv` with 3.11"
    assert "installing the lock with `uv pip sync`" in phases
    installing = [seen for seen in progress.seen if seen["phase"] == "installing the lock with `uv pip sync`"]
    # Told while uv ran (its output and a heartbeat every INTERVAL), not only when it ended.
    assert any(seen["line"] == "Downloading torch (846.0MiB)" for seen in installing), progress.seen
    assert max(seen["phase_seconds"] or 0 for seen in installing) >= ct_progress.INTERVAL
    assert not os.path.exists(f"{spec['path']}.20261203T101500Z")


def test_the_venv_builds_progress_masks_its_secrets(tmp_path, monkeypatch):
    """The build's network secrets (secret_environment, index passwords) never reach a progress line, whatever uv
    prints (bare host: the script runs in this process)."""
    monkeypatch.setattr(node_progress, "WRITE_INTERVAL", 0.0)
    monkeypatch.setattr(ct_progress, "INTERVAL", 0.0)
    uv = tmp_path / "uv"
    uv.write_text(
        '#!/bin/sh\ncase "$1" in\n  venv) shift 4; mkdir -p "$1/bin"; exit 0 ;;\n'
        '  pip) echo "Fetching https://bob:$UV_TOKEN@idx.example/simple" >&2; echo "token $UV_TOKEN" >&2; sleep 0.1\n'
        '       echo "error: Failed to download torch: connection closed" >&2; exit 2 ;;\nesac\nexit 1\n'
    )
    uv.chmod(0o755)
    spec = {"path": str(tmp_path / "venvs" / "train"), "lock": (FIXTURES / "venv" / "lock_cu128.txt").read_text()}
    spec.update(python_version="3.11", tooling="ignore", keep=None, unattended=False, unattended_keep=3)
    params = {"uv": str(uv), "build_timeout": 60, "secret_environment": {"UV_TOKEN": "s3cr3t-t0ken"}}
    payload = build_payload(spec, params, "20261203T101500Z")
    progress = Recording()
    payload["progress"] = True
    parts = Target(node="gpu1").run_probes({"build": (venv_script, payload)}, timeout=60, on_output=progress.feed)
    assert parts["build"]["answer"]["error"] == "index_unreachable"
    lines = [seen["line"] for seen in progress.seen if seen["line"]]
    assert "token ********" in lines, progress.seen
    assert not any("s3cr3t" in json.dumps(seen) for seen in progress.seen)


def test_the_warm_up_tells_its_latest_output_line_while_it_compiles(monkeypatch):
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import script  # noqa: PLC0415

    told = []
    monkeypatch.setattr(ct_progress, "INTERVAL", 0.0)
    ct_progress.sink = told.append
    ct_progress.start(True)
    code = "import time\nfor i in range(3):\n    print(f'compiling layer {i + 1}/3', flush=True); time.sleep(0.2)\n"
    warmup = {"argv": [sys.executable, "-c", code], "env": {"PATH": "/usr/bin:/bin"}, "timeout": 30, "cwd": "/"}
    rc, out, _, _ = script.run_warmup(warmup, time.monotonic() + 30)
    assert (rc, out.splitlines()[-1]) == (0, "compiling layer 3/3")
    found = [node_progress.parse_line(text) for text in told]
    assert found[0]["phase"].startswith("warming up the compile cache with `")
    assert "compiling layer 2/3" in [f["line"] for f in found]
