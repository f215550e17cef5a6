#!/usr/bin/python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Build, break and tear down a fleet of lab nodes on this machine: several Proxmox nodes, each a labctl node.

Node i (0, 1, ...) is ``pve-a``, ``pve-b``, ...: its directory FLEET_DIR/<node> (default
/var/lib/pve-gpu-recover-fleet), its sshd on 127.0.0.1:2231+i, its CTs (i+3)00, (i+3)01, ... and GPUs of its own,
split between its CTs the way a Proxmox node passes them (each CT a contiguous block in PCI order; eight CTs on
eight GPUs get one each, fewer CTs several). Every command runs labctl.py with that node's environment
(PVE_GPU_LAB_NODE, PVE_GPU_LAB_DIR, PVE_GPU_LAB_SSH_PORT). Run as root (labctl is).

    fleet.py create [--nodes 2] [--cts-per-node 8] [--gpus-per-node 8]
                                build (or repair) the fleet; writes FLEET_DIR/hosts.yml with every CT
    fleet.py destroy            destroy every node of the fleet (the default lab and others are left alone)
    fleet.py status             each node's CTs and sshd
    fleet.py inventory [--size N] [--out PATH]
                                the inventory of the first N CTs, taken round-robin over the nodes (ct300, ct400,
                                ct301, ...), so fleets of 1, 4 and 16 CTs run on one built fleet
    fleet.py pct-delay SECONDS  every node's pct costs SECONDS per call (labctl pct-delay)
    fleet.py stop-node NODE / start-node NODE    the node unreachable (its sshd and sessions down) / back
    fleet.py stop-ct VMID / start-ct VMID        on whichever node has it
    fleet.py node NODE LABCTL-ARGS...            any labctl command on one node, e.g. node pve-b fault ct400 gpu_lost
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# Each node gets its own (node_env); one left in the caller's shell would only make labctl's import refuse it.
for name in ("PVE_GPU_LAB_NODE", "PVE_GPU_LAB_DIR", "PVE_GPU_LAB_SSH_PORT"):
    os.environ.pop(name, None)
sys.path.insert(0, HERE)
import labctl  # noqa: E402  (its inventory lines; every change to a node goes through its CLI)

FLEET_DIR = os.environ.get("PVE_GPU_FLEET_DIR", "/var/lib/pve-gpu-recover-fleet")
LABCTL = ["/usr/bin/python3", os.path.join(HERE, "labctl.py")]
FIRST_PORT = 2231
FIRST_VMID_BASE = 3  # node i's CTs are (i + 3) * 100 + j: never the default lab's 200 and 201
MAX_NODES = 7  # vmid bases 300..900
# inventory/lab/group_vars/gpu_targets.yml without preflight_expected_gpu_count, which each CT gets as a host
# variable (its own share of its node's GPUs). tests/unit/lab keeps the two in step.
GROUP_VARS = {"preflight_min_free_gib": 1, "verify_import_torch": "never"}


def log(message):
    print(f"fleet: {message}", file=sys.stderr, flush=True)


# -- pure: the layout and the inventory ------------------------------------------------------------------------
def split_gpus(gpu_count, ct_count):
    """GPU indexes per CT: contiguous blocks in PCI order, the first CTs one more when they do not divide evenly.
    ``split_gpus(8, 3)`` -> ``[[0, 1, 2], [3, 4, 5], [6, 7]]``."""
    if not 1 <= ct_count <= gpu_count:
        raise ValueError(f"{ct_count} CTs cannot share {gpu_count} GPUs without two CTs on one GPU")
    share, extra = divmod(gpu_count, ct_count)
    blocks, first = [], 0
    for index in range(ct_count):
        size = share + (index < extra)
        blocks.append(list(range(first, first + size)))
        first += size
    return blocks


def layout(nodes, cts_per_node, gpus_per_node=8, fleet_dir=FLEET_DIR):
    """The fleet's nodes: ``[{node, lab_dir, ssh_port, gpus, cts: {vmid: [gpu indexes]}}]``."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"a fleet has 1 to {MAX_NODES} nodes (their vmids are 300 to 999), got {nodes}")
    if cts_per_node > 100:
        raise ValueError(f"a node has at most 100 CTs (vmids (i+3)00 to (i+3)99), got {cts_per_node}")
    blocks = split_gpus(gpus_per_node, cts_per_node)
    fleet = []
    for index in range(nodes):
        name = f"pve-{chr(ord('a') + index)}"
        base = (index + FIRST_VMID_BASE) * 100
        fleet.append(
            {
                "node": name,
                "lab_dir": os.path.join(fleet_dir, name),
                "ssh_port": FIRST_PORT + index,
                "gpus": gpus_per_node,
                "cts": {base + j: block for j, block in enumerate(blocks)},
            }
        )
    return fleet


def round_robin(fleet):
    """Every CT as ``(node, vmid, gpus)``, taken one per node in turn: ct300, ct400, ct301, ct401, ..."""
    columns = [[(n["node"], vmid, gpus) for vmid, gpus in sorted(n["cts"].items())] for n in fleet]
    longest = max((len(c) for c in columns), default=0)
    return [column[j] for j in range(longest) for column in columns if j < len(column)]


def inventory_yaml(fleet, size=None):
    """The fleet as an Ansible inventory: the nodes in pve_nodes, the first ``size`` CTs (all: None) in
    gpu_targets with the lab's settings; each CT expects its own number of GPUs."""
    targets = round_robin(fleet)
    if size is not None:
        if not 1 <= size <= len(targets):
            raise ValueError(f"the fleet has {len(targets)} CTs; --size must be 1 to {len(targets)}, got {size}")
        targets = targets[:size]
    lines = [
        f"# Written by tests/lab/fleet.py: {len(fleet)} lab nodes, {len(targets)} of their CTs (round-robin).",
        "all:",
        "  children:",
        "    pve_nodes:",
        "      hosts:",
    ]
    for node in fleet:
        lines += labctl.node_host_lines(node["node"], node["ssh_port"], node["lab_dir"])
    lines += ["    gpu_targets:", "      vars:"]
    lines += [f"        {key}: {value}" for key, value in GROUP_VARS.items()]
    lines.append("      hosts:")
    for node, vmid, gpus in targets:
        lines += [
            f"        ct{vmid}:",
            f"          pve_node: {node}",
            f"          pve_vmid: {vmid}",
            f"          preflight_expected_gpu_count: {len(gpus)}",
        ]
    return "\n".join(lines) + "\n"


def ct_specs(node):
    """labctl create's --ct arguments for a node: ``["--ct", "300:0", ...]``."""
    specs = []
    for vmid, gpus in sorted(node["cts"].items()):
        specs += ["--ct", f"{vmid}:{','.join(map(str, gpus))}"]
    return specs


def node_env(node, environ=None):
    return dict(
        os.environ if environ is None else environ,
        PVE_GPU_LAB_NODE=node["node"],
        PVE_GPU_LAB_DIR=node["lab_dir"],
        PVE_GPU_LAB_SSH_PORT=str(node["ssh_port"]),
    )


# -- state ---------------------------------------------------------------------------------------------------------
def fleet_file():
    return os.path.join(FLEET_DIR, "fleet.json")


def load_fleet():
    """The fleet as created (FLEET_DIR/fleet.json), vmids as integers; [] when there is none."""
    try:
        with open(fleet_file(), encoding="utf-8") as handle:
            fleet = json.load(handle)["nodes"]
    except FileNotFoundError:
        return []
    for node in fleet:
        node["cts"] = {int(vmid): gpus for vmid, gpus in node["cts"].items()}
    return fleet


def save_fleet(fleet):
    os.makedirs(FLEET_DIR, exist_ok=True)
    plain = [dict(node, cts={str(vmid): gpus for vmid, gpus in node["cts"].items()}) for node in fleet]
    labctl.write(fleet_file(), json.dumps({"nodes": plain}, indent=1) + "\n")


def labctl_on(node, *args, check=True, **kwargs):
    return subprocess.run([*LABCTL, *args], env=node_env(node), check=check, text=True, **kwargs)


def node_named(fleet, name):
    for node in fleet:
        if node["node"] == name:
            return node
    sys.exit(f"fleet: no node {name} (the fleet has {', '.join(n['node'] for n in fleet) or 'none'})")


def node_of_ct(fleet, vmid):
    for node in fleet:
        if vmid in node["cts"]:
            return node
    sys.exit(f"fleet: no CT {vmid} in the fleet")


def require_fleet():
    fleet = load_fleet()
    if not fleet:
        sys.exit(f"fleet: no fleet in {FLEET_DIR}; run `fleet.py create` first")
    return fleet


# -- commands ------------------------------------------------------------------------------------------------------
def create(args):
    try:
        wanted = layout(args.nodes, args.cts_per_node, args.gpus_per_node)
    except ValueError as error:
        sys.exit(f"fleet: {error}")
    existing = load_fleet()
    if existing and existing != wanted:
        sys.exit(f"fleet: a fleet of another shape exists in {FLEET_DIR}; run `fleet.py destroy` first")
    # Written first, so destroy finds a node whose create failed half-way.
    save_fleet(wanted)
    for node in wanted:
        log(f"creating {node['node']} (port {node['ssh_port']}, CTs {', '.join(map(str, node['cts']))})")
        done = labctl_on(node, "create", *ct_specs(node), "--gpus", str(node["gpus"]), check=False)
        if done.returncode != 0:
            sys.exit(f"fleet: creating {node['node']} failed (exit {done.returncode}); `fleet.py destroy` cleans up")
    inventory = os.path.join(FLEET_DIR, "hosts.yml")
    labctl.write(inventory, inventory_yaml(wanted))
    log(f"fleet ready: {len(wanted)} nodes, {sum(len(n['cts']) for n in wanted)} CTs; inventory {inventory}")


def destroy(_args):
    fleet = load_fleet()
    failed = []
    for node in fleet:
        if labctl_on(node, "destroy", check=False).returncode != 0:
            failed.append(node["node"])
    if failed:
        sys.exit(f"fleet: destroying {', '.join(failed)} failed; the fleet's files are kept so it can run again")
    for name in ("hosts.yml", "fleet.json"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(FLEET_DIR, name))
    with contextlib.suppress(FileNotFoundError, OSError):
        os.rmdir(FLEET_DIR)
    if os.path.exists(FLEET_DIR):
        sys.exit(f"fleet: {FLEET_DIR} still holds {sorted(os.listdir(FLEET_DIR))}; nothing of the fleet runs")
    log("fleet destroyed" if fleet else "no fleet")


def status(_args):
    fleet = load_fleet()
    if not fleet:
        print("no fleet")
        return
    for node in fleet:
        labctl_on(node, "status", check=False)
    print(f"inventory: {os.path.join(FLEET_DIR, 'hosts.yml')}")


def inventory(args):
    try:
        text = inventory_yaml(require_fleet(), args.size)
    except ValueError as error:
        sys.exit(f"fleet: {error}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        labctl.write(args.out, text)
    else:
        print(text, end="")


def on_every_node(*labctl_args):
    for node in require_fleet():
        labctl_on(node, *labctl_args)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("create")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cts-per-node", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.set_defaults(func=create)
    sub.add_parser("destroy").set_defaults(func=destroy)
    sub.add_parser("status").set_defaults(func=status)
    p = sub.add_parser("inventory")
    p.add_argument("--size", type=int, help="only the first N CTs, round-robin over the nodes")
    p.add_argument("--out", help="write it there (default: stdout)")
    p.set_defaults(func=inventory)
    p = sub.add_parser("pct-delay")
    p.add_argument("seconds")
    p.set_defaults(func=lambda a: on_every_node("pct-delay", a.seconds))
    for name in ("stop-node", "start-node"):
        p = sub.add_parser(name)
        p.add_argument("node")
        p.set_defaults(func=lambda a, name=name: labctl_on(node_named(require_fleet(), a.node), name))
    for name in ("stop-ct", "start-ct"):
        p = sub.add_parser(name)
        p.add_argument("vmid", type=int)
        p.set_defaults(func=lambda a, name=name: labctl_on(node_of_ct(require_fleet(), a.vmid), name, str(a.vmid)))
    p = sub.add_parser("node", help="any labctl command on one node")
    p.add_argument("node")
    p.add_argument("labctl_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: labctl_on(node_named(require_fleet(), a.node), *a.labctl_args))
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except subprocess.CalledProcessError as error:
        sys.exit(f"fleet: {' '.join(error.cmd[1:])} failed (exit {error.returncode})")


if __name__ == "__main__":
    main()
