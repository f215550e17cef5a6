#!/bin/bash
# Issue 8's hardware run (docs/hardware.md): recover.yml in bare mode against CUDA jobs shaped like real ones:
# a shell loop that restarts its worker (`while true; do python train.py; done`), a worker whose forked child
# inherited its GPU files, and a worker that ignores SIGTERM. All must be ended, the memory verified free and
# still free after the settle window, and a second run must report changed=0.
#   OUT=/some/dir bench/hardware_jobs.sh        # with .whl/ (ansible-core and its needs, cp312) carried along
# Safety: the real run happens only when --check planned exactly these jobs' processes.
set -u -o pipefail
cd "$(dirname "$0")/.."
. bench/hardware_env.sh
RECOVER=(ansible-playbook -i inventory/localhost recover.yml -e preflight_min_free_gib=1
         -e "preflight_expected_gpu_count=$(nvidia-smi -L | wc -l)")
log="$OUT/jobs-runs.log"
: > "$log"
memory() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | python3 -c 'import sys; print(sum(map(int, sys.stdin.read().split())))'; }
# Started detached (setsid, their starter gone), as a job started from a login session that ended would be.
(setsid bash -c 'while true; do python3 bench/cuda_holder.py --gib 8 > /tmp/loop-worker.out; done' &)
(setsid python3 bench/cuda_holder.py --gib 8 --fork-child > /tmp/forked.out 2>&1 &)
(setsid python3 bench/cuda_holder.py --gib 8 --ignore-term > /tmp/stubborn.out 2>&1 &)
for _ in $(seq 600); do [ "$(cat /tmp/loop-worker.out /tmp/forked.out /tmp/stubborn.out 2>/dev/null | grep -c held)" -eq 3 ] && break; sleep 0.1; done
{ echo "== jobs started"; ps -eo pid,ppid,stat,args | grep -E "cuda_holder|while true" | grep -v grep
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv; echo "memory.used: $(memory) MiB"; } >> "$log"
run() {
    local name=$1; shift
    echo "== $name: ${RECOVER[*]} $*" >> "$log"
    local start end rc
    start=$(date +%s.%N); "${RECOVER[@]}" "$@" >> "$log" 2>&1; rc=$?; end=$(date +%s.%N)
    echo "== $name: exit $rc, wall $(python3 -c "print(round($end - $start, 2))") s" >> "$log"
}
run "1 jobs, --check --diff" --check --diff
planned=$(python3 -c 'import json, glob, os; r = json.load(open(max(glob.glob(os.environ["OUT"] + "/reports/localhost/*.json"), key=os.path.getmtime))); s = r["steps"]["gpu_processes"]; print(len(s["processes"]), len(s.get("launchers", [])))')
echo "== planned (processes, launchers): $planned" >> "$log"
if [ "$planned" = "4 1" ]; then
    run "2 jobs, real run (grace 3 s)" --diff -e gpu_processes_grace=3
    sleep 5  # longer than the settle window: a restarted worker would hold memory again by now
    { echo "== 5 s later"; ps -eo pid,ppid,stat,args | grep -E "cuda_holder|while true" | grep -v grep
      echo "memory.used: $(memory) MiB"; } >> "$log"
    run "3 again: idempotence"
else
    echo "== ABORTED: the plan was not these jobs' 4 processes and 1 launcher; no real run" >> "$log"
fi
pkill -9 -f "while true; do python3 bench/cuda_holder.py"; pkill -9 -f bench/cuda_holder.py
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
reports = [json.load(open(p)) for p in sorted(glob.glob(out + "/reports/localhost/*.json"), key=os.path.getmtime)]
json.dump(reports, open(out + "/jobs-reports.json", "w"), indent=1)
PY
rm -rf "$OUT/reports"
echo done
