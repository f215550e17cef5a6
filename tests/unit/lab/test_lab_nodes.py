"""Several lab nodes on one machine (labctl's node settings, tests/lab/fleet.py's layout and inventory): the default
lab keeps every name it had, and no two nodes share a name that is global on the machine."""

import sys

import pytest
import yaml
from harness import TESTS, gpulab

sys.path.insert(0, str(TESTS / "lab"))
import fleet
import labctl

FLEET = {"PVE_GPU_LAB_NODE": "pve-a", "PVE_GPU_LAB_SSH_PORT": "2231", "PVE_GPU_LAB_DIR": "/var/lib/f/pve-a"}


# -- labctl: the node from the environment ----------------------------------------------------------------------
def test_without_environment_the_node_is_the_default_lab_with_its_old_names():
    assert labctl.node_settings({}) == {
        "node": "pve-lab",
        "lab_dir": "/var/lib/pve-gpu-recover-lab",
        "ssh_port": 2222,
        "frozen_cgroup": "pgr-frozen",
        "gpu_seed": None,
        "private_run_lock": False,
    }
    # The machine-wide lock is the path the default lab always locked.
    assert labctl.MACHINE_LOCK == "/var/lib/pve-gpu-recover-lab.lock"


def test_another_node_gets_names_of_its_own():
    assert labctl.node_settings(FLEET) == {
        "node": "pve-a",
        "lab_dir": "/var/lib/f/pve-a",
        "ssh_port": 2231,
        "frozen_cgroup": "pgr-frozen-pve-a",
        "gpu_seed": "pve-a",
        "private_run_lock": True,
    }
    settings = labctl.node_settings({"PVE_GPU_LAB_NODE": "pve-b", "PVE_GPU_LAB_SSH_PORT": "2232"})
    assert settings["lab_dir"] == "/var/lib/pve-gpu-recover-lab-pve-b"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PVE_GPU_LAB_NODE": "pve-a"}, "node pve-a needs its own PVE_GPU_LAB_SSH_PORT"),
        ({"PVE_GPU_LAB_NODE": "../x", "PVE_GPU_LAB_SSH_PORT": "1"}, "PVE_GPU_LAB_NODE must be a host name"),
        ({"PVE_GPU_LAB_NODE": "PVE A", "PVE_GPU_LAB_SSH_PORT": "1"}, "PVE_GPU_LAB_NODE must be a host name"),
    ],
)
def test_a_node_without_a_port_or_with_a_bad_name_is_refused(environ, message):
    with pytest.raises(ValueError, match=message):
        labctl.node_settings(environ)


def test_the_default_gpus_keep_their_uuids_and_each_node_has_its_own():
    default = gpulab.make_gpus(10)
    # The UUIDs the default lab always had (reports and scenarios of earlier runs name them).
    assert default[0]["uuid"] == "GPU-bedd2116-d121-1a66-1f5b-443335fd9e24"
    assert default[9]["uuid"] == "GPU-34b5fb4f-2e45-3269-367b-cb7eb1423c1e"
    assert default == gpulab.make_gpus(10, node=None)
    nodes = [default, gpulab.make_gpus(8, node="pve-a"), gpulab.make_gpus(8, node="pve-b")]
    every = [gpu for gpus in nodes for gpu in gpus]
    assert len({gpu["uuid"] for gpu in every}) == len(every)
    assert len({gpu["serial"] for gpu in every}) == len(every)
    # Nodes of one model share their PCI layout.
    assert [g["pci.bus_id"] for g in nodes[1]] == [g["pci.bus_id"] for g in default[:8]]


def test_the_gpu_count_is_given_or_eight_or_what_the_cts_name():
    assert labctl.node_gpu_count(labctl.DEFAULT_CTS) == 10
    assert labctl.node_gpu_count({300: [0], 301: [1]}) == 8
    assert labctl.node_gpu_count({300: [0], 301: [1]}, 2) == 2
    with pytest.raises(ValueError, match="the CTs name GPU index 9, but the node has 8 GPUs"):
        labctl.node_gpu_count(labctl.DEFAULT_CTS, 8)


def test_the_default_inventory_is_what_labctl_always_wrote(monkeypatch):
    for name, value in (("NODE_NAME", "pve-lab"), ("SSH_PORT", 2222), ("LAB_DIR", "/var/lib/pve-gpu-recover-lab")):
        monkeypatch.setattr(labctl, name, value)
    lab = "/var/lib/pve-gpu-recover-lab"
    assert labctl.inventory_yaml(labctl.DEFAULT_CTS) == (
        "# Written by tests/lab/labctl.py create: the lab's node and containers.\n"
        "all:\n  children:\n    pve_nodes:\n      hosts:\n"
        "        pve-lab:\n"
        "          ansible_host: 127.0.0.1\n"
        "          ansible_port: 2222\n"
        "          ansible_user: root\n"
        f"          ansible_ssh_private_key_file: {lab}/ssh/id_ed25519\n"
        f"          ansible_ssh_common_args: -o UserKnownHostsFile={lab}/ssh/known_hosts\n"
        "          ansible_python_interpreter: /usr/bin/python3\n"
        "    gpu_targets:\n      hosts:\n"
        "        ct200:\n          pve_node: pve-lab\n          pve_vmid: 200\n"
        "        ct201:\n          pve_node: pve-lab\n          pve_vmid: 201\n"
    )


def test_only_this_nodes_directory_counts_as_its_leftover(monkeypatch):
    monkeypatch.setattr(labctl, "LAB_DIR", "/var/lib/f/pve-a")
    assert labctl.names_lab_dir("python3 /var/lib/f/pve-a/standins/pct.py exec 300")
    assert labctl.names_lab_dir("36 25 0:5 / /var/lib/f/pve-a rw")
    assert not labctl.names_lab_dir("python3 /var/lib/f/pve-ab/standins/pct.py")
    assert not labctl.names_lab_dir("sshd -f /var/lib/f/pve-a.old/ssh/sshd_config")


# -- fleet.py: layout and inventory --------------------------------------------------------------------------------
def test_two_nodes_of_eight_cts_have_one_gpu_per_ct_their_own_ports_and_vmids():
    a, b = fleet.layout(2, 8, fleet_dir="/var/lib/pve-gpu-recover-fleet")
    assert (a["node"], a["ssh_port"], a["lab_dir"]) == ("pve-a", 2231, "/var/lib/pve-gpu-recover-fleet/pve-a")
    assert (b["node"], b["ssh_port"], b["lab_dir"]) == ("pve-b", 2232, "/var/lib/pve-gpu-recover-fleet/pve-b")
    assert a["cts"] == {300 + j: [j] for j in range(8)}
    assert b["cts"] == {400 + j: [j] for j in range(8)}
    assert fleet.ct_specs(b)[:4] == ["--ct", "400:0", "--ct", "401:1"]


def test_fewer_cts_share_the_gpus_in_contiguous_blocks():
    assert fleet.split_gpus(8, 1) == [list(range(8))]
    assert fleet.split_gpus(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert fleet.split_gpus(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="9 CTs cannot share 8 GPUs"):
        fleet.split_gpus(8, 9)
    with pytest.raises(ValueError, match="1 to 7 nodes"):
        fleet.layout(8, 1)


@pytest.mark.parametrize(
    ("size", "targets"),
    [
        (1, ["ct300"]),
        (4, ["ct300", "ct400", "ct301", "ct401"]),
        (16, [f"ct{base + j}" for j in range(8) for base in (300, 400)]),
    ],
)
def test_a_sized_inventory_takes_the_cts_round_robin_over_the_nodes(size, targets):
    inventory = yaml.safe_load(fleet.inventory_yaml(fleet.layout(2, 8), size))
    groups = inventory["all"]["children"]
    assert list(groups["gpu_targets"]["hosts"]) == targets
    assert sorted(groups["pve_nodes"]["hosts"]) == ["pve-a", "pve-b"]
    for name, host in groups["gpu_targets"]["hosts"].items():
        assert host == {
            "pve_node": "pve-a" if name.startswith("ct3") else "pve-b",
            "pve_vmid": int(name[2:]),
            "preflight_expected_gpu_count": 1,
        }
    node = groups["pve_nodes"]["hosts"]["pve-b"]
    assert node["ansible_port"] == 2232
    assert node["ansible_ssh_private_key_file"].endswith("/pve-b/ssh/id_ed25519")


def test_the_fleet_uses_the_lab_settings_with_each_cts_own_gpu_count():
    lab = yaml.safe_load((TESTS.parent / "inventory" / "lab" / "group_vars" / "gpu_targets.yml").read_text())
    lab.pop("preflight_expected_gpu_count")
    inventory = yaml.safe_load(fleet.inventory_yaml(fleet.layout(2, 3)))
    targets = inventory["all"]["children"]["gpu_targets"]
    assert targets["vars"] == lab
    counts = {name: host["preflight_expected_gpu_count"] for name, host in targets["hosts"].items()}
    assert counts == {"ct300": 3, "ct400": 3, "ct301": 3, "ct401": 3, "ct302": 2, "ct402": 2}


def test_a_size_beyond_the_fleet_is_refused():
    with pytest.raises(ValueError, match="the fleet has 16 CTs; --size must be 1 to 16, got 17"):
        fleet.inventory_yaml(fleet.layout(2, 8), 17)


def test_each_node_runs_labctl_with_its_own_environment():
    env = fleet.node_env(fleet.layout(2, 8)[1], environ={"PATH": "/usr/bin"})
    assert env == {
        "PATH": "/usr/bin",
        "PVE_GPU_LAB_NODE": "pve-b",
        "PVE_GPU_LAB_DIR": f"{fleet.FLEET_DIR}/pve-b",
        "PVE_GPU_LAB_SSH_PORT": "2232",
    }
    assert labctl.node_settings(env)["frozen_cgroup"] == "pgr-frozen-pve-b"
