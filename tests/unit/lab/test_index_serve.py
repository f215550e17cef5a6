"""labctl index-serve's HTTPS index with a login (issue 21, item 2, in the lab): the command line it runs inside the
CT, run here on the files it would copy there, serves HTTPS only with the private CA's certificate and wants the
login; the secrets are files, never arguments."""

import argparse
import base64
import http.client
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from harness import STANDINS, TESTS

sys.path.insert(0, str(TESTS / "lab"))
import labctl
import private_ca

PASSWORD = "Lab1ndexT0kenS3cret"  # noqa: S105 (a test's credential)


def test_the_plain_index_is_what_it_always_was():
    assert labctl.index_server_argv(8900) == [
        "/usr/bin/python3",
        "/usr/local/lib/pve-gpu-lab/index_server.py",
        "/srv/pve-gpu-lab/index",
        "--port",
        "8900",
        "--pid-file",
        "/run/pve-gpu-lab-index.pid",
    ]
    assert labctl.index_server_argv(8900, "torch-2.11.0")[-2:] == ["--break", "torch-2.11.0"]


def test_the_key_certificate_and_login_are_files_of_the_ct_never_their_content():
    argv = labctl.index_server_argv(8943, tls=True, auth=True, access_log="/run/index.log")
    assert argv[7:] == [
        "--tls-cert",
        "/run/pve-gpu-lab-index/cert.pem",
        "--tls-key",
        "/run/pve-gpu-lab-index/key.pem",
        "--auth-file",
        "/run/pve-gpu-lab-index/auth",
        "--access-log",
        "/run/index.log",
    ]


def test_index_serve_takes_the_certificate_and_its_key_together(tmp_path):
    args = argparse.Namespace(tls_cert=str(tmp_path / "c"), tls_key=None, auth_file=None)
    with pytest.raises(SystemExit, match="--tls-cert and --tls-key together"):
        labctl.index_files(args)
    args.tls_key, args.auth_file = str(tmp_path / "k"), str(tmp_path / "a")
    assert labctl.index_files(args) == {
        "cert.pem": str(tmp_path / "c"),
        "key.pem": str(tmp_path / "k"),
        "auth": str(tmp_path / "a"),
    }


@pytest.fixture
def served(tmp_path, monkeypatch):
    """labctl's command line run here, the CT's paths mapped onto tmp_path, with the files index-serve copies."""
    ca = private_ca.make_ca(tmp_path / "ca")
    files = tmp_path / "files"
    files.mkdir(mode=0o700)
    (files / "cert.pem").write_bytes(ca["cert"].read_bytes())
    (files / "key.pem").write_bytes(ca["key"].read_bytes())
    (files / "auth").write_text(f"ci:{PASSWORD}\n")
    (tmp_path / "www" / "pypi" / "simple").mkdir(parents=True)
    (tmp_path / "www" / "pypi" / "simple" / "index.html").write_text("<a href='six/'>six</a>\n")
    monkeypatch.setattr(labctl, "CT_LIB", str(STANDINS))
    monkeypatch.setattr(labctl, "CT_INDEX", str(tmp_path / "www"))
    monkeypatch.setattr(labctl, "INDEX_PID", str(tmp_path / "pid"))
    monkeypatch.setattr(labctl, "INDEX_FILES", str(files))
    argv = labctl.index_server_argv(0, tls=True, auth=True, access_log=str(tmp_path / "access.log"))
    assert PASSWORD not in " ".join(argv)
    argv[0] = sys.executable
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    assert line.startswith("serving ") and " on https://127.0.0.1:" in line, line
    yield line.split(" on ", 1)[1].strip(), ca, tmp_path / "access.log"
    process.terminate()
    process.wait(10)


def fetch(url, ca=None, login=None):
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    request = urllib.request.Request(url)  # noqa: S310 (https or http, a test's own)
    if login:
        request.add_header("Authorization", "Basic " + base64.b64encode(login.encode()).decode())
    with urllib.request.urlopen(request, context=context, timeout=10) as response:  # noqa: S310 (https, a test's)
        return response.status


def test_the_index_is_https_only_of_the_private_ca_and_wants_the_login(served):
    base, ca, access_log = served
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        fetch(f"{base}/pypi/simple/")  # the default roots do not trust it
    with pytest.raises(urllib.error.HTTPError, match="401"):
        fetch(f"{base}/pypi/simple/", ca["ca"])
    assert fetch(f"{base}/pypi/simple/", ca["ca"], f"ci:{PASSWORD}") == 200
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        fetch(base.replace("https://", "http://") + "/pypi/simple/")  # no plain HTTP beside it
    assert access_log.read_text().splitlines() == ["/pypi/simple/ -", "/pypi/simple/ ci"]
