#!/bin/bash
# The whole recover.yml in bare mode on a real NVIDIA GPU machine (docs/hardware.md: issue 11's run, again for 3.0.0),
# every step on, against drift of each kind at once: a stray CUDA holder, a training repo moved off its pinned commit with
# local edits, a compile cache stamped for another torch build. The venv step checks the machine's own torch venv
# (the python3 there) against a lock made from its own freeze (in spec, so it is only ever read); verify asserts
# that machine's known-good facts (N x its GPU model, torch 2.11.0+cu130, CUDA 13.0). Then the drift runner's check of
# the converged host writes its textfile from the real GPUs' health (issue 44), and the log says whether any run
# printed a warning.
#   OUT=/some/dir bench/hardware_recover.sh        # with .whl/ (ansible-core and its needs, cp312) carried along
# Safety: the real run happens only when --check exited 0, planned to end exactly the holder this script started, changed
# nothing it snapshots (holder alive, repo HEAD and diff, cache listing and stamp, venv freeze), and found the
# venv in spec.
set -u -o pipefail
cd "$(dirname "$0")/.."
. bench/hardware_env.sh
VENV=$(python3 -c 'import sys; print(sys.prefix)')
# A machine's venv may hold a .pth that no distribution installed (the device's sandbox adds a CA hook,
# _sandboxing_egress_ca.pth): import drift that the venv step rightly rebuilds for, and no index is reachable there.
# So the run works on a copy of the venv without such files; the machine's own venv is never touched.
SOURCE_VENV=$VENV VENV=/tmp/pgr-venv
rm -rf "$VENV" && cp -a "$SOURCE_VENV" "$VENV"
python3 - "$VENV" <<'PY'
import glob, os, sys
site = glob.glob(os.path.join(sys.argv[1], "lib", "python3*", "site-packages"))[0]
listed = set()
for record in glob.glob(os.path.join(site, "*.dist-info", "RECORD")):
    with open(record, encoding="utf-8") as handle:
        listed.update(line.split(",", 1)[0] for line in handle)
for pth in sorted(glob.glob(os.path.join(site, "*.pth"))):
    if os.path.basename(pth) not in listed:
        os.remove(pth)
        print(f"the copy drops {os.path.basename(pth)} (no RECORD lists it)")
PY
GPUS=$(nvidia-smi -L | wc -l)
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)  # an H200 or an H100, whichever came
REPO=/tmp/pgr-train CACHE=/tmp/pgr-inductor
log="$OUT/recover-runs.log"
: > "$log"

# The training repo: commit 1 is the known-good one; HEAD is moved to commit 2, train.py edited, a file added.
rm -rf "$REPO" /var/backups/pve-gpu-recover/training_code
git init -q -b main "$REPO" && cd "$REPO" && git config user.email lab@example.invalid && git config user.name lab
printf 'print("train v1")\n' > train.py && git add train.py && git commit -qm v1
PINNED=$(git rev-parse HEAD)
printf 'print("train v2")\n' > train.py && git commit -qam v2
printf 'print("train v2, edited on the node")\n' > train.py && printf 'notes\n' > NOTES.txt
cd - > /dev/null
# The stale cache: 1 MB of old kernels and a stamp for torch's cu128 build (this machine runs cu130).
rm -rf "$CACHE" && mkdir -p "$CACHE/fxgraph/xx" && head -c 1048576 /dev/urandom > "$CACHE/fxgraph/xx/old-kernel"
printf '{"fingerprint": {"torch": "2.11.0+cu128", "variant": "cu128", "cuda": "12.8", "triton": "3.5.0", "gpus": ["NVIDIA H200"]}, "stamped_at": "2026-11-01T00:00:00Z", "stamped_by": "pve-gpu-recover"}\n' \
    > "$CACHE/.pve-gpu-recover-stamp"
# The venv's lock: exactly what is installed (the venv is in spec; the step only reads it).
python3 bench/venv_check.py --venv "$VENV" --python python3 --write-lock "$OUT/own.lock" >> "$log" 2>&1
# The stray holder: a detached CUDA process with 8 GiB on GPU 0.
rm -f /tmp/stray.out
(setsid python3 bench/cuda_holder.py --gib 8 > /tmp/stray.out 2>&1 &)
for _ in $(seq 600); do grep -q held /tmp/stray.out 2>/dev/null && break; sleep 0.1; done
HOLDER=$(awk '/held/ {print $2}' /tmp/stray.out)
[ -n "$HOLDER" ] || { echo "the stray CUDA holder did not start: $(cat /tmp/stray.out)" >&2; exit 1; }

SETTINGS=$(python3 -c 'import json, sys; venv, repo, pinned, cache, warmup, lock, gpus, gpu_name = sys.argv[1:]; print(json.dumps({
    "preflight_min_free_gib": 1, "preflight_space_path": "/tmp", "preflight_expected_gpu_count": int(gpus),
    "training_code_path": repo, "training_code_commit": pinned,
    "training_venv_path": venv, "training_venv_lock_file": lock,
    "compile_cache_enabled": True, "compile_cache_venv": venv, "compile_cache_roots": [cache],
    "compile_cache_warmup": ["python3", warmup], "compile_cache_warmup_timeout": 600,
    "verify_venv": venv, "verify_torch_version": "2.11.0+cu130", "verify_cuda_version": "13.0",
    "verify_gpu_count": int(gpus), "verify_gpu_name": gpu_name}))' \
    "$VENV" "$REPO" "$PINNED" "$CACHE" "$PWD/bench/flex_step.py" "$OUT/own.lock" "$GPUS" "$GPU_NAME")
echo "== settings: $SETTINGS" >> "$log"

snapshot() {  # what --check must not change
    echo "holder $HOLDER alive: $(kill -0 "$HOLDER" 2>/dev/null && echo yes || echo no)"
    git -C "$REPO" rev-parse HEAD; git -C "$REPO" status --porcelain; git -C "$REPO" diff | sha256sum
    find "$CACHE" -type f -printf '%P %s\n' | sort; sha256sum "$CACHE/.pve-gpu-recover-stamp"
    python3 -m pip freeze --all 2>/dev/null | sha256sum
}
run() {  # run NAME PLAYBOOK ARGS...: one run; its wall time, exit code and output into the log
    local name=$1 playbook=$2; shift 2
    echo "== $name: ansible-playbook -i inventory/localhost $playbook -e <settings> $*" >> "$log"
    local start end rc
    start=$(date +%s.%N)
    ansible-playbook -i inventory/localhost "$playbook" -e "$SETTINGS" "$@" >> "$log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    echo "== $name: exit $rc, wall $(python3 -c "print(round($end - $start, 2))") s" >> "$log"
    return $rc
}
latest_report() { python3 -c 'import json, glob, os; print(json.dumps(json.load(open(max(glob.glob(os.environ["OUT"] + "/reports/localhost/*.json"), key=os.path.getmtime)))))'; }

{ echo "== environment"; date -u; nvidia-smi -L; python3 -V; ansible-playbook --version | head -1
  echo "venv $VENV (a copy of $SOURCE_VENV); pinned $PINNED; holder $HOLDER"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; } >> "$log" 2>&1

before=$(snapshot)
check_rc=0
run "1 drift of every kind, --check --diff" recover.yml --check --diff || check_rc=$?
after=$(snapshot)
planned=$(latest_report | python3 -c 'import json, sys; r = json.load(sys.stdin); print(" ".join(str(p["pid"]) for p in r["steps"]["gpu_processes"].get("processes", [])))')
venv_status=$(latest_report | python3 -c 'import json, sys; print(json.load(sys.stdin)["steps"]["training_venv"]["status"])')
{ echo "== snapshot before --check:"; echo "$before"; echo "== snapshot after --check:"; echo "$after"
  echo "== check mode planned to end: [$planned] (holder $HOLDER); venv step: $venv_status; exit $check_rc"; } >> "$log"
if [ "$check_rc" = 0 ] && [ "$before" = "$after" ] && [ "$planned" = "$HOLDER" ] && [ "$venv_status" != "changed" ]; then
    echo "== --check changed nothing and planned only the holder: real run" >> "$log"
    run "2 real run" recover.yml --diff -e gpu_processes_grace=3
    { echo "== after the real run:"; snapshot; ls /var/backups/pve-gpu-recover/training_code/*/ 2>&1
      nvidia-smi --query-gpu=index,memory.used --format=csv; } >> "$log" 2>&1
    for i in 3 4 5; do run "$i converged, real run" recover.yml; done
    for i in 6 7 8; do run "$i converged, --check --diff (the drift check)" recover.yml --check --diff; done
    for i in 9 10 11; do run "$i playbooks/verify.yml (imports torch)" playbooks/verify.yml; done
    must_fail() {  # a wrong expectation that passes is a verify that cannot fail
        run "$@" && echo "== UNEXPECTED: $1 passed" >> "$log" || true
    }
    must_fail "12 playbooks/verify.yml expecting the cu128 build (must fail)" playbooks/verify.yml \
        -e verify_torch_version=2.11.0+cu128 -e verify_cuda_version=12.8
    must_fail "13 playbooks/verify.yml expecting 8 GPUs (must fail)" playbooks/verify.yml -e verify_gpu_count=8
    { echo "== after verify.yml:"; snapshot; } >> "$log" 2>&1
    # The drift check as the timer runs it: the textfile from the real GPUs (issue 44), the summary, exit 0.
    echo "$SETTINGS" > "$OUT/settings.json"
    start=$(date +%s.%N)
    python3 drift/runner.py --inventory inventory/localhost --extra-vars "@$OUT/settings.json" \
        --reports-dir "$OUT/drift" --textfile "$OUT/pve_gpu_recover.prom" --summary "$OUT/summary.json" >> "$log" 2>&1
    echo "== 14 drift/runner.py (the timer's check): exit $?, wall $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s" >> "$log"
    rm -rf "$OUT/drift"
else
    echo "== --check failed, changed something or planned more than the holder: no real run" >> "$log"
fi
kill -9 "$HOLDER" 2>/dev/null
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
reports = [json.load(open(p)) for p in sorted(glob.glob(out + "/reports/localhost/*.json"), key=os.path.getmtime)]
json.dump(reports, open(out + "/recover-reports.json", "w"), indent=1)
PY
rm -rf "$OUT/reports"
echo "== warnings printed by the runs: $(grep -c '\[WARNING\]\|DEPRECATION' "$log")" >> "$log"
grep -E "^== .*(exit|wall|UNEXPECTED|warnings)|PLAY RECAP|changed=" "$log" | tail -60
echo done
