"""tests/lab/same_drift.py: two drift runs compared less what names or times a run, and every real difference
found (molecule recover compares a per-node run with a per-CT run through it)."""

import copy
import json
import sys

from harness import TESTS

sys.path.insert(0, str(TESTS / "lab"))
import same_drift

SUMMARY = {
    "run_id": "20261206T030000Z-aaaaaa",
    "targets": {
        "ct200": {
            "status": "in_spec",
            "reason": None,
            "report": "/r/ct200/a.json",
            "run_id": "a",
            "node": "pve-lab",
            "steps": {"preflight": {"drift": False, "seconds": 0.2}},
        },
        "ct201": {"status": "failed", "reason": "CT 201 on pve-lab is not running", "report": "/r/ct201/a.json"},
    },
}
TEXTFILE = """# HELP pve_gpu_recover_target_status status
pve_gpu_recover_target_status{status="in_spec",target="ct200"} 1.0
pve_gpu_recover_target_status{status="failed",target="ct201"} 1.0
pve_gpu_recover_target_info{node="pve-lab",run_id="a",target="ct200",vmid="200"} 1.0
pve_gpu_recover_last_success_timestamp_seconds{target="ct200"} 1.7965e+09
pve_gpu_recover_runner_duration_seconds 3.1
"""


def another_run():
    """The same findings under another run: other ids, paths, seconds and times."""
    summary = copy.deepcopy(SUMMARY)
    summary["run_id"] = "20261206T030100Z-bbbbbb"
    for name, target in summary["targets"].items():
        target.update(report=f"/r/{name}/b.json", run_id="b")
    summary["targets"]["ct200"]["steps"]["preflight"]["seconds"] = 0.9
    text = TEXTFILE.replace('run_id="a"', 'run_id="b"').replace("1.7965e+09", "1.7966e+09").replace("3.1", "4.7")
    return summary, text


def test_two_runs_that_found_the_same_agree():
    summary, text = another_run()
    assert same_drift.differences(SUMMARY, TEXTFILE, summary, text) == []


def test_a_status_reason_or_series_that_differs_is_named():
    summary, text = another_run()
    summary["targets"]["ct201"]["reason"] = "the fact pass of this node failed: MODULE FAILURE"
    text = text.replace('status="failed",target="ct201"} 1.0', 'status="failed",target="ct201"} 0.0')
    found = same_drift.differences(SUMMARY, TEXTFILE, summary, text)
    assert found[0].startswith("target ct201: ")
    assert 'only in the first textfile: pve_gpu_recover_target_status{status="failed",target="ct201"} 1.0' in found
    moved = TEXTFILE.replace('node="pve-lab",run_id="a"', 'node="pve-b",run_id="a"')
    assert any("pve-b" in line for line in same_drift.differences(SUMMARY, TEXTFILE, SUMMARY, moved))
    del summary["targets"]["ct200"]
    assert any(line.startswith("target ct200: ") for line in same_drift.differences(SUMMARY, TEXTFILE, summary, text))


def test_the_command_exits_1_naming_the_difference(tmp_path, capsys):
    summary, text = another_run()
    summary["targets"]["ct200"]["status"] = "drift"
    paths = []
    for index, (one, prom) in enumerate([(SUMMARY, TEXTFILE), (summary, text)]):
        (tmp_path / f"s{index}.json").write_text(json.dumps(one))
        (tmp_path / f"t{index}.prom").write_text(prom)
        paths += [str(tmp_path / f"s{index}.json"), str(tmp_path / f"t{index}.prom")]
    assert same_drift.main(paths) == 1
    assert '"status": "drift"' in capsys.readouterr().err
    assert same_drift.main([paths[0], paths[1], paths[0], paths[1]]) == 0
