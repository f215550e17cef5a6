"""plugins/plugin_utils/payload_store.py: the kept payload carries each module's bytecode, which the node's Python
of the controller's minor loads instead of compiling every module from source each run (issue 41, item 4); any
other Python, or a source that differs from what was compiled, compiles the source as before."""

import base64
import io
import json
import subprocess
import sys
import zipfile

from ansible.module_utils import _internal as module_internal

controller = module_internal.is_controller
from ansible.executor.module_common import _CachedModule  # noqa: E402
from ansible_collections.pve_gpu.recover.plugins.plugin_utils import payload_store  # noqa: E402

# Importing controller code flips module_utils to controller semantics; the module tests in this process need it back.
module_internal.is_controller = controller

from tests.conftest import other_python  # noqa: E402

PROBE = b'"""A part."""\n\n\ndef probe(payload):\n    return {"seen": payload}\n'
FILES = {
    "ansible_collections/__init__.py": b"",
    "ansible_collections/demo/__init__.py": b"",
    "ansible_collections/demo/probe.py": PROBE,
}
IMPORT = """
import inspect, json, sys
sys.path.insert(0, sys.argv[1])
from ansible_collections.demo import probe
print(json.dumps({"file": probe.__file__, "source": inspect.getsource(probe), "answer": probe.probe(1)}))
"""


def cached_payload(path, files=FILES):
    """A payload as Ansible caches it: a pickle holding the base64 of the zip (ansible-core's _CachedModule)."""
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w", zipfile.ZIP_DEFLATED) as payload:
        for name, body in files.items():
            payload.writestr(name, body)
    _CachedModule(zip_data=base64.b64encode(data.getvalue()), metadata=None, source_mapping={}).dump(str(path))
    return path


def zip_of(path, target):
    target.write_bytes(base64.b64decode(_CachedModule.load(str(path)).zip_data))
    return target


def imported(python, zip_path):
    done = subprocess.run([python, "-I", "-c", IMPORT, str(zip_path)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_kept_payload_is_loaded_from_its_bytecode_and_its_source_is_still_read(tmp_path):
    path = cached_payload(tmp_path / "payload")
    assert payload_store.with_bytecode(str(path)) is True
    payload = zip_of(path, tmp_path / "payload.zip")
    names = zipfile.ZipFile(payload).namelist()
    assert "ansible_collections/demo/probe.pyc" in names and "ansible_collections/demo/probe.py" in names
    found = imported(sys.executable, payload)
    assert found["file"].endswith("ansible_collections/demo/probe.pyc")  # loaded, not compiled
    assert found["source"] == PROBE.decode()  # what the fact pass ships to a CT (Target.run_probes)
    assert found["answer"] == {"seen": 1}
    assert payload_store.with_bytecode(str(path)) is False  # once


def test_a_source_that_differs_from_its_bytecode_is_compiled_from_source(tmp_path):
    path = cached_payload(tmp_path / "payload")
    payload_store.with_bytecode(str(path))
    payload = zip_of(path, tmp_path / "payload.zip")
    changed = tmp_path / "changed.zip"
    with zipfile.ZipFile(payload) as old, zipfile.ZipFile(changed, "w") as new:
        for info in old.infolist():
            body = old.read(info)
            new.writestr(info, body.replace(b'"seen"', b'"new"') if info.filename.endswith("probe.py") else body)
    found = imported(sys.executable, changed)
    assert found["file"].endswith("probe.py")
    assert found["answer"] == {"new": 1}


def test_a_python_of_another_minor_compiles_the_source_as_before(tmp_path):
    python = other_python("3.9") or other_python("3.13") or other_python("3.12")
    if python is None:
        import pytest  # noqa: PLC0415

        pytest.skip("no Python of another minor here")
    path = cached_payload(tmp_path / "payload")
    payload_store.with_bytecode(str(path))
    found = imported(python, zip_of(path, tmp_path / "payload.zip"))
    assert found["file"].endswith("probe.py")
    assert found["answer"] == {"seen": 1}


def test_a_payload_that_is_not_what_ansible_caches_is_left_alone(tmp_path):
    path = tmp_path / "payload"
    path.write_bytes(b"not a pickle")
    assert payload_store.guarded("compiled", payload_store.with_bytecode, str(path)) is None
    assert path.read_bytes() == b"not a pickle"
