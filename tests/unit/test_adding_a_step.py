"""docs/design.md's "Adding a step", followed to the letter for a trivial demo step in a copy of this checkout: the
step's package, one line in the registry, its module, its role and its two lines in the recover playbook. Nothing
else is edited, and the copy then works: the registry runs the step in the fact pass (shipped by Ansible's own
AnsiballZ from the collection), the step list is consistent everywhere (the copy's own tests/unit/test_step_list.py
passes), the module and the role are found by their FQCN, and the playbook imports them. The demo is never shipped.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

BIN = Path(sys.executable).parent

# 1. The step's package: plugins/module_utils/steps/demo/
FACTS = '''\
"""The demo step (a test's, never shipped): whether a marker file exists in the target."""

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.demo import probe as demo_probe

NAME = "demo"
PROBE = demo_probe
SPEC = {"marker": {"type": "path", "default": "/etc/pve-gpu-recover-demo"}}
NODE_READ_NEEDS_ANSWER = False


def probe_payload(spec, timeout):
    return {"marker": spec["marker"]}


def read_node(spec, target, answer, context):
    return {}


def evaluate_step(spec, answer, node, context):
    missing = not (answer or {}).get("exists")
    changes = [f"create {spec['marker']}"] if missing else []
    return {"changes": changes, "problems": [], "diff": {"before": "", "after": ""}, "pending": missing}
'''
PROBE = '''\
"""The demo step's probe: standard library only, read only."""

import os


def probe(payload):
    return {"exists": os.path.exists(payload["marker"])}
'''
# 3. Its module and role.
MODULE = '''\
DOCUMENTATION = r"""
module: demo
short_description: The demo step (a test's)
description: [Creates the marker file.]
author: pve-gpu-recover contributors
options:
  marker:
    description: The file.
    type: path
    required: true
"""
EXAMPLES = r"""
- name: Demo
  pve_gpu.recover.demo:
    marker: /tmp/x
"""
RETURN = r"""
created:
  description: Whether it created the file.
  returned: always
  type: bool
"""
import os

from ansible.module_utils.basic import AnsibleModule


def main():
    module = AnsibleModule({"marker": {"type": "path", "required": True}}, supports_check_mode=True)
    marker = module.params["marker"]
    created = not os.path.exists(marker)
    if created and not module.check_mode:
        open(marker, "w").close()
    module.exit_json(changed=created, created=created)


if __name__ == "__main__":
    main()
'''
ROLE = {
    "defaults/main.yml": "---\ndemo_enabled: false\ndemo_marker: /etc/pve-gpu-recover-demo\n",
    "tasks/settings.yml": "---\n[]\n",
    "tasks/main.yml": textwrap.dedent("""\
        ---
        - name: Create the marker
          pve_gpu.recover.demo:
            marker: "{{ demo_marker }}"
          when:
            - demo_enabled | bool
            - ansible_facts.pve_gpu_recover.demo.pending | default(true)
        """),
    "meta/argument_specs.yml": textwrap.dedent("""\
        ---
        argument_specs:
          main:
            short_description: The demo step
            options:
              demo_enabled: {type: bool, description: Whether the step runs.}
              demo_marker: {type: path, description: The marker file.}
        """),
}


def add_demo_step(copy):
    """Exactly docs/design.md's list, and nothing else."""
    package = copy / "plugins" / "module_utils" / "steps" / "demo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "facts.py").write_text(FACTS)
    (package / "probe.py").write_text(PROBE)
    # 2. The registry: one loader and its line in LOADERS, after the last step.
    registry = copy / "plugins" / "module_utils" / "pve_steps.py"
    text = registry.read_text()
    loader = (
        "def _demo():\n"
        "    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.demo import facts  # noqa: PLC0415\n\n"
        "    return facts\n\n\n"
    )
    text = text.replace("# In the order the steps run;", loader + "# In the order the steps run;", 1)
    text = re.sub(r'(\n    "verify": _verify,\n)', r'\1    "demo": _demo,\n', text, count=1)
    registry.write_text(text)
    (copy / "plugins" / "modules" / "demo.py").write_text(MODULE)
    for name, content in ROLE.items():
        path = copy / "roles" / "demo" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    # 4. The recover playbook: its settings, its name for the fact pass, its acting role.
    playbook = copy / "playbooks" / "recover.yml"
    text = playbook.read_text()
    settings = (
        "    - name: Load the demo settings\n      ansible.builtin.import_role:\n"
        "        name: pve_gpu.recover.demo\n        tasks_from: settings\n"
    )
    text = text.replace(
        "\n    # The fact pass module checks", "\n" + settings + "\n    # The fact pass module checks", 1
    )
    text = text.replace("compile_cache, verify]", "compile_cache, verify, demo]", 1)
    playbook.write_text(text)
    steps = copy / "playbooks" / "tasks" / "steps.yml"
    text = steps.read_text()
    acting = (
        "    - name: Demo\n      ansible.builtin.import_role:\n        name: pve_gpu.recover.demo\n"
        "        rolespec_validate: false\n      tags: [demo]\n\n  always:"
    )
    steps.write_text(text.replace("\n  always:", "\n" + acting, 1))
    # The docs the step-list test reads: a row of the README's table and an entry of design.md's steps.
    readme = copy / "README.md"
    (verify_row,) = [line for line in readme.read_text().splitlines() if re.match(r"\| \d\. verify", line)]
    readme.write_text(readme.read_text().replace(verify_row, verify_row + "\n| 9. demo | `demo` | a demo |", 1))
    design = copy / "docs" / "design.md"
    text = design.read_text()
    design.write_text(
        text.replace(
            "\n## Scheduled drift correction", "\n9. **Demo** (role `demo`)\n\n## Scheduled drift correction", 1
        )
    )
    target_facts = copy / "plugins" / "modules" / "target_facts.py"
    text = target_facts.read_text()
    target_facts.write_text(re.sub(r"(Known steps, in their order[\s\S]*?C\(verify\))", r"\1, C(demo)", text, count=1))


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """This checkout's tracked files (collections/ is a relative link: in the copy it finds the copy)."""
    copy = tmp_path_factory.mktemp("added") / "checkout"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        source, target = ROOT / name, copy / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    add_demo_step(copy)
    return copy


def env_for(copy, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        ANSIBLE_CONFIG=str(copy / "ansible.cfg"),
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"),
        PVE_GPU_RECOVER_REPORT_DIR=str(tmp_path / "reports"),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', os.defpath)}",
    )
    return env


def test_the_list_is_what_design_md_says(copy):
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("\n## Adding a step") : text.index("\n## The lab")]
    for place in (
        "plugins/module_utils/steps/<step>/",
        "LOADERS",
        "plugins/modules/<step>.py",
        "roles/<step>/",
        "playbooks/recover.yml",
        "playbooks/tasks/steps.yml",
    ):
        assert place in section, place
    changed = subprocess.run(
        ["git", "diff", "--no-index", "--stat", str(ROOT / "roles" / "verify"), str(copy / "roles" / "verify")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert changed.stdout == ""  # no other step's files were touched


def test_the_copys_step_list_is_consistent_everywhere(copy):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_step_list.py"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


def test_the_real_fact_pass_ships_and_registers_the_new_step(copy, tmp_path):
    """The real fact pass (action plugin, Ansible's AnsiballZ, the registry's function-level import) on localhost
    as a bare host: the demo step is in the pass (this machine has no GPU, so preflight's problems stop it there,
    as they stop every step; an import the payload lacked would fail the whole module instead)."""
    args = {"lock_dir": str(tmp_path / "lock"), "steps": {"demo": {}}, "fail_on_problems": False}
    argv = [str(BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local", "-m", "pve_gpu.recover.target_facts"]
    argv += ["-a", json.dumps(args), "-e", f"ansible_python_interpreter={sys.executable}", "-o"]
    env = env_for(copy, tmp_path)
    done = subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=120, check=False)
    out = done.stdout
    assert "=>" in out, out + done.stderr
    facts = json.loads(out[out.index("=>") + 2 :])["ansible_facts"]["pve_gpu_recover"]
    assert "demo" in facts, sorted(facts)
    assert facts["demo"]["error"] == "preflight found problems"


@pytest.mark.parametrize("enabled", [True, False])
def test_the_fact_pass_reads_the_new_steps_settings_from_its_role_variables(copy, tmp_path, enabled):
    """recover.yml's way: the action reads the demo's settings from demo_<setting>, and leaves it out while
    demo_enabled is false."""
    args = {"lock_dir": str(tmp_path / "lock"), "steps_from_variables": ["demo"], "fail_on_problems": False}
    argv = [str(BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local", "-m", "pve_gpu.recover.target_facts"]
    argv += ["-a", json.dumps(args), "-e", f"ansible_python_interpreter={sys.executable}", "-o"]
    argv += ["-e", json.dumps({"demo_enabled": enabled, "demo_marker": str(tmp_path / "marker")})]
    done = subprocess.run(
        argv, cwd=copy, env=env_for(copy, tmp_path), capture_output=True, text=True, timeout=120, check=False
    )
    out = done.stdout
    assert "=>" in out, out + done.stderr
    facts = json.loads(out[out.index("=>") + 2 :])["ansible_facts"]["pve_gpu_recover"]
    assert ("demo" in facts) is enabled, sorted(facts)


def test_the_registry_reads_and_evaluates_the_new_step_in_the_one_probe_run(copy, tmp_path):
    """The copy's registry, in a python of its own: the demo's settings checked, its part run with preflight's in
    one probe run, its facts evaluated (pending while the marker is missing, converged once it exists)."""
    program = textwrap.dedent("""\
        import json, sys
        from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_steps
        from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_target import Target
        specs = pve_steps.validate_specs({"demo": {"marker": sys.argv[1]}})
        parts = pve_steps.probe_parts(specs, 30)
        answers = Target().run_probes(parts)
        demo = pve_steps.load_step("demo")
        facts = demo.evaluate_step(specs["demo"], answers["demo"]["answer"], {}, {"steps": {}})
        print(json.dumps({"names": list(pve_steps.STEP_NAMES), "parts": list(parts), "facts": facts}))
        """)
    marker = tmp_path / "marker"
    env = dict(env_for(copy, tmp_path), PYTHONPATH=str(copy / "collections"))
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", program, str(marker)], env=env, capture_output=True, text=True, check=True
        )
        runs.append(json.loads(done.stdout))
        marker.touch()
    assert runs[0]["names"][-1] == "demo" and runs[0]["parts"] == ["preflight", "demo"]
    assert (runs[0]["facts"]["pending"], runs[0]["facts"]["changes"]) == (True, [f"create {marker}"])
    assert (runs[1]["facts"]["pending"], runs[1]["facts"]["changes"]) == (False, [])


def test_the_module_and_role_are_found_by_fqcn_and_the_playbook_imports_them(copy, tmp_path):
    env = env_for(copy, tmp_path)
    doc = subprocess.run(
        [str(BIN / "ansible-doc"), "--json", "pve_gpu.recover.demo"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert doc.returncode == 0, doc.stderr
    # recover.yml imports the demo role statically: a role it cannot find fails the syntax check.
    syntax = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "--syntax-check", "recover.yml"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert syntax.returncode == 0, syntax.stderr
    # The role by its FQCN, run alone twice: it acts, then it is converged.
    marker = tmp_path / "marker"
    play = tmp_path / "demo.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  roles:\n    - role: pve_gpu.recover.demo\n"
        f"      vars: {{demo_enabled: true, demo_marker: {marker}}}\n"
    )
    argv = [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play)]
    argv += ["-e", f"ansible_python_interpreter={sys.executable}"]
    recaps = []
    for _ in range(2):
        done = subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        recaps.append(re.search(r"changed=(\d+)", done.stdout).group(1))
    assert recaps == ["1", "0"] and marker.exists()
