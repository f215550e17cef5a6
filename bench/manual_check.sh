#!/bin/bash
# The yardstick of docs/benchmarks.md: the manual drift check as a person runs it, one `ssh node "pct exec ..."`
# per check, against the lab's CT 200 (node pve-lab on 127.0.0.1:2222). Every check's output goes to stdout;
# a check that finds nothing (no venv, no repo, no stamp yet) still costs its round trip, as it would by hand.
#   bench/manual_check.sh [VMID]
set -u
VMID=${1:-200}
LAB=/var/lib/pve-gpu-recover-lab
SSH=${BENCH_SSH:-ssh}
node() {
    "$SSH" -p 2222 -i "$LAB/ssh/id_ed25519" -o UserKnownHostsFile="$LAB/ssh/known_hosts" -o BatchMode=yes \
        root@127.0.0.1 "$@"
}
# 1. the venv's python facts
node "pct exec $VMID -- python3 -c 'import platform, sys; print(platform.python_version(), sys.prefix)'"
# 2. GPU memory
node "pct exec $VMID -- nvidia-smi --query-gpu=index,uuid,memory.used --format=csv"
# 3. the venv's freeze against the lock
node "pct exec $VMID -- sh -c 'cat /opt/venvs/train/pyvenv.cfg 2>/dev/null; ls /usr/lib/python3/dist-packages | wc -l'"
# 4. the training repo's HEAD and status
node "pct exec $VMID -- sh -c 'cd /srv/train 2>/dev/null && git rev-parse HEAD && git status --porcelain; true'"
# 5. the compile cache's stamp
node "pct exec $VMID -- sh -c 'cat /tmp/torchinductor_root/.pve-gpu-recover-stamp 2>/dev/null; true'"
# 6. the processes on the GPUs
node "pct exec $VMID -- nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv"
