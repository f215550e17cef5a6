# Sourced by bench/hardware_*.sh (from the repository root): the output folder, and ansible-core from the wheels
# carried in .whl/ where the machine has no ansible-playbook (a device machine reaches no package index).
export OUT=${OUT:-/tmp/pgr-hardware}
mkdir -p "$OUT"
if ! command -v ansible-playbook >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export ANSIBLE_CONFIG=$PWD/ansible.cfg ANSIBLE_NOCOLOR=1 PVE_GPU_RECOVER_REPORT_DIR=$OUT/reports
