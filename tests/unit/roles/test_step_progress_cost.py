"""What following a long step costs and how soon its end is seen (issue 23 item 4, issue 41 item 1), measured with
ansible-playbook on localhost running the collection's real training_venv and compile_cache roles (a bare host,
the module's real code, the step's action plugin), pipelining on as ansible.cfg has it for ssh:

* a converged target: both acting tasks are skipped, so no module runs and nothing is polled (the fact pass stays
  the one module execution a converged target costs);
* check mode: the acting module runs once, as one plain pipelined call (no async job, no status call);
* a real rebuild: an async job the action follows: one status call per progress interval, each waiting on the
  node, so a build that ends is seen at once, not at the next poll; one progress line per call that finds it
  running; a build that fails comes back as the module's own failure.

Each task's round trips are counted from ansible-playbook's own ``-vvv`` lines (``EXEC``, ``PUT``, ``Using module
file``), the time a build ended from a stand-in uv that notes it.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

COUNT = '''
import json, os, time
from ansible.plugins.callback import CallbackBase

class CallbackModule(CallbackBase):
    """Per task: its action, how it ended and when, and Ansible's own polls of an async job."""
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "count"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self.tasks = []

    def v2_playbook_on_task_start(self, task, is_conditional):
        self.tasks.append({"task": task.get_name(), "action": task.action, "status": None, "polls": 0, "msg": None,
                           "started": time.time(), "ended": None})

    def end(self, status, **more):
        self.tasks[-1].update(status=status, ended=time.time(), **more)

    def v2_runner_on_ok(self, result):
        self.end("ok", keys=sorted(result._result))

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self.end("failed", msg=result._result.get("msg"), keys=sorted(result._result))

    def v2_runner_on_skipped(self, result):
        self.end("skipped")

    def v2_runner_on_async_poll(self, result):
        self.tasks[-1]["polls"] += 1

    def v2_playbook_on_stats(self, stats):
        with open(os.environ["COUNT_FILE"], "w") as out:
            json.dump(self.tasks, out)
'''

FACTS = """
from ansible.module_utils.basic import AnsibleModule

module = AnsibleModule({"facts": {"type": "dict", "required": True}}, supports_check_mode=True)
module.exit_json(changed=False, ansible_facts={"pve_gpu_recover": module.params["facts"]})
"""

PLAY = """
- name: The acting roles alone, after stand-in facts
  hosts: target
  gather_facts: false
  tasks:
    - name: Stand-in fact pass
      fake_facts:
        facts: "{{ fake_facts }}"
    - name: Training venv
      ansible.builtin.import_role:
        name: pve_gpu.recover.training_venv
    - name: Compile cache
      ansible.builtin.import_role:
        name: pve_gpu.recover.compile_cache
"""

# A hashed lock whose only index refuses connections: a real uv fails, naming it.
LOCK = "--index-url http://127.0.0.1:9/simple\n\nsix==1.17.0 \\\n    --hash=sha256:" + "a" * 64 + "\n"

# uv as a slow index makes it look, whatever its argv's shape: `uv venv` makes the venv's directory (its last
# argument), `uv pip sync` says what it downloads for $SECONDS, notes when it ends, then fails as a dropped download.
SLOW_UV = """#!/bin/sh
case "$1" in
  venv) for a in "$@"; do last="$a"; done; mkdir -p "$last/bin"; exit 0 ;;
  pip) echo "Resolved 3 packages" >&2
       end=$(( $(date +%s) + SECONDS_OF_UV ))
       while [ "$(date +%s)" -lt "$end" ]; do echo "Downloading torch (846.0MiB)" >&2; sleep 0.2; done
       date +%s.%N > "$(dirname "$0")/uv-ended"
       echo "error: Failed to download torch: connection closed" >&2; exit 2 ;;
esac
exit 1
"""

TASK = re.compile(r"^TASK \[(.*?)\] \*+$")
MODULE = re.compile(r"^Using module file .*/([a-z_]+)\.py$")


def rounds(stdout):
    """``{task name: {"exec", "put", "modules"}}`` from ``-vvv`` output: the commands and file transfers each task's
    connection made, and the modules it ran, in order."""
    found, current = {}, None
    for line in stdout.splitlines():
        if TASK.match(line):
            current = found.setdefault(TASK.match(line).group(1), {"exec": 0, "put": 0, "modules": []})
        elif current is None:
            continue
        elif line.startswith("<target> EXEC "):
            current["exec"] += 1
        elif line.startswith("<target> PUT "):
            current["put"] += 1
        elif MODULE.match(line):
            current["modules"].append(MODULE.match(line).group(1))
    return found


def make_project(tmp_path, facts, uv_seconds=None, **variables):
    """The play, its stand-in facts module and counting callback, an inventory of one local target; returns
    ``(play, inventory, environment)``. A ``uv_seconds`` puts SLOW_UV in place of uv."""
    project = tmp_path / "project"
    for name, text in {"library/fake_facts.py": FACTS, "callback_plugins/count.py": COUNT, "play.yml": PLAY}.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(textwrap.dedent(text))
    (tmp_path / "lock.txt").write_text(LOCK)
    settings = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "fake_facts": facts,
        "training_venv_lock_file": str(tmp_path / "lock.txt"),
        "training_venv_path": str(tmp_path / "venvs" / "train"),
        "training_venv_python_version": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "compile_cache_enabled": True,
        "compile_cache_warmup": ["true"],
    }
    if uv_seconds is not None:
        uv = tmp_path / "bin" / "uv"
        uv.parent.mkdir()
        uv.write_text(SLOW_UV.replace("SECONDS_OF_UV", str(uv_seconds)))
        uv.chmod(0o755)
        settings["training_venv_uv"] = str(uv)
    settings.update(variables)
    (tmp_path / "hosts.json").write_text(json.dumps({"all": {"hosts": {"target": settings}}}))
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_COLLECTIONS_PATH=str(ROOT / "collections"),
        ANSIBLE_CALLBACKS_ENABLED="count",
        ANSIBLE_CALLBACK_PLUGINS=str(project / "callback_plugins"),
        ANSIBLE_LIBRARY=str(project / "library"),
        ANSIBLE_PIPELINING="true",  # ansible.cfg's, which names it for ssh only
        ANSIBLE_NOCOLOR="1",
        PVE_GPU_RECOVER_REPORT_DIR=str(tmp_path / "reports"),
        COUNT_FILE=str(tmp_path / "count.json"),
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    )
    return project / "play.yml", tmp_path / "hosts.json", env


def run(tmp_path, facts, *extra, uv_seconds=None, **variables):
    play, inventory, env = make_project(tmp_path, facts, uv_seconds, **variables)
    playbook = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    done = subprocess.run(
        [playbook, "-vvv", "-i", str(inventory), str(play), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert (tmp_path / "count.json").exists(), done.stdout + done.stderr
    tasks = json.loads((tmp_path / "count.json").read_text())
    steps = {t["action"].rsplit(".", 1)[-1]: t for t in tasks if t["action"].startswith("pve_gpu.recover.")}
    for step in steps.values():
        step["rounds"] = rounds(done.stdout).get(step["task"], {"exec": 0, "put": 0, "modules": []})
    return done, steps


def progress_lines(done):
    return [line for line in done.stderr.splitlines() if line.startswith("target: training_venv: ")]


CONVERGED = {"training_venv": {"pending": False, "rebuild": False}, "compile_cache": {"pending": False}}
REBUILD = {"training_venv": {"pending": True, "rebuild": True}, "compile_cache": {"pending": False}}
NOTHING = {"exec": 0, "put": 0, "modules": []}
# An async start as ansible-core makes it: its temporary directory (`echo ~`, mkdir), the module and async_wrapper
# put there, made executable, async_wrapper run. Two commands more than a plain pipelined call and two transfers.
START = {"exec": 4, "put": 2}


@pytest.mark.parametrize("check", [True, False])
def test_a_converged_target_runs_no_acting_module_and_polls_nothing(tmp_path, check):
    done, tasks = run(tmp_path, CONVERGED, *(["--check"] if check else []))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {role: (t["status"], t["polls"], t["rounds"]) for role, t in tasks.items()} == {
        "training_venv": ("skipped", 0, NOTHING),
        "compile_cache": ("skipped", 0, NOTHING),
    }


def test_check_mode_runs_the_acting_module_once_as_a_plain_call(tmp_path):
    done, tasks = run(tmp_path, REBUILD, "--check", "--diff")
    assert done.returncode == 0, done.stdout + done.stderr
    venv = tasks["training_venv"]
    assert (venv["status"], venv["polls"]) == ("ok", 0)
    assert venv["rounds"] == {"exec": 1, "put": 0, "modules": ["training_venv"]}  # one pipelined call, no job
    assert progress_lines(done) == []
    assert not (tmp_path / "venvs").exists()  # check mode built nothing


def test_a_rebuild_that_ends_is_seen_at_once_not_at_the_next_interval(tmp_path):
    """The interval is 15 s; the build (a uv that fails at once) ends in well under a second: the status call
    already waiting on the node sees it. Ansible's own polling would have slept 15 s before its first look."""
    done, tasks = run(tmp_path, REBUILD, uv_seconds=0, training_venv_progress_interval=15)
    venv = tasks["training_venv"]
    assert done.returncode == 2, done.stdout + done.stderr
    assert venv["status"] == "failed"
    assert "failed to download" in venv["msg"].lower(), venv
    assert venv["ended"] - venv["started"] < 5, venv
    ended = float((tmp_path / "bin" / "uv-ended").read_text())
    assert venv["ended"] - ended < 1.0, venv  # the build's last command to the task's end, the module's end included
    # One job started, ONE status call, which found it finished: no progress line, no poll of Ansible's.
    one_call = ["training_venv", "step_job_status"]
    assert venv["rounds"] == {"exec": START["exec"] + 1, "put": START["put"], "modules": one_call}
    assert (venv["polls"], progress_lines(done)) == (0, [])
    assert "ansible_job_id" in venv["keys"] and "pve_gpu_recover_progress" not in venv["keys"]


def test_a_long_rebuild_shows_its_progress_every_interval_and_its_end_at_once(tmp_path):
    done, tasks = run(tmp_path, REBUILD, uv_seconds=4, training_venv_progress_interval=1)
    venv = tasks["training_venv"]
    assert done.returncode == 2, done.stdout + done.stderr
    assert venv["status"] == "failed" and "failed to download" in venv["msg"].lower(), venv
    lines = progress_lines(done)
    # About one line a second while uv ran (4 s), each what the module said last: its phase, uv's latest line.
    assert 2 <= len(lines) <= 6, lines
    said = r"target: training_venv: installing the lock with `uv pip sync` \(\d+s\): Downloading torch \(846.0MiB\)"
    assert any(re.fullmatch(said, line) for line in lines), lines
    # One status call per line, and the last one, which found the job finished.
    assert venv["rounds"]["modules"] == ["training_venv"] + ["step_job_status"] * (len(lines) + 1), venv
    assert venv["rounds"]["exec"] == START["exec"] + len(lines) + 1 and venv["rounds"]["put"] == START["put"]
    ended = float((tmp_path / "bin" / "uv-ended").read_text())
    assert venv["ended"] - ended < 1.0, venv
    assert venv["polls"] == 0


def test_a_real_rebuild_fails_with_the_modules_own_sentence(tmp_path):
    """The real uv, an index that refuses connections: the module's own message, through the job's status file."""
    done, tasks = run(tmp_path, REBUILD, training_venv_progress_interval=1)
    venv = tasks["training_venv"]
    assert done.returncode == 2, done.stdout + done.stderr
    assert venv["status"] == "failed"
    assert "building the venv failed (" in venv["msg"], venv
    assert f"{tmp_path / 'venvs' / 'train'} was left as it was" in venv["msg"]
    assert venv["rounds"]["modules"][:2] == ["training_venv", "step_job_status"]


# A warm-up that compiles for a while (5 s: progress lines are told every 2 s), saying what it compiles (a
# torch.compile of a model, as the role runs one).
WARMUP = """import os, sys, time
for layer in range(1, 7):
    print(f"compiling layer {layer}/6", flush=True)
    time.sleep(0.8)
open(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "graph"), "w").write("compiled")
open(sys.argv[1], "w").write(repr(time.time()))
"""
VERSION_PY = "__version__ = '2.11.0+cu128'\ndebug = False\ncuda: Optional[str] = '12.8'\ngit_version = 'abc'\n"


def test_a_warm_up_is_followed_the_same_way(tmp_path):
    """compile_cache's warm-up, the other long step: one line per interval with the warm-up's latest line, and its
    end seen at once (a bare host: a venv with torch's version.py, a stale cache, an nvidia-smi stand-in)."""
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "version.py").write_text(VERSION_PY)
    (site / "triton-3.3.0.dist-info").mkdir()
    (site / "triton-3.3.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: triton\nVersion: 3.3.0\n\n")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    cache = tmp_path / "inductor"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "graph").write_text("compiled for another torch")
    other = {"torch": "2.11.0+cu130", "variant": "cu130", "cuda": "13.0", "triton": "3.3.0", "gpus": ["NVIDIA H200"]}
    (cache / ".pve-gpu-recover-stamp").write_text(json.dumps({"fingerprint": other, "stamped_by": "pve-gpu-recover"}))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text("#!/bin/sh\nprintf 'name\\nNVIDIA H200\\n'\n")
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    (tmp_path / "warmup.py").write_text(WARMUP)
    ended = tmp_path / "warmup-ended"
    facts = {"training_venv": {"pending": False, "rebuild": False}, "compile_cache": {"pending": True}}
    play, inventory, env = make_project(
        tmp_path,
        facts,
        training_venv_enabled=False,
        compile_cache_venv=str(venv),
        compile_cache_roots=[str(cache)],
        compile_cache_warmup=[sys.executable, str(tmp_path / "warmup.py"), str(ended)],
        compile_cache_progress_interval=1,
    )
    env["PATH"] = os.pathsep.join([str(tmp_path / "bin"), env["PATH"]])
    playbook = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    done = subprocess.run(
        [playbook, "-vvv", "-i", str(inventory), str(play)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    steps = {t["action"].rsplit(".", 1)[-1]: t for t in json.loads((tmp_path / "count.json").read_text())}
    warm = steps["compile_cache"]
    assert warm["status"] == "ok"
    lines = [line for line in done.stderr.splitlines() if line.startswith("target: compile_cache: ")]
    assert len(lines) >= 2, done.stderr
    assert any(
        re.search(r"warming up the compile cache with `.*` \(\d+s\): compiling layer [1-6]/6$", x) for x in lines
    )
    modules = rounds(done.stdout)[warm["task"]]["modules"]
    assert modules == ["compile_cache"] + ["step_job_status"] * (len(lines) + 1), modules
    assert warm["ended"] - float(ended.read_text()) < 1.0, warm
    assert not (cache / "fxgraph").exists()  # the stale cache was purged before the warm-up
