#!/bin/bash
# The probe parts' hardware run (docs/hardware.md; 2.4.1, 2.4.2): the fact pass's probe program, which imports no
# json, subprocess, glob or re in the CT, against a real GPU machine's nvidia-smi, device nodes and NVML libraries;
# what each piece of a CT's read costs there (bench/per_ct_cost.py: the real nvidia-smi's CPU); the one reading of a
# venv's layout (ct_venv.site_packages, 2.4.2) by verify's, compile_cache's and the venv step's probes on the
# machine's real training venv; then converged recover.yml runs in bare mode, where the same probe parts run in
# the module's threads.
#   OUT=/some/dir bench/hardware_probe.sh        # with .whl/ (ansible-core and its needs, cp312) carried along
# Changes nothing on the machine: the real runs happen only when --check found nothing to change.
set -u -o pipefail
cd "$(dirname "$0")/.."
. bench/hardware_env.sh
RECOVER=(ansible-playbook -i inventory/localhost recover.yml -e preflight_min_free_gib=1
         -e "preflight_expected_gpu_count=$(nvidia-smi -L | wc -l)"
         -e "verify_gpu_name='$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)'")  # H100 or H200
recover() {  # recover [--check --diff]: one run; its exit code, wall time, changed count and tasks
    local start end rc
    start=$(date +%s.%N)
    "${RECOVER[@]}" "$@" > "$OUT/run.txt" 2>&1
    rc=$?
    end=$(date +%s.%N)
    echo "== recover.yml ${*:-(real)}: exit $rc, wall $(python3 -c "print(round($end - $start, 2))") s," \
        "$(grep -o 'changed=[0-9]*' "$OUT/run.txt" | head -1), tasks $(grep -c '^TASK' "$OUT/run.txt")"
    return $rc
}
{
    date -u; uname -r; nvidia-smi -L; python3 -V; ansible-playbook --version | head -1
    python3 bench/per_ct_cost.py --runs 30 --venv "$(python3 -c 'import sys; print(sys.prefix)')" \
        --out "$OUT/per_ct_cost.json"
    # ct_run against the standard library on the real device nodes, libraries and nvidia-smi, and what the
    # probe program imports and answers here.
    python3 - "$OUT/probe_answer.json" <<'PY'
import glob, json, os, subprocess, sys
sys.path.insert(0, "tests")
import conftest  # noqa: F401  (the collection importable)
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import facts as verify
payload = preflight.probe_payload(dict(preflight.SPEC_DEFAULTS))
for pattern in (*payload["device_globs"], *payload["library_globs"]):
    mine, theirs = sorted(ct_run.glob(pattern)), sorted(glob.glob(pattern))
    print(f"== glob {pattern}: {'same' if mine == theirs else 'DIFFERENT'} {mine}" + ("" if mine == theirs else f" != {theirs}"))
env = dict(os.environ, LC_ALL="C", LANG="C")
lean = ct_run.run(payload["nvidia_smi_argv"], 60, env=env)
real = subprocess.run(payload["nvidia_smi_argv"], capture_output=True, text=True, env=env, check=False)
same = (lean["rc"], lean["stdout"].splitlines()[:1], lean["stderr"]) == (real.returncode, real.stdout.splitlines()[:1], real.stderr)
print(f"== nvidia-smi through ct_run.run: {'same' if same else 'DIFFERENT'} exit {lean['rc']}, {lean['stdout'].count(chr(10))} lines")
parts = {"preflight": (preflight.PROBE, payload), "verify": (verify.PROBE, verify.probe_payload({"venv": sys.prefix}))}
program = node_target.PROBES_MAIN + "\nsys.stderr.write(' '.join(sorted(sys.modules)))\n"
done = subprocess.run([*node_target.probes_argv("python3")[:-1], program], input=node_target.probes_input(parts),
                      capture_output=True, text=True, check=True)
heavy = sorted(set(done.stderr.split()) & {"re", "enum", "json", "subprocess", "glob", "fnmatch", "signal", "locale"})
print(f"== the probe program imported of re, enum, json, subprocess, glob, fnmatch, signal, locale: {heavy}")
json.dump(json.loads(done.stdout), open(sys.argv[1], "w"), indent=1)
PY
    echo "== checks: exit $?"
    # One reading of the real venv's layout and torch's version by the three probes (2.4.2).
    python3 - <<'PY'
import sys, time
sys.path.insert(0, "tests")
import conftest  # noqa: F401  (the collection importable)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import probe as verify_probe
venv = sys.prefix
started = time.monotonic()
read = venv_probe.probe({"path": venv, "timeout": 60, "uv": "uv", "python": None})
took = time.monotonic() - started
verify = verify_probe.probe({"venv": venv})
cache = cache_probe.read_venv(venv)
print(f"== venv {venv}: python {read['python']}, lib {read['lib_pythons']}, {len(read['distributions'])} "
      f"distributions, broken {read['broken']}, errors {read['errors']}, read in {took:.2f} s")
for name, answer in (("training_venv", read), ("verify", verify), ("compile_cache", cache)):
    print(f"== {name}: site_packages {answer['site_packages']}, torch {(answer['torch_version_py'] or {}).get('version')}")
PY
    echo "== venv layout: exit $?"
    # A real run only where --check found nothing to change: this script must change nothing on the machine.
    if recover --check --diff && grep -q 'changed=0' "$OUT/run.txt"; then
        for _ in 1 2 3; do recover; recover --check --diff; done
    else
        echo "== not converged: no real run"
        cat "$OUT/run.txt"
    fi
    tail -4 "$OUT/run.txt"
} > "$OUT/runs.log" 2>&1
rm -f "$OUT/run.txt"
rm -rf "$OUT/reports"
echo done
