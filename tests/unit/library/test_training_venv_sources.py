"""No source distribution is built as root unless the user names it, and the new venv's interpreters run isolated
(issue 40 item 2, the install half).

A lock pins hashes, not what building a source distribution runs: its build backend is the package's own code, run
as root in the target by uv or pip. So the build installs wheels only, except for the packages named in
``build_from_source`` (the role's ``training_venv_build_from_source``); a lock whose package has only an sdist fails
naming the package and the setting. Every interpreter of the new venv that the build runs (its check, pip, the
ensurepip that seeds it) starts with ``-I``: no PYTHON* variable, no user site, no working directory on its path.

Real builds on a bare host with the real uv (and ``python3 -m venv`` + pip) from a PEP 503 index on loopback that
serves a wheel and a source distribution whose in-tree build backend (PEP 517 ``backend-path``, no requirements:
no network) records that it ran. No test reaches PyPI or imports torch.
"""

import functools
import http.server
import io
import os
import socket
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import training_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import acting as venv_acting

from tests.conftest import ROOT, unavailable
from tests.fakes import FakeRunner, run_module

sys.path.insert(0, str(ROOT / "tests" / "lab"))
import wheelhouse

UV = str(ROOT / ".venv" / "bin" / "uv")
SYSTEM_PYTHON = "/usr/bin/python3.11"
STAMPS = iter(f"20261205T1{hour:01d}{minute:02d}00Z" for hour in range(10) for minute in range(60))
# An in-tree PEP 517 backend: it writes a wheel of the package with the standard library, and first records that
# it ran (the file named BUILT): the proof that a package's own code was, or was never, run by the build.
BACKEND = """
import base64, hashlib, os, zipfile

NAME, VERSION, BUILT = {name!r}, {version!r}, {built!r}


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with open(BUILT, "a") as handle:
        handle.write(f"built as uid {{os.getuid()}}\\n")
    info = f"{{NAME}}-{{VERSION}}.dist-info"
    files = {{
        f"{{NAME}}.py": b"BUILT_FROM_SOURCE = True\\n",
        f"{{info}}/METADATA": f"Metadata-Version: 2.1\\nName: {{NAME}}\\nVersion: {{VERSION}}\\n".encode(),
        f"{{info}}/WHEEL": b"Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }}
    record = ""
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{{path}},sha256={{digest}},{{len(data)}}\\n"
    record += f"{{info}}/RECORD,,\\n"
    wheel = f"{{NAME}}-{{VERSION}}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{{info}}/RECORD", record)
    return wheel
"""


def build_sdist(directory, name, version, built):
    """``<name>-<version>.tar.gz``: a source distribution whose build backend writes to ``built`` when it runs."""
    directory.mkdir(parents=True, exist_ok=True)
    top = f"{name}-{version}"
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
        "backend.py": BACKEND.format(name=name, version=version, built=str(built)),
    }
    sdist = directory / f"{top}.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return sdist


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A PEP 503 index on loopback: six as a wheel, ``srconly`` as a source distribution only; the locks of both."""
    root = tmp_path_factory.mktemp("index")
    built = root / "built"
    six = wheelhouse.build_wheel(root / "w", "six", "1.17.0")
    sdist = build_sdist(root / "w", "srconly", "1.0", built)
    wheelhouse.write_index(root / "www", [six, sdist])
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root / "www"))
    handler.log_message = lambda *_args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/simple"
    yield {
        "built": built,
        "lock": wheelhouse.lock_text([("six", "1.17.0", [six]), ("srconly", "1.0", [sdist])], index_url=url),
        "wheels_only": wheelhouse.lock_text([("six", "1.17.0", [six])], index_url=url),
    }
    server.shutdown()
    server.server_close()


@pytest.fixture
def host(index, tmp_path, monkeypatch):
    if not (Path(UV).exists() and Path(SYSTEM_PYTHON).exists()):
        unavailable(f"needs {UV} and {SYSTEM_PYTHON}")
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu1")
    monkeypatch.setattr(venv_acting, "utc_stamp", lambda: next(STAMPS))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    index["built"].unlink(missing_ok=True)
    (tmp_path / "venvs").mkdir()
    path = tmp_path / "venvs" / "train"

    def run(capsys, **params):
        args = {"path": str(path), "lock": index["lock"], "python_version": "3.11", "uv": UV, **params}
        return run_module(training_venv, args, FakeRunner(), monkeypatch, capsys)

    run.path = path
    return run


@pytest.mark.parametrize("builder", ["uv", "venv+pip"])
def test_a_package_with_only_a_source_distribution_is_never_built_and_is_named(host, capsys, index, builder):
    result = host(capsys, **({} if builder == "uv" else {"uv": "/nonexistent/uv"}))
    assert (result.get("failed"), result.get("error")) == (True, "no_wheel"), result.get("msg")
    assert "srconly 1.0 has no wheel" in result["msg"]
    assert "training_venv_build_from_source" in result["msg"]
    assert f"{host.path} was left as it was" in result["msg"]
    assert not index["built"].exists(), "the package's own build backend ran as root"
    assert [p.name for p in host.path.parent.iterdir()] == ["train.cache"]  # nothing built; the cache stays


@pytest.mark.parametrize("builder", ["uv", "venv+pip"])
def test_a_package_named_in_build_from_source_is_built_from_its_sdist(host, capsys, index, builder):
    result = host(capsys, build_from_source=["SrcOnly"], **({} if builder == "uv" else {"uv": "/nonexistent/uv"}))
    assert result["changed"] is True, result.get("msg")
    assert result["builder"]["name"] == builder
    assert {name: result["installed"][name] for name in ("six", "srconly")} == {"six": "1.17.0", "srconly": "1.0"}
    assert (result["missing"], result["extra"], result["wrong"]) == ([], [], [])
    assert index["built"].read_text() == f"built as uid {os.getuid()}\n"


@pytest.mark.parametrize("builder", ["uv", "venv+pip"])
def test_every_interpreter_of_the_new_venv_starts_isolated(host, capsys, index, monkeypatch, builder):
    """What the build runs: each python of the new version (its check, pip, ensurepip) and the base python that
    makes it with ``-m venv`` get -I; uv and pip are told to build nothing (wheels only) but what the user named."""
    ran = []
    real_run = ct_run.run

    def recording(argv, *args, **kwargs):
        ran.append(list(argv))
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(ct_run, "run", recording)
    result = host(capsys, lock=index["wheels_only"], **({} if builder == "uv" else {"uv": "/nonexistent/uv"}))
    assert result["changed"] is True, result.get("msg")
    new = result["current"]
    pythons = [argv for argv in ran if argv[0].startswith(f"{new}/") or argv[0].startswith("/usr/bin/python")]
    assert pythons, ran
    assert all(argv[1] == "-I" for argv in pythons), pythons
    installs = [argv for argv in ran if "sync" in argv or "install" in argv]
    assert len(installs) == 1, ran
    assert installs[0][installs[0].index("--only-binary") + 1] == ":all:"
    if builder == "venv+pip":
        assert next(argv[1:4] for argv in pythons if argv[0].startswith(f"{new}/")) == ["-I", "-m", "ensurepip"]


def test_only_the_named_packages_may_build_the_rest_of_the_lock_stays_wheels_only(host, capsys, index, monkeypatch):
    ran = []
    real_run = ct_run.run
    monkeypatch.setattr(ct_run, "run", lambda argv, *a, **k: ran.append(list(argv)) or real_run(argv, *a, **k))
    result = host(capsys, build_from_source=["srconly"])
    assert result["changed"] is True, result.get("msg")
    (sync,) = [argv for argv in ran if "sync" in argv]
    assert sync[sync.index("--only-binary") + 1] == "six"
    assert sync.count("--only-binary") == 1


@pytest.mark.parametrize("names", [["six", "../x"], [""], ["-r"]])
def test_build_from_source_names_that_are_no_package_names_are_refused(host, capsys, names):
    result = host(capsys, build_from_source=names)
    assert (result["failed"], result["error"]) == (True, "invalid")
    assert "build_from_source" in result["msg"] and "a package name" in result["msg"]
