"""What following a long step costs (issue 23 item 4), measured with ansible-playbook on localhost running the
collection's real training_venv and compile_cache roles (a bare host, the module's real code):

* a converged target: both acting tasks are skipped, so no module runs and nothing is polled (the fact pass stays
  the one module execution a converged target costs);
* check mode: the acting module runs once, as one plain call (no async job, no poll);
* a real rebuild: an async job that Ansible polls; a build that fails comes back as the module's own failure.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

COUNT = '''
import json, os
from ansible.plugins.callback import CallbackBase

class CallbackModule(CallbackBase):
    """Per task: its action, how it ended, whether it ran a module, and Ansible's polls of its async job."""
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "count"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self.tasks = []

    def v2_playbook_on_task_start(self, task, is_conditional):
        self.tasks.append({"task": task.get_name(), "action": task.action, "status": None, "polls": 0, "msg": None})

    def v2_runner_on_ok(self, result):
        self.tasks[-1]["status"] = "ok"

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self.tasks[-1].update(status="failed", msg=result._result.get("msg"))

    def v2_runner_on_skipped(self, result):
        self.tasks[-1]["status"] = "skipped"

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

# A hashed lock whose only index refuses connections: a build fails at once, naming it.
LOCK = "--index-url http://127.0.0.1:9/simple\n\nsix==1.17.0 \\\n    --hash=sha256:" + "a" * 64 + "\n"


def run(tmp_path, facts, *extra):
    project = tmp_path / "project"
    for name, text in {"library/fake_facts.py": FACTS, "callback_plugins/count.py": COUNT, "play.yml": PLAY}.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(textwrap.dedent(text))
    (tmp_path / "lock.txt").write_text(LOCK)
    variables = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "fake_facts": facts,
        "training_venv_lock_file": str(tmp_path / "lock.txt"),
        "training_venv_path": str(tmp_path / "venvs" / "train"),
        "training_venv_python_version": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "training_venv_progress_interval": 1,
        "compile_cache_enabled": True,
        "compile_cache_warmup": ["true"],
    }
    (tmp_path / "hosts.json").write_text(json.dumps({"all": {"hosts": {"target": variables}}}))
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_COLLECTIONS_PATH=str(ROOT / "collections"),
        ANSIBLE_CALLBACKS_ENABLED="count",
        ANSIBLE_CALLBACK_PLUGINS=str(project / "callback_plugins"),
        ANSIBLE_LIBRARY=str(project / "library"),
        PVE_GPU_RECOVER_REPORT_DIR=str(tmp_path / "reports"),
        COUNT_FILE=str(tmp_path / "count.json"),
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    )
    playbook = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    done = subprocess.run(
        [playbook, "-i", str(tmp_path / "hosts.json"), str(project / "play.yml"), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert (tmp_path / "count.json").exists(), done.stdout + done.stderr
    tasks = json.loads((tmp_path / "count.json").read_text())
    return done, {t["action"].rsplit(".", 1)[-1]: t for t in tasks if t["action"].startswith("pve_gpu.recover.")}


CONVERGED = {"training_venv": {"pending": False, "rebuild": False}, "compile_cache": {"pending": False}}
REBUILD = {"training_venv": {"pending": True, "rebuild": True}, "compile_cache": {"pending": False}}


@pytest.mark.parametrize("check", [True, False])
def test_a_converged_target_runs_no_acting_module_and_polls_nothing(tmp_path, check):
    done, tasks = run(tmp_path, CONVERGED, *(["--check"] if check else []))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {role: (t["status"], t["polls"]) for role, t in tasks.items()} == {
        "training_venv": ("skipped", 0),
        "compile_cache": ("skipped", 0),
    }


def test_check_mode_runs_the_acting_module_once_as_a_plain_call(tmp_path):
    done, tasks = run(tmp_path, REBUILD, "--check", "--diff")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tasks["training_venv"]["status"], tasks["training_venv"]["polls"]) == ("ok", 0)
    assert "ASYNC" not in done.stdout
    assert not (tmp_path / "venvs").exists()  # check mode built nothing


def test_a_real_rebuild_is_an_async_job_whose_failure_is_the_modules_own(tmp_path):
    done, tasks = run(tmp_path, REBUILD)
    venv = tasks["training_venv"]
    assert done.returncode == 2, done.stdout + done.stderr
    assert venv["status"] == "failed"
    # The module's own sentence, through async_wrapper and async_status: what failed, and that nothing was swapped.
    assert "building the venv failed (" in venv["msg"], venv
    assert f"{tmp_path / 'venvs' / 'train'} was left as it was" in venv["msg"]
    assert "ASYNC" in done.stdout  # Ansible ran it as a job and polled it
