"""plugins/action/target_facts.py: the fact pass's AnsiballZ payload kept between runs, never a stale one.

The key and the store are tested as functions on files made here; then a real ``ansible`` on localhost shows that a
second process uses the payload the first one built (ansible-core's own debug line says which it did).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def action():
    """The plugin, loaded by path under its own name (``target_facts`` is library/target_facts.py to the other
    tests) and only when these tests run: importing Ansible's action machinery changes how AnsibleModule's warnings
    reach the module tests that run in the same process."""
    spec = importlib.util.spec_from_file_location(
        "action_target_facts", ROOT / "plugins" / "action" / "target_facts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FQN = "ansible.legacy.target_facts"
PAYLOAD = f"{FQN}-ZIP_DEFLATED-none"


@pytest.fixture
def code(tmp_path):
    """A module and two module_utils directories, like library/ and module_utils/."""
    module = tmp_path / "library" / "target_facts.py"
    module.parent.mkdir()
    module.write_text("print('module')\n")
    utils = tmp_path / "module_utils"
    (utils / "sub").mkdir(parents=True)
    (utils / "pve_target.py").write_text("X = 1\n")
    (utils / "sub" / "deep.py").write_text("Y = 1\n")
    return module, utils


def key(action, module, utils, **kwargs):
    return action.payload_key(str(module), [str(utils)], **kwargs)


def test_the_key_changes_with_everything_the_payload_is_built_from_and_nothing_else(action, code):
    module, utils = code
    first = key(action, module, utils)
    assert first == key(action, module, utils) and len(first) == 32
    (utils / "__pycache__").mkdir()
    (utils / "__pycache__" / "pve_target.cpython-312.pyc").write_bytes(b"\0")
    (utils / "README.md").write_text("docs are not code\n")
    assert key(action, module, utils) == first
    (utils / "sub" / "deep.py").write_text("Y = 2\n")
    changed_util = key(action, module, utils)
    assert changed_util != first
    (utils / "new.py").write_text("")
    assert key(action, module, utils) != changed_util
    before_module = key(action, module, utils)
    module.write_text("print('module, edited')\n")
    assert key(action, module, utils) != before_module
    assert key(action, module, utils, ansible_version="2.21.0") != key(action, module, utils, ansible_version="2.21.5")
    assert key(action, module, utils, python="3.12.1") != key(action, module, utils, python="3.13.0")


def test_a_payload_is_kept_restored_into_a_new_process_cache_and_never_over_one_ansible_built(action, tmp_path):
    store, built, fresh = tmp_path / "store", tmp_path / "run1", tmp_path / "run2"
    store.mkdir(mode=0o700)
    built.mkdir()
    (built / PAYLOAD).write_bytes(b"payload 1")
    (built / f"{PAYLOAD}.lock").write_bytes(b"")
    (built / "ansible.legacy.command-ZIP_DEFLATED-none").write_bytes(b"another module")
    assert action.keep(str(store), "k1", str(built), FQN) == 1
    assert sorted(os.listdir(store / "k1")) == [PAYLOAD]
    assert action.keep(str(store), "k1", str(built), FQN) == 0  # already kept
    assert action.restore(str(store), "k1", str(fresh), FQN) == 1
    assert (fresh / PAYLOAD).read_bytes() == b"payload 1"
    assert oct((fresh).stat().st_mode & 0o777) == "0o700"
    (fresh / PAYLOAD).write_bytes(b"built by this process")
    assert action.restore(str(store), "k1", str(fresh), FQN) == 0
    assert (fresh / PAYLOAD).read_bytes() == b"built by this process"
    assert action.restore(str(store), "another key", str(tmp_path / "run3"), FQN) == 0
    assert not (tmp_path / "run3").exists()


def test_the_store_keeps_the_newest_keys_only(action, tmp_path):
    store, built = tmp_path / "store", tmp_path / "built"
    store.mkdir()
    built.mkdir()
    (built / PAYLOAD).write_bytes(b"payload")
    for number in range(6):
        action.keep(str(store), f"k{number}", str(built), FQN, limit=3)
        os.utime(store / f"k{number}", (1000 + number, 1000 + number))
    assert sorted(os.listdir(store)) == ["k3", "k4", "k5"]


def test_a_store_others_can_write_is_not_used(action, tmp_path):
    store = tmp_path / "store"
    assert action.private_dir(str(store))
    assert oct(store.stat().st_mode & 0o777) == "0o700"
    store.chmod(0o777)
    assert not action.private_dir(str(store))
    store.chmod(0o700)
    if os.geteuid() == 0:
        os.chown(store, 65534, 65534)
        assert not action.private_dir(str(store))
    (tmp_path / "file").write_text("")
    assert not action.private_dir(str(tmp_path / "file"))


def run_ad_hoc(local_tmp):
    """The real module through the action, in its own ansible process (it fails on its arguments: enough)."""
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_LOCAL_TEMP=str(local_tmp),
        ANSIBLE_DEBUG="1",
        ANSIBLE_NOCOLOR="1",
    )
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible"), "localhost", "-i", "localhost,", "-c", "local"]
    argv += ["-e", f"ansible_python_interpreter={sys.executable}", "-m", "target_facts", "-a", "steps={}"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert "missing required arguments: run_id" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout + done.stderr


def test_a_second_ansible_process_uses_the_payload_the_first_one_built(action, tmp_path):
    first = run_ad_hoc(tmp_path)
    assert "ANSIBALLZ: Creating module" in first
    (kept,) = os.listdir(tmp_path / action.STORE_NAME)
    assert os.listdir(tmp_path / action.STORE_NAME / kept) == [PAYLOAD]
    second = run_ad_hoc(tmp_path)
    assert "ANSIBALLZ: using cached module" in second and "ANSIBALLZ: Creating module" not in second
