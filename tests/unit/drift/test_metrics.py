"""drift/metrics.py: the textfile's families (rendered by prometheus_client), series that stay when a target gets
worse, last success kept between runs in the state file, and why the file is not written by write_to_textfile."""

import json
import os
import stat
import threading

from prometheus_client import CollectorRegistry, Gauge, write_to_textfile
from prometheus_client.parser import text_string_to_metric_families

from drift import failures, metrics
from tests.unit.drift.conftest import (
    H200_GPU,
    event,
    fact_pass,
    make_report,
    parse_exposition,
    schema_errors,
    step_facts,
    summary_of,
    write_report,
)
from tests.unit.drift.test_runner import DRIFT, UNREACHABLE

PREFIX = "pve_gpu_recover_"
FIRST, LATER = 1796371200.5, 1796374800.0


def summarize(runner, directory, reports, events=()):
    for report in reports:
        write_report(directory, report)
    return runner.summarize_phase(runner.load_reports(directory), list(events))


def samples(families, family, *keys):
    """``{label value(s): value}`` of one family, keyed by the given labels."""
    found = {}
    for labels, value in families[PREFIX + family]["samples"]:
        key = tuple(labels[k] for k in keys)
        found[key[0] if len(key) == 1 else key] = value
    return found


def render(runner, targets, state=None, **kwargs):
    text, new_state = metrics.render_textfile(summary_of(runner, targets, **kwargs), state)
    return parse_exposition(text), new_state, text


def test_every_family_with_help_and_type_and_label_values_escaped(runner, tmp_path):
    weird = 'ct "200"\\lab\nsecond'
    reports = [
        make_report("train200", fact_pass(gpu_processes=DRIFT["gpu_processes"], training_venv=step_facts())),
        make_report(
            weird, fact_pass(training_venv=step_facts(DRIFT["training_venv"]["changes"], needs_window=["a", "b"]))
        ),
    ]
    events = [event("runner_on_unreachable", "down202", task="Read", res={"msg": UNREACHABLE})]
    targets = summarize(runner, tmp_path, reports, events)
    for target in targets.values():
        target["seconds"] = 7.5
    families, _, text = render(runner, targets)
    drift = samples(families, "drift", "target", "step")
    assert drift[("train200", "gpu_processes")] == 1
    assert drift[("train200", "training_venv")] == 0
    assert drift[(weird, "training_venv")] == 1  # the name came back exactly, quote, backslash and newline
    assert samples(families, "needs_window", "target", "step")[(weird, "training_venv")] == 2
    assert samples(families, "target_up", "target") == {"train200": 1, weird: 1, "down202": 0}
    assert samples(families, "target_failed", "target") == {"train200": 0, weird: 0, "down202": 1}
    assert samples(families, "last_run_timestamp_seconds", "target") == dict.fromkeys(targets, FIRST)
    assert set(samples(families, "run_duration_seconds", "target").values()) == {7.5}
    assert families[PREFIX + "runner_exit_code"]["samples"] == [({}, 1.0)]
    assert families[PREFIX + "runner_last_run_timestamp_seconds"]["samples"] == [({}, FIRST)]
    assert samples(families, "targets", "status") == {
        "in_spec": 0,
        "drift": 2,
        "failed": 0,
        "busy": 0,
        "unreachable": 1,
    }
    # Every family of FAMILIES, and nothing else; prometheus_client's own parser reads the file back the same.
    assert sorted(families) == metrics.names()
    parsed = {family.name: family for family in text_string_to_metric_families(text)}
    assert sorted(PREFIX + name for name in metrics.FAMILIES) == sorted(
        f"{name}_info" if family.type == "info" else name for name, family in parsed.items()
    )


def test_busy_failed_and_unreachable_are_told_apart_each_with_its_kind_and_where_it_lives(runner, tmp_path):
    targets = {
        "ok200": {"status": "in_spec", "kind": "none", "report": "r", "node": "pve1", "vmid": 200, "steps": {}},
        "busy201": {"status": "busy", "kind": "busy", "report": "r", "node": "pve1", "vmid": 201, "steps": {}},
        "bad202": {"status": "failed", "kind": "stopped", "report": "r", "node": "pve2", "vmid": 202, "steps": {}},
        # Never reached: the runner named its node and vmid from the inventory (drift/inventory.py).
        "down203": {"status": "unreachable", "kind": "unreachable", "report": None, "node": "pve3", "vmid": 203},
        # A bare GPU host: its node is itself, it has no vmid.
        "gpu1": {"status": "failed", "kind": "a-kind-from-the-future", "report": None, "node": "gpu1", "vmid": None},
    }
    for target in targets.values():
        target.setdefault("steps", {})
    families, _, _ = render(runner, targets)
    status = samples(families, "target_status", "target", "status")
    assert len(status) == 5 * 5  # every status of every target: the series never come and go with it
    assert {t for (t, s), v in status.items() if v == 1 and s == "busy"} == {"busy201"}
    assert {t for (t, s), v in status.items() if v == 1 and s == "failed"} == {"bad202", "gpu1"}
    assert {t for (t, s), v in status.items() if v == 1 and s == "unreachable"} == {"down203"}
    assert {t for (t, s), v in status.items() if v == 1 and s == "in_spec"} == {"ok200"}
    # Why, from the fixed set: one series per target, a kind this runner does not know is "other".
    failed = samples(families, "target_failed", "target", "kind")
    assert failed == {
        ("ok200", "none"): 0,
        ("busy201", "busy"): 1,
        ("bad202", "stopped"): 1,
        ("down203", "unreachable"): 1,
        ("gpu1", "other"): 1,
    }
    assert {labels["kind"] for labels, _ in families[PREFIX + "target_failed"]["samples"]} <= set(failures.KINDS)
    info = {labels["target"]: labels for labels, value in families[PREFIX + "target_info"]["samples"] if value == 1}
    # The id joins prometheus-pve-exporter's series of the same CT (pve_up{id="lxc/200"}, pve_guest_info).
    assert info["ok200"] == {"target": "ok200", "node": "pve1", "vmid": "200", "id": "lxc/200"}
    assert info["down203"] == {"target": "down203", "node": "pve3", "vmid": "203", "id": "lxc/203"}
    assert info["gpu1"] == {"target": "gpu1", "node": "gpu1", "vmid": "", "id": ""}
    # Every series of a target names its node and vmid, the target's own family by family.
    for family, (_, labels, _) in metrics.FAMILIES.items():
        for found, _ in families[PREFIX + family]["samples"]:
            if "target" in labels:
                expected = targets[found["target"]]
                assert (found["node"], found["vmid"]) == (expected["node"], str(expected["vmid"] or "")), family


def test_a_target_that_fails_keeps_its_drift_series_and_its_last_success(runner, tmp_path):
    """The alert on drift must not resolve because the target got worse (unreachable): its series stay, with the
    values of its last successful check; last_success stays where it was."""
    first = summarize(runner, tmp_path / "1", [make_report("train200", fact_pass(**DRIFT))])
    families, state, _ = render(runner, first)
    assert samples(families, "drift", "target", "step")[("train200", "training_venv")] == 1
    assert samples(families, "last_success_timestamp_seconds", "target") == {"train200": FIRST}
    state = json.loads(metrics.state_text(state))  # as the state file holds it

    events = [event("runner_on_unreachable", "train200", task="Read", res={"msg": UNREACHABLE})]
    later = summarize(runner, tmp_path / "2", [], events)
    assert later["train200"]["steps"] == {}  # the run itself read nothing
    families, state, _ = render(runner, later, state, finished=LATER)
    drift = samples(families, "drift", "target", "step")
    assert {step for (_, step), value in drift.items() if value == 1} == set(DRIFT)
    assert samples(families, "corrected", "target", "step")[("train200", "training_venv")] == 0
    assert samples(families, "last_success_timestamp_seconds", "target") == {"train200": FIRST}
    assert samples(families, "last_run_timestamp_seconds", "target") == {"train200": LATER}
    assert samples(families, "target_status", "target", "status")[("train200", "unreachable")] == 1
    info = families[PREFIX + "target_info"]["samples"][0][0]
    assert (info["node"], info["vmid"]) == ("pve1", "200")  # the last known node and vmid

    # Checked again, in spec: this run's values, and its time as the last success.
    again = summarize(runner, tmp_path / "3", [make_report("train200", fact_pass(training_venv=step_facts()))])
    families, state, _ = render(runner, again, state, finished=LATER + 3600)
    assert samples(families, "drift", "target", "step") == {
        ("train200", "preflight"): 0,
        ("train200", "training_venv"): 0,
    }
    assert samples(families, "last_success_timestamp_seconds", "target") == {"train200": LATER + 3600}


def test_a_failed_target_shows_what_this_run_did_read_over_what_it_knew(runner, tmp_path):
    first = summarize(runner, tmp_path / "1", [make_report("train200", fact_pass(**DRIFT))])
    _, state, _ = render(runner, first)
    stopped = fact_pass(training_venv=step_facts(), preflight=step_facts(problems=["CT 200 on pve1: not running"]))
    error = {"step": "preflight", "task": "preflight : Assert", "msg": "CT 200 on pve1: not running"}
    later = summarize(runner, tmp_path / "2", [make_report("train200", stopped, error=error, failed_step="preflight")])
    assert later["train200"]["status"] == "failed"
    families, _, _ = render(runner, later, state, finished=LATER)
    drift = samples(families, "drift", "target", "step")
    assert drift[("train200", "training_venv")] == 0  # read this run
    assert drift[("train200", "gpu_processes")] == 1  # not read this run: its last successful check
    assert samples(families, "last_success_timestamp_seconds", "target") == {"train200": FIRST}


def test_a_target_never_checked_has_a_last_success_of_0(runner):
    targets = {"new200": {"status": "failed", "report": None, "steps": {}}}
    families, state, _ = render(runner, targets)
    assert samples(families, "last_success_timestamp_seconds", "target") == {"new200": 0}
    assert families[PREFIX + "runner_last_success_timestamp_seconds"]["samples"] == [({}, 0.0)]
    assert state["targets"]["new200"]["last_success"] is None


def test_a_run_that_failed_before_naming_its_targets_still_writes_every_known_target_as_failed(runner, tmp_path):
    first = summarize(runner, tmp_path, [make_report("train200", fact_pass(**DRIFT))])
    _, state, _ = render(runner, first)
    assert state["runner"]["last_success"] == FIRST  # exit 2: every target checked
    error = "the check run's ansible-playbook exited 4 (failed); see check.log"
    families, state, _ = render(runner, {}, state, finished=LATER, errors=[error])
    assert samples(families, "target_status", "target", "status")[("train200", "failed")] == 1
    assert samples(families, "target_up", "target") == {"train200": 0}
    assert samples(families, "drift", "target", "step")[("train200", "compile_cache")] == 1
    assert samples(families, "last_success_timestamp_seconds", "target") == {"train200": FIRST}
    assert samples(families, "targets", "status")["failed"] == 1
    assert families[PREFIX + "runner_exit_code"]["samples"] == [({}, 1.0)]
    assert families[PREFIX + "runner_last_success_timestamp_seconds"]["samples"] == [({}, FIRST)]
    assert families[PREFIX + "runner_last_run_timestamp_seconds"]["samples"] == [({}, LATER)]


def test_a_target_the_runs_no_longer_name_leaves_the_file_and_later_the_state(runner, tmp_path):
    first = summarize(runner, tmp_path, [make_report("gone200", fact_pass()), make_report("ok201", fact_pass())])
    _, state, _ = render(runner, first)
    ok = {"ok201": first["ok201"]}
    families, state, _ = render(runner, ok, state, finished=LATER)
    assert set(samples(families, "target_up", "target")) == {"ok201"}  # a successful run shows what it checked
    assert set(state["targets"]) == {"gone200", "ok201"}  # remembered a while (--limit may have left it out)
    _, state, _ = render(runner, ok, state, finished=FIRST + metrics.STATE_TTL + 1)
    assert set(state["targets"]) == {"ok201"}


def test_a_run_that_reached_no_target_still_says_so(runner):
    families, _, _ = render(runner, {})
    assert families[PREFIX + "runner_exit_code"]["samples"] == [({}, 1.0)]
    assert families[PREFIX + "drift"]["samples"] == []
    assert families[PREFIX + "drift"]["help"]  # the family is declared, with no sample


def test_the_state_file_is_read_safely(tmp_path):
    path = tmp_path / metrics.STATE_FILE
    assert metrics.load_state(path) == metrics.empty_state()  # none yet
    path.write_text("{half")
    assert metrics.load_state(path) == metrics.empty_state()
    path.write_text(json.dumps({"version": 99, "targets": {"x": {}}}))
    assert metrics.load_state(path) == metrics.empty_state()  # another shape: started over, never misread
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps(dict(metrics.empty_state(), targets={"planted": {"last_success": 1}})))
    path.unlink()
    path.symlink_to(victim)
    assert metrics.load_state(path) == metrics.empty_state()  # never through a link


# -- why the runner does not use prometheus_client's write_to_textfile (measured) ----------------------------------
def registry():
    found = CollectorRegistry()
    Gauge("pve_gpu_recover_probe", "a gauge", registry=found).set(1)
    return found


def test_write_to_textfile_leaves_the_mode_to_the_umask_so_node_exporter_may_not_read_it(runner, tmp_path):
    old = os.umask(0o077)  # a unit with UMask=0077, a hardened root shell
    try:
        write_to_textfile(str(tmp_path / "theirs.prom"), registry())
        runner.write_atomic(tmp_path / "ours.prom", "x 1\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "theirs.prom").stat().st_mode) == 0o600  # node_exporter (another user): denied
    assert stat.S_IMODE((tmp_path / "ours.prom").stat().st_mode) == 0o644


def test_write_to_textfile_writes_through_a_link_planted_at_its_predictable_temporary_name(runner, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "pve_gpu_recover.prom"
    (tmp_path / f"{path.name}.{os.getpid()}.{threading.current_thread().ident}").symlink_to(victim)
    write_to_textfile(str(path), registry())
    assert victim.read_text().startswith("# HELP pve_gpu_recover_probe")  # written through the link
    assert path.is_symlink()  # and the textfile is now that link
    victim.write_text("precious\n")
    runner.write_atomic(path, "x 1\n")  # mkstemp (O_EXCL): a new file, whatever lies around; renamed over the link
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink()


# -- bounded labels ------------------------------------------------------------------------------------------------
def series_of(families):
    """Every series of the textfile: (name, its labels), values left out."""
    return {
        (name, tuple(sorted(labels.items()))) for name, family in families.items() for labels, _ in family["samples"]
    }


def test_no_label_changes_from_one_run_to_the_next(runner, tmp_path):
    """A day of hourly runs must not make 24 new series per target: the run id is the summary's alone."""
    before = fact_pass(**{"gpu_processes": step_facts(), "preflight": step_facts(gpus=[H200_GPU])})
    shown = []
    state = None
    for hour, run_id in enumerate(("20261203T080000Z-abc123", "20261203T090000Z-def456")):
        report = dict(make_report("train200", before), run_id=run_id)
        targets = summarize(runner, tmp_path / run_id, [report])
        assert targets["train200"]["run_id"] == run_id  # the summary keeps it
        families, state, text = render(runner, targets, state, finished=FIRST + 3600 * hour)
        assert run_id not in text
        shown.append(series_of(families))
    assert shown[0] == shown[1]
    assert not any("run_id" in dict(labels) for _, labels in shown[0])


# -- GPU health ----------------------------------------------------------------------------------------------------
def gpu_samples(families, family):
    return {labels["index"]: (labels, value) for labels, value in families[PREFIX + family]["samples"]}


def test_each_gpu_of_a_target_is_exported_with_its_health_as_the_fact_pass_read_it(runner, tmp_path):
    """The real H200's reading (docs/hardware) and a sick GPU beside it, through the report callback's report."""
    sick = dict(
        H200_GPU,
        index=1,
        uuid="GPU-11111111-2222-3333-4444-555555555555",
        ecc_uncorrected_volatile=3,
        ecc_uncorrected_aggregate=7,
        remapped_rows_pending=True,
        remapped_rows_failure=True,
        recovery_action="Reboot",
        pcie_link_width=8,
        persistence_mode=False,
        memory_used_mib=0,
    )
    before = fact_pass(preflight=step_facts(gpus=[H200_GPU, sick]))
    targets = summarize(runner, tmp_path, [make_report("train200", before)])
    families, _, _ = render(runner, targets)
    uuid = H200_GPU["uuid"]
    labels, value = gpu_samples(families, "gpu_memory_used_bytes")["0"]
    assert labels == {
        "target": "train200",
        "node": "pve1",
        "vmid": "200",
        "index": "0",
        "uuid": uuid,
        "name": "NVIDIA H200",
    }
    assert value == H200_GPU["memory_used_mib"] * 1024 * 1024 == 8811 * 1024 * 1024
    expected = {
        # family: (the H200 as read, the sick GPU)
        "gpu_memory_total_bytes": (143771 * 1024 * 1024, 143771 * 1024 * 1024),
        "gpu_ecc_uncorrected_volatile_errors": (0, 3),
        "gpu_remapped_rows_pending": (0, 1),
        "gpu_remapped_rows_failure": (0, 1),
        "gpu_recovery_action": (0, 2),  # nvidia-smi's "None" and "Reboot" as NVML's codes
        "gpu_pcie_link_generation": (5, 5),
        "gpu_pcie_link_generation_max": (5, 5),
        "gpu_pcie_link_width": (16, 8),
        "gpu_pcie_link_width_max": (16, 16),
        "gpu_persistence_mode": (1, 0),
        "gpu_read_timestamp_seconds": (FIRST, FIRST),
    }
    for family, (healthy, worn) in expected.items():
        found = gpu_samples(families, family)
        assert (found["0"][1], found["1"][1]) == (healthy, worn), family
    # The H200 has no retired pages (Hopper remaps rows): no value, so no sample, never a 0 that means "fine".
    assert H200_GPU["retired_pages_pending"] is None
    assert families[PREFIX + "gpu_retired_pages_pending"]["samples"] == []
    # Lifetime ECC: the sick GPU's 7; the H200's report predates the field (no value, so no sample).
    aggregate = gpu_samples(families, "gpu_ecc_uncorrected_aggregate_errors")
    assert {index: value for index, (_, value) in aggregate.items()} == {"1": 7}


def test_a_target_that_fails_keeps_its_gpus_last_readings_and_a_checked_one_shows_only_what_it_read(runner, tmp_path):
    two = [H200_GPU, dict(H200_GPU, index=1, uuid="GPU-11111111-2222-3333-4444-555555555555", recovery_action="Reset")]
    first = summarize(runner, tmp_path / "1", [make_report("train200", fact_pass(preflight=step_facts(gpus=two)))])
    _, state, _ = render(runner, first)
    state = json.loads(metrics.state_text(state))

    # Unreachable: nothing read; both GPUs keep their values (the reset still asked for: its alert stays).
    events = [event("runner_on_unreachable", "train200", task="Read", res={"msg": UNREACHABLE})]
    families, state, _ = render(runner, summarize(runner, tmp_path / "2", [], events), state, finished=LATER)
    action = gpu_samples(families, "gpu_recovery_action")
    assert {index: value for index, (_, value) in action.items()} == {"0": 0, "1": 1}
    read = gpu_samples(families, "gpu_read_timestamp_seconds")
    assert {index: value for index, (_, value) in read.items()} == {"0": FIRST, "1": FIRST}  # how old they are

    # Failed on a problem after reading GPU 0 only (GPU 1 fell off the bus): GPU 0 is this run's, GPU 1 its last.
    stopped = fact_pass(
        preflight=step_facts(problems=["GPU 1 fell off the bus"], gpus=[dict(H200_GPU, memory_used_mib=5)])
    )
    error = {"step": "preflight", "task": "preflight : Assert", "msg": "GPU 1 fell off the bus"}
    third = summarize(runner, tmp_path / "3", [make_report("train200", stopped, error=error, failed_step="preflight")])
    families, state, _ = render(runner, third, state, finished=LATER + 3600)
    used = gpu_samples(families, "gpu_memory_used_bytes")
    assert used["0"][1] == 5 * 1024 * 1024
    read = gpu_samples(families, "gpu_read_timestamp_seconds")
    assert {index: value for index, (_, value) in read.items()} == {"0": LATER + 3600, "1": FIRST}

    # Checked again with one GPU passed through: exactly what it read.
    fourth = summarize(
        runner, tmp_path / "4", [make_report("train200", fact_pass(preflight=step_facts(gpus=[H200_GPU])))]
    )
    families, _, _ = render(runner, fourth, state, finished=LATER + 7200)
    assert set(gpu_samples(families, "gpu_recovery_action")) == {"0"}


def test_what_nvidia_smi_printed_in_the_ct_becomes_a_bounded_label_or_nothing(runner, tmp_path_factory):
    hostile = [
        dict(H200_GPU, index=0, name='H200"} 1\nfake_metric{a="b'),  # a model name that would forge a line
        dict(H200_GPU, index=1, uuid="GPU-22222222-2222-3333-4444-555555555555", recovery_action="Please Reboot Me"),
        dict(H200_GPU, index=True, uuid="GPU-33333333-2222-3333-4444-555555555555"),  # not an index
        dict(H200_GPU, index=3, uuid="not-a-uuid"),
        dict(H200_GPU, index=4, uuid="GPU-44444444-2222-3333-4444-555555555555", ecc_uncorrected_volatile=True),
    ]
    report = make_report("train200", fact_pass(preflight=step_facts(gpus=hostile)), valid=False)
    # The node's parser never lets such a report through (docs/schema says what it promises); the runner does not
    # rely on it.
    assert len(schema_errors("report", report)) == 3
    targets = summarize(runner, tmp_path_factory.mktemp("hostile"), [report])  # not a report the tests vouch for
    assert [gpu["index"] for gpu in targets["train200"]["gpus"]] == [0, 1, 4]
    families, _, text = render(runner, targets)
    assert "fake_metric" not in text  # the name became "unknown": nothing of it reaches the file
    names = {labels["name"] for labels, _ in families[PREFIX + "gpu_read_timestamp_seconds"]["samples"]}
    assert names == {"unknown", "NVIDIA H200"}
    assert gpu_samples(families, "gpu_recovery_action")["1"][1] == -1  # an action all the same: it alerts
    assert "4" not in gpu_samples(families, "gpu_ecc_uncorrected_volatile_errors")  # a flag is not a count
