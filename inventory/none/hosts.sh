#!/bin/sh
# ansible.cfg's default inventory: none. A run without -i must never reach a machine nobody named (a real node or
# the lab), so this stops it (with [inventory] unparsed_is_failed) and says what to pass.
echo "pve-gpu-recover: no inventory given. Name the targets: -i inventory/proxmox (your nodes; README, Point it at a real Proxmox node) or -i inventory/lab (the lab, make lab-up)" >&2
exit 1
