#!/bin/bash
# Issue 10's hardware run (docs/hardware.md): the compile-cache step in bare mode on the machine's own torch venv.
# A cache stamped for another torch build is purged, the warm-up (bench/flex_step.py: a compiled flex_attention,
# single-threaded) fills it, the next run keeps it (changed=0); then a training step's first compile is timed
# with that warm cache against an empty one.
#   OUT=/some/dir bench/hardware_cache.sh        # with .whl/ carried along
set -u -o pipefail
cd "$(dirname "$0")/.."
. bench/hardware_env.sh
VENV=$(python3 -c 'import sys; print(sys.prefix)')
CACHE=/tmp/pgr-inductor
log="$OUT/cache-runs.log"
: > "$log"
# A stale cache: some compiled files and a stamp for torch's cu128 build (this machine runs cu130).
rm -rf "$CACHE" && mkdir -p "$CACHE/fxgraph/xx" && head -c 1048576 /dev/urandom > "$CACHE/fxgraph/xx/old-kernel"
printf '{"fingerprint": {"torch": "2.11.0+cu128", "variant": "cu128", "cuda": "12.8", "triton": "3.5.0", "gpus": ["NVIDIA H200"]}, "stamped_at": "2026-11-01T00:00:00Z", "stamped_by": "pve-gpu-recover"}\n' \
    > "$CACHE/.pve-gpu-recover-stamp"
EXTRA=$(python3 -c 'import json, sys; print(json.dumps({"compile_cache_enabled": True, "compile_cache_venv": sys.argv[1],
    "compile_cache_roots": [sys.argv[2]], "compile_cache_warmup": ["python3", sys.argv[3]],
    "compile_cache_warmup_timeout": 600}))' "$VENV" "$CACHE" "$PWD/bench/flex_step.py")
RECOVER=(ansible-playbook -i inventory/localhost recover.yml -e preflight_min_free_gib=1
         -e "preflight_expected_gpu_count=$(nvidia-smi -L | wc -l)" -e "$EXTRA")
run() {
    local name=$1; shift
    echo "== $name" >> "$log"
    local start end rc
    start=$(date +%s.%N); "${RECOVER[@]}" "$@" >> "$log" 2>&1; rc=$?; end=$(date +%s.%N)
    echo "== $name: exit $rc, wall $(python3 -c "print(round($end - $start, 2))") s" >> "$log"
}
run "1 stale cache, --check --diff" --check --diff
run "2 stale cache, real run: purge, warm up, stamp"
run "3 again: the fresh cache is kept"
{ echo "== cache after: $(du -sh "$CACHE" | cut -f1)"; cat "$CACHE/.pve-gpu-recover-stamp"; echo; } >> "$log"
# The training step's first compile: with the warmed cache, and with an empty one (median of 2 each).
for i in 1 2; do
    echo "warm $i $(TORCHINDUCTOR_CACHE_DIR=$CACHE python3 bench/flex_step.py)" >> "$log"
    rm -rf /tmp/pgr-cold && echo "cold $i $(TORCHINDUCTOR_CACHE_DIR=/tmp/pgr-cold python3 bench/flex_step.py)" >> "$log"
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
reports = [json.load(open(p)) for p in sorted(glob.glob(out + "/reports/localhost/*.json"), key=os.path.getmtime)]
json.dump(reports, open(out + "/cache-reports.json", "w"), indent=1)
PY
rm -rf "$OUT/reports"
echo done
