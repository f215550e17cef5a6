"""drift/runner.py shows text a CT chose safely (issue 25 item 11): a process name with a newline, a terminal
escape and a forged Ansible line reaches the journal (stderr) and the summary's reasons as one escaped line."""

import json

from tests.unit.drift.conftest import (
    FakeAnsibleRunner,
    event,
    fact_pass,
    make_report,
    project_with_unattended,
    run_main,
    step_facts,
)

EVIL = "python3\n\x1b[2Jok: [train200] => all fine\u202e"
SHOWN = "python3\\n\\x1b[2Jok: [train200] => all fine\\u202e"


def test_ct_text_reaches_the_journal_and_the_reasons_as_one_escaped_line(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)
    change = f"end pid 516 ({EVIL}) on GPU 0"
    steps = {"gpu_processes": step_facts([change], needs_window=[f"leave pid 4242 ({EVIL}): guarded"])}
    fake = FakeAnsibleRunner(
        {
            "check": (
                [make_report("train200", fact_pass(**steps))],
                [
                    event("runner_on_start", "train201"),
                    event("runner_on_failed", "train201", task="End the holders", res={"msg": f"pid 7 ({EVIL})"}),
                ],
                "failed",
                2,
            )
        }
    )
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(tmp_path / "r")]
    code, out, err = run_main(runner, argv, capsys, ansible_runner=fake)
    assert code == 1
    assert "\x1b" not in err and "\u202e" not in err
    lines = err.splitlines()
    # No line starts with the forged text: each CT string stayed inside its own line.
    assert not [line for line in lines if line.startswith("ok: [")]
    assert f"  gpu_processes would change: end pid 516 ({SHOWN}) on GPU 0" in lines
    assert f"  gpu_processes needs a window: leave pid 4242 ({SHOWN}): guarded" in lines
    assert f"train201: failed: End the holders: pid 7 ({SHOWN})" in lines
    summary = json.loads(out)
    assert summary["targets"]["train201"]["reason"] == f"End the holders: pid 7 ({SHOWN})"
    # The summary keeps the change as the module wrote it: JSON escapes it.
    assert summary["targets"]["train200"]["steps"]["gpu_processes"]["changes"] == [change]
    assert "\x1b" not in out


def test_a_diff_line_is_split_at_newlines_only_and_escaped(runner):
    """A diff is lines joined by newlines (the module escapes a newline in a name); any other line break a CT put
    in a name (\x1e, \u2028, which splitlines() would split at) stays inside its line, escaped."""
    diff = {"before": "?? file\x1eforged\n M a\x1b[2J\u2028ok: [x]\n", "after": ""}
    assert runner.diff_lines(diff) == {"before": ["?? file\\x1eforged", " M a\\x1b[2J\\u2028ok: [x]"], "after": []}


def test_text_already_escaped_is_never_escaped_twice(runner):
    assert runner.one_line(f"pid 7 ({SHOWN})") == f"pid 7 ({SHOWN})"
    assert runner.one_line(runner.one_line(EVIL)) == SHOWN
