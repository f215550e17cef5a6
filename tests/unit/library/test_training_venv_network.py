"""The venv build behind proxies and private CAs, with index credentials (issue 21, item 2).

Real builds on a bare host (the build script runs in this process, as on a GPU host without a CT) with the real uv,
and pip where it is cheap, against a real HTTPS PEP 503 index on 127.0.0.1: tests/lab/standins/index_server.py
serving TLS with a certificate of a private CA made here (tests/lab/private_ca.py), which neither uv nor pip trusts
by default; a second one also wants Basic credentials. tests/lab/standins/connect_proxy.py is the proxy the build
must go through. Secrets given to the module never reach its result, a message or the build script's answer.
No test reaches PyPI or imports torch.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import training_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import wrong_option
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import acting as venv_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import commands as venv_commands
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import network, script

from tests.conftest import ROOT, unavailable
from tests.fakes import ANSIBLE_CORE, FakeRunner, run_module

sys.path.insert(0, str(ROOT / "tests" / "lab"))
sys.path.insert(0, str(ROOT / "tests" / "lab" / "standins"))
import private_ca
import wheelhouse
from connect_proxy import ConnectProxy

UV = str(ROOT / ".venv" / "bin" / "uv")
SYSTEM_PYTHON = "/usr/bin/python3.11"
INDEX_SERVER = ROOT / "tests" / "lab" / "standins" / "index_server.py"
PINS = {"idna": "3.10", "six": "1.17.0", "torch": "2.11.0+cu128"}
STAMPS = iter(f"20261203T1{hour:01d}{minute:02d}00Z" for hour in range(10) for minute in range(60))
TOKEN = "T0kenS3cretForTheIndex"  # noqa: S105 (a test's credential)
PROXY_PASSWORD = "Pr0xyS3cretPassw0rd"  # noqa: S105
# What this machine's environment may set that a CT's (pct exec --keep-env 0) does not: each would decide trust.
HOST_TLS_SETTINGS = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")
PROXY_SETTINGS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY")


class Index:
    """tests/lab/standins/index_server.py run as its own process, HTTPS with the private CA's certificate."""

    def __init__(self, root, ca, *, credentials=None):
        self.root = root
        self.log = root / "access.log"
        argv = [sys.executable, str(INDEX_SERVER), str(root / "www"), "--port", "0", "--access-log", str(self.log)]
        argv += ["--tls-cert", str(ca["cert"]), "--tls-key", str(ca["key"])]
        if credentials:
            (root / "auth").write_text(credentials)
            argv += ["--auth-file", str(root / "auth")]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        assert line.startswith("serving "), line
        self.base = line.split(" on ", 1)[1].strip()
        self.url = f"{self.base}/simple"

    def seen(self):
        """``[(path, user or None)]`` of every request the index answered."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [(path, None if user == "-" else user) for path, user in (line.rsplit(" ", 1) for line in lines)]

    def stop(self):
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheels")
    torch_files = {
        "torch/__init__.py": wheelhouse.GUARD,
        "torch/version.py": wheelhouse.torch_version_py("2.11.0+cu128", "12.8"),
    }
    return {
        "idna": wheelhouse.build_wheel(root, "idna", "3.10"),
        "six": wheelhouse.build_wheel(root, "six", "1.17.0"),
        "torch": wheelhouse.build_wheel(root, "torch", "2.11.0+cu128", torch_files),
    }


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return private_ca.make_ca(tmp_path_factory.mktemp("ca"))


def serve(tmp_path_factory, wheels, ca, credentials=None):
    root = tmp_path_factory.mktemp("index")
    wheelhouse.write_index(root / "www", wheels.values())
    return Index(root, ca, credentials=credentials)


@pytest.fixture(scope="module")
def index(tmp_path_factory, wheels, ca):
    served = serve(tmp_path_factory, wheels, ca)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def private_index(tmp_path_factory, wheels, ca):
    """The same index, wanting ci's token."""
    served = serve(tmp_path_factory, wheels, ca, credentials=f"ci:{TOKEN}")
    yield served
    served.stop()


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A bare host whose environment is what a CT's is (no CA or proxy settings), fresh uv/pip caches, no retries."""
    if not (Path(UV).exists() and Path(SYSTEM_PYTHON).exists()):
        unavailable(f"needs {UV} and {SYSTEM_PYTHON}")
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu1")
    monkeypatch.setattr(venv_acting, "utc_stamp", lambda: next(STAMPS))
    for name in HOST_TLS_SETTINGS + PROXY_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "10")
    (tmp_path / "venvs").mkdir()
    return Host(tmp_path / "venvs" / "train", monkeypatch)


class Host:
    def __init__(self, path, monkeypatch):
        self.path = path
        self.monkeypatch = monkeypatch

    def run(self, capsys, index, wheels, **params):
        """The module's result, and the JSON it printed as it printed it (what reaches Ansible)."""
        pins = [(name, version, [wheels[name]]) for name, version in PINS.items()]
        lock = wheelhouse.lock_text(pins, index_url=index.url)
        args = {"path": str(self.path), "lock": lock, "python_version": "3.11", "uv": UV, **params}
        result = run_module(training_venv, args, FakeRunner(), self.monkeypatch, capsys)
        return result, json.dumps(result)


def pip_fallback_available():
    check = subprocess.run([SYSTEM_PYTHON, "-c", "import ensurepip, venv"], capture_output=True, check=False)
    if check.returncode != 0:
        unavailable(f"{SYSTEM_PYTHON} has no venv/ensurepip")


# -- TLS: a private CA -----------------------------------------------------------------------------------------
def test_uv_fails_on_an_index_of_a_private_ca_naming_the_tls_problem_and_the_setting(host, capsys, index, wheels):
    result, _ = host.run(capsys, index, wheels)
    assert (result["failed"], result["error"]) == (True, "tls"), result["msg"]
    assert "invalid peer certificate: UnknownIssuer" in result["msg"]
    assert "the target does not trust the TLS certificate of the index or of a proxy on the way" in result["msg"]
    assert "set training_venv_ca_bundle to a PEM file inside the target" in result["msg"]
    assert "training_venv_system_certs: true" in result["msg"]
    assert [p.name for p in host.path.parent.iterdir()] == ["train.cache"]  # nothing built; the cache stays


def test_uv_builds_from_that_index_with_the_ca_bundle(host, capsys, index, wheels, ca):
    result, _ = host.run(capsys, index, wheels, ca_bundle=str(ca["ca"]))
    assert result["changed"] is True, result.get("msg")
    assert result["builder"]["name"] == "uv"
    assert (result["installed"], result["missing"], result["extra"], result["wrong"]) == (PINS, [], [], [])
    assert ("/files/torch-2.11.0+cu128-py3-none-any.whl", None) in index.seen()


def test_uv_with_system_certs_trusts_what_the_system_store_names(host, capsys, index, wheels, ca):
    # The system store as OpenSSL finds it: SSL_CERT_FILE names the private CA here (a CT would have it in
    # /etc/ssl/certs after update-ca-certificates). uv's own roots do not count then.
    result, _ = host.run(capsys, index, wheels, system_certs=True, environment={"SSL_CERT_FILE": str(ca["ca"])})
    assert result["changed"] is True, result.get("msg")
    assert result["installed"] == PINS


def test_pip_fails_on_that_index_naming_the_tls_problem_and_builds_with_the_ca_bundle(host, capsys, index, wheels, ca):
    pip_fallback_available()
    failed, _ = host.run(capsys, index, wheels, uv="/nonexistent/uv")
    assert (failed["failed"], failed["error"]) == (True, "tls"), failed["msg"]
    assert "installing the lock with pip failed" in failed["msg"]
    # pip names the certificate only in a warning; its last error is "No matching distribution".
    assert "No matching distribution found for idna==3.10 (problem confirming the ssl certificate)" in failed["msg"]
    assert "set training_venv_ca_bundle" in failed["msg"]
    assert [p.name for p in host.path.parent.iterdir()] == ["train.cache"]  # nothing built; the cache stays
    result, _ = host.run(capsys, index, wheels, uv="/nonexistent/uv", ca_bundle=str(ca["ca"]))
    assert result["changed"] is True, result.get("msg")
    assert result["builder"]["name"] == "venv+pip"
    assert {k: v for k, v in result["installed"].items() if k not in ("pip", "setuptools")} == PINS


def test_a_ca_bundle_that_is_not_in_the_target_is_named_before_anything_is_built(host, capsys, index, wheels, tmp_path):
    result, _ = host.run(capsys, index, wheels, ca_bundle=str(tmp_path / "nowhere.pem"))
    assert (result["failed"], result["error"]) == (True, "ca_bundle")
    assert f"the CA bundle {tmp_path / 'nowhere.pem'} is not a file in the target" in result["msg"]
    assert list(host.path.parent.iterdir()) == []


# -- proxies ---------------------------------------------------------------------------------------------------
@pytest.fixture
def proxy():
    started = ConnectProxy().start()
    yield started
    started.stop()


@pytest.fixture
def locked_proxy():
    started = ConnectProxy(credentials=f"alice:{PROXY_PASSWORD}").start()
    yield started
    started.stop()


def test_the_build_goes_through_the_proxy_of_the_environment(host, capsys, index, wheels, ca, proxy):  # noqa: PLR0917
    result, _ = host.run(capsys, index, wheels, ca_bundle=str(ca["ca"]), environment={"HTTPS_PROXY": proxy.url()})
    assert result["changed"] is True, result.get("msg")
    assert (index.base.removeprefix("https://"), None) in proxy.seen


def test_no_proxy_keeps_the_index_off_the_proxy(host, capsys, index, wheels, ca, proxy):  # noqa: PLR0917
    environment = {"HTTPS_PROXY": proxy.url(), "NO_PROXY": "127.0.0.1"}
    result, _ = host.run(capsys, index, wheels, ca_bundle=str(ca["ca"]), environment=environment)
    assert result["changed"] is True, result.get("msg")
    assert proxy.seen == []


def test_pip_goes_through_the_proxy_too(host, capsys, index, wheels, ca, proxy):  # noqa: PLR0917
    pip_fallback_available()
    environment = {"HTTPS_PROXY": proxy.url()}
    result, _ = host.run(capsys, index, wheels, uv="/nonexistent/uv", ca_bundle=str(ca["ca"]), environment=environment)
    assert result["builder"]["name"] == "venv+pip", result.get("msg")
    assert (index.base.removeprefix("https://"), None) in proxy.seen


def test_a_proxy_password_in_secret_environment_works_and_never_shows(host, capsys, index, wheels, ca, locked_proxy):  # noqa: PLR0917
    secret = {"HTTPS_PROXY": locked_proxy.url(f"alice:{PROXY_PASSWORD}")}
    # From ansible-core 2.21 the invocation is added only when asked (inject_invocation; older versions refuse the
    # key and always add it): a user who asks must see the secret masked.
    asks = {"_ansible_inject_invocation": True} if ANSIBLE_CORE >= (2, 21) else {}
    result, printed = host.run(capsys, index, wheels, ca_bundle=str(ca["ca"]), secret_environment=secret, **asks)
    assert result["changed"] is True, result.get("msg")
    assert (index.base.removeprefix("https://"), "alice") in locked_proxy.seen
    assert PROXY_PASSWORD not in printed
    masked = "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER"  # Ansible's word for a no_log option in the invocation
    assert result["invocation"]["module_args"]["secret_environment"] == {"HTTPS_PROXY": masked}


# -- index credentials -----------------------------------------------------------------------------------------
def test_an_index_that_wants_credentials_is_named_with_the_setting(host, capsys, private_index, wheels, ca):
    result, _ = host.run(capsys, private_index, wheels, ca_bundle=str(ca["ca"]))
    assert (result["failed"], result["error"]) == (True, "index_auth"), result["msg"]
    assert "give them as training_venv_index_credentials" in result["msg"]


@pytest.mark.parametrize("builder", ["uv", "pip"])
def test_index_credentials_reach_the_index_and_never_the_result(host, capsys, private_index, wheels, ca, builder):  # noqa: PLR0917
    if builder == "pip":
        pip_fallback_available()
    credentials = [{"host": "127.0.0.1", "username": "ci", "password": TOKEN}]
    uv = UV if builder == "uv" else "/nonexistent/uv"
    result, printed = host.run(
        capsys, private_index, wheels, uv=uv, ca_bundle=str(ca["ca"]), index_credentials=credentials
    )
    assert result["changed"] is True, result.get("msg")
    assert ("/files/six-1.17.0-py3-none-any.whl", "ci") in private_index.seen()
    assert TOKEN not in printed
    # The netrc lived in the build's private directory, gone with it; nothing of it beside the venv.
    assert not any(TOKEN in p.read_text(errors="replace") for p in host.path.parent.glob("*.txt"))


# -- secrets out of every answer, whatever a tool prints -------------------------------------------------------
def echoing_uv(directory):
    """A uv that makes the venv, then fails the install printing every secret it was given (and its netrc)."""
    uv = directory / "uv"
    uv.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = venv ]; then exec /usr/bin/python3.11 -m venv --without-pip "$5"; fi\n'
        'if [ "$1" = --version ]; then echo "uv 0.13.9"; exit 0; fi\n'
        'echo "error: Failed to fetch: https://ci:$UV_INDEX_CORP_PASSWORD@pypi.internal/simple/six/" >&2\n'
        'echo "  Caused by: proxy $HTTPS_PROXY: tunnel failed" >&2\n'
        'cat "$NETRC" >&2\n'
        "exit 2\n"
    )
    uv.chmod(0o755)
    return str(uv)


SECRETS = {"UV_INDEX_CORP_PASSWORD": "IndexPassw0rdXYZ", "HTTPS_PROXY": f"http://alice:{PROXY_PASSWORD}@proxy:3128"}


def test_what_a_tool_prints_of_a_secret_is_masked_in_the_result(host, capsys, index, wheels, tmp_path):
    credentials = [{"host": "pypi.internal", "username": "ci", "password": TOKEN}]
    result, printed = host.run(
        capsys, index, wheels, uv=echoing_uv(tmp_path), secret_environment=SECRETS, index_credentials=credentials
    )
    assert result["failed"] is True
    for secret in ("IndexPassw0rdXYZ", PROXY_PASSWORD, TOKEN):
        assert secret not in printed
    assert "Failed to fetch: https://********@pypi.internal/simple/six/" in result["stderr_tail"]
    assert "proxy ********: tunnel failed" in result["stderr_tail"]  # the whole secret value
    assert "machine pypi.internal login ci password ********" in result["stderr_tail"]


def test_the_build_script_masks_them_before_its_answer_leaves_the_target(tmp_path, monkeypatch):
    # Ansible's no_log masks the module's result; the answer that crosses `pct exec` is masked already.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    params = {"secret_environment": SECRETS, "index_credentials": [{"host": "h", "username": "u", "password": TOKEN}]}
    payload = {
        "path": str(tmp_path / "venvs" / "train"),
        "lock": "six==1.17.0 --hash=sha256:" + "a" * 64 + "\n",
        "python": "3.11",
        "stamp": "20261203T101500Z",
        "uv": echoing_uv(tmp_path),
        "keep": None,
        "timeout": 60,
        "expected": {"six": "1.17.0"},
        **network.network_payload(params),
    }
    answer = json.dumps(script.probe(payload))
    assert "install_failed" in answer or "index_unreachable" in answer
    for secret in ("IndexPassw0rdXYZ", PROXY_PASSWORD, TOKEN):
        assert secret not in answer
    assert ct_act.MASK in answer


def test_redact_masks_secrets_and_the_user_information_of_any_url():
    text = "fetch https://bob:t0ken@idx/simple via http://alice@proxy:3128 (t0ken); mail ci@example.org"
    assert ct_act.redact(text, ["t0ken", ""]) == (
        "fetch https://********@idx/simple via http://********@proxy:3128 (********); mail ci@example.org"
    )
    assert ct_act.redact(None, ["x"]) is None
    assert ct_act.redact_answer({"cmd": ["uv", "https://u:p@h/"], "rc": 2}, []) == {
        "cmd": ["uv", "https://********@h/"],
        "rc": 2,
    }


# -- the settings ----------------------------------------------------------------------------------------------
def test_the_network_settings_become_the_build_commands_environment(monkeypatch):
    monkeypatch.setenv("UV_INDEX_URL", "https://elsewhere/simple")  # foreign: dropped
    params = {
        "environment": {"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "pypi.internal", "UV_HTTP_TIMEOUT": 300},
        "secret_environment": {"UV_INDEX_CORP_PASSWORD": "s"},
        "ca_bundle": "/usr/local/share/ca-certificates/corp.crt",
        "system_certs": True,
    }
    payload = network.network_payload(params)["network"]
    env = venv_commands.build_env(payload)
    assert "UV_INDEX_URL" not in env
    assert (env["HTTPS_PROXY"], env["NO_PROXY"], env["UV_HTTP_TIMEOUT"]) == (
        "http://proxy:3128",
        "pypi.internal",
        "300",
    )
    assert env["UV_INDEX_CORP_PASSWORD"] == "s"  # noqa: S105 (a test's credential)
    crt = "/usr/local/share/ca-certificates/corp.crt"
    assert (env["SSL_CERT_FILE"], env["REQUESTS_CA_BUNDLE"], env["PIP_CERT"]) == (crt, crt, crt)
    # uv 0.11+ reads UV_SYSTEM_CERTS, older uv UV_NATIVE_TLS (ignored, without a warning, beside the new one).
    assert (env["UV_SYSTEM_CERTS"], env["UV_NATIVE_TLS"]) == ("true", "true")
    assert env["UV_NO_CONFIG"] == "1"  # the build's own settings stay
    assert payload["secrets"] == ["s"]
    assert network.network_payload({"environment": {}, "system_certs": False}) == {}


def test_the_payload_carries_the_network_only_when_set():
    spec = {
        "path": "/opt/venvs/train",
        "lock": "six==1.17.0\n",
        "python_version": None,
        "tooling": "ignore",
        "keep": None,
    }
    params = {"uv": "uv", "build_timeout": 60}
    assert "network" not in venv_acting.build_payload(spec, params, "20261203T101500Z")
    credentials = [{"host": "pypi.internal", "username": "ci", "password": "tok"}]
    payload = venv_acting.build_payload(spec, dict(params, index_credentials=credentials), "20261203T101500Z")
    assert payload["network"]["netrc"] == "machine pypi.internal login ci password tok\n"
    assert payload["network"]["secrets"] == ["tok"]


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"environment": {"UV_INDEX_URL": "https://x/simple"}}, "environment sets UV_INDEX_URL, which the build"),
        ({"environment": {"PIP_CONFIG_FILE": "/etc/pip.conf"}}, "environment sets PIP_CONFIG_FILE, which the build"),
        ({"environment": {"BAD-NAME": "x"}}, "environment names 'BAD-NAME', which is not an environment variable"),
        ({"environment": {"HTTPS_PROXY": ["x"]}}, "environment gives HTTPS_PROXY a list; give it a string"),
        ({"environment": {"A": "1"}, "secret_environment": {"A": "2"}}, "A is in both environment and secret_env"),
        (
            {"environment": {"SSL_CERT_FILE": "/a.pem"}, "ca_bundle": "/b.pem"},
            "SSL_CERT_FILE is set by ca_bundle and by the environment",
        ),
        ({"ca_bundle": "corp.pem"}, "ca_bundle is 'corp.pem'; expected the absolute path of a PEM file inside"),
        (
            {"index_credentials": [{"host": "https://pypi.internal/simple", "username": "u", "password": "p"}]},
            "index_credentials[0].host is 'https://pypi.internal/simple'; expected the index's host name alone",
        ),
        (
            {"index_credentials": [{"host": "pypi.internal", "username": "u", "password": "with space"}]},
            "index_credentials[0].password for pypi.internal is empty or holds white space",
        ),
    ],
)
def test_network_settings_that_cannot_work_are_named_without_a_secret(changed, message):
    params = {"path": "/opt/venvs/train", "lock": "six==1.17.0\n", "python_version": None, "tooling": "ignore"}
    params.update({"keep": None, "unattended_keep": 3, "unattended": False, "build_timeout": 1800, **changed})
    wrong = wrong_option(training_venv.TrainingVenv(training_venv.ARGUMENT_SPEC), params)
    assert wrong.startswith(message), wrong
    assert "with space" not in wrong


def test_a_lock_with_credentials_in_a_url_is_refused_without_showing_them():
    lock = "--index-url https://ci:s3cr3t@pypi.internal/simple\nsix==1.17.0\n"
    params = {"path": "/opt/venvs/train", "lock": lock, "python_version": None, "tooling": "ignore", "build_timeout": 1}
    wrong = wrong_option(training_venv.TrainingVenv(training_venv.ARGUMENT_SPEC), params)
    assert wrong == (
        "the lock, line 1: https://********@pypi.internal/simple carries credentials, which would be in every report "
        "and log; take them out of the lock and give them as training_venv_index_credentials"
    )


def test_the_secrets_are_no_log_in_the_argument_spec():
    spec = training_venv.ARGUMENT_SPEC
    assert spec["secret_environment"]["no_log"] is True
    assert spec["index_credentials"]["options"]["password"]["no_log"] is True
    assert not spec["environment"].get("no_log")  # a proxy's address is worth seeing; its password is not there
