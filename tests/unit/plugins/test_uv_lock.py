"""plugins/lookup/uv_lock.py: a lock compiled by the real uv from local PEP 503 indexes on loopback, then cached."""

import functools
import http.server
import sys
import threading

import pytest
from ansible.module_utils import _internal as module_internal
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "plugins" / "lookup"))
sys.path.insert(0, str(ROOT / "tests" / "lab"))
controller = module_internal.is_controller
import uv_lock  # noqa: E402
import wheelhouse  # noqa: E402
from ansible.plugins.loader import lookup_loader  # noqa: E402

lookup_loader.add_directory(str(ROOT / "plugins" / "lookup"))

# Importing controller code flips module_utils to controller semantics; the module tests in this process need it back.
module_internal.is_controller = controller


@pytest.fixture
def indexes(tmp_path):
    """A "pypi" index (six, torch's cu130 build) and a "cu128" index (torch's cu128 build), served on loopback."""
    pypi = [
        wheelhouse.build_wheel(tmp_path / "w", "six", "1.17.0"),
        wheelhouse.build_wheel(tmp_path / "w", "torch", "2.11.0+cu130"),
    ]
    wheelhouse.write_index(tmp_path / "www" / "pypi", pypi)
    wheelhouse.write_index(
        tmp_path / "www" / "cu128", [wheelhouse.build_wheel(tmp_path / "w128", "torch", "2.11.0+cu128")]
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www"))
    handler.log_message = lambda *_args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield server, f"{base}/pypi/simple", f"{base}/cu128/simple"
    server.shutdown()


def compile_lock(tmp_path, index_url, torch_index_url, requirements):
    lookup = lookup_loader.get("uv_lock")  # through the loader, which reads the options from DOCUMENTATION
    options = {
        "index_url": index_url,
        "torch_index_url": torch_index_url,
        "cache_dir": str(tmp_path / "cache"),
        "uv": str(ROOT / ".venv" / "bin" / "uv"),
        "python_version": "3.11",
    }
    return lookup.run([requirements], variables={}, **options)[0]


def test_torch_comes_from_its_own_index_and_the_lock_is_what_the_venv_step_reads(tmp_path, indexes):
    server, pypi, cu128 = indexes
    text = compile_lock(tmp_path, pypi, cu128, ["torch==2.11.0+cu128", "six"])
    lock = venv_facts.parse_lock(text)
    assert lock["distributions"] == {"six": "1.17.0", "torch": "2.11.0+cu128"}
    assert lock["torch_index"] == cu128
    assert lock["python"] == "3.11"
    assert "--hash=sha256:" in text
    # Cached: the indexes are not asked again (the server is gone) and the text is the same.
    server.shutdown()
    assert compile_lock(tmp_path, pypi, cu128, ["torch==2.11.0+cu128", "six"]) == text


def test_a_requirement_no_index_has_is_a_clear_error_and_caches_nothing(tmp_path, indexes):
    _, pypi, cu128 = indexes
    with pytest.raises(Exception, match=r"uv_lock: uv pip compile failed for \['sglang'\]"):
        compile_lock(tmp_path, pypi, cu128, ["sglang"])
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_cache_key_changes_with_every_option():
    options = {"python_version": "3.11", "python_platform": "p", "index_url": "a", "torch_index_url": "b"}
    keys = {uv_lock.cache_key(["torch"], dict(options, **{k: "other"})) for k in options}
    assert len(keys | {uv_lock.cache_key(["torch"], options)}) == len(options) + 1


def test_an_empty_cache_dir_leaves_the_configured_one(tmp_path, monkeypatch):
    """The training_venv role passes cache_dir="" unless set: PVE_GPU_RECOVER_LOCK_CACHE_DIR (an execution
    environment's persistent storage, docs/awx.md) then decides. A cached lock is read, uv is never run."""
    options = {"python_version": "3.11", "python_platform": "x86_64-manylinux_2_28"}
    options |= {"index_url": "https://pypi.org/simple", "torch_index_url": "https://download.pytorch.org/whl/cu128"}
    cache = tmp_path / "persistent"
    cache.mkdir()
    (cache / uv_lock.cache_key(["six"], options)).write_text("six==1.17.0\n")
    monkeypatch.setenv("PVE_GPU_RECOVER_LOCK_CACHE_DIR", str(cache))
    lookup = lookup_loader.get("uv_lock")
    assert lookup.run([["six"]], variables={}, cache_dir="", uv="/nonexistent/uv") == ["six==1.17.0\n"]
