"""A long step's progress (issue 23 item 4): the script in the target tells it (pve_ct_progress), the module on the
node reads it as it comes and puts it in its async job's status file (pve_progress), which Ansible's polls hand to
the controller. Here: each piece, and the venv build's real script through Target in a CT (a local stand-in for
pct exec) and on a bare host, with a uv that downloads slowly."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_progress, pve_progress, pve_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_target import Target
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script as venv_script

from tests.conftest import FIXTURES

JOB = "j955916282008.11713"


@pytest.fixture(autouse=True)
def quiet_progress():
    """Progress state is module-global (a script runs once per process): each test starts and ends quiet."""
    pve_ct_progress.start(False)
    pve_ct_progress.sink = None
    yield
    pve_ct_progress.start(False)
    pve_ct_progress.sink = None


# -- what the target says, read on the node ------------------------------------------------------------------------
def test_a_progress_line_is_parsed_and_its_text_made_one_printable_line():
    line = pve_ct_progress.MARK + json.dumps({"phase": "installing", "line": "a\x1b[2Jb\nforged", "phase_seconds": 3})
    assert pve_progress.parse_line(line) == {"phase": "installing", "line": "a\\x1b[2Jb forged", "phase_seconds": 3.0}


@pytest.mark.parametrize(
    "line",
    [
        "Downloading torch (846.0MiB)",  # not ours
        pve_ct_progress.MARK + "{half",
        pve_ct_progress.MARK + json.dumps(["phase"]),
        pve_ct_progress.MARK + json.dumps({"phase": 7}),
    ],
)
def test_anything_else_is_no_progress(line):
    assert pve_progress.parse_line(line) is None


def test_what_people_read():
    assert pve_progress.elapsed(3725) == "1h02m05s"
    assert pve_progress.elapsed(252.4) == "4m12s"
    assert pve_progress.elapsed(None) == "0s"
    progress = {"step": "training_venv", "phase": "`uv venv` with 3.11", "line": None, "elapsed_seconds": 9}
    assert pve_progress.describe(progress) == "training_venv: `uv venv` with 3.11 (9s)"
    assert pve_progress.describe("garbage") == ""


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
    assert pve_progress.async_job_file(environ, 4242, str(proc)) == str(jobs / JOB)


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
    assert pve_progress.async_job_file(env if environ else {}, 4242, str(proc)) is None


# -- writing it ------------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def reporter(path, clock):
    return pve_progress.Reporter("training_venv", "CT 200 on pve1", path=str(path), clock=clock, wall=lambda: 0)


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
    text = pve_ct_progress.MARK + json.dumps(line) + "\n"
    progress.feed("stderr", text[:20].encode())
    assert status(path)["pve_gpu_recover_progress"]["phase"] == "starting the build"
    progress.feed("stdout", text.encode())  # stdout is the answer, never progress
    progress.feed("stderr", text[20:].encode())
    written = status(path)["pve_gpu_recover_progress"]
    assert (written["phase"], written["line"], written["elapsed_seconds"]) == (line["phase"], line["line"], 30.0)
    # The same phase again within WRITE_INTERVAL: kept in memory, not written; a new phase is written at once.
    clock.now += 1
    progress.feed("stderr", (pve_ct_progress.MARK + json.dumps(dict(line, line="Downloaded torch")) + "\n").encode())
    assert status(path)["pve_gpu_recover_progress"]["line"] == "Downloading torch"
    progress.feed("stderr", (pve_ct_progress.MARK + json.dumps({"phase": "checking"}) + "\n").encode())
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
    monkeypatch.setattr(pve_progress, "async_job_file", lambda: None)
    assert pve_progress.follow("training_venv", "CT 200 on pve1", payload) is None
    assert "progress" not in payload  # the payload the module's tests pin stays as it was
    _, _, jobs = fake_job(tmp_path, WRAPPER)
    monkeypatch.setattr(pve_progress, "async_job_file", lambda: str(jobs / JOB))
    reader = pve_progress.follow("training_venv", "CT 200 on pve1", payload, "starting the build")
    assert payload["progress"] is True and callable(reader)
    assert status(jobs / JOB)["pve_gpu_recover_progress"]["phase"] == "starting the build"


# -- telling it, in the target ---------------------------------------------------------------------------------------
def command(script):
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def test_communicate_tells_each_ended_line_as_it_comes_and_returns_everything(monkeypatch):
    told = []
    monkeypatch.setattr(pve_ct_progress, "INTERVAL", 0.0)
    pve_ct_progress.sink = told.append
    pve_ct_progress.start(True)
    pve_ct_progress.phase("installing")
    process = command("""
        import sys, time
        print("Resolved 3 packages", file=sys.stderr, flush=True)
        time.sleep(0.3)
        sys.stderr.write("Downloading torch (846.0MiB)\\nhalf a li"); sys.stderr.flush()
        time.sleep(0.3)
        print("answer")
    """)
    out, err = pve_ct_progress.communicate(process, 30)
    assert (out, err) == (b"answer\n", b"Resolved 3 packages\nDownloading torch (846.0MiB)\nhalf a li")
    lines = [pve_progress.parse_line(text) for text in told]
    assert lines[0] == {"phase": "installing", "line": None, "phase_seconds": 0.0}
    seen = [found["line"] for found in lines]
    assert "Resolved 3 packages" in seen and "Downloading torch (846.0MiB)" in seen
    assert "half a li" not in seen  # a line is told once it ends
    assert all(found["phase"] == "installing" for found in lines)


def test_communicate_at_the_deadline_raises_with_what_was_read_and_leaves_the_kill_to_the_caller():
    process = command("""
        import sys, time
        print("started", flush=True)
        time.sleep(30)
    """)
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        pve_ct_progress.communicate(process, 0.5)
    assert expired.value.output == b"started\n"
    assert process.poll() is None
    process.kill()
    process.wait(5)


def test_nothing_is_told_unless_the_payload_asked():
    told = []
    pve_ct_progress.sink = told.append
    pve_ct_progress.start(None)
    pve_ct_progress.phase("installing")
    pve_ct_progress.note("Downloading torch")
    assert told == []


def test_a_secret_is_masked_before_the_line_is_cut(monkeypatch):
    """What the build's commands print may quote a secret (an index token, a URL's user information): masked as
    the script's answer is, before the line is cut to LINE_CHARS, so not even a part of one is told."""
    from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_act  # noqa: PLC0415

    told = []
    monkeypatch.setattr(pve_ct_progress, "INTERVAL", 0.0)
    pve_ct_progress.sink = told.append
    secret = "t0ken-" + "x" * 40
    pve_ct_progress.start(True, redact=lambda text: pve_ct_act.redact(text, [secret]))
    pve_ct_progress.phase(f"fetching with {secret}")
    cut = pve_ct_progress.LINE_CHARS - 20  # the secret straddles the cut
    pve_ct_progress.note("a" * cut + secret)
    pve_ct_progress.note("Downloading https://bob:hunter2@idx.example/simple/torch")
    found = [pve_progress.parse_line(text) for text in told]
    assert found[0]["phase"] == f"fetching with {pve_ct_act.MASK}"
    assert found[1]["line"] == "a" * cut + pve_ct_act.MASK
    assert found[2]["line"] == f"Downloading https://{pve_ct_act.MASK}@idx.example/simple/torch"
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


class Recording(pve_progress.Reporter):
    """A reporter that keeps every progress it would write to the job's status file."""

    def __init__(self):
        super().__init__("training_venv", "CT 200 on pve1", path="status file")
        self.seen = []

    def write(self):
        self.seen.append(dict(self.progress))


def local_pct(argv, *, stdin=None, timeout=None, env=None, on_output=None):
    """``pct exec 200 ... -- <argv>`` run here as pct would run it in the CT: the argv after ``--``."""
    inner = argv[argv.index("--") + 1 :]
    return pve_target.run_local(inner, stdin=stdin, timeout=timeout, env=env, on_output=on_output)


@pytest.mark.parametrize("where", ["ct", "bare host"])
def test_the_venv_build_tells_its_phases_and_what_uv_downloads_while_it_runs(tmp_path, monkeypatch, where):
    from training_venv import build_payload  # noqa: PLC0415 (plugins/modules is on sys.path: tests/conftest.py)

    monkeypatch.setattr(pve_progress, "WRITE_INTERVAL", 0.0)
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
    assert max(seen["phase_seconds"] or 0 for seen in installing) >= pve_ct_progress.INTERVAL
    assert not os.path.exists(f"{spec['path']}.20261203T101500Z")


def test_the_venv_builds_progress_masks_its_secrets(tmp_path, monkeypatch):
    """The build's network secrets (secret_environment, index passwords) never reach a progress line, whatever uv
    prints (bare host: the script runs in this process)."""
    from training_venv import build_payload  # noqa: PLC0415 (plugins/modules is on sys.path: tests/conftest.py)

    monkeypatch.setattr(pve_progress, "WRITE_INTERVAL", 0.0)
    monkeypatch.setattr(pve_ct_progress, "INTERVAL", 0.0)
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
    monkeypatch.setattr(pve_ct_progress, "INTERVAL", 0.0)
    pve_ct_progress.sink = told.append
    pve_ct_progress.start(True)
    code = "import time\nfor i in range(3):\n    print(f'compiling layer {i + 1}/3', flush=True); time.sleep(0.2)\n"
    warmup = {"argv": [sys.executable, "-c", code], "env": {"PATH": "/usr/bin:/bin"}, "timeout": 30, "cwd": "/"}
    rc, out, _, _ = script.run_warmup(warmup, time.monotonic() + 30)
    assert (rc, out.splitlines()[-1]) == (0, "compiling layer 3/3")
    found = [pve_progress.parse_line(text) for text in told]
    assert found[0]["phase"].startswith("warming up the compile cache with `")
    assert "compiling layer 2/3" in [f["line"] for f in found]
