#!/bin/bash
# The venv step's hardware run of docs/hardware.md: recover.yml in bare mode against the machine's own torch venv
# (the python3 there), with a lock made from its own freeze (in spec: nothing to do) and with that lock's torch
# pinned to the cu128 build (drift: torch's build variant), then the in-spec check's time next to `import torch`.
#   OUT=/some/dir bench/hardware_venv.sh        # with .whl/ (ansible-core and its needs, cp312) carried along
# Safety: the machine's venv is only ever read. Every run that names it is --check, except one real run made only
# after a --check of the same lock reported changed=0 (so it has nothing to do).
set -u -o pipefail
cd "$(dirname "$0")/.."
. bench/hardware_env.sh
VENV=$(python3 -c 'import sys; print(sys.prefix)')
gpus=$(nvidia-smi -L | wc -l)
python3 bench/venv_check.py --venv "$VENV" --python python3 --write-lock "$OUT/own.lock"
python3 bench/venv_check.py --venv "$VENV" --python python3 --write-lock "$OUT/cu128.lock" \
    --torch 2.11.0+cu128 --torch-index https://download.pytorch.org/whl/cu128
RECOVER=(ansible-playbook -i inventory/localhost recover.yml -e preflight_min_free_gib=1 -e preflight_space_path=/tmp
         -e "preflight_expected_gpu_count=$gpus" -e "training_venv_path=$VENV")
runs="$OUT/venv-runs.log"
: > "$runs"
run() {  # run NAME ARGS...: one recover.yml run; its wall time, exit code and recap into venv-runs.log
    local name=$1; shift
    echo "== $name: ${RECOVER[*]} $*" >> "$runs"
    local start end rc
    start=$(date +%s.%N)
    "${RECOVER[@]}" "$@" >> "$runs" 2>&1
    rc=$?
    end=$(date +%s.%N)
    echo "== $name: exit $rc, wall $(python3 -c "print(round($end - $start, 2))") s" >> "$runs"
    return $rc
}
{ echo "venv: $VENV"; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'; wc -l "$OUT"/*.lock; } \
    >> "$runs" 2>&1
run "1 own lock, --check --diff" --check --diff -e "training_venv_lock_file=$OUT/own.lock"
if tail -5 "$runs" | grep -q "changed=0 .*failed=0"; then
    for i in 2 3 4; do run "$i own lock, real run (in spec: nothing to do)" -e "training_venv_lock_file=$OUT/own.lock"; done
else
    echo "== the own lock was not in spec: no real run" >> "$runs"
fi
run "5 cu128 lock, --check --diff" --check --diff -e "training_venv_lock_file=$OUT/cu128.lock"
for i in 6 7 8; do run "$i venv step off, real run" ; done
python3 bench/venv_check.py --venv "$VENV" --python python3 --runs 5 > "$OUT/venv-check.json" 2> "$OUT/venv-check.err"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
reports = [json.load(open(p)) for p in sorted(glob.glob(out + "/reports/localhost/*.json"), key=os.path.getmtime)]
json.dump(reports, open(out + "/venv-reports.json", "w"), indent=1)
PY
rm -rf "$OUT/reports"
echo done
