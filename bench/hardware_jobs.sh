#!/bin/bash
# Hardware runs of jobs that restart their workers, bare mode, real CUDA (docs/hardware.md).
#   OUT=/some/dir bash bench/hardware_jobs.sh     # with .whl/ (ansible-core and its needs, cp312) carried along
# Issue 19 (this version): one invocation measures how long a restart takes to show (bench/worker_start_latency.py:
# exec -> first allocation, a supervisor's restart -> new child) and runs every case of issue 19 item 4 with real CUDA
# workers: the shell that runs the playbook as the holder's parent, a python supervisor restarting after 0, 2 and
# 5 s, a bash `until` loop, a parent that never restarts, a Jupyter-like server whose kernel holds the GPU. Each:
# --check, the real run only when the plan ends nothing but the case's own processes, memory.used 15 s after it,
# and a second run that must change nothing. bench/hardware_jobs.py has the details; it keeps under ~9 minutes.
# Output under $OUT: jobs-summary.json (a verdict per case), worker-latency.json, jobs-runs.log, jobs-reports.json.
# Issue 8's version of this script (three detached jobs) is in git history (commit 784cc5e).
set -u -o pipefail
cd "$(dirname "$0")/.."
. bench/hardware_env.sh
{ date -u; nvidia-smi -L; python3 -V; ansible-playbook --version | head -1; } > "$OUT/jobs-environment.txt" 2>&1
python3 bench/hardware_jobs.py
rc=$?
rm -rf "$OUT/reports"  # every report is in jobs-reports.json
echo "done (exit $rc)"
exit $rc
