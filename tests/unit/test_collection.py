"""The collection as someone else gets it (docs/collection.md): `ansible-galaxy collection build` of this checkout,
installed with `ansible-galaxy collection install` into a temporary collections path, then used from a directory
that has no ansible.cfg of ours, with nothing on the collections path but that install. Its modules, action,
callback, lookup, roles and playbooks must resolve by their FQCN from the installed copy, and the
artifact must hold nothing a checkout keeps for itself (the link to itself, the venvs, caches, the measurements)."""

import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from tests.conftest import ROOT

BIN = Path(sys.executable).parent
NAME = "pve_gpu.recover"
GALAXY = yaml.safe_load((ROOT / "galaxy.yml").read_text())
MODULES = sorted(p.stem for p in (ROOT / "plugins" / "modules").glob("*.py"))
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file())
# What a checkout has that the artifact must not carry: the self-link (it would loop), venvs, tool caches, build
# output, the lab's and the benchmarks' scratch.
FORBIDDEN = re.compile(
    r"^(collections|\.venv|\.venv-latest|\.cache|\.ansible|\.pytest_cache|\.ruff_cache|\.whl|\.device|dist|reports"
    r"|bench|docs/benchmarks|docs/hardware|tests/output)(/|$)|(^|/)__pycache__(/|$)|\.pyc$|rootfs"
)
# What only development uses: the test tooling, its locks and settings, the lab (its code, inventories and
# playbook), molecule, every test but the sanity ignores `ansible-test sanity` on the artifact reads.
DEV_ONLY = re.compile(
    r"^(Makefile|scripts|molecule|\.config|\.ci|\.ansible-lint|\.gitignore|ruff\.toml|pytest\.ini|bench"
    r"|inventory/lab[^/]*|playbooks/lab\.yml|requirements/(dev[^/]*|tools\.in)|tests/(?!sanity(/|$))[^/]+)(/|$)"
)
RUNTIME = yaml.safe_load((ROOT / "meta" / "runtime.yml").read_text())


def run(*argv, cwd, env, check=True):
    command = [str(BIN / argv[0]), *argv[1:]]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    if check:
        assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The built artifact, installed into a temp collections path, and a consumer directory with its env."""
    tmp = tmp_path_factory.mktemp("collection")
    home, consumer, collections = tmp / "home", tmp / "consumer", tmp / "collections"
    for directory in (home, consumer):
        directory.mkdir()
    (consumer / "empty.cfg").write_text("")  # not ours, nor /etc/ansible's, nor ~/.ansible.cfg
    env = {key: value for key, value in os.environ.items() if not key.startswith(("ANSIBLE_", "PVE_GPU_"))}
    env.update(
        HOME=str(home),
        ANSIBLE_CONFIG=str(consumer / "empty.cfg"),
        ANSIBLE_COLLECTIONS_PATH=str(collections),
        ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false",  # no copy on sys.path either
        ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"),
        ANSIBLE_NOCOLOR="1",
    )
    run("ansible-galaxy", "collection", "build", "--output-path", str(tmp / "dist"), str(ROOT), cwd=tmp, env=env)
    (artifact,) = (tmp / "dist").glob("*.tar.gz")
    run("ansible-galaxy", "collection", "install", "-p", str(collections), str(artifact), cwd=consumer, env=env)
    return SimpleNamespace(artifact=artifact, collections=collections, consumer=consumer, env=env)


def test_the_artifact_is_named_for_a_semantic_version_and_says_so_in_its_manifest(installed):
    artifact = installed.artifact
    assert re.fullmatch(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)", GALAXY["version"])
    assert artifact.name == f"pve_gpu-recover-{GALAXY['version']}.tar.gz"
    with tarfile.open(artifact) as tar:
        manifest = json.load(tar.extractfile("MANIFEST.json"))["collection_info"]
    assert (manifest["namespace"], manifest["name"], manifest["version"]) == ("pve_gpu", "recover", GALAXY["version"])
    assert f"## {GALAXY['version']} " in (ROOT / "CHANGELOG.md").read_text(), "each release has its CHANGELOG entry"


def test_the_artifact_holds_the_collection_and_nothing_a_checkout_keeps_for_itself(installed):
    with tarfile.open(installed.artifact) as tar:
        members = tar.getmembers()
    names = {m.name for m in members}
    assert [m.name for m in members if FORBIDDEN.search(m.name)] == []
    # The only link: plugins/modules -> library/, the design card's place for the module files (the collection maps
    # onto the same files); never the checkout's link to itself.
    assert {m.name: m.linkname for m in members if m.issym() or m.islnk()} == {"plugins/modules": "../library"}
    for needed in (
        "LICENSE",
        "CHANGELOG.md",
        "README.md",
        "meta/runtime.yml",
        "meta/execution-environment.yml",
        "playbooks/recover.yml",
        "recover.yml",
        "drift/runner.py",
        "tests/sanity/ignore-2.19.txt",
        "tests/sanity/ignore-2.21.txt",
    ):
        assert needed in names, needed


def test_the_artifact_holds_no_file_only_development_uses(installed):
    with tarfile.open(installed.artifact) as tar:
        names = tar.getnames()
    assert [name for name in names if DEV_ONLY.search(name)] == []
    # ... and what its consumers read: the EE's requirements, the example inventories, the sanity ignores.
    collection_ee = yaml.safe_load((ROOT / "meta" / "execution-environment.yml").read_text())["dependencies"]
    for needed in (
        collection_ee["python"],
        collection_ee["system"],
        "inventory/proxmox-minimal/hosts.yml",
        "inventory/proxmox/hosts.yml",
        *(f"tests/sanity/ignore-{version}.txt" for version in admitted_ansible_core()),
    ):
        assert needed in names, needed


def admitted_ansible_core():
    """The ansible-core minors (``2.19``) meta/runtime.yml's requires_ansible admits."""
    spec = SpecifierSet(RUNTIME["requires_ansible"])
    return [f"2.{minor}" for minor in range(10, 40) if any(f"2.{minor}.{patch}" in spec for patch in range(100))]


def test_every_ansible_core_the_collection_admits_has_its_sanity_ignores():
    """ansible-test X.Y reads tests/sanity/ignore-X.Y.txt: a version requires_ansible admits without one fails its
    sanity run. The files say the same: one set of reasons, whatever the version."""
    versions = admitted_ansible_core()
    assert versions[0] == "2.19" and len(versions) >= 2
    ignores = {version: (ROOT / "tests" / "sanity" / f"ignore-{version}.txt") for version in versions}
    assert [version for version, path in ignores.items() if not path.is_file()] == []
    assert len({path.read_text() for path in ignores.values()}) == 1
    shipped = sorted(path.name for path in (ROOT / "tests" / "sanity").glob("ignore-*.txt"))
    assert shipped == sorted(path.name for path in ignores.values()), "an ignore file for a version not admitted"


def test_every_sanity_ignore_names_a_file_the_artifact_ships(installed):
    """ansible-test fails on an ignore whose file is not there: the artifact's own, not the checkout's."""
    with tarfile.open(installed.artifact) as tar:
        files = {m.name for m in tar.getmembers() if m.isfile() or m.issym()}
    for path in sorted((ROOT / "tests" / "sanity").glob("ignore-*.txt")):
        named = [line.split()[0] for line in path.read_text().splitlines() if line.strip()]
        assert [name for name in named if name not in files] == [], path.name


def test_modules_and_their_docs_resolve_from_the_installed_copy(installed):
    consumer, env = installed.consumer, installed.env
    where = installed.collections / "ansible_collections" / "pve_gpu" / "recover"
    docs = json.loads(run("ansible-doc", "--json", *[f"{NAME}.{m}" for m in MODULES], cwd=consumer, env=env).stdout)
    assert sorted(docs) == [f"{NAME}.{m}" for m in MODULES]
    for name, doc in docs.items():
        assert Path(doc["doc"]["filename"]).is_relative_to(where), name
    for kind, plugin in (("callback", "recover_report"), ("lookup", "uv_lock")):
        doc = json.loads(run("ansible-doc", "-t", kind, "--json", f"{NAME}.{plugin}", cwd=consumer, env=env).stdout)
        assert Path(doc[f"{NAME}.{plugin}"]["doc"]["filename"]).is_relative_to(where), plugin
    roles = run("ansible-doc", "-t", "role", "--list", "--json", NAME, cwd=consumer, env=env).stdout
    assert sorted(json.loads(roles)) == [f"{NAME}.{role}" for role in ROLES]


def test_the_playbooks_and_roles_resolve_by_fqcn_from_a_consumers_playbook(installed):
    consumer, env = installed.consumer, installed.env
    playbook = consumer / "site.yml"
    playbook.write_text(
        textwrap.dedent(f"""\
        - name: The whole recovery
          ansible.builtin.import_playbook: {NAME}.recover
        - name: The read-only proof
          ansible.builtin.import_playbook: {NAME}.verify
        - name: The drift check, once
          ansible.builtin.import_playbook: {NAME}.drift
        - name: Each role on its own
          hosts: gpu_targets
          gather_facts: false
          roles:
        """)
        + "".join(f"    - role: {NAME}.{role}\n" for role in ROLES if role != "drift_timer")
    )
    run("ansible-playbook", "--syntax-check", "-i", "localhost,", str(playbook), cwd=consumer, env=env)
    run("ansible-playbook", "--syntax-check", "-i", "localhost,", f"{NAME}.recover", cwd=consumer, env=env)


def test_the_action_callback_and_lookup_run_from_the_installed_copy(installed, tmp_path):
    """The fact pass's action refuses a bad pve_vmid before any connection, the
    report callback writes that run's report, and the uv_lock lookup compiles into the cache
    PVE_GPU_RECOVER_LOCK_CACHE_DIR names (docs/awx.md)."""
    consumer, env = installed.consumer, installed.env
    uv = tmp_path / "uv"  # stands in for uv: says its version, and `pip compile` writes a lock to --output-file
    uv.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && { echo "uv 0.13.9 (x86_64-unknown-linux-gnu)"; exit 0; }\n'
        'while [ "$1" != --output-file ]; do shift; done\necho "six==1.17.0" > "$2"\n'
    )
    uv.chmod(0o755)
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        textwrap.dedent(f"""\
        - name: A target whose inventory is wrong
          hosts: all
          gather_facts: false
          tasks:
            - name: Compile a lock on the controller
              ansible.builtin.debug:
                msg: "{{{{ lookup('{NAME}.uv_lock', ['six'], uv='{uv}', cache_dir='') }}}}"
            - name: The fact pass
              {NAME}.target_facts:
                vmid: 200
                node_name: pve1
              delegate_to: pve1
        """)
    )
    env = dict(
        env,
        ANSIBLE_CALLBACKS_ENABLED=f"{NAME}.recover_report",
        PVE_GPU_RECOVER_REPORT_DIR=str(tmp_path / "reports"),
        PVE_GPU_RECOVER_LOCK_CACHE_DIR=str(tmp_path / "locks"),
    )
    argv = ["-i", "ct,ct2,", "-c", "local", "-e", "pve_vmid=oops", "-e", "pve_node=pve1", "-vvv", str(playbook)]
    done = run("ansible-playbook", *argv, cwd=consumer, env=env, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "six==1.17.0" in done.stdout
    # The cached lock: its key and the sha256 of the lock on its first line, then the lock as uv wrote it.
    assert [p.read_text().split("\n", 1)[1] for p in (tmp_path / "locks").glob("*.lock")] == ["six==1.17.0\n"]
    assert "ct: pve_vmid must be a Proxmox CT id" in done.stdout
    (report,) = (tmp_path / "reports" / "ct").glob("*.json")
    assert json.loads(report.read_text())["error"]["msg"].startswith("ct: pve_vmid must be a Proxmox CT id")


def test_the_installed_drift_runner_may_correct(installed):
    """--correct runs only where recover.yml, run with stand-in modules, hands unattended to every acting module
    (drift/unattended.py): the installed copy (AWX, an execution environment) must pass as a checkout does, its
    stand-ins found before the installed original."""
    root = installed.collections / "ansible_collections" / "pve_gpu" / "recover"
    probe = "import sys, ansible_runner\nfrom drift import unattended\n"
    probe += "print(unattended.probe(ansible_runner, sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", probe, str(root)],
        cwd=root,
        env=installed.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr
