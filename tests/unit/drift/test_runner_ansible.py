"""drift/runner.py with the real ansible-runner and ansible-playbook, on localhost: a throwaway project whose
recover.yml has the collection's real recover_report callback and stand-in step modules, never the project's
recover.yml.
Its roles hand recover_unattended to the fact pass and to the acting modules, as --correct's probe checks."""

import json
import re
import shutil
import subprocess
import sys
import textwrap

from tests.conftest import ROOT
from tests.unit.drift.conftest import parse_exposition

RUNNER = ROOT / "drift" / "runner.py"
WINDOW = "swap /opt/venvs/train: pid 4242 (python3 train.py) runs from it"

FILES = {
    "ansible.cfg": """\
        [defaults]
        roles_path = roles
        library = library
        collections_path = {collections}
        callbacks_enabled = pve_gpu.recover.recover_report
        inject_facts_as_vars = false
        gathering = explicit
        retry_files_enabled = false
        """,
    # The fact pass: publishes the facts the inventory gives the host, or fails as the real one does when another
    # run holds the target's lock (error kind "locked", the lock's details); either way with the run's id, as the
    # real action adds it.
    "library/target_facts.py": """\
        from ansible.module_utils.basic import AnsibleModule

        def main():
            module = AnsibleModule(
                {"facts": {"type": "dict", "required": True}, "locked_by": {"type": "str"}, "steps": {"type": "dict"}},
                supports_check_mode=True,
            )
            holder = module.params["locked_by"]
            if holder:
                lock = {"path": "/run/lock/pve-gpu-recover/ct-204.lock", "holder": {"run_id": holder}}
                message = f"CT 204 on pve1 is locked by run {holder} of ops@ctl"
                module.fail_json(msg=message, error="locked", lock=lock, run_id="run-e2e")
            facts = module.params["facts"]
            module.exit_json(changed=False, ansible_facts={"pve_gpu_recover": facts}, run_id=facts["run_id"])

        main()
        """,
    # A step's acting module: would change (check), changes, or, unattended, leaves what it must to a window.
    # make_project copies it as each step's module.
    "library/gpu_processes.py": """\
        from ansible.module_utils.basic import AnsibleModule

        def main():
            module = AnsibleModule(
                {"changes": {"type": "list"}, "window": {"type": "list"}, "unattended": {"type": "bool"}},
                supports_check_mode=True,
            )
            p = module.params
            if p["unattended"] and p["window"] and not module.check_mode:
                module.exit_json(changed=False, needs_window=p["window"], changes=[])
            module.exit_json(changed=True, changes=p["changes"])

        main()
        """,
    "roles/preflight/tasks/main.yml": """\
        - name: Read what every step needs
          target_facts:
            facts: "{{ fake_facts | default({}) }}"
            locked_by: "{{ locked_by | default(omit) }}"
            steps:
              gpu_processes: {unattended: "{{ recover_unattended | default(false) }}"}
              training_code: {unattended: "{{ recover_unattended | default(false) }}"}
              training_venv: {unattended: "{{ recover_unattended | default(false) }}"}
              compile_cache: {unattended: "{{ recover_unattended | default(false) }}"}
        - name: Assert no step found a problem
          ansible.builtin.assert:
            that: ansible_facts.pve_gpu_recover.problems | length == 0
            fail_msg: "{{ ansible_facts.pve_gpu_recover.problems | join(' | ') }}"
        """,
    "roles/gpu_processes/tasks/main.yml": """\
        - name: End the holders
          gpu_processes:
            changes: "{{ ansible_facts.pve_gpu_recover.gpu_processes.changes }}"
            unattended: "{{ recover_unattended | default(false) }}"
          when: ansible_facts.pve_gpu_recover.gpu_processes.pending
        """,
    # The venv step's stand-in builds for real: the collection's progress chain (node_progress.follow, a probe part
    # telling ct_progress lines on a bare host, the async job's status file) with Ansible's own async polls, as
    # the real role runs a rebuild. It changes nothing but what it says.
    "library/training_venv.py": """\
        import time
        import types

        from ansible.module_utils.basic import AnsibleModule
        from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import progress as ct_progress
        from ansible_collections.pve_gpu.recover.plugins.module_utils.node import progress as node_progress
        from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target


        def build(payload):
            ct_progress.start(payload.get("progress"))
            ct_progress.phase("installing the lock with `uv pip sync`")
            for line in payload["lines"]:
                ct_progress.note(line)
                time.sleep(payload["seconds"] / len(payload["lines"]))
            return {"built": True}


        def main():
            module = AnsibleModule(
                {"changes": {"type": "list"}, "window": {"type": "list"}, "unattended": {"type": "bool"},
                 "build_seconds": {"type": "float", "default": 0}},
                supports_check_mode=True,
            )
            p = module.params
            if p["unattended"] and p["window"] and not module.check_mode:
                module.exit_json(changed=False, needs_window=p["window"], changes=[])
            if not module.check_mode and p["build_seconds"]:
                payload = {"seconds": p["build_seconds"], "lines": ["Downloading torch (846.0MiB)", "Downloaded torch"]}
                on_output = node_progress.follow("training_venv", "CT 201 on localhost", payload, "starting the build")
                part = types.SimpleNamespace(probe=build)
                Target(timeout=60).run_probes({"build": (part, payload)}, on_output=on_output)
            module.exit_json(changed=True, changes=p["changes"])

        main()
        """,
    "roles/training_venv/tasks/main.yml": """\
        - name: Rebuild the venv
          training_venv:
            changes: "{{ ansible_facts.pve_gpu_recover.training_venv.changes }}"
            window: "{{ venv_window | default([]) }}"
            unattended: "{{ recover_unattended | default(false) }}"
            build_seconds: "{{ venv_build_seconds | default(0) }}"
          when: ansible_facts.pve_gpu_recover.training_venv.pending
          async: "{{ 0 if ansible_check_mode else 120 }}"
          poll: 1
        """,
    "roles/training_code/tasks/main.yml": """\
        - name: Reset the training code
          training_code:
            changes: []
            unattended: "{{ recover_unattended | default(false) }}"
          when: ansible_facts.pve_gpu_recover.training_code.pending | default(false)
        """,
    "roles/compile_cache/tasks/main.yml": """\
        - name: Purge stale caches
          compile_cache:
            changes: []
            unattended: "{{ recover_unattended | default(false) }}"
          when: ansible_facts.pve_gpu_recover.compile_cache.pending | default(false)
        """,
    "recover.yml": """\
        - name: Recover GPU targets (recover_unattended honoured by the stand-in steps)
          hosts: gpu_targets
          gather_facts: false
          tasks:
            - name: Fail before any step (a broken host)
              ansible.builtin.fail:
                msg: "no pve_node for this host"
              when: fail_early | default(false)
            - name: Preflight
              ansible.builtin.import_role:
                name: preflight
            - name: GPU processes
              ansible.builtin.import_role:
                name: gpu_processes
            - name: Training code
              ansible.builtin.import_role:
                name: training_code
            - name: Training venv
              ansible.builtin.import_role:
                name: training_venv
            - name: Compile cache
              ansible.builtin.import_role:
                name: compile_cache
        """,
}


def facts(gpu_changes=(), venv_changes=()):
    """The fact pass's facts, shaped as the real one's (docs/schema/report.schema.json, ``before``)."""
    diff = {"before": "", "after": ""}
    steps = {
        "preflight": {"changes": [], "problems": [], "pending": False, "diff": diff},
        "gpu_processes": {"changes": list(gpu_changes), "problems": [], "pending": bool(gpu_changes), "diff": diff},
        "training_venv": {"changes": list(venv_changes), "problems": [], "pending": bool(venv_changes), "diff": diff},
    }
    return {
        "run_id": "run-e2e",
        "target": {"label": "CT", "vmid": 200, "node": "localhost"},
        "lock": {"path": "/run/lock/pve-gpu-recover/ct-200.lock", "held": False, "action": "taken"},
        "pending": [s for s, f in steps.items() if f["pending"]],
        "problems": [],
        "seconds": 0.1,
        **steps,
    }


def where(vmid):
    return {"pve_node": "pve-gone", "pve_vmid": vmid}


def make_project(tmp_path):
    project = tmp_path / "project"
    for name, text in FILES.items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).replace("{collections}", str(ROOT / "collections")))
    for step in ("training_code", "compile_cache"):
        shutil.copy(project / "library" / "gpu_processes.py", project / "library" / f"{step}.py")
    # The report callback is the collection's own (ansible.cfg's collections_path is this checkout's).
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    hosts = {
        "ok200": dict(local, fake_facts=facts()),
        "drift201": dict(
            local,
            fake_facts=facts(["end pid 516 (python3) on GPU 0, 20000 MiB"], ["torch 2.11.0+cu130 -> 2.11.0+cu128"]),
            venv_window=[WINDOW],
        ),
        # Corrected for real (no window): its build runs as an async job, its progress at each poll.
        "build205": dict(
            local, fake_facts=facts(venv_changes=["torch 2.11.0+cu130 -> 2.11.0+cu128"]), venv_build_seconds=4
        ),
        # Nothing listens on port 9: refused at once. Where it lives, only the inventory says.
        "down202": {"ansible_host": "127.0.0.1", "ansible_port": 9, "fake_facts": facts(), **where(202)},
        "broken203": dict(local, fail_early=True, fake_facts=facts(), **where(203)),
        "busy204": dict(local, locked_by="run-other", fake_facts=facts()),
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"all": {"children": {"gpu_targets": {"hosts": hosts}}}}))
    return project, inventory


def test_check_then_correct_through_ansible_runner(tmp_path):
    project, inventory = make_project(tmp_path)
    textfile = tmp_path / "pve_gpu_recover.prom"
    command = [sys.executable, str(RUNNER), "--inventory", str(inventory), "--project", str(project)]
    command += ["--correct", "--textfile", str(textfile), "--timeout", "120"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False, cwd=tmp_path)
    summary = json.loads(done.stdout)
    # Failure wins over drift.
    assert done.returncode == 1, done.stderr
    targets = summary["targets"]
    assert {name: t["status"] for name, t in targets.items()} == {
        "ok200": "in_spec",
        "drift201": "drift",
        "down202": "unreachable",
        "broken203": "failed",
        "busy204": "busy",
        "build205": "in_spec",
    }
    assert "Connection refused" in targets["down202"]["reason"]
    assert targets["broken203"]["reason"] == "Fail before any step (a broken host): no pve_node for this host"
    assert targets["broken203"]["report"] is None
    # Another run's lock: named from the report's error kind and the failed event's lock holder.
    busy = targets["busy204"]
    assert (busy["reason"], busy["held_by"]) == (
        "preflight : Read what every step needs: CT 204 on pve1 is locked by run run-other of ops@ctl",
        "run-other",
    )
    assert json.loads((tmp_path / busy["report"]).read_text())["error"]["kind"] == "locked"
    drift = targets["drift201"]
    assert drift["check"]["drift"] == ["gpu_processes", "training_venv"]
    assert drift["corrected"] == {"gpu_processes": ["end pid 516 (python3) on GPU 0, 20000 MiB"]}
    assert drift["needs_window"] == {"training_venv": [WINDOW]}
    correct_report = json.loads((tmp_path / drift["report"]).read_text())
    assert correct_report["check_mode"] is False
    check_report = json.loads((tmp_path / drift["check"]["report"]).read_text())
    assert check_report["check_mode"] is True
    # The correction ran on the drifting target only.
    assert [run["phase"] for run in summary["runs"]] == ["check", "correct"]
    correct_dir = summary["runs"][1]["report_dir"]
    assert [p.name for p in sorted((tmp_path / correct_dir).iterdir())] == ["build205", "drift201"]
    # Why each failed, in a word of the fixed set; where the ones never reached live, from the inventory.
    assert {name: t["kind"] for name, t in targets.items()} == {
        "ok200": "none",
        "drift201": "none",
        "down202": "unreachable",
        "broken203": "other",  # a task of the playbook's own (ansible.builtin.fail), no module's kind
        "busy204": "busy",
        "build205": "none",
    }
    assert {name: (targets[name]["node"], targets[name]["vmid"]) for name in ("down202", "broken203")} == {
        "down202": ("pve-gone", 202),
        "broken203": ("pve-gone", 203),
    }
    families = parse_exposition(textfile.read_text())

    def value(family, **labels):
        (found,) = [v for got, v in families[f"pve_gpu_recover_{family}"]["samples"] if labels.items() <= got.items()]
        return found

    assert value("drift", step="training_venv", target="drift201", node="localhost", vmid="200") == 1
    assert value("needs_window", step="training_venv", target="drift201") == 1
    assert value("target_up", target="down202", node="pve-gone", vmid="202") == 0
    assert value("target_failed", target="broken203", kind="other") == 1
    assert value("target_failed", target="down202", kind="unreachable") == 1
    assert value("target_status", status="busy", target="busy204") == 1
    assert value("target_status", status="unreachable", target="down202") == 1
    assert value("target_info", target="down202", node="pve-gone", vmid="202", id="lxc/202") == 1
    assert value("targets", status="busy") == 1
    assert "PLAY RECAP" in (tmp_path / summary["runs"][0]["log"]).read_text()
    # The build's progress while it ran: in the journal (stderr) as Ansible polled it, and in the run's log (the
    # report callback's line at each poll); the check run (no async in check mode) showed none.
    progress = [line for line in done.stderr.splitlines() if line.startswith("build205: training_venv: ")]
    assert progress, done.stderr
    # What the build said last when Ansible polled (its polls are seconds apart: which line is a matter of timing).
    assert any(
        re.search(r"installing the lock with `uv pip sync` \(\d+s\): Download(ing|ed) torch", line) for line in progress
    ), progress
    correct_log = (tmp_path / summary["runs"][1]["log"]).read_text()
    assert "build205: training_venv: installing the lock with `uv pip sync` (" in correct_log
    assert "build205: training_venv: " not in (tmp_path / summary["runs"][0]["log"]).read_text()
    build = json.loads((tmp_path / targets["build205"]["report"]).read_text())
    assert build["schema_version"] == 1
    assert "ansible_job_id" not in build["steps"]["training_venv"]  # async_wrapper's keys are not the step's
