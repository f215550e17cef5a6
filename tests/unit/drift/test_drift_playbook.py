"""playbooks/drift.yml (role drift_timer, entry point `run`): the drift check once, as an AWX schedule runs it. A
real ansible-playbook runs the real runner on a target whose node does not answer: the runner's exit 1 fails the
play, after its summary became the run's artifacts (set_stats) and the state directory holds what a timer's does."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ROOT

INVENTORY = textwrap.dedent("""\
    all:
      children:
        pve_nodes:
          hosts:
            pve-x:
              ansible_host: 127.0.0.1
              ansible_port: 9
              ansible_user: root
        gpu_targets:
          hosts:
            ct300:
              pve_node: pve-x
              pve_vmid: 300
    """)


def sorted_labels(text):
    """The textfile with each sample's labels in name order: what a line says, whatever order the client wrote."""
    lines = []
    for line in text.splitlines():
        found = re.match(r"^(\w+)\{(.*)\} (.*)$", line)
        labels = ",".join(sorted(re.findall(r'\w+="(?:[^"\\]|\\.)*"', found.group(2)))) if found else ""
        lines.append(f"{found.group(1)}{{{labels}}} {found.group(3)}" if found else line)
    return "\n".join(lines)


def run_drift(tmp_path, *extra):
    (tmp_path / "hosts.yml").write_text(INVENTORY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PVE_GPU_"))}
    env.update(
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_SHOW_CUSTOM_STATS="true",
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"),
    )
    argv = [str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(tmp_path / "hosts.yml")]
    argv += ["-e", f"drift_timer_state_dir={tmp_path / 'state'}", "-e", f"drift_timer_textfile_dir={tmp_path}"]
    argv += [*extra, str(ROOT / "playbooks" / "drift.yml")]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_an_unreachable_target_fails_the_run_after_its_summary_became_the_artifacts(tmp_path):
    done = run_drift(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    summary = json.loads((tmp_path / "state" / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("failed", 1)
    assert summary["targets"]["ct300"]["status"] == "unreachable"
    # The same outputs as the timer's service: the run directory with its reports, the textfile.
    assert Path(summary["run_dir"]).parent == tmp_path / "state" / "reports"
    # Never reached, yet named where it lives (the inventory's pve_node and pve_vmid) and why it failed.
    assert (summary["targets"]["ct300"]["node"], summary["targets"]["ct300"]["vmid"]) == ("pve-x", 300)
    textfile = (tmp_path / "pve_gpu_recover.prom").read_text()
    assert 'pve_gpu_recover_target_up{node="pve-x",target="ct300",vmid="300"} 0' in sorted_labels(textfile)
    assert 'pve_gpu_recover_target_failed{kind="unreachable",node="pve-x",target="ct300",vmid="300"} 1' in (
        sorted_labels(textfile)
    )
    # The artifacts (CUSTOM STATS): what AWX keeps with the job.
    stats = done.stdout[done.stdout.index("CUSTOM STATS") :]
    artifacts = json.loads(re.search(r"RUN: (\{.*\})", stats, re.DOTALL).group(1))["pve_gpu_recover_drift"]
    assert artifacts["targets"] == {"ct300": "unreachable"}
    assert artifacts["kinds"] == {"ct300": "unreachable"}  # why, in a word of the fixed set
    assert (artifacts["exit_code"], artifacts["counts"]["unreachable"]) == (1, 1)
    assert artifacts["summary"] == str(tmp_path / "state" / "summary.json")
    assert "drift check failed (exit 1)" in done.stdout


def test_a_run_that_cannot_start_says_why(tmp_path):
    done = run_drift(tmp_path, "-e", "drift_timer_timeout=0")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "drift_timer settings out of range" in done.stdout
    assert not (tmp_path / "state").exists()
