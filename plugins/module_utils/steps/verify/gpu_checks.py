# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The verify step's assertions on nvidia-smi's facts (the fact pass: preflight's ``gpus``; the acting module:
its own read): the GPU count and model, the memory in use, the driver, and the GPUs' health. Also what every
check of the step is (:func:`make_check`: expected, found, and one sentence saying why) and how a check quotes
what the target said (:func:`quoted`)."""

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import OPTIONAL_GPU_FIELDS, shown

LEVELS = ("fail", "warn", "ignore")
# The health checks and what each does by default. An idle GPU lowers its PCIe generation to save power, so
# gen below max is a finding only when asked; a narrower link than the slot's is real, but the GPU still works.
HEALTH_DEFAULTS = {
    "ecc": "fail",
    "remapped_rows": "fail",
    "recovery_action": "fail",
    "pcie_width": "warn",
    "pcie_gen": "ignore",
    "persistence_mode": "warn",
}
SAFE_TEXT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._()/+-]{0,79}$")
RECOVERY_ADVICE = {
    "Reset": "reset it (on the node: nvidia-smi --gpu-reset -i <its uuid>, with no process on it)",
    "Reboot": "reboot the node",
    "Drain P2P": "end the jobs using peer-to-peer on it, then reset it",
    "Drain and Reset": "drain it (no new work), then reset it once its jobs ended",
}


def health_levels(spec):
    """Each health check's level, the defaults filled in: ``{"health": {"pcie_gen": "warn"}}`` -> ``{"ecc":
    "fail", ..., "pcie_gen": "warn", ...}``."""
    return {**HEALTH_DEFAULTS, **{k: v for k, v in (spec.get("health") or {}).items() if v is not None}}


# -- wording ---------------------------------------------------------------------------------------------------
def quoted(text):
    """CT text as a message shows it: as is when it is plainly a name or version, else repr'd and shortened."""
    return text if isinstance(text, str) and SAFE_TEXT.match(text) else shown(text)


def gpu_label(gpu):
    """``GPU 3 (GPU-993fc641-...)``: the index and the UUID the nvidia-smi parser validated."""
    return f"GPU {gpu.get('index')} ({gpu.get('uuid')})"


def plural(count, word):
    return f"{count} {word}{'' if count == 1 else 's'}"


# -- checks ----------------------------------------------------------------------------------------------------
def make_check(name, ok, *, expected, found, detail, severity="fail"):
    """One assertion: ``ok`` True, False, or None (not decided here: left to the step that fixes it)."""
    return {"name": name, "ok": ok, "severity": severity, "expected": expected, "found": found, "detail": detail}


def deferred_check(name, expected, detail):
    return make_check(name, None, expected=expected, found=None, detail=detail)


def gpu_count_check(gpus, expected, source, label):
    found = len(gpus)
    if found == expected:
        return make_check(
            "gpu_count", True, expected=expected, found=found, detail=f"{label}: nvidia-smi sees {plural(found, 'GPU')}"
        )
    cause = (
        "a GPU fell off the bus or is not passed through to the target (nvidia-smi -L and dmesg | grep -i xid on "
        "the node)"
        if found < expected
        else "more GPUs are passed through than expected (set verify_gpu_count, or fix the target's GPU entries)"
    )
    return make_check(
        "gpu_count",
        False,
        expected=expected,
        found=found,
        detail=f"{label}: nvidia-smi sees {plural(found, 'GPU')}, expected {expected} ({source}); {cause}",
    )


def gpu_name_check(gpus, expected, label):
    wrong = [g for g in gpus if g.get("name") != expected]
    found = sorted({str(g.get("name")) for g in gpus})
    if not wrong:
        detail = f"{label}: {plural(len(gpus), 'GPU')}, all {expected}"
        return make_check("gpu_name", True, expected=expected, found=found, detail=detail)
    listed = ", ".join(f"{gpu_label(g)} is {quoted(g.get('name'))}" for g in wrong)
    return make_check(
        "gpu_name",
        False,
        expected=expected,
        found=found,
        detail=f"{label}: {listed}, expected {expected}; another GPU model is passed through to the target (check "
        "its /dev/nvidiaN entries) or verify_gpu_name names the wrong model",
    )


def memory_check(gpus, limit, label, kept=()):
    """The memory every GPU uses against ``limit``; the GPUs in ``kept`` (indexes) are left out: an unattended run
    leaves the guarded training job on them (gpu_processes' ``kept_gpus``)."""
    findings = []
    kept = set(kept)
    for g in gpus:
        used = g.get("memory_used_mib")
        if g.get("index") in kept:
            continue
        if used is None:
            raw = (g.get("unreadable") or {}).get("memory_used_mib", "[N/A]")
            findings.append(f"{gpu_label(g)} reports memory.used as {shown(raw)}")
        elif used > limit:
            findings.append(f"{gpu_label(g)} uses {used} MiB")
    found = {str(g.get("index")): g.get("memory_used_mib") for g in gpus}
    left_out = ", ".join(f"GPU {i}" for i in sorted(kept))
    except_kept = f" except {left_out}, which the guarded training job keeps until a window" if kept else ""
    if not findings:
        return make_check(
            "memory",
            True,
            expected=limit,
            found=found,
            detail=f"{label}: every GPU uses at most {limit} MiB{except_kept}",
        )
    return make_check(
        "memory",
        False,
        expected=limit,
        found=found,
        detail=f"{label}: {'; '.join(findings)}, expected at most {limit} MiB; a process still holds it: the "
        "gpu_processes step ends it (turn it on), or raise verify_max_memory_used_mib",
    )


def driver_check(gpus, expected, label):
    found = sorted({str(g.get("driver_version")) for g in gpus})
    if found == [expected]:
        return make_check(
            "driver_version", True, expected=expected, found=expected, detail=f"{label}: NVML reports driver {expected}"
        )
    shown_found = ", ".join(quoted(v) for v in found) or "no driver"
    return make_check(
        "driver_version",
        False,
        expected=expected,
        found=found,
        detail=f"{label}: NVML reports driver {shown_found}, expected {expected}; install driver {expected} on the "
        "node (and the same userspace driver, without its kernel module, in the target)",
    )


def gpu_checks(spec, gpus, *, label, expected_count, count_source, memory_deferred=None, memory_kept=()):
    """The assertions on nvidia-smi's facts (the fact pass: preflight's ``gpus``; the module: its own read).

    ``memory_deferred`` is why the memory check is left to a step with work in this run (None: check it now);
    ``memory_kept`` the GPUs (indexes) whose memory an unattended run leaves to the guarded training job.
    """
    checks = [gpu_count_check(gpus, expected_count, count_source, label)]
    if spec["gpu_name"]:
        checks.append(gpu_name_check(gpus, spec["gpu_name"], label))
    if memory_deferred:
        checks.append(deferred_check("memory", spec["max_memory_used_mib"], f"{label}: memory: {memory_deferred}"))
    else:
        checks.append(memory_check(gpus, spec["max_memory_used_mib"], label, memory_kept))
    if spec["driver_version"]:
        checks.append(driver_check(gpus, spec["driver_version"], label))
    return checks + health_checks(health_levels(spec), gpus, label)


# -- health ----------------------------------------------------------------------------------------------------
class Unread(str):
    """A health finding that says a value could not be read (its check then notes what that means)."""


def _unread(gpu, key):
    """A finding for a health value the GPU did not give, or None when the check may skip it.

    A marker the parser kept (``[GPU requires reset]``, ``[Unknown Error]``) is quoted as printed; a plain
    [N/A] / [Not Supported] is a finding too, except for the fields an older driver does not know at all
    (nvidia_smi.OPTIONAL_GPU_FIELDS: their None may only mean "not asked").
    """
    raw = (gpu.get("unreadable") or {}).get(key)
    if raw is not None:
        return Unread(f"{gpu_label(gpu)}: {shown(raw)}")
    field = next((f for f, k in FIELD_OF.items() if k == key), key)
    if field in OPTIONAL_GPU_FIELDS:
        return None
    return Unread(f"{gpu_label(gpu)}: not reported ([N/A] or [Not Supported])")


FIELD_OF = {
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected_volatile",
    "remapped_rows.pending": "remapped_rows_pending",
    "remapped_rows.failure": "remapped_rows_failure",
    "gpu_recovery_action": "recovery_action",
    "pcie.link.gen.current": "pcie_link_gen",
    "pcie.link.gen.max": "pcie_link_gen_max",
    "pcie.link.width.current": "pcie_link_width",
    "pcie.link.width.max": "pcie_link_width_max",
    "persistence_mode": "persistence_mode",
}
UNREAD_NOTE = (
    "a value nvidia-smi could not read makes the check impossible ([GPU requires reset]: reset the GPU; a GPU "
    "without the feature: set verify_health's {name} to ignore)"
)


def _ecc(gpus):
    findings, advice = [], []
    for g in gpus:
        value = g.get("ecc_uncorrected_volatile")
        if value is None:
            findings.append(_unread(g, "ecc_uncorrected_volatile"))
        elif value > 0:
            findings.append(f"{gpu_label(g)}: {value}")
            advice = [
                "its memory had uncorrectable errors since its last reset: drain it and reset it (on the node: "
                "nvidia-smi --gpu-reset -i <its uuid>, with no process on it) or reboot the node; errors that come "
                "back mean an RMA"
            ]
    return "uncorrected volatile ECC errors", "0 on every GPU", findings, advice


def _remapped_rows(gpus):
    findings, advice = [], []
    for g in gpus:
        pending, failure = g.get("remapped_rows_pending"), g.get("remapped_rows_failure")
        if pending is None:
            findings.append(_unread(g, "remapped_rows_pending"))
        elif pending:
            findings.append(f"{gpu_label(g)}: a row remap is pending")
            advice.append("a pending remap is applied by a GPU reset (or a reboot of the node)")
        if failure is None:
            findings.append(_unread(g, "remapped_rows_failure"))
        elif failure:
            findings.append(f"{gpu_label(g)}: a row remap failed")
            advice.append("a failed remap means the GPU ran out of spare rows: it needs an RMA")
    return "memory row remapping", "no pending or failed row remap", findings, advice


def _recovery_action(gpus):
    findings, advice = [], []
    for g in gpus:
        action = g.get("recovery_action")
        if action is None:
            findings.append(_unread(g, "recovery_action"))
        elif action != "None":
            findings.append(f"{gpu_label(g)}: {quoted(action)}")
            advice.append(RECOVERY_ADVICE.get(action, "see NVIDIA's GPU recovery documentation for that action"))
    return "the recovery action the driver asks for", "None on every GPU", findings, advice


def _pcie(gpus, current, maximum, unit):
    findings = []
    for g in gpus:
        have, top = g.get(current), g.get(maximum)
        if have is None or top is None:
            findings.append(_unread(g, current if have is None else maximum))
        elif have < top:
            findings.append(f"{gpu_label(g)}: {unit}{have} of {unit}{top}")
    return findings


def _pcie_width(gpus):
    findings = _pcie(gpus, "pcie_link_width", "pcie_link_width_max", "x")
    advice = [
        "a degraded link (a loose card or riser, a bad slot): reseat it; transfers between host and GPU run at "
        "a fraction of the bandwidth"
    ]
    return "PCIe link width below its maximum", "the maximum width on every GPU", findings, advice


def _pcie_gen(gpus):
    findings = _pcie(gpus, "pcie_link_gen", "pcie_link_gen_max", "gen ")
    advice = [
        "an idle GPU lowers its link generation to save power, so look again under load: a link that stays "
        "below its maximum then points at the slot, a riser or the BIOS settings"
    ]
    return "PCIe link generation below its maximum", "the maximum generation on every GPU", findings, advice


def _persistence_mode(gpus):
    findings = []
    for g in gpus:
        value = g.get("persistence_mode")
        if value is None:
            findings.append(_unread(g, "persistence_mode"))
        elif not value:
            findings.append(f"{gpu_label(g)}: off")
    advice = [
        "enable it on the node (systemctl enable --now nvidia-persistenced), or every CUDA start initializes the "
        "GPUs again"
    ]
    return "persistence mode", "on for every GPU", findings, advice


HEALTH = {
    "ecc": _ecc,
    "remapped_rows": _remapped_rows,
    "recovery_action": _recovery_action,
    "pcie_width": _pcie_width,
    "pcie_gen": _pcie_gen,
    "persistence_mode": _persistence_mode,
}


def health_checks(levels, gpus, label):
    """One check per health setting that is not "ignore", naming every GPU that fails it (its level is the
    check's ``severity``)."""
    checks = []
    for name, read in HEALTH.items():
        level = levels.get(name, HEALTH_DEFAULTS[name])
        if level == "ignore":
            continue
        what, expected, findings, advice = read(gpus)
        findings = [f for f in findings if f]
        if any(isinstance(f, Unread) for f in findings):
            advice = [*advice, UNREAD_NOTE.format(name=name)]
        if not findings:
            detail = f"{label}: {what}: {expected} ({plural(len(gpus), 'GPU')})"
            checks.append(make_check(name, True, expected=expected, found=[], detail=detail, severity=level))
            continue
        unique = list(dict.fromkeys(advice))
        detail = f"{label}: {what}: {'; '.join(findings)}; expected {expected}" + (
            f"; {'; '.join(unique)}" if unique else ""
        )
        checks.append(make_check(name, False, expected=expected, found=findings, detail=detail, severity=level))
    return checks
