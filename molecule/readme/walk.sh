#!/bin/bash
# README.md's "Point it at a real Proxmox node" and "The full example", walked as written by a new user against the
# lab (molecule/readme; test code). The lab's node is sshd on 127.0.0.1:2222 (root, the lab's key), CT 200.
#
#   walk.sh SOURCE WORK TLS     (as root, in a mount namespace of its own: converge.yml runs it through unshare)
#
# SOURCE is the checkout to walk: its tracked and untracked files make the clone. WORK/home becomes /root here, the
# user's fresh home (ssh reads ~/.ssh from the password database's home, so only a home of its own keeps this
# machine's out of the walk and the walk out of it); the clone is ~/pve-gpu-recover; ~/records keeps each command's
# command line, output and exit status (<nn>-<name>.cmd, .out, .rc) for verify.yml. Every command runs whatever the
# ones before it did, so that verify names each break, not only the first.
#
# The walk makes only the edits the README names (the node's address, the CHANGE lines: the commit, the pins, the
# index; the settings "Behind a proxy or a private CA" names) plus one the lab needs: verify_import_torch never (the
# lab's torch is a stand-in that refuses `import torch`, as in inventory/lab). Step 2's ssh setup is the lab's key
# as the user's key (the node already authorizes it, as ssh-copy-id would have made it) and the node's address with
# its port in ~/.ssh/config. The user's own index is the lab's: the same files served over HTTPS by a private CA
# (TLS: ca.pem, server.pem, server.key of tests/lab/private_ca.py) in CT 200 (prepare.yml) and here, on this
# machine's loopback, at the same URL, as a user's index is reached by the controller and the CT alike; the user
# has its CA as ~/index-ca.pem, and the CT as /etc/pve-gpu-lab/index-ca.pem, in neither's trust store.
set -u
source_dir=$1
work=$2
tls=$3
lab=/var/lib/pve-gpu-recover-lab
index=https://127.0.0.1:8943

rm -rf "$work" && mkdir -p "$work/home" && chmod 0700 "$work/home" || exit 1
cp "$tls/ca.pem" "$work/home/index-ca.pem" || exit 1
# The controller's side of the user's own index (the lab's files), stopped when the walk ends. Its first line says
# it serves, its certificate read: only then is TLS's directory (under /root) hidden by the walk's home.
exec 3< <(exec python3 "$(dirname "$0")/../../tests/lab/standins/index_server.py" "$lab/index" --port 8943 \
    --tls-cert "$tls/server.pem" --tls-key "$tls/server.key" 2>&1)
index_pid=$!
trap 'kill $index_pid' EXIT
read -r serving <&3
[[ $serving == serving* ]] || { echo "walk.sh: the index server did not start: $serving" >&2; exit 1; }
mount --bind "$work/home" /root || exit 1
cd /root || exit 1
mkdir records
clone=/root/pve-gpu-recover
n=0

# step NAME COMMAND...: run COMMAND in the clone; keep its command line, output and exit status.
step() {
    local name
    n=$((n + 1))
    name=records/$(printf %02d "$n")-$1
    shift
    printf '%s\n' "$*" >"$name.cmd"
    (cd "$clone" && "$@") >"$name.out" 2>&1
    echo $? >"$name.rc"
}

# The clone: the checkout's files as git sees them (tracked and untracked, nothing ignored: no .venv, no reports).
mkdir "$clone" || exit 1
(cd "$source_dir" && git ls-files -z --cached --others --exclude-standard |
    tar --null --no-recursion --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$clone" || exit 1

# -- Quick start and step 1: the controller ------------------------------------------------------------------------
step setup make setup

# -- Step 2: ssh to the node, as root, by key ------------------------------------------------------------------------
mkdir -m 0700 ~/.ssh && cp "$lab/ssh/id_ed25519" ~/.ssh/id_ed25519 && chmod 0600 ~/.ssh/id_ed25519
printf 'Host pve-lab\n    HostName 127.0.0.1\n    Port 2222\n' >~/.ssh/config
# The first ssh asks to trust the node's host key; the user answers yes (accept-new) and it lands in known_hosts.
step ssh-pct-list ssh -o StrictHostKeyChecking=accept-new -o BatchMode=yes root@pve-lab pct list

# -- Step 3: your inventory -------------------------------------------------------------------------------------------
step copy-minimal cp -r inventory/proxmox-minimal inventory/mine
# The node's address (its port is in ~/.ssh/config); the vmid stays 200, the lab's CT; the GPUs (8, NVIDIA H200)
# are the lab's already.
step edit-minimal sed -i 's/ansible_host: pve1.example.org/ansible_host: pve-lab/' inventory/mine/hosts.yml

# -- Step 4: check, then recover (the venv activated, then not) ----------------------------------------------------
step minimal-check bash -c '. .venv/bin/activate && ansible-playbook -i inventory/mine recover.yml --check --diff'
step minimal-recover .venv/bin/ansible-playbook -i inventory/mine recover.yml

# -- The full example ---------------------------------------------------------------------------------------------------
step copy-full cp inventory/proxmox/group_vars/gpu_targets.yml inventory/mine/group_vars/
# 1. Its CHANGE lines: the commit as the README reads it, the pins, the index; the path, the guard and the warm-up
# script stay the example's (prepare.yml made the repository at /srv/dflash with its warmup.py).
step commit ssh root@pve-lab pct exec 200 -- git -C /srv/dflash rev-parse HEAD
commit=$(tail -1 "records/$(printf %02d "$n")-commit.out")
vars=inventory/mine/group_vars/gpu_targets.yml
step edit-full python3 - "$vars" "$commit" "$index" <<'EOF'
import re
import sys

path, commit, index = sys.argv[1:]
text = open(path, encoding="utf-8").read()


def change(key, value):
    """The line `key: ...` (and the list under it) now says `value`; added at the end where the file has none."""
    global text
    line = f"{key}: {value}\n"
    text, found = re.subn(rf"^{key}:.*\n(?:  - .*\n)*", lambda _: line, text, count=1, flags=re.M)
    if not found:
        text += line


change("training_code_commit", f'"{commit}"')
change("training_venv_requirements", "[torch==2.11.0+cu128, six==1.17.0, idna==3.10]")
change("training_venv_index_url", f"{index}/pypi/simple")
change("training_venv_torch_index_url", f"{index}/cu128/simple")
change("verify_import_torch", "never")  # the lab's one: its torch is a stand-in that refuses import
open(path, "w", encoding="utf-8").write(text)
EOF
# 2. uv for the venv: CT 200 has none, so PyPI's uv wheel where the example points.
step uv-wheel make uv-wheel
# 3. The lock, from an index behind a private CA: the first check fails, naming the cause and the fix; the user
# gives the CA as the README says, to the controller's compilation and to the build in the CT.
step full-check-untrusted bash -c '. .venv/bin/activate && ansible-playbook -i inventory/mine recover.yml --check --diff'
step edit-ca python3 - "$vars" <<'EOF'
import sys

path = sys.argv[1]
with open(path, "a", encoding="utf-8") as handle:
    handle.write("training_venv_compile_environment: {SSL_CERT_FILE: /root/index-ca.pem}\n")
    handle.write("training_venv_ca_bundle: /etc/pve-gpu-lab/index-ca.pem\n")
EOF
# 4. Check, then recover, as above: the check with the venv activated, the recovery without, then once more. What
# the check could have touched (the venv, the caches, uv in the CT; the wheel on the node) is listed around it.
seen="pct exec 200 -- find /opt /tmp /root /usr/local/lib -maxdepth 2; find /var/cache/pve-gpu-recover"
step before-check ssh root@pve-lab "$seen"
step full-check bash -c '. .venv/bin/activate && ansible-playbook -i inventory/mine recover.yml --check --diff'
step after-check ssh root@pve-lab "$seen"
step full-recover .venv/bin/ansible-playbook -i inventory/mine recover.yml
step full-again bash -c '. .venv/bin/activate && ansible-playbook -i inventory/mine recover.yml'
exit 0
