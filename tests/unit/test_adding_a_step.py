"""docs/design.md's "Adding a step", followed to the letter for a trivial demo step in a copy of this checkout: its
package, one line in the registry, its module, its role and one import in the recover playbook, and a row of the
README's table: ten files (three of them the package's, one of those the empty __init__.py Ansible's module finder
needs). Nothing else is edited, and the copy then works: every generic test of the steps passes in the copy (the step
list, one truth per setting, the unattended probe's list), the registry runs the step in the fact pass (shipped by
Ansible's own AnsiballZ from the collection), the module and the role are found by their FQCN, the playbook imports
them, and the role acts, then is converged. The demo is never shipped.
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


def check_spec(spec):
    return ""


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
"""The demo step's probe and acting script (one file for a demo): standard library only."""

import os


def probe(payload):
    if "create" in payload:
        with open(payload["create"], "w", encoding="utf-8"):
            return {"created": payload["create"]}
    return {"exists": os.path.exists(payload["marker"])}
'''
# 3. Its module and role.
MODULE = '''\
#!/usr/bin/python
DOCUMENTATION = r"""
module: demo
short_description: The demo step (a test's)
description: [Creates the marker file in the target.]
author: pve-gpu-recover contributors
extends_documentation_fragment:
  - pve_gpu.recover.pve_target
  - pve_gpu.recover.pve_target.python
options:
  marker:
    description: The file.
    type: path
    default: /etc/pve-gpu-recover-demo
"""
EXAMPLES = r"""
- name: Demo
  pve_gpu.recover.demo:
    marker: /tmp/x
"""
RETURN = r"""
changes:
  description: What it created.
  returned: always
  type: list
  elements: str
"""
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import ActingStep, run_step_module
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import (
    PYTHON_ARGUMENT_SPEC,
    TARGET_ARGUMENT_SPEC,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.demo import facts as demo_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.demo import probe as demo_probe

ARGUMENT_SPEC = {**TARGET_ARGUMENT_SPEC, **demo_facts.SPEC, **PYTHON_ARGUMENT_SPEC}


class Demo(ActingStep):
    facts = demo_facts
    argument_spec = ARGUMENT_SPEC
    script = demo_probe

    def act_payload(self, run, before):
        return {"create": run.spec["marker"]}, run.params["timeout"]


def main():
    run_step_module(Demo())


if __name__ == "__main__":
    main()
'''
ROLE = {
    "defaults/main.yml": "---\ndemo_enabled: false\ndemo_marker: /etc/pve-gpu-recover-demo\n",
    "tasks/main.yml": textwrap.dedent("""\
        ---
        - name: Create the marker
          pve_gpu.recover.demo:
            vmid: "{{ pve_vmid | default(omit) }}"
            node_name: "{{ pve_node | default(inventory_hostname) }}"
            marker: "{{ demo_marker }}"
            python: "{{ preflight_python | default('python3') }}"
          delegate_to: "{{ pve_node | default(inventory_hostname) }}"
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
              demo_enabled: {type: bool, default: false, description: Whether the step runs.}
              demo_marker: {type: path, default: /etc/pve-gpu-recover-demo, description: The marker file.}
        """),
}


def add_demo_step(copy):
    """Exactly docs/design.md's list, and nothing else; returns the files it wrote, relative to the copy."""
    written = []

    def write(name, text):
        path = copy / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(name)

    # 1. The step's package.
    package = "plugins/module_utils/steps/demo"
    write(f"{package}/__init__.py", "")
    write(f"{package}/facts.py", FACTS)
    write(f"{package}/probe.py", PROBE)
    # 2. The registry: one loader and its line in LOADERS, after the last step.
    registry = "plugins/module_utils/steps/registry.py"
    text = (copy / registry).read_text()
    loader = (
        "def _demo():\n"
        "    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.demo import facts  # noqa: PLC0415\n\n"
        "    return facts\n\n\n"
    )
    text = text.replace("# In the order the steps run;", loader + "# In the order the steps run;", 1)
    text = re.sub(r'(\n    "verify": _verify,\n)', r'\1    "demo": _demo,\n', text, count=1)
    write(registry, text)
    # 3. Its module.
    write("library/demo.py", MODULE)
    # 4. Its role.
    for name, content in ROLE.items():
        write(f"roles/demo/{name}", content)
    # 5. The recover playbook: its acting role, after the last step.
    playbook = "playbooks/recover.yml"
    text = (copy / playbook).read_text()
    acting = (
        "        - name: Demo\n          ansible.builtin.import_role:\n            name: pve_gpu.recover.demo\n"
        "            rolespec_validate: false\n          tags: [demo]\n\n      always:"
    )
    write(playbook, text.replace("\n      always:", "\n" + acting, 1))
    # 6. The README's table of steps.
    readme = (copy / "README.md").read_text()
    (verify_row,) = [line for line in readme.splitlines() if re.match(r"\| \d\. verify", line)]
    write("README.md", readme.replace(verify_row, verify_row + "\n| 9. demo | `demo` | a demo |", 1))
    return written


@pytest.fixture(scope="module")
def added(tmp_path_factory):
    """This checkout's files (tracked and new; collections/ and plugins/modules are relative links: in the copy they
    find the copy), the demo step added: ``(copy, the files the list wrote)``."""
    copy = tmp_path_factory.mktemp("added") / "checkout"
    listed = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(listed, cwd=ROOT, capture_output=True, check=True).stdout
    for name in sorted(set(filter(None, files.decode().split("\0")))):
        source, target = ROOT / name, copy / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return copy, add_demo_step(copy)


@pytest.fixture(scope="module")
def copy(added):
    return added[0]


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


def test_the_list_is_what_design_md_says_and_ten_files(added):
    copy, written = added
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("\n## Adding a step") : text.index("\n## The lab")]
    for place in (
        "plugins/module_utils/steps/<step>/",
        "LOADERS",
        "library/<step>.py",
        "roles/<step>/",
        "playbooks/recover.yml",
        "README.md",
    ):
        assert place in section, place
    assert len(written) == len(set(written)) == 10, written
    changed = subprocess.run(
        ["git", "diff", "--no-index", "--stat", str(ROOT / "roles" / "verify"), str(copy / "roles" / "verify")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert changed.stdout == ""  # no other step's files were touched


# The tests that hold every step to the same rules, whatever the step.
GENERIC = [
    "tests/unit/test_step_list.py",
    "tests/unit/test_step_settings.py",
    "tests/unit/drift/test_unattended.py::test_this_checkout_runs_every_acting_step_unattended",
]


def test_the_copy_passes_every_generic_test_of_the_steps(copy):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *GENERIC],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    # The demo itself was among what they checked (a test that skipped it would prove nothing).
    assert "test_each_setting_is_declared_once_and_agrees_everywhere[demo] PASSED" in done.stdout, done.stdout[-4000:]


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
        from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
        from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target
        specs = step_registry.validate_specs({"demo": {"marker": sys.argv[1]}})
        parts = step_registry.probe_parts(specs, 30)
        answers = Target().run_probes(parts)
        demo = step_registry.load_step("demo")
        facts = demo.evaluate_step(specs["demo"], answers["demo"]["answer"], {}, {"steps": {}})
        print(json.dumps({"names": list(step_registry.STEP_NAMES), "parts": list(parts), "facts": facts}))
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
