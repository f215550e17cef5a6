"""plugins/lookup/uv_lock.py: a lock compiled by the real uv from local PEP 503 indexes on loopback, then cached by
the requirements, the options and uv's version; behind a private CA and credentials, with the network settings."""

import functools
import http.server
import subprocess
import sys
import threading

import pytest
from ansible.errors import AnsibleError
from ansible.module_utils import _internal as module_internal
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import lock as venv_lock

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "plugins" / "lookup"))
sys.path.insert(0, str(ROOT / "tests" / "lab"))
controller = module_internal.is_controller
import private_ca  # noqa: E402
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
    lock = venv_lock.parse_lock(text)
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
    uv = uv_of_version(tmp_path / "uv", "0.13.9")
    cache = tmp_path / "persistent"
    cache.mkdir()
    key = uv_lock.cache_key(["six"], options | {"uv_version": "uv 0.13.9 (x86_64-unknown-linux-gnu)"})
    (cache / key).write_text(uv_lock.entry_text(key.removesuffix(".lock"), "six==1.17.0\n"))
    monkeypatch.setenv("PVE_GPU_RECOVER_LOCK_CACHE_DIR", str(cache))
    lookup = lookup_loader.get("uv_lock")
    assert lookup.run([["six"]], variables={}, cache_dir="", uv=str(uv)) == ["six==1.17.0\n"]
    assert compilations(uv) == 0


# -- the cache key names the uv that compiled ------------------------------------------------------------------
def uv_of_version(directory, version):
    """A uv that says it is ``version`` and compiles with the real one, counting its compilations."""
    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "uv"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = --version ]; then echo "uv {version} (x86_64-unknown-linux-gnu)"; exit 0; fi\n'
        f'echo compiled >> "{directory}/compilations"\n'
        f'exec "{ROOT / ".venv" / "bin" / "uv"}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def compilations(wrapper):
    path = wrapper.parent / "compilations"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_another_uv_version_misses_the_cache_and_the_same_one_hits_it(tmp_path, indexes):
    _, pypi, cu128 = indexes
    old, new = uv_of_version(tmp_path / "old", "0.13.9"), uv_of_version(tmp_path / "new", "0.14.0")
    lookup = lookup_loader.get("uv_lock")
    options = {"index_url": pypi, "torch_index_url": cu128, "cache_dir": str(tmp_path / "cache")}
    first = lookup.run([["six"]], variables={}, uv=str(old), **options)[0]
    assert lookup.run([["six"]], variables={}, uv=str(old), **options)[0] == first
    assert (compilations(old), compilations(new)) == (1, 0)
    again = lookup.run([["six"]], variables={}, uv=str(new), **options)[0]
    assert venv_lock.parse_lock(again)["distributions"] == venv_lock.parse_lock(first)["distributions"]
    assert (compilations(old), compilations(new)) == (1, 1)
    assert len(list((tmp_path / "cache").glob("*.lock"))) == 2
    options["uv_version"] = "uv 0.13.9 (x86_64-unknown-linux-gnu)"
    assert uv_lock.cache_key(["six"], options) != uv_lock.cache_key(["six"], dict(options, uv_version="uv 0.14.0"))


# -- behind a private CA, with credentials ---------------------------------------------------------------------
HOST_TLS_SETTINGS = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "UV_SYSTEM_CERTS")
TOKEN = "CompileT0kenS3cret"  # noqa: S105 (a test's credential)


@pytest.fixture
def private_index(tmp_path, monkeypatch):
    """tests/lab/standins/index_server.py over HTTPS with a private CA's certificate, wanting ci's token."""
    for name in HOST_TLS_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    ca = private_ca.make_ca(tmp_path / "ca")
    wheelhouse.write_index(tmp_path / "www", [wheelhouse.build_wheel(tmp_path / "w", "six", "1.17.0")])
    (tmp_path / "auth").write_text(f"ci:{TOKEN}")
    server = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "lab" / "standins" / "index_server.py"),
            str(tmp_path / "www"),
            *("--port", "0", "--tls-cert", str(ca["cert"]), "--tls-key", str(ca["key"])),
            *("--auth-file", str(tmp_path / "auth")),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    url = server.stdout.readline().split(" on ", 1)[1].strip() + "/simple"
    yield url, ca["ca"]
    server.terminate()
    server.wait(10)


def compile_private(tmp_path, url, **network):
    lookup = lookup_loader.get("uv_lock")
    options = {"index_url": url, "torch_index_url": url, "cache_dir": str(tmp_path / "cache")}
    return lookup.run([["six"]], variables={}, uv=str(ROOT / ".venv" / "bin" / "uv"), **options, **network)[0]


def test_the_controller_compiles_from_an_index_of_a_private_ca_with_the_settings(tmp_path, private_index):
    url, ca = private_index
    credentials = [{"host": "127.0.0.1", "username": "ci", "password": TOKEN}]
    with pytest.raises(AnsibleError) as refused:
        compile_private(tmp_path, url, index_credentials=credentials)
    # The cause and the fix on the first line: the fact pass's action keeps only that line of a lookup's failure.
    first = str(refused.value).splitlines()[0]
    assert "invalid peer certificate: UnknownIssuer" in first
    assert "give its CA as SSL_CERT_FILE in training_venv_compile_environment" in first
    assert "training_venv_system_certs: true" in first
    with pytest.raises(AnsibleError) as refused:  # trusted now, but without the token
        compile_private(tmp_path, url, environment={"SSL_CERT_FILE": str(ca)})
    assert "401 Unauthorized" in str(refused.value)
    wrong = [{"host": "127.0.0.1", "username": "ci", "password": "NotTheT0ken"}]
    with pytest.raises(AnsibleError) as refused:
        compile_private(tmp_path, url, environment={"SSL_CERT_FILE": str(ca)}, index_credentials=wrong)
    assert "NotTheT0ken" not in str(refused.value)
    text = compile_private(tmp_path, url, environment={"SSL_CERT_FILE": str(ca)}, index_credentials=credentials)
    assert venv_lock.parse_lock(text)["distributions"] == {"six": "1.17.0"}
    assert TOKEN not in text  # the lock names the index, never its credentials
    # The system's store as OpenSSL finds it (SSL_CERT_FILE names the CA) serves as well; the network settings are
    # no part of the cache key: the lock compiled above is read again.
    system = {"environment": {"SSL_CERT_FILE": str(ca)}, "system_certs": True, "index_credentials": credentials}
    assert compile_private(tmp_path, url, **system) == text
    fresh = compile_private(tmp_path / "fresh", url, **system)  # compiled again: the header names another output
    assert venv_lock.parse_lock(fresh)["distributions"] == {"six": "1.17.0"}


def test_network_settings_that_cannot_work_are_refused_before_uv_runs(tmp_path):
    with pytest.raises(AnsibleError, match="uv_lock: environment sets UV_INDEX_URL, which the build decides itself"):
        compile_private(tmp_path, "https://127.0.0.1:9/simple", environment={"UV_INDEX_URL": "https://x/simple"})


def test_the_first_line_of_a_tls_failure_names_the_certificate_and_the_fix_whatever_uv_printed_first():
    """As uv prints it behind a TLS-intercepting proxy (issue 43): the fetch first, the certificate last."""
    stderr = (
        "error: Failed to fetch: `https://pypi.org/simple/datasets/`\n"
        "  Caused by: Request failed after 3 retries\n"
        "  Caused by: error sending request for url (https://pypi.org/simple/datasets/)\n"
        "  Caused by: client error (Connect)\n"
        "  Caused by: invalid peer certificate: UnknownIssuer\n"
    )
    first, *rest = uv_lock.failure_message(["datasets"], 2, stderr, []).splitlines()
    assert first.startswith("uv_lock: the controller does not trust the TLS certificate")
    assert "invalid peer certificate: UnknownIssuer" in first
    assert "SSL_CERT_FILE in training_venv_compile_environment" in first
    assert "training_venv_system_certs" in first
    assert rest[-1].strip() == "Caused by: invalid peer certificate: UnknownIssuer"


def test_the_fact_pass_keeps_the_cause_and_the_fix_of_a_failed_compilation(tmp_path, private_index):
    """The action reads the venv step's lock through Jinja and keeps the first line of what failed (its
    variable_reader): that line names the certificate and the settings that fix it."""
    from ansible.parsing.dataloader import DataLoader  # noqa: PLC0415
    from ansible.template import Templar, trust_as_template  # noqa: PLC0415
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.registry import StepSpecError  # noqa: PLC0415
    from ansible_collections.pve_gpu.recover.plugins.plugin_utils import settings  # noqa: PLC0415

    url, _ca = private_index
    uv = ROOT / ".venv" / "bin" / "uv"
    template = (
        f"{{{{ lookup('uv_lock', ['six'], index_url='{url}', torch_index_url='{url}', uv='{uv}', "
        f"cache_dir='{tmp_path / 'cache'}') }}}}"
    )
    read = settings.variable_reader(Templar(loader=DataLoader()), {"_training_venv_lock": trust_as_template(template)})
    with pytest.raises(StepSpecError) as refused:
        read("_training_venv_lock")
    assert "invalid peer certificate: UnknownIssuer" in str(refused.value)
    assert "training_venv_system_certs" in str(refused.value)


# -- uv beside the Python that runs Ansible (issue 43, item 1) --------------------------------------------------
def test_uv_is_found_beside_the_python_that_runs_ansible_before_path(tmp_path, monkeypatch):
    """`.venv/bin/ansible-playbook` without an activated venv: .venv/bin is not on PATH, .venv/bin/uv is there."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    uv = uv_of_version(bin_dir, "0.13.9")
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    cache = tmp_path / "cache"
    key = uv_lock.cache_key(
        ["six"],
        {
            "python_version": "3.11",
            "python_platform": "x86_64-manylinux_2_28",
            "index_url": "https://pypi.org/simple",
            "torch_index_url": "https://download.pytorch.org/whl/cu128",
            "uv_version": "uv 0.13.9 (x86_64-unknown-linux-gnu)",
        },
    )
    cache.mkdir(mode=0o700)
    (cache / key).write_text(uv_lock.entry_text(key.removesuffix(".lock"), "six==1.17.0\n"))
    (cache / key).chmod(0o600)
    assert lookup_loader.get("uv_lock").run([["six"]], variables={}, cache_dir=str(cache)) == ["six==1.17.0\n"]
    assert uv_lock.find_uv("uv") == str(uv)


def test_uv_found_nowhere_names_both_places(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(AnsibleError) as missing:
        uv_lock.find_uv("uv", path=str(tmp_path))
    assert f"neither beside the Python that runs Ansible ({tmp_path}) nor on PATH" in str(missing.value)
