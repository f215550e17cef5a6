# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where a target lives when the run never reached it: its ``pve_node`` and ``pve_vmid`` from the inventory.

A target whose fact pass did not run (its node unreachable, the run cut off) has no report to say where it is,
yet its series must name its node and vmid like any other's (an alert that says ``node=""`` helps nobody). The
inventory does: ``ansible-inventory --list`` through ansible-runner (the same inventories, ansible.cfg and
collections as the run, so an inventory plugin's composed ``pve_node`` comes out as the run saw it). It is asked
only when some target lacks them (about a second), and a value it cannot vouch for (one still templated, a vmid
that is not a CT id) is left out, never guessed.
"""

from __future__ import annotations

import os
import re
import tempfile

from drift.playbook import environment
from drift.text import one_line

VMID_MIN, VMID_MAX = 100, 999_999_999  # Proxmox's CT ids
NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")  # a host name as an inventory names a node
INVENTORY_TIMEOUT = 60  # seconds at most for ansible-inventory


def vmid_of(value):
    """``200`` or ``"200"`` -> ``200``; ``"{{ id }}"``, ``True``, ``"07"``, ``42`` -> None."""
    if isinstance(value, bool):
        return None
    text = str(value) if isinstance(value, (int, str)) else ""
    if not re.fullmatch(r"[1-9][0-9]{0,9}", text):
        return None
    return int(text) if VMID_MIN <= int(text) <= VMID_MAX else None


def locations(inventory, names):
    """``{name: {"node", "vmid"}}`` for each of ``names`` the inventory (``ansible-inventory --list``'s JSON) holds.

    A CT is ``pve_node`` and ``pve_vmid``; a bare host (no ``pve_vmid``) is its ``pve_node`` or its own name, as
    the fact pass names it, with vmid None. A host whose values are not plain (a template ansible-inventory does
    not render, a vmid out of range) is left out.
    """
    meta = inventory.get("_meta") if isinstance(inventory, dict) else None
    hostvars = meta.get("hostvars") if isinstance(meta, dict) else None
    found = {}
    for name in names:
        variables = (hostvars or {}).get(name)
        if not isinstance(variables, dict):
            continue
        node = variables.get("pve_node", name)
        node = node if isinstance(node, str) and NODE.match(node) else None
        if "pve_vmid" in variables:
            vmid = vmid_of(variables["pve_vmid"])
            if node is None or vmid is None:
                continue
        else:
            vmid = None
        if node is not None:
            found[name] = {"node": node, "vmid": vmid}
    return found


def read_inventory(ansible_runner, args, *, timeout):
    """``(inventory JSON or None, why not)``: ``ansible-inventory --list`` of the run's inventories."""
    env = environment(args, args.reports_dir)
    path = os.environ.get("PATH")
    try:
        # ansible-runner looks ansible-inventory up on this process's PATH (ansible-playbook on the run's): the
        # venv's bin first here too, for as long as the call lasts (systemd's PATH has none).
        os.environ["PATH"] = env["PATH"]
        with tempfile.TemporaryDirectory(prefix="pve-gpu-drift-inventory-") as private:
            out, err = ansible_runner.get_inventory(
                action="list",
                inventories=args.inventory,
                response_format="json",
                private_data_dir=private,
                envvars=env,
                timeout=max(1, int(timeout)),
                quiet=True,
            )
    except Exception as error:  # the metrics then name what the state knows; never a traceback
        return None, one_line(error)
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path
    if not isinstance(out, dict):
        return None, one_line(err or "ansible-inventory printed no inventory")
    return out, None


def locate(targets, ansible_runner, args, *, timeout=INVENTORY_TIMEOUT):
    """Fill the node and vmid of each target of the summary that has no node (its report never came) from the
    inventory, in place; returns the line to log when the inventory could not be read, else None."""
    unplaced = [name for name, target in targets.items() if target.get("node") is None]
    if not unplaced or timeout < 1:
        return None
    inventory, why = read_inventory(ansible_runner, args, timeout=min(timeout, INVENTORY_TIMEOUT))
    if inventory is None:
        return f"drift: the inventory could not say where {', '.join(unplaced)} live(s): {why}"
    for name, place in locations(inventory, unplaced).items():
        targets[name].update(place)
    return None
