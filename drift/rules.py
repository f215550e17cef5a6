# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The Prometheus alert rules of the drift runner's metrics, written from settings.

    python3 drift/rules.py > pve_gpu_recover.rules.yml                      # the defaults: the hourly timer
    python3 drift/rules.py --settings '{"period": "15m", "selector": "job=\\"node\\"",
        "runbook_url": "https://wiki.example.org/pve-gpu-recover/runbook.md",
        "alerts": {"PveGpuRecoverTargetFailed": {"severity": "page"}}}'

Settings (JSON; every key optional):

* ``period``: how often the timer runs (``1h``: ``drift_timer_on_calendar: hourly``). Each alert's ``for:`` and
  age threshold is a number of periods (a drift alert waits for 3 runs, a failed target for 2), so a 15-minute
  timer alerts four times sooner with the same meaning;
* ``selector``: label matchers put into every selector of every rule (``job="node"``,
  ``instance=~"ctl[12]:9100"``), for a Prometheus that scrapes more than the controller(s);
* ``runbook_url``: where monitoring/runbook.md is served; each alert's ``runbook_url`` is it plus ``#<alert>`` in
  lower case (the runbook's section). Empty (the default): no ``runbook_url``, the ``runbook`` line says what to do;
* ``alerts``: per alert, ``severity``, ``for`` and (the age alerts) ``after``: a duration (``45m``) or a number of
  periods (``3``, ``1.5``); ``enabled: false`` leaves the alert out;
* ``xids``: the Xid codes PveGpuRecoverGpuXid alerts on (default: those after which NVIDIA's guide says to reset
  the GPU or reboot the node, XIDS); every code is exported either way.

monitoring/prometheus/pve_gpu_recover.rules.yml is this program's output for the defaults (a unit test holds them
equal); the role drift_timer writes it from its variables (``drift_timer_rules``, ``drift_timer_rules_dest``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drift.metrics import metric_name


class RulesError(ValueError):
    """A setting the rules cannot be written from: which one, what was found, what is expected."""


DURATION = re.compile(r"^(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
UNITS = (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\\n]|\\.)*"\s*'
SELECTOR = re.compile(rf"^(?:{MATCHER}(?:,{MATCHER})*)?,?\s*$")
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^\s#\"'{}]+$")
SEVERITY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")
# The Xids after which NVIDIA's "XID Errors" guide has the GPU reset or the node rebooted: 48 double-bit ECC, 61 and
# 62 internal micro-controller, 64 row remapper failure, 74 NVLink, 79 fallen off the bus, 95 uncontained ECC,
# 119 and 120 GSP, 140 unrecovered ECC. Application faults (13, 31, 43, 45) and notices (63, 94) are exported only.
XIDS = [48, 61, 62, 64, 74, 79, 95, 119, 120, 140]
DEFAULTS = {"period": "1h", "selector": "", "runbook_url": "", "alerts": {}, "xids": XIDS}


# -- durations ---------------------------------------------------------------------------------------------------
def seconds(value, what):
    """``"1h30m"`` -> ``5400``: a Prometheus duration of whole seconds, at least 1 s."""
    found = DURATION.match(value) if isinstance(value, str) and value else None
    if not found:
        raise RulesError(f"{what} is {value!r}: expected a duration such as 15m, 1h or 1h30m")
    total = sum(int(n) * size for n, (_unit, size) in zip(found.groups(), UNITS, strict=True) if n)
    if total < 1:
        raise RulesError(f"{what} is {value!r}: expected at least 1s")
    return total


def duration(total):
    """``5400`` -> ``"1h30m"``: as Prometheus writes a duration."""
    parts = []
    for unit, size in UNITS[2:]:
        if total >= size:
            parts.append(f"{total // size}{unit}")
            total %= size
    return "".join(parts) or "0s"


def spoken(total):
    """``10800`` -> ``"3 h"``, ``5400`` -> ``"90 min"``, ``1350`` -> ``"1350 s"``: how an annotation says it."""
    if total % 3600 == 0:
        return f"{total // 3600} h"
    return f"{total // 60} min" if total % 60 == 0 else f"{total} s"


def span(value, period, what):
    """An alert's ``for`` or ``after``: a duration as written, or a number of periods, in whole seconds."""
    if isinstance(value, bool):
        raise RulesError(f"{what} is {value!r}: expected a duration (45m) or a number of periods (3, 1.5)")
    if isinstance(value, (int, float)):
        if not value > 0:
            raise RulesError(f"{what} is {value!r}: expected a positive number of periods")
        return max(1, round(value * period))
    return seconds(value, what)


# -- the rules -----------------------------------------------------------------------------------------------------
class Rules:
    """The expressions' selectors, with the settings' matchers in each."""

    def __init__(self, selector):
        self.selector = selector.strip().rstrip(",").strip()

    def m(self, family, matchers=""):
        """``m("drift")`` -> ``pve_gpu_recover_drift{job="node"}`` (the selector's matchers, then these)."""
        inner = ",".join(part for part in (self.selector, matchers) if part)
        return metric_name(family) + (f"{{{inner}}}" if inner else "")


# How an annotation names a target: ``ct200 (CT 200 on pve1)``, a bare host ``gpu1 (gpu1)``.
WHERE = "{{ $labels.target }} ({{ with $labels.vmid }}CT {{ . }} on {{ end }}{{ $labels.node }})"
# Each alert: its defaults (severity; for, after: periods or a duration), why it exists (a comment in the file),
# its expression, and its annotations (summary, description, runbook: one line of what to do first).
ALERTS = {
    "PveGpuRecoverDrift": {
        "severity": "warning",
        "for": 3,
        "why": "A step out of spec for three runs. A target that fails or is unreachable keeps its last drift "
        "value, so this alert never resolves because the target got worse.",
        "expr": lambda r, a: f"{r.m('drift')} == 1",
        "summary": lambda a: "{{ $labels.target }}: {{ $labels.step }} out of spec for " + a["for_spoken"],
        "description": lambda a: (
            "The drift check has found {{ $labels.step }} of "
            + WHERE
            + " out of its known-good state for "
            + a["for_spoken"]
            + "."
        ),
        "runbook": "Read the step's changes in the runner's summary.json, then run recover.yml on the target (or let "
        "--correct do it).",
    },
    "PveGpuRecoverNeedsWindow": {
        "severity": "warning",
        "for": "24h",
        "why": "What an unattended correction will not do (a venv swap or a purge under a live job, a guarded "
        "job's processes): still waiting after a day, whatever the timer's period.",
        "expr": lambda r, a: f"{r.m('needs_window')} > 0",
        "summary": lambda a: (
            "{{ $labels.target }}: {{ $labels.step }} has waited for a maintenance window for " + a["for_spoken"]
        ),
        "description": lambda a: (
            "{{ $value }} thing(s) of {{ $labels.step }} on {{ $labels.target }} wait for a "
            "window: --correct leaves them while the job runs."
        ),
        "runbook": "Plan a window: stop the training job, then run recover.yml on the target without "
        "recover_unattended.",
    },
    "PveGpuRecoverTargetFailed": {
        "severity": "critical",
        "for": 1.5,
        "why": "The run failed on the target (a fact-pass problem, a failed step, cut off) in two runs in a row; "
        "kind says why (README.md, Monitoring). Busy and unreachable targets have alerts of their own.",
        "expr": lambda r, a: r.m("target_failed", 'kind!~"none|busy|unreachable"') + " == 1",
        "summary": lambda a: "{{ $labels.target }}: the drift check fails ({{ $labels.kind }})",
        "description": lambda a: (
            "The drift runner's last runs failed on " + WHERE + ", kind {{ $labels.kind }}; its drift values are "
            "those of its last successful check."
        ),
        "runbook": "Read the target's reason in the summary (journalctl -u pve-gpu-drift.service), fix what it names, "
        "run the check again.",
    },
    "PveGpuRecoverTargetUnreachable": {
        "severity": "critical",
        "for": 1.5,
        "why": "The target's node did not answer in two runs in a row.",
        "expr": lambda r, a: r.m("target_status", 'status="unreachable"') + " == 1",
        "summary": lambda a: "{{ $labels.target }}: its node {{ $labels.node }} does not answer",
        "description": lambda a: (
            "The drift runner could not reach {{ $labels.target }}'s node {{ $labels.node }} over ssh in its last runs."
        ),
        "runbook": "Check the node is up and ssh from the controller as the runner's user works (ssh root@NODE pct "
        "list).",
    },
    "PveGpuRecoverTargetBusy": {
        "severity": "warning",
        "for": 3,
        "why": "Another recover run has held the target's run lock through three drift runs: a run that hangs.",
        "expr": lambda r, a: r.m("target_status", 'status="busy"') + " == 1",
        "summary": lambda a: "{{ $labels.target }}: held by another recover run for " + a["for_spoken"],
        "description": lambda a: (
            "Every drift check of {{ $labels.target }} for " + a["for_spoken"] + " found its "
            "run lock held by another run."
        ),
        "runbook": "Find the run the summary's held_by names; if it is gone, remove the lock file the reason names "
        "on the node.",
    },
    "PveGpuRecoverTargetNotChecked": {
        "severity": "warning",
        "after": 6,
        "for": "15m",
        "why": "Whatever the reason (failed, busy, unreachable, a run that never names it): no successful check for "
        "six periods, so its drift values are that old. 0 (never checked) counts as very old.",
        "expr": lambda r, a: f"time() - {r.m('last_success_timestamp_seconds')} > {a['after']}",
        "summary": lambda a: "{{ $labels.target }}: not checked successfully for " + a["after_spoken"],
        "description": lambda a: (
            "The last successful drift check of {{ $labels.target }} is {{ $value | humanizeDuration }} old."
        ),
        "runbook": "See why in pve_gpu_recover_target_status and the runner's summary; the alerts on failed, busy or "
        "unreachable name it.",
    },
    "PveGpuRecoverRunnerNotRunning": {
        "severity": "warning",
        "after": 2,
        "for": "15m",
        "why": "The timer has not finished a run for two periods: stopped, disabled, or a run hung past its "
        "timeout. The runner's own infrastructure, not a target: a warning unless set otherwise.",
        "expr": lambda r, a: f"time() - {r.m('runner_last_run_timestamp_seconds')} > {a['after']}",
        "summary": lambda a: "the drift runner has not run for " + a["after_spoken"],
        "description": lambda a: (
            "The drift runner on {{ $labels.instance }} last finished {{ $value | humanizeDuration }} ago."
        ),
        "runbook": "systemctl status pve-gpu-drift.timer pve-gpu-drift.service; journalctl -u pve-gpu-drift.service.",
    },
    "PveGpuRecoverRunnerAbsent": {
        "severity": "warning",
        "for": 2,
        "why": "No textfile at all (never written, removed, unreadable by node_exporter): the alert above cannot fire.",
        "expr": lambda r, a: f"absent({r.m('runner_last_run_timestamp_seconds')})",
        "summary": lambda a: "no metrics from the drift runner",
        "description": lambda a: (
            "No node_exporter scraped by this Prometheus has "
            "pve_gpu_recover_runner_last_run_timestamp_seconds for " + a["for_spoken"] + "."
        ),
        "runbook": "Check the timer is installed and enabled, and the textfile's directory is node_exporter's "
        "--collector.textfile.directory.",
    },
    "PveGpuRecoverRunnerFailing": {
        "severity": "warning",
        "after": 6,
        "for": "15m",
        "why": "No run has checked every target for six periods (exit 1 every time): run-level errors (an "
        "inventory that does not parse, the timeout, no target) and failed targets alike.",
        "expr": lambda r, a: f"time() - {r.m('runner_last_success_timestamp_seconds')} > {a['after']}",
        "summary": lambda a: "the drift runner has failed for " + a["after_spoken"],
        "description": lambda a: (
            "The drift runner on {{ $labels.instance }} has not finished with exit 0 or 2 for "
            "{{ $value | humanizeDuration }}."
        ),
        "runbook": "Read the errors of the runner's summary.json (or its journal); a run-level error names the run's "
        "log.",
    },
    "PveGpuRecoverGpuRecoveryAction": {
        "severity": "critical",
        "for": 0.5,
        "why": "The driver asks for a GPU reset, a node reboot or a drain (gpu_recovery_action, as NVML's code): "
        "one run's reading is enough.",
        "expr": lambda r, a: f"{r.m('gpu_recovery_action')} != 0",
        "summary": lambda a: "{{ $labels.target }}: GPU {{ $labels.index }} needs a recovery action ({{ $value }})",
        "description": lambda a: (
            "The driver asks for recovery action {{ $value }} (1 GPU reset, 2 node reboot, "
            "3 drain peer-to-peer, 4 drain and reset, -1 another) on GPU {{ $labels.index }} ({{ $labels.uuid }}, "
            "{{ $labels.name }}) of " + WHERE + "."
        ),
        "runbook": "Drain the GPU's jobs, then do what the action says on the node (nvidia-smi --gpu-reset -i UUID, "
        "or a reboot); the next check shows 0.",
    },
    "PveGpuRecoverGpuEccUncorrected": {
        "severity": "critical",
        "for": 0.5,
        "why": "Uncorrected ECC errors since the driver loaded: the jobs on that GPU may have read bad memory; a "
        "GPU reset clears the count.",
        "expr": lambda r, a: f"{r.m('gpu_ecc_uncorrected_volatile_errors')} > 0",
        "summary": lambda a: "{{ $labels.target }}: GPU {{ $labels.index }} has uncorrected ECC errors",
        "description": lambda a: (
            "GPU {{ $labels.index }} ({{ $labels.uuid }}) of "
            + WHERE
            + " counts {{ $value }} uncorrected ECC error(s) since the driver loaded."
        ),
        "runbook": "Drain the GPU, reset it (nvidia-smi --gpu-reset -i UUID on the node) and watch the count; "
        "errors that come back mean the GPU goes back to its vendor.",
    },
    "PveGpuRecoverGpuRemapFailed": {
        "severity": "critical",
        "for": 0.5,
        "why": "A row remapping failed: the GPU has no spare memory rows left.",
        "expr": lambda r, a: f"{r.m('gpu_remapped_rows_failure')} == 1",
        "summary": lambda a: "{{ $labels.target }}: GPU {{ $labels.index }} failed to remap a memory row",
        "description": lambda a: (
            "GPU {{ $labels.index }} ({{ $labels.uuid }}) of "
            + WHERE
            + " reports a failed row remapping: its memory can no longer be repaired."
        ),
        "runbook": "Take the GPU out of service (pass it through to no CT) and open a case with its vendor (RMA).",
    },
    "PveGpuRecoverGpuResetPending": {
        "severity": "warning",
        "for": 0.5,
        "why": "A row remapping (or, before Ampere, a page retirement) waits for a GPU reset or a reboot to take "
        "effect.",
        "expr": lambda r, a: f"{r.m('gpu_remapped_rows_pending')} == 1 or {r.m('gpu_retired_pages_pending')} == 1",
        "summary": lambda a: "{{ $labels.target }}: GPU {{ $labels.index }} waits for a reset to repair its memory",
        "description": lambda a: (
            "GPU {{ $labels.index }} ({{ $labels.uuid }}) of "
            + WHERE
            + " has a memory repair pending until it is reset."
        ),
        "runbook": "In the next window: end the jobs on the GPU and reset it (nvidia-smi --gpu-reset -i UUID on the "
        "node), or reboot the node.",
    },
    "PveGpuRecoverGpuPcieLinkDegraded": {
        "severity": "warning",
        "for": 1.5,
        "why": "A PCIe link narrower than the slot's in two runs in a row (a generation below its maximum is "
        "normal while the GPU idles and is not alerted on).",
        "expr": lambda r, a: f"{r.m('gpu_pcie_link_width')} < {r.m('gpu_pcie_link_width_max')}",
        "summary": lambda a: "{{ $labels.target }}: GPU {{ $labels.index }} runs its PCIe link at x{{ $value }}",
        "description": lambda a: (
            "GPU {{ $labels.index }} ({{ $labels.uuid }}) of "
            + WHERE
            + " has a PCIe link of {{ $value }} lanes, fewer than its slot's."
        ),
        "runbook": "Reseat or replace the GPU or its riser in a window (a reboot alone rarely helps); check "
        "lspci -vv on the node.",
    },
    "PveGpuRecoverGpuPersistenceOff": {
        "severity": "warning",
        "for": 1.5,
        "why": "Persistence mode off in two runs in a row: the driver unloads between jobs (slow starts, lost "
        "settings).",
        "expr": lambda r, a: f"{r.m('gpu_persistence_mode')} == 0",
        "summary": lambda a: "{{ $labels.target }}: GPU {{ $labels.index }} has persistence mode off",
        "description": lambda a: (
            "GPU {{ $labels.index }} ({{ $labels.uuid }}) of " + WHERE + " runs without persistence mode."
        ),
        "runbook": "Start nvidia-persistenced on the node (systemctl enable --now nvidia-persistenced).",
    },
    "PveGpuRecoverGpuXid": {
        "severity": "critical",
        "for": 0.5,
        "after": 2,
        "why": "The node's kernel logged an Xid error of the GPU after which it needs a reset or the node a reboot "
        "(the setting xids) within two periods: a later check resolves it, the log keeps the count.",
        "expr": lambda r, a: (
            "time() - " + r.m("gpu_xid_last_timestamp_seconds", f'xid=~"{a["xids"]}"') + f" < {a['after']}"
        ),
        "summary": lambda a: "{{ $labels.target }}: GPU {{ $labels.index }} had Xid {{ $labels.xid }}",
        "description": lambda a: (
            "The node's kernel logged Xid {{ $labels.xid }} of GPU {{ $labels.index }} ({{ $labels.uuid }}) of "
            + WHERE
            + " {{ $value | humanizeDuration }} ago."
        ),
        "runbook": "Look up the Xid in NVIDIA's XID guide and dmesg on the node; drain the GPU's jobs, then reset it "
        "(nvidia-smi --gpu-reset -i UUID) or reboot the node.",
    },
}
ALERT_KEYS = ("severity", "for", "after", "enabled")


# -- settings -------------------------------------------------------------------------------------------------------
def settings_of(overrides=None):
    """The settings, the defaults filled in and each checked: a wrong one raises RulesError naming it."""
    overrides = overrides or {}
    if not isinstance(overrides, dict):
        raise RulesError(f"the settings are {type(overrides).__name__}: expected a mapping")
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise RulesError(f"unknown setting(s) {', '.join(unknown)}: the settings are {', '.join(DEFAULTS)}")
    settings = {**DEFAULTS, **{k: v for k, v in overrides.items() if v is not None}}
    settings["period_seconds"] = seconds(settings["period"], "period")
    for key, pattern, expected in (
        ("selector", SELECTOR, 'label matchers such as job="node" or job="node",instance=~"ctl.*"'),
        ("runbook_url", URL, "a URL without # (https://wiki.example.org/pve-gpu-recover/runbook.md)"),
    ):
        value = settings[key]
        if not isinstance(value, str) or (value and not pattern.match(value)):
            raise RulesError(f"{key} is {value!r}: expected {expected}, or empty")
    xids = settings["xids"]
    if (
        not isinstance(xids, list)
        or not xids
        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x < 100000 for x in xids)
    ):
        raise RulesError(f"xids is {xids!r}: expected a list of Xid codes such as [48, 79, 95]")
    alerts = settings["alerts"]
    if not isinstance(alerts, dict):
        raise RulesError(f"alerts is {alerts!r}: expected a mapping of alert names to their settings")
    for name, values in alerts.items():
        if name not in ALERTS:
            raise RulesError(f"alerts: unknown alert {name!r}; the alerts are {', '.join(ALERTS)}")
        if not isinstance(values, dict) or set(values) - set(ALERT_KEYS):
            raise RulesError(f"alerts.{name} is {values!r}: expected a mapping of {', '.join(ALERT_KEYS)}")
        if "after" in values and "after" not in ALERTS[name]:
            raise RulesError(f"alerts.{name}.after: {name} has no age threshold (only for)")
        severity = values.get("severity", ALERTS[name]["severity"])
        if not isinstance(severity, str) or not SEVERITY.match(severity):
            raise RulesError(f"alerts.{name}.severity is {severity!r}: expected a word such as warning or critical")
    return settings


def alert_values(name, settings):
    """One alert's effective settings: severity, for and after (seconds), enabled."""
    spec, given = ALERTS[name], settings["alerts"].get(name) or {}
    period = settings["period_seconds"]
    values = {"severity": given.get("severity", spec["severity"]), "enabled": given.get("enabled", True) is not False}
    values["xids"] = "|".join(str(code) for code in sorted(set(settings["xids"])))
    for key in ("for", "after"):
        if key in spec:
            values[key] = span(given.get(key, spec[key]), period, f"alerts.{name}.{key}")
            values[f"{key}_spoken"] = spoken(values[key])
    return values


# -- the file ---------------------------------------------------------------------------------------------------------
def quoted(text):
    """A YAML scalar for any one line: double-quoted for prose, single-quoted when it holds a double quote or a
    backslash (PromQL's label values), so neither needs an escape."""
    if '"' in text or "\\" in text:
        return "'" + text.replace("'", "''") + "'"
    return f'"{text}"'


def word(text):
    """``warning`` as it is; anything YAML could read as another type, or that is not a plain word, quoted."""
    plain = re.fullmatch(r"[a-z][a-z0-9_-]*", text) and text not in ("true", "false", "yes", "no", "on", "off", "null")
    return text if plain else quoted(text)


def rule_lines(name, settings, rules):
    values = alert_values(name, settings)
    spec = ALERTS[name]
    lines = [f"      - alert: {name}"]
    lines += [f"        # {line}" for line in wrap(spec["why"], 108)]
    lines += scalar_lines("expr", spec["expr"](rules, values), " " * 8)
    lines.append(f"        for: {duration(values['for'])}")
    lines += ["        labels:", f"          severity: {word(values['severity'])}", "        annotations:"]
    annotations = {
        "summary": spec["summary"](values),
        "description": spec["description"](values),
        "runbook": spec["runbook"],
    }
    if settings["runbook_url"]:
        annotations["runbook_url"] = f"{settings['runbook_url']}#{name.lower()}"
    for key, text in annotations.items():
        lines += scalar_lines(key, text, " " * 10)
    return lines


def scalar_lines(key, text, indent, width=118):
    """``key: "text"`` on one line when it fits ``width``, else a folded block of the same text (YAML joins its
    lines with one space: the words are split at single spaces only, so it reads back exactly)."""
    line = f"{indent}{key}: {quoted(text)}"
    words = wrap(text, width - len(indent) - 2)
    if len(line) <= width or " ".join(words) != text or text != text.strip():
        return [line]
    return [f"{indent}{key}: >-", *(f"{indent}  {part}" for part in words)]


def wrap(text, width):
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line] if line else lines


def render(overrides=None):
    """The rules file (YAML text) for the settings ``overrides`` (None: the defaults)."""
    settings = settings_of(overrides)
    rules = Rules(settings["selector"])
    head = [
        "# Alert rules for pve-gpu-recover's drift runner (drift/runner.py), on the metrics its textfile gives",
        "# node_exporter's textfile collector (drift/metrics.py; README.md, Monitoring). Written by drift/rules.py",
        "# (the role drift_timer's drift_timer_rules) from these settings; edit them there, not here:",
        f"#   period {settings['period']}, selector {settings['selector'] or '(none)'}, runbook_url "
        f"{settings['runbook_url'] or '(none)'}",
        "# Each alert waits a number of the timer's periods (a single bad run pages nobody) and says what to do first",
        "# (runbook; monitoring/runbook.md has a section of the alert's name). Checked by `promtool check rules`,",
        "# unit-tested by `promtool test rules` (pve_gpu_recover.rules.test.yml, tests/unit/test_monitoring.py).",
        "groups:",
        "  - name: pve_gpu_recover",
        "    rules:",
    ]
    body = []
    for name in ALERTS:
        if alert_values(name, settings)["enabled"]:
            body += [*([""] if body else []), *rule_lines(name, settings, rules)]
    return "\n".join(head + body) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="drift/rules.py", description="Write the drift runner's Prometheus alert rules (YAML) to stdout."
    )
    parser.add_argument("--settings", default="{}", help="the settings as JSON (the module's docstring lists them)")
    args = parser.parse_args(argv)
    try:
        text = render(json.loads(args.settings))
    except (ValueError, RulesError) as error:
        print(f"drift/rules.py: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
