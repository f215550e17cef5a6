"""Setting the project up (Makefile, requirements/, scripts/): `make setup` installs the runtime only, from a hashed
lock; the test tooling comes from its own lock, which agrees with the runtime's; the test tooling installs no service
on the machine (promtool without the Prometheus server, Debian packages without their recommends); and every target
that would install Debian packages or build the lab refuses on a Proxmox VE node before it does anything."""

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT, unavailable

REQUIREMENTS = ROOT / "requirements"
GUARD = ROOT / "scripts" / "pve-guard"
# Every target that installs Debian packages or builds, uses or tests the lab.
GUARDED = ["lab", "test", "unit", "molecule", "system-deps", "lab-up", "unit-latest", "molecule-latest"]
TOOLING = {"molecule", "ansible-lint", "pytest", "pytest-testinfra", "ruff", "ansible-builder"}
RUNTIME = {"ansible-core", "ansible-runner", "prometheus-client", "uv"}
# make's own settings when these tests run under `make unit`, and what the Makefile exports, left out.
ENV = {
    k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PROMTOOL", "PVE_GUARD_ROOT")
}


def make(*args):
    """``make -n ARGS`` here: what the targets would run, nothing run (a failed dry run fails the test)."""
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def lock(name):
    """``{package: (version, sorted hashes)}`` of a hashed requirements lock."""
    found, current = {}, None
    for line in (REQUIREMENTS / name).read_text().splitlines():
        pin = re.match(r"([A-Za-z0-9._-]+)==(\S+)", line)
        if pin:
            current = pin.group(1).lower()
            found[current] = (pin.group(2), [])
        for digest in re.findall(r"--hash=(sha256:[0-9a-f]{64})", line):
            found[current][1].append(digest)
    return {name: (version, sorted(digests)) for name, (version, digests) in found.items()}


def pins(name):
    """``{package: version}`` of the ``name==version`` lines of a requirements input, its ``-r`` includes too."""
    found = {}
    for raw in (REQUIREMENTS / name).read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("-r "):
            found.update(pins(line[3:].strip()))
        elif "==" in line:
            package, version = line.split("==")
            found[package.strip().lower()] = version.strip()
    return found


# -- the runtime and the test tooling -------------------------------------------------------------------------------
def test_make_setup_installs_the_runtime_only_from_its_hashed_lock():
    steps = make("-W", "requirements/runtime.lock", "setup")
    installs = re.findall(r"pip install .*--require-hashes -r (\S+)", steps)
    assert installs == ["requirements/runtime.lock"], steps
    runtime = lock("runtime.lock")
    assert set(runtime) >= RUNTIME, sorted(runtime)
    assert not TOOLING & set(runtime), "the runtime lock carries test tooling"
    assert runtime["ansible-core"][0].startswith("2.19."), "the low end: ansible-core 2.19, the newest on Python 3.11"
    assert pins("runtime.in") == {name: runtime[name][0] for name in RUNTIME}


def test_make_test_installs_the_test_tooling_from_its_own_lock():
    for target in ("lint", "unit", "molecule"):
        steps = make("-W", "requirements/dev.lock", target)
        assert re.findall(r"pip install .*--require-hashes -r (\S+)", steps) == ["requirements/dev.lock"], target
    assert set(lock("dev.lock")) >= TOOLING
    assert set(lock("dev-latest.lock")) >= TOOLING


@pytest.mark.parametrize("name", ["runtime.lock", "dev.lock", "dev-latest.lock"])
def test_every_lock_is_hashed_and_holds_its_inputs_pins(name):
    found = lock(name)
    assert found
    assert [package for package, (_, digests) in found.items() if not digests] == []
    source = name.replace(".lock", ".in")
    assert {package: found[package][0] for package in pins(source)} == pins(source)


def test_the_runtime_and_the_tooling_agree_on_every_package_they_share():
    """`make setup-dev` installs dev.lock into the runtime's venv: a version or hash of its own would change the
    runtime under the user's feet."""
    runtime, dev = lock("runtime.lock"), lock("dev.lock")
    assert {name: dev.get(name) for name in runtime} == runtime
    assert pins("dev-latest.in")["ansible-core"].startswith("2.21.")
    assert {k: v for k, v in pins("dev-latest.in").items() if k != "ansible-core"} == {
        k: v for k, v in pins("dev.in").items() if k != "ansible-core"
    }


def test_make_lock_compiles_against_pypi_whatever_the_machine_configures():
    steps = make("-W", "requirements/runtime.lock", "lock")
    compiles = [line for line in steps.splitlines() if " pip compile " in line]
    assert len(compiles) == 3
    for line in compiles:
        assert "--generate-hashes" in line and "--universal" in line
        assert "--default-index https://pypi.org/simple" in line and "--no-config" in line
        assert "-u UV_FIND_LINKS" in line and "-u UV_INDEX_URL" in line
    assert "-c requirements/runtime.lock requirements/dev.in" in compiles[1]


# -- nothing installed that runs: no service, no recommends ----------------------------------------------------------
def test_system_packages_come_without_recommends_and_without_a_server():
    database = subprocess.run(
        ["make", "-pn", "--no-print-directory", "pve-guard"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    packages = re.search(r"^SYSTEM_PACKAGES := (.*)$", database, re.MULTILINE).group(1).split()
    assert "lxc" in packages
    assert not {"prometheus", "prometheus-node-exporter"} & set(packages)
    sources = [ROOT / "Makefile", *(ROOT / "scripts").iterdir()]
    installs = [line for path in sources for line in path.read_text().splitlines() if "apt-get install" in line]
    assert installs
    assert [line for line in installs if "--no-install-recommends" not in line] == []
    # The unit tests' promtool comes from scripts/fetch-promtool, never from installing the package.
    assert "scripts/fetch-promtool" in make("-W", "requirements/dev.lock", "PROMTOOL=/nonexistent/promtool", "unit")


def test_promtool_is_taken_out_of_debians_package_without_installing_it(tmp_path):
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        unavailable("apt-get and dpkg-deb are not here (Debian's)")

    def status():
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", "prometheus"], capture_output=True, text=True, check=False
        )
        return done.stdout

    before = status()
    done = subprocess.run(
        [str(ROOT / "scripts" / "fetch-promtool"), str(tmp_path / "promtool")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "promtool").iterdir()) == ["promtool"]
    version = subprocess.run(
        [str(tmp_path / "promtool" / "promtool"), "--version"], capture_output=True, text=True, check=False
    )
    assert version.returncode == 0 and "promtool, version" in version.stdout + version.stderr
    assert status() == before, "the prometheus package was installed or changed"


# -- a Proxmox VE node refuses ---------------------------------------------------------------------------------------
def node_root(tmp_path, mark):
    """A root directory with one of a Proxmox VE node's marks, or none."""
    root = tmp_path / mark
    (root / "var" / "lib" / "dpkg").mkdir(parents=True)
    status = "Package: python3\nStatus: install ok installed\nVersion: 3.11.2-1+b1\nArchitecture: amd64\n\n"
    if mark == "etc-pve":
        (root / "etc" / "pve").mkdir(parents=True)
    elif mark == "pveversion":
        (root / "usr" / "bin").mkdir(parents=True)
        (root / "usr" / "bin" / "pveversion").write_text("#!/usr/bin/perl\n")
    elif mark == "pve-manager":
        status += "Package: pve-manager\nStatus: install ok installed\nVersion: 8.4.1\nArchitecture: amd64\n\n"
    elif mark == "pve-manager-removed":  # removed, its configuration kept: no longer a node
        status += "Package: pve-manager\nStatus: deinstall ok config-files\nVersion: 8.4.1\nArchitecture: amd64\n\n"
    (root / "var" / "lib" / "dpkg" / "status").write_text(status)
    return root


def guard(root, *args):
    env = dict(ENV, PVE_GUARD_ROOT=str(root))
    return subprocess.run([str(GUARD), *args], env=env, capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize(
    ("mark", "found"),
    [
        ("etc-pve", "/etc/pve exists"),
        ("pveversion", "/usr/bin/pveversion exists"),
        ("pve-manager", "the pve-manager package is installed"),
    ],
)
def test_the_guard_refuses_a_proxmox_node_saying_why_and_what_to_use(tmp_path, mark, found):
    if mark == "pve-manager" and not shutil.which("dpkg-query"):
        unavailable("dpkg-query is not here (Debian's)")
    done = guard(node_root(tmp_path, mark), "make lab")
    assert (done.returncode, done.stdout) == (1, "")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    message = done.stderr
    assert message.startswith("make lab: refused: this machine is a Proxmox VE node (")
    assert found in message
    for why in ("Debian's lxc", "conflicts with PVE's lxc-pve", "sshd", "cgroups"):
        assert why in message
    assert "a separate Debian 12/13 VM or CT instead" in message
    assert "`make setup` alone" in message


@pytest.mark.parametrize("mark", ["none", "pve-manager-removed"])
def test_the_guard_lets_any_other_machine_through(tmp_path, mark):
    done = guard(node_root(tmp_path, mark), "make lab")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize("target", GUARDED)
def test_every_target_that_installs_or_builds_the_lab_runs_the_guard_first(target):
    """The dry run lists what the target runs in order: the guard before any venv, apt-get, promtool or lab."""
    steps = make(target, "-W", "requirements/dev.lock", "-W", "requirements/runtime.lock").splitlines()
    assert steps, target
    assert steps[0].startswith("scripts/pve-guard "), f"make {target} starts with {steps[0]!r}"


def test_make_stops_at_the_guard_on_a_node(tmp_path):
    """The guard's refusal stops make: its message, exit 2 and nothing after it."""
    root = node_root(tmp_path, "etc-pve")
    env = dict(ENV, PVE_GUARD_ROOT=str(root))
    done = subprocess.run(
        ["make", "--no-print-directory", "pve-guard"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("make pve-guard: refused: this machine is a Proxmox VE node ("), done.stderr
    assert done.stdout == ""
