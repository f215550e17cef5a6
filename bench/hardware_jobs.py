#!/usr/bin/env python3
"""Issue 19's hardware run, driven by bench/hardware_jobs.sh (which sets up ansible and OUT); bare mode, real CUDA.

    OUT=/some/dir python3 bench/hardware_jobs.py

1. Measures how long a restart takes to show, with bench/worker_start_latency.py (the H200 run of 2026-12-04,
   17:23 UTC, docs/hardware.md): exec -> `import torch` -> first allocation -> NVML lists it, exec -> first child,
   and a supervisor's kill -> new child / new worker's memory. Written to $OUT/worker-latency.json (skipped, and
   said so, in a tree without that script or with PGR_JOBS_SKIP_LATENCY set).
2. Runs each case of issue 19 item 4 with real CUDA workers (bench/cuda_holder.py, 8 GiB), recover.yml on
   inventory/localhost with the default settle window: `--check --diff`, then (only when the plan ends nothing but
   the case's own processes) the real run, the GPU memory and the case's processes 15 s after it, and a second run
   that must change nothing. Cases: the shell that runs the playbook is the holder's parent; a python supervisor
   (no launcher's name) restarting after 0, 2 and 5 s; a bash `until` loop; a parent that never restarts; a
   Jupyter-like server whose kernel holds the GPU.
3. Writes $OUT/jobs-runs.log (every command and its output), $OUT/jobs-summary.json (each case: what was expected,
   what was found, pass/fail) and $OUT/jobs-reports.json (every run's report).

Every case runs in a session of its own started detached (setsid -f: its parent is init, as a job left by a
closed login is), so a mistake of the step can never reach this driver or the device's shell; each session is
killed at the end of its case. The whole run keeps under BUDGET seconds: a case that would start later is skipped
(named in the summary).
"""

import contextlib
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ["OUT"])  # bench/hardware_env.sh sets it
REPORTS = OUT / "reports" / "localhost"
LOG = OUT / "jobs-runs.log"
BUDGET = 360  # seconds before the last case starts: setup, the latency run (<=150 s) and one case more fit in 600
AFTER = 15  # seconds after the real run at which the memory must still be 0 MiB
PY = sys.executable
# PGR_JOBS_HOLDER replaces the CUDA holder for a dry run of this driver on a machine without a GPU.
HOLDER = shlex.split(os.environ.get("PGR_JOBS_HOLDER", "")) or [PY, "bench/cuda_holder.py", "--gib", "8"]
T0 = time.monotonic()


def log(text):
    with open(LOG, "a") as handle:
        handle.write(text.rstrip("\n") + "\n")


def recover_argv(*extra):
    gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout.splitlines())
    return [
        "ansible-playbook",
        "-i",
        "inventory/localhost",
        "recover.yml",
        "-e",
        "preflight_min_free_gib=1",
        "-e",
        f"preflight_expected_gpu_count={gpus}",
        "-e",
        "gpu_processes_grace=3",
        # verify imports torch in the venv of this python (the device's training venv) after the step changed
        # something; the default /opt/venvs/train does not exist there.
        "-e",
        f"verify_venv={sys.prefix}",
        *extra,
    ]


def memory_used():
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout
    return sum(int(v) for v in out.split() if v.isdigit())


def nvml_pids():
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    ).stdout
    return {int(v) for v in out.split() if v.isdigit()}


def stat_fields(pid):
    """(state, ppid, sid) of a live process, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[3])


def session(sid):
    """Live pids of session ``sid`` (the case's processes)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields and fields[2] == sid and fields[0] not in "ZX":
                found.append(int(entry))
    return sorted(found)


def describe(pids):
    rows = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            argv = "(gone)"
        rows.append(f"{pid} {argv[:150]}")
    return rows


def kill_session(sid):
    for pid in session(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_detached(script, name):
    """``bash -c script`` in a session of its own whose parent is init; its pid (the session id)."""
    pidfile = OUT / f"{name}.pid"
    pidfile.unlink(missing_ok=True)
    body = f"echo $$ > {shlex.quote(str(pidfile))}; {script}"
    with open(OUT / f"{name}.out", "w") as output:  # the job's own output (the supervisor's starts and exits)
        subprocess.run(
            ["setsid", "-f", "bash", "-c", body], cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, check=True
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if pidfile.exists() and pidfile.read_text().strip():
            return int(pidfile.read_text())
        time.sleep(0.05)
    raise RuntimeError(f"{name}: the case's shell never started")


def wait_holders(sid, count=1, timeout=90):
    """Wait until NVML lists ``count`` processes of the session; their pids (empty on timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mine = nvml_pids() & set(session(sid))
        if len(mine) >= count:
            return sorted(mine)
        time.sleep(0.2)
    return []


def newest_report(since):
    paths = [p for p in glob.glob(str(REPORTS / "*.json")) if os.path.getmtime(p) >= since]
    if not paths:
        return None
    with open(max(paths, key=os.path.getmtime)) as handle:
        return json.load(handle)


def run(name, *extra, timeout=200):
    """One recover.yml run: rc, wall, its report (None if none was written)."""
    argv = recover_argv(*extra)
    log(f"\n== {name}: {' '.join(argv)}")
    since = time.time()
    started = time.monotonic()
    try:
        with open(LOG, "a") as handle:
            done = subprocess.run(argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        rc = done.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = round(time.monotonic() - started, 2)
    log(f"== {name}: exit {rc}, wall {wall} s")
    return {"rc": rc, "wall": wall, "report": newest_report(since)}


def converged(outcome):
    return outcome["rc"] == 0 and (outcome.get("report") or {}).get("status") == "ok"


def gpu_step(outcome):
    return ((outcome.get("report") or {}).get("steps") or {}).get("gpu_processes") or {}


def planned(outcome):
    step = gpu_step(outcome)
    return sorted({p["pid"] for p in (step.get("processes") or []) + (step.get("launchers") or [])})


def check_gate(name, sid):
    """--check, then whether the plan ends only this case's processes (else no real run)."""
    check = run(f"{name}: --check --diff", "--check", "--diff")
    plan = planned(check)
    ours = set(session(sid))
    ok = check["rc"] == 0 and bool(plan) and set(plan) <= ours
    log(f"== {name}: planned {plan}, the case's processes {sorted(ours)}: {'real run' if ok else 'NO real run'}")
    return check, plan, ok


def after_run(name, sid, real_done):
    """Memory and the case's processes AFTER s after the real run, then the second run."""
    time.sleep(max(0.0, real_done + AFTER - time.monotonic()))
    left = session(sid)
    memory = memory_used()
    log(f"== {name}: {AFTER} s after the real run: memory.used {memory} MiB; left: {describe(left)}")
    again = run(f"{name}: again (must change nothing)")
    return memory, left, again


def summary_of(outcome):
    step = gpu_step(outcome)
    keys = ("killed", "launchers", "parents", "own_run", "watched", "seconds_to_free", "needs_window", "changes")
    return {
        "rc": outcome["rc"],
        "wall": outcome["wall"],
        "status": (outcome.get("report") or {}).get("status"),
        "error": (outcome.get("report") or {}).get("error"),
        **{k: step.get(k) for k in keys},
    }


def job_case(name, script, expect):
    """A detached job (``script``), the gated real run, the 15 s check, the second run; ``expect(result)`` judges."""
    result = {"case": name}
    sid = start_detached(script, name)
    try:
        holders = wait_holders(sid)
        result["holders"] = holders
        log(f"\n== {name}: job started, session {sid}: {describe(session(sid))}")
        if not holders:
            result["verdict"] = "no CUDA holder started within 90 s"
            return result
        check, plan, ok = check_gate(name, sid)
        result["check"] = dict(summary_of(check), planned=plan)
        if not ok:
            result["verdict"] = "ABORTED: the plan was not only this case's processes; no real run"
            return result
        real = run(f"{name}: real run", "--diff")
        done = time.monotonic()
        result["real"] = summary_of(real)
        memory, left, again = after_run(name, sid, done)
        result.update(memory_after=memory, left_after=describe(left), again=summary_of(again))
        failures = [why for ok_, why in expect(result, sid, holders) if not ok_]
        failures += [] if memory == 0 else [f"memory {memory} MiB {AFTER} s after the run"]
        failures += [] if converged(again) else ["the second run changed something"]
        result["verdict"] = "pass" if not failures else "FAIL: " + "; ".join(failures)
        return result
    finally:
        kill_session(sid)


def shell_case():
    """The holder's parent is the shell that runs the playbook: that shell runs the check, the gate, the real run."""
    name = "shell-runs-the-playbook"
    status = OUT / f"{name}.status"
    status.unlink(missing_ok=True)
    holder = " ".join(shlex.quote(a) for a in HOLDER)
    script = (
        f"{holder} > {OUT}/{name}.holder.out 2>&1 & "
        f"for i in $(seq 900); do grep -q held {OUT}/{name}.holder.out && break; sleep 0.1; done; "
        f"{shlex.quote(PY)} bench/hardware_jobs.py --as-shell {name}; "
        f'echo "the shell survived; the runs exited $?" > {status}; wait'
    )
    result = {"case": name}
    sid = start_detached(script, name)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not status.exists() and session(sid):
            time.sleep(0.2)
        done = time.monotonic()
        inner = OUT / f"{name}.json"
        result.update(json.loads(inner.read_text()) if inner.exists() else {"verdict": "the runs wrote nothing"})
        result["shell_status"] = status.read_text().strip() if status.exists() else "NO STATUS: the shell died"
        if "real" not in result:
            return result
        memory, left, again = after_run(name, sid, done)
        result.update(memory_after=memory, left_after=describe(left), again=summary_of(again))
        real = result["real"]
        shell = result["shell"]
        failures = []
        failures += [] if real["rc"] == 0 else [f"the real run exited {real['rc']}"]
        failures += [] if status.exists() else ["the shell running the playbook was ended"]
        failures += [] if any(f"pid {shell} " in s for s in real["own_run"] or []) else ["own_run does not name it"]
        failures += [] if not real["launchers"] else ["a launcher was ended"]
        failures += [] if memory == 0 else [f"memory {memory} MiB {AFTER} s after the run"]
        failures += [] if converged(again) else ["the second run changed something"]
        result["verdict"] = "pass" if not failures else "FAIL: " + "; ".join(failures)
        return result
    finally:
        kill_session(sid)


def as_shell(name):
    """Inside the case's shell: the check, the gate and the real run, as `ansible-playbook` from that shell."""
    shell = os.getppid()
    sid = os.getsid(0)
    result = {"case": name, "shell": shell, "holders": sorted(nvml_pids() & set(session(sid)))}
    check, plan, ok = check_gate(name, sid)
    result["check"] = dict(summary_of(check), planned=plan)
    if ok:
        result["real"] = summary_of(run(f"{name}: real run", "--diff"))
    else:
        result["verdict"] = "ABORTED: the plan was not only this case's processes; no real run"
    (OUT / f"{name}.json").write_text(json.dumps(result))


def restarted(result, sid, holders):
    launchers = result["real"]["launchers"] or []
    return [
        (result["real"]["rc"] == 0, f"the real run exited {result['real']['rc']}"),
        (any(r["reason"].startswith("restarted its worker") for r in launchers), "no parent ended for restarting"),
        (not result["left_after"], "processes of the job were left"),
    ]


def never_restarted(result, sid, holders):
    parents = result["real"]["parents"] or []
    return [
        (result["real"]["rc"] == 0, f"the real run exited {result['real']['rc']}"),
        (sid in [p["pid"] for p in parents], "the parent is not named in parents"),
        (any(p["note"].startswith("may start workers again") for p in parents), "no 'may start workers again'"),
        (bool(result["left_after"]), "the parent was ended"),
        (not result["real"]["launchers"], "a launcher was ended"),
    ]


def loop_ended(result, sid, holders):
    launchers = result["real"]["launchers"] or []
    return [
        (result["real"]["rc"] == 0, f"the real run exited {result['real']['rc']}"),
        ([r["reason"] for r in launchers] == ["a shell running the job"], "the loop was not ended as a launcher"),
        (not result["left_after"], "processes of the job were left"),
    ]


def main():
    if sys.argv[1:2] == ["--as-shell"]:
        return as_shell(sys.argv[2])
    OUT.mkdir(parents=True, exist_ok=True)
    log(f"== start {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; memory.used {memory_used()} MiB")
    summary = {"cases": [], "skipped": []}
    latency = OUT / "worker-latency.json"
    if os.environ.get("PGR_JOBS_SKIP_LATENCY"):
        out, err = "", "skipped (PGR_JOBS_SKIP_LATENCY): measured on its own, docs/hardware.md"
    elif (ROOT / "bench/worker_start_latency.py").exists():
        argv = [PY, "bench/worker_start_latency.py", "--runs", "5", "--delays", "0", "2", "--out", str(latency)]
        try:
            timing = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=150, check=False)
            out, err = timing.stdout, timing.stderr
        except subprocess.TimeoutExpired:
            out, err = "", "bench/worker_start_latency.py took more than 150 s"
    else:
        out, err = "", "bench/worker_start_latency.py is not in this tree: no measurement"
    if not latency.exists():
        latency.write_text(json.dumps({"error": err[-2000:], "stdout": out[-2000:]}))
    log(f"== worker latency: {out[-1500:] or err[-1500:]}")
    holder = " ".join(shlex.quote(a) for a in HOLDER)
    supervise = f"exec {shlex.quote(PY)} bench/supervisor.py"
    cases = [
        ("shell-runs-the-playbook", None, None),
        *[(f"supervisor-restarts-after-{d}s", f"{supervise} --delay {d} -- {holder}", restarted) for d in (0, 2, 5)],
        ("bash-until-loop", f"until {holder}; do sleep 1; done", loop_ended),
        ("parent-never-restarts", f"{supervise} --never -- {holder}", never_restarted),
        ("jupyter-like-kernel", f"exec -a jupyter-lab {PY} bench/supervisor.py --never -- {holder}", never_restarted),
    ]
    started = time.monotonic()
    for name, script, expect in cases:
        if time.monotonic() - started > BUDGET:
            summary["skipped"].append(name)
            continue
        try:
            outcome = shell_case() if script is None else job_case(name, script, expect)
        except Exception as error:  # one broken case must not cost the others their one shot
            outcome = {"case": name, "verdict": f"ERROR: {type(error).__name__}: {error}"}
        summary["cases"].append(outcome)
        log(f"== {name}: {outcome.get('verdict')}")
        (OUT / "jobs-summary.json").write_text(json.dumps(summary, indent=1))
    try:
        summary["latency"] = json.loads(latency.read_text())
    except ValueError:
        summary["latency"] = {"error": "worker_start_latency.py wrote no JSON (see jobs-runs.log)"}
    summary["passed"] = all(c.get("verdict") == "pass" for c in summary["cases"]) and not summary["skipped"]
    (OUT / "jobs-summary.json").write_text(json.dumps(summary, indent=1))
    reports = []
    for path in sorted(glob.glob(str(REPORTS / "*.json")), key=os.path.getmtime):
        with open(path) as handle:
            reports.append(json.load(handle))
    (OUT / "jobs-reports.json").write_text(json.dumps(reports, indent=1))
    print(json.dumps({c["case"]: c.get("verdict") for c in summary["cases"]}, indent=1))
    print("skipped:", summary["skipped"], "passed:", summary["passed"])
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
