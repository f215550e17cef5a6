"""Every module's DOCUMENTATION renders with ansible-doc and documents exactly its argument_spec."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_act_runner

from tests.conftest import ROOT

MODULES = sorted(p.stem for p in (ROOT / "plugins" / "modules").glob("*.py"))
assert MODULES, "no module found under plugins/modules"


class SpecCaptured(Exception):
    pass


def argument_spec(name, monkeypatch):
    """The argument_spec a module's main() builds (itself, or through the acting modules' runner), captured before
    it does anything else."""
    module = __import__(name)

    def capture(*_args, **kwargs):
        raise SpecCaptured(kwargs["argument_spec"])

    monkeypatch.setattr(pve_act_runner, "AnsibleModule", capture)
    if hasattr(module, "AnsibleModule"):
        monkeypatch.setattr(module, "AnsibleModule", capture)
    with patch_module_args({}), pytest.raises(SpecCaptured) as captured:
        module.main()
    return captured.value.args[0]


@pytest.mark.parametrize("name", MODULES)
def test_ansible_doc_renders_and_matches_the_argument_spec(name, monkeypatch):
    done = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-doc")), "--json", f"pve_gpu.recover.{name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)[f"pve_gpu.recover.{name}"]
    for part in ("doc", "examples", "return"):
        assert doc[part], f"{name}: {part} is empty"
    options = doc["doc"]["options"]
    spec = argument_spec(name, monkeypatch)
    assert sorted(options) == sorted(spec)
    for option, rules in spec.items():
        assert options[option]["type"] == rules.get("type", "str"), option
        assert options[option].get("default") == rules.get("default"), option
        assert options[option].get("choices") == rules.get("choices"), option
