#!/bin/bash
# The hardware runs of docs/hardware.md: recover.yml in bare mode on a real NVIDIA GPU machine, one GPU or eight.
#   OUT=/some/dir bench/hardware_run.sh
# Needs: nvidia-smi, a python3 with torch, and (where PyPI is out of reach) ansible-core's wheels in .whl/.
# Safety: before any real run it runs --check and stops if gpu_processes would end anything but the two CUDA
# holders this script started (the machine may run agents of its own).
set -u -o pipefail
cd "$(dirname "$0")/.."
. bench/hardware_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RECOVER=(ansible-playbook -i inventory/localhost recover.yml -e preflight_min_free_gib=1
         -e "preflight_expected_gpu_count=$(nvidia-smi -L | wc -l)")
FIELDS=$(python3 -c 'import sys; sys.path.insert(0, "tests"); import conftest; from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import GPU_FIELDS; print(",".join(f[0] for f in GPU_FIELDS))')

step() { echo; echo "== $* ($(date -u +%H:%M:%S.%N | cut -c1-12))"; }
{
    step environment
    date -u; uname -r; nvidia-smi -L; python3 -V; ansible-playbook --version | head -1
    step /proc/driver/nvidia/version; cat /proc/driver/nvidia/version
    step nvidia majors in /proc/devices; grep -i nvidia /proc/devices
    step device nodes; ls -l /dev/nvidia*
    step "project GPU query (plugins/module_utils/node/nvidia_smi.py GPU_FIELDS)"
    nvidia-smi "--query-gpu=$FIELDS" --format=csv; echo "rc=$?"
    step memory query; nvidia-smi --query-gpu=index,uuid,memory.used --format=csv; echo "rc=$?"
} > "$OUT/captures.txt" 2>&1

runs="$OUT/runs.log"
: > "$runs"
run() {  # run NAME ARGS...: one recover.yml run, its wall time and exit code into runs.log
    local name=$1; shift
    step "$name: ${RECOVER[*]} $*" >> "$runs"
    local start end
    start=$(date +%s.%N)
    "${RECOVER[@]}" "$@" >> "$runs" 2>&1
    local rc=$?
    end=$(date +%s.%N)
    echo "== $name: exit $rc, wall $(python3 -c "print(round($end - $start, 2))") s" >> "$runs"
    return $rc
}

run "1 idle GPUs, real run"
# Holders: on one GPU, one obeying SIGTERM and one ignoring it; on several (issue 4), one per GPU with every
# other one ignoring SIGTERM, plus one holding GPUs 0 and 1 together.
gpus=$(nvidia-smi -L | wc -l)
rm -f /tmp/holder-*.out
start_holder() {  # start_holder NAME ARGS...
    local name=$1; shift
    python3 bench/cuda_holder.py --gib 20 "$@" > "/tmp/holder-$name.out" 2> "/tmp/holder-$name.err" &
}
if [ "$gpus" -eq 1 ]; then
    start_holder term
    start_holder ignore --ignore-term
else
    for i in $(seq 0 $((gpus - 1))); do
        start_holder "gpu$i" --device "$i" $([ $((i % 2)) -eq 1 ] && echo --ignore-term)
    done
    start_holder two-gpus --device 0 --device 1 --ignore-term
fi
expected=$(ls /tmp/holder-*.out | wc -l)
for _ in $(seq 900); do
    [ "$(cat /tmp/holder-*.out | grep -c held)" -eq "$expected" ] && break
    sleep 0.1
done
holders=$(cat /tmp/holder-*.out | awk '{print $2}' | sort -n | xargs)
{ step "holders: $holders"; nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv
  nvidia-smi --query-gpu=index,memory.used --format=csv; } >> "$OUT/captures.txt" 2>&1

run "2 CUDA holders, --check --diff" --check --diff
planned=$(python3 -c 'import json, glob, os; r = json.load(open(max(glob.glob(os.environ["OUT"] + "/reports/localhost/*.json"), key=os.path.getmtime))); print(" ".join(str(p["pid"]) for p in sorted(r["steps"]["gpu_processes"]["processes"], key=lambda p: p["pid"])))')
echo "== check mode planned: [$planned], holders: [$holders]" >> "$runs"
alive=$(for p in $holders; do kill -0 "$p" 2>/dev/null && echo "$p"; done | xargs)
echo "== alive after check: [$alive]" >> "$runs"
if [ "$planned" = "$holders" ] && [ "$alive" = "$holders" ]; then
    run "3 CUDA holders, real run (grace 3 s)" --diff -e gpu_processes_grace=3
    alive=$(for p in $holders; do kill -0 "$p" 2>/dev/null && echo "$p"; done | xargs)
    echo "== alive after real run: [$alive]" >> "$runs"
    run "4 again: idempotence"
else
    echo "== ABORTED: the plan would end other processes than the holders; no real run" >> "$runs"
    kill -9 $holders
fi
for p in $holders; do kill -9 "$p" 2>/dev/null; done

python3 bench/gpu_free_latency.py --repeat 3 --gib 20 > "$OUT/free_latency.json" 2> "$OUT/free_latency.err"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
reports = [json.load(open(p)) for p in sorted(glob.glob(out + "/reports/localhost/*.json"), key=os.path.getmtime)]
json.dump(reports, open(out + "/reports.json", "w"), indent=1)
PY
rm -rf "$OUT/reports"
echo done
