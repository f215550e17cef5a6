# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The verify step: is the target in the known-good state - the GPUs, their health, torch and CUDA.

The last good manual check printed ``2.11.0+cu128 / 12.8 / True 8``: torch's build, its CUDA, CUDA available and
eight GPUs, all ``NVIDIA H200`` at 0 MiB. This step asserts exactly that, plus the GPUs' health, two ways:

* in the fact pass (:func:`evaluate_step`, no ``import torch``): from preflight's ``gpus`` (the one
  ``nvidia-smi --query-gpu`` of the fact pass) and from the venv's ``torch/version.py`` read as text by the probe
  part (``verify_probe``). Broken health (set to "fail") and a GPU count or model that is not the spec are
  ``problems``: recovery cannot fix hardware, so the run stops before anything changes. So is any other failed
  assertion that no step with work in this run will fix; one a step will fix (the memory the GPU step frees, the
  torch the venv step rebuilds) is deferred (``ok`` null) to the acting module. A converged run thus makes no
  remote call for verify;
* by the acting module (plugins/modules/verify.py), when :func:`evaluate_step` says ``pending``: nvidia-smi read again,
  and torch imported by the venv's own python in ONE process (:func:`torch_answer` checks what it printed).

Every failed assertion is one sentence: what was expected, what was found, and the likely cause. Everything read
inside a CT is untrusted: versions are checked against a strict pattern before they reach a message, other text
(an error, a GPU name) is quoted and shortened (``shown``), and advice names only our settings and values the
nvidia-smi parser validated (GPU UUIDs).
"""

from __future__ import annotations

import json
import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.nvidia_smi import OPTIONAL_GPU_FIELDS, shown
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_torch_build import cuda_of, variant
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import probe as verify_probe

NAME = "verify"
PROBE = verify_probe
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
IMPORT_TORCH = ("changed", "always", "never")
SPEC = {
    # The venv whose torch is checked: its torch/version.py in the fact pass, its bin/python imports torch.
    "venv": {"type": "path", "default": "/opt/venvs/train"},
    # torch.__version__ exactly, local tag included ("2.11.0+cu128"); "" asserts nothing.
    "torch_version": {"type": "str", "default": ""},
    # torch.version.cuda ("12.8"); "" asserts nothing.
    "cuda_version": {"type": "str", "default": ""},
    # GPUs nvidia-smi and torch must see; None: the /dev/nvidiaN nodes of the target (preflight counts them and
    # checks them against preflight_expected_gpu_count).
    "gpu_count": {"type": "int"},
    # The model of every GPU, as nvidia-smi and torch name it; "" asserts nothing.
    "gpu_name": {"type": "str", "default": "NVIDIA H200"},
    # memory.used of every GPU at most this (MiB); an idle H200 shows 0.
    "max_memory_used_mib": {"type": "int", "default": 0},
    # The driver NVML reports ("580.159.04"); "" asserts nothing (preflight already requires the node's).
    "driver_version": {"type": "str", "default": ""},
    "health": {
        "type": "dict",
        "default": {},
        "options": {
            name: {"type": "str", "choices": list(LEVELS), "default": d} for name, d in HEALTH_DEFAULTS.items()
        },
    },
    # When the acting module runs (and imports torch): "changed" after another step had work in this run (never
    # in check mode), "always" on every run (check mode too), "never" (the fact pass's checks only).
    "import_torch": {"type": "str", "default": "changed", "choices": list(IMPORT_TORCH)},
}
SPEC_DEFAULTS = {name: option.get("default") for name, option in SPEC.items()}
SPEC_DEFAULTS["health"] = dict(HEALTH_DEFAULTS)

# What the answers must look like before any of it is used (they come from inside the target).
VERSION = re.compile(r"^[0-9][0-9A-Za-z.+_-]{0,63}$")
CUDA_VERSION = re.compile(r"^\d{1,3}\.\d{1,3}$")
DRIVER_VERSION = re.compile(r"^\d{2,4}\.\d{1,4}(?:\.\d{1,4})?$")
DEVICE = re.compile(r"^/dev/nvidia\d{1,4}$")
SAFE_TEXT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._()/+-]{0,79}$")
MAX_OUTPUT = 64 * 1024  # bytes of the torch probe's stdout that are read at all
MAX_ITEMS = 64
# The oldest driver each CUDA major runs on (CUDA minor version compatibility; NVIDIA's CUDA release notes).
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}
_GPU_DEVICE = re.compile(r"^/dev/nvidia(\d+)$")
RECOVERY_ADVICE = {
    "Reset": "reset it (on the node: nvidia-smi --gpu-reset -i <its uuid>, with no process on it)",
    "Reboot": "reboot the node",
    "Drain P2P": "end the jobs using peer-to-peer on it, then reset it",
    "Drain and Reset": "drain it (no new work), then reset it once its jobs ended",
}


class VerifyError(RecoverError):
    """The verify settings cannot work, or a probe answered something that is not its answer."""


# -- settings --------------------------------------------------------------------------------------------------
def health_levels(spec):
    """Each health check's level, the defaults filled in: ``{"health": {"pcie_gen": "warn"}}`` -> ``{"ecc":
    "fail", ..., "pcie_gen": "warn", ...}``."""
    return {**HEALTH_DEFAULTS, **{k: v for k, v in (spec.get("health") or {}).items() if v is not None}}


def check_spec(spec):
    """Why the step's settings cannot work (one sentence), or ``""``: called once the SPEC types are checked."""
    if not spec["venv"].startswith("/"):
        return f"venv is {spec['venv']!r}; give the venv's absolute path inside the target"
    torch, cuda = spec["torch_version"], spec["cuda_version"]
    if torch and not VERSION.match(torch):
        return f"torch_version is {torch!r}; give torch.__version__ exactly, like '2.11.0+cu128'"
    if cuda and not CUDA_VERSION.match(cuda):
        return f"cuda_version is {cuda!r}; give torch.version.cuda, like '12.8'"
    if torch and cuda and cuda_of(variant(torch)) not in (None, cuda):
        return f"torch_version {torch} is a CUDA {cuda_of(variant(torch))} build but cuda_version is {cuda}"
    if torch and cuda and variant(torch) == "cpu":
        return f"torch_version {torch} is a CPU build but cuda_version is {cuda}"
    if spec["gpu_count"] is not None and spec["gpu_count"] < 1:
        return f"gpu_count is {spec['gpu_count']}; give the number of GPUs (at least 1), or null for the target's"
    if spec["max_memory_used_mib"] < 0:
        return f"max_memory_used_mib is {spec['max_memory_used_mib']}; give 0 or more MiB"
    if spec["driver_version"] and not DRIVER_VERSION.match(spec["driver_version"]):
        return f"driver_version is {spec['driver_version']!r}; give the driver as NVML reports it, like '580.159.04'"
    return ""


# -- wording ---------------------------------------------------------------------------------------------------
def quoted(text):
    """CT text as a message shows it: as is when it is plainly a name or version, else repr'd and shortened."""
    return text if isinstance(text, str) and SAFE_TEXT.match(text) else shown(text)


def gpu_label(gpu):
    """``GPU 3 (GPU-993fc641-...)``: the index and the UUID the nvidia-smi parser validated."""
    return f"GPU {gpu.get('index')} ({gpu.get('uuid')})"


def plural(count, word):
    return f"{count} {word}{'' if count == 1 else 's'}"


def torch_index(expected):
    """Where the expected torch build comes from: ``2.11.0+cu128`` -> PyTorch's cu128 index, else None."""
    wanted = variant(expected)
    return f"https://download.pytorch.org/whl/{wanted}" if wanted else None


def wrong_torch_cause(found, expected):
    """Why torch is ``found`` and not ``expected`` (both checked versions), as the clause after the semicolon."""
    if found is None:
        return f"no torch is installed there: the training_venv step installs the lock (pinning torch=={expected})"
    index = torch_index(expected)
    take = f"; take torch from {index} (an --extra-index-url of the training_venv lock)" if index else ""
    have, want = variant(found), variant(expected)
    if have == "cpu" and want != "cpu":
        return (
            "a CPU build: torch came from the wrong index (the CPU wheel, from PyPI's default index or the /whl/cpu "
            f"index){take}"
        )
    if found.partition("+")[0] != expected.partition("+")[0]:
        return "another torch release: rebuild the venv from the lock (the training_venv step)"
    if have != want:
        return f"the other CUDA build of torch ({have or 'no build variant'}, expected {want or 'none'}){take}"
    return "another build of torch: rebuild the venv from the lock (the training_venv step)"


def driver_tuple(version):
    """``580.159.04`` -> ``(580, 159, 4)``; None when it is not a driver version."""
    if not isinstance(version, str) or not DRIVER_VERSION.match(version):
        return None
    return tuple(int(part) for part in version.split("."))


def driver_too_old(driver, cuda):
    """The oldest driver for torch's CUDA (``"525.60.13"``) when ``driver`` is older than it, else None."""
    have = driver_tuple(driver)
    major = int(cuda.split(".")[0]) if isinstance(cuda, str) and CUDA_VERSION.match(cuda) else None
    need = MIN_DRIVER.get(major)
    if have is None or need is None or have >= need:
        return None
    return f"{need[0]}.{need[1]}.{need[2]:02d}"


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


# -- torch -----------------------------------------------------------------------------------------------------
def torch_version_check(expected, found, label, where):
    """torch.__version__ (``where`` says how it was read) against the spec, exact string, local tag included."""
    if found == expected:
        return make_check("torch_version", True, expected=expected, found=found, detail=f"{label}: torch {found}")
    return make_check(
        "torch_version",
        False,
        expected=expected,
        found=found,
        detail=f"{label}: torch is {found or 'not installed'} ({where}), expected {expected}; "
        f"{wrong_torch_cause(found, expected)}",
    )


def cuda_version_check(expected, found, torch, label, where):
    """torch.version.cuda against the spec; ``torch`` is torch's version, which names the build."""
    if found == expected:
        return make_check("cuda_version", True, expected=expected, found=found, detail=f"{label}: CUDA {found}")
    if torch is None:
        cause = "no torch is installed there: the training_venv step installs the lock"
    elif found is None:
        cause = wrong_torch_cause(torch, f"{torch.partition('+')[0]}+cu{expected.replace('.', '')}")  # a CPU build
    else:
        cause = f"the other CUDA build of torch ({torch})"
    return make_check(
        "cuda_version",
        False,
        expected=expected,
        found=found,
        detail=f"{label}: torch's CUDA is {found or 'none (a CPU build)'} ({where}), expected {expected}; {cause}",
    )


# What a failed CUDA initialization says (torch's warnings and errors: c10/cuda/CUDAFunctions.cpp), and why.
CUDA_CAUSES = (
    (
        re.compile(r"\b802\b|system not yet initialized", re.IGNORECASE),
        "CUDA error 802 (system not yet initialized): the NVIDIA fabric manager is not running on the node; an "
        "NVSwitch system (HGX H200) needs it before CUDA starts: systemctl enable --now nvidia-fabricmanager (the "
        "same version as the driver)",
    ),
    (
        re.compile(r"\b804\b|forward compatibility was attempted", re.IGNORECASE),
        "CUDA error 804: a forward-compatibility CUDA library (cuda-compat) is loaded on a GPU or driver that does "
        "not support it; remove it from the target's library path",
    ),
    (
        re.compile(r"driver on your system is too old|\b803\b|\b35\b|insufficient for CUDA runtime", re.IGNORECASE),
        "the driver is too old for torch's CUDA build: install a newer driver on the node, or the torch build for "
        "an older CUDA",
    ),
    (
        re.compile(r"\b100\b|no CUDA-capable device", re.IGNORECASE),
        "CUDA found no GPU: the /dev/nvidiaN nodes are missing in the target, or CUDA_VISIBLE_DEVICES hides them",
    ),
    (
        re.compile(r"\b999\b|unknown error", re.IGNORECASE),
        "CUDA error 999 (unknown error): /dev/nvidia-uvm is missing in the target or nvidia_uvm is not loaded on "
        "the node (modprobe nvidia-uvm), or a GPU is in a bad state (dmesg | grep -i xid on the node)",
    ),
)


def expected_build(spec, found):
    """The torch build the spec asks for: torch_version, else ``found``'s release built for cuda_version, else
    None (``2.13.0+cpu`` with cuda_version 12.8 -> ``2.13.0+cu128``)."""
    if spec["torch_version"]:
        return spec["torch_version"]
    public = (found or "").partition("+")[0]
    return f"{public}+cu{spec['cuda_version'].replace('.', '')}" if spec["cuda_version"] and public else None


CUDA_TEXT = re.compile(r"cuda|driver|nvml|gpu|device", re.IGNORECASE)


def cuda_cause(torch, driver, expected=None):
    """Why CUDA is not available to torch (``torch``: the checked torch facts; ``driver``: NVML's version;
    ``expected``: the torch build the spec asks for, or None)."""
    if torch["cuda"] is None:
        if expected and variant(expected) != "cpu":
            return wrong_torch_cause(torch["version"], expected)
        return (
            f"torch {torch['version']} is a CPU build (torch.version.cuda is None): the training_venv lock must take "
            "a CUDA build of torch from PyTorch's index (https://download.pytorch.org/whl/cu128 for CUDA 12.8)"
        )
    # Only what is about CUDA: importing torch warns about other things too ("Failed to initialize NumPy").
    said = " ".join([torch["error"] or "", *(w for w in torch["warnings"] if CUDA_TEXT.search(w))])
    for pattern, cause in CUDA_CAUSES:
        if pattern.search(said):
            if "too old" in cause:
                need = driver_too_old(driver, torch["cuda"])
                if need:
                    return f"driver {driver} is too old for CUDA {torch['cuda']} (it needs {need} or newer): {cause}"
            return cause
    need = driver_too_old(driver, torch["cuda"])
    if need:
        return (
            f"driver {driver} is too old for torch's CUDA {torch['cuda']} (it needs {need} or newer): install a newer "
            "driver on the node, or the torch build for an older CUDA"
        )
    if torch["cuda_visible_devices"] is not None:
        # Hidden GPUs make CUDA report none without a word (seen on an H200: tests/fixtures/verify).
        return f"CUDA_VISIBLE_DEVICES={shown(torch['cuda_visible_devices'])} is set in the target's environment"
    if said.strip():
        return f"CUDA said {shown(said.strip())}"
    return "CUDA gave no reason: check dmesg | grep -i nvrm on the node"


def count_cause(torch, expected):
    """Why torch sees fewer (or more) GPUs than expected."""
    count = torch["device_count"]
    if count > expected:
        return "more GPUs than expected: set verify_gpu_count, or fix the target's GPU entries"
    if torch["cuda_visible_devices"] is not None:
        return f"CUDA_VISIBLE_DEVICES={shown(torch['cuda_visible_devices'])} is set in the target's environment"
    nodes = len(torch["devices"])
    if nodes < expected:
        return (
            f"the target has only {plural(nodes, '/dev/nvidiaN node')}: one is missing in the CT (its lxc.mount.entry "
            "lines); restart the CT after fixing them"
        )
    return "CUDA_VISIBLE_DEVICES is set for the jobs, or a /dev/nvidiaN node is missing in the target"


def import_cause(error):
    text = error or ""
    if "No module named 'torch'" in text:
        return "torch is not installed in the venv: the training_venv step installs the lock"
    if re.search(r"lib(?:cudart|cublas|cudnn|nvrtc|nvJitLink|cusparse|nccl)|cannot open shared object", text):
        return (
            "a CUDA library of torch is missing (the nvidia-* wheels of the other CUDA build?): rebuild the venv from "
            "the lock (the training_venv step)"
        )
    if "undefined symbol" in text:
        return "files of two torch builds are mixed: rebuild the venv from the lock (the training_venv step)"
    return "rebuild the venv from the lock (the training_venv step)"


def torch_failure_check(spec, torch, label):
    """The failed ``torch_import`` check of a probe that could not import torch, or gave no answer."""
    venv = spec["venv"]
    python = f"{venv}/bin/python"
    failure = torch["failure"]
    if failure == "not_found":
        detail = (
            f"{label}: {python} not found: there is no venv at {venv}; the training_venv step builds it (or set "
            "verify_venv)"
        )
    elif failure == "timeout":
        detail = (
            f"{label}: importing torch and starting CUDA did not finish within {torch['timeout']} s and was "
            "killed; a GPU stuck in initialization (dmesg | grep -i xid on the node) or a slow filesystem (then "
            "raise verify_torch_timeout)"
        )
    elif failure == "crashed":
        detail = (
            f"{label}: {python} died ({torch['error']}) while importing torch and starting CUDA; a broken CUDA "
            "library or driver: rebuild the venv from the lock, check dmesg on the node"
        )
    else:
        error = torch["error"]
        detail = f"{label}: `import torch` failed in {python}: {shown(error)}; {import_cause(error)}"
    return make_check("torch_import", False, expected="import torch works", found=torch["error"], detail=detail)


def device_names_check(spec, torch, label, driver):
    """Every GPU torch sees is the spec's model (torch.cuda.get_device_name)."""
    expected, names = spec["gpu_name"], torch["device_names"]
    wrong = [(i, n) for i, n in enumerate(names) if n != expected]
    if torch["error"]:
        cause = cuda_cause(torch, driver, expected_build(spec, torch["version"]))
        detail = f"{label}: torch could not name the GPUs: {shown(torch['error'])}; {cause}"
    elif wrong:
        listed = ", ".join(f"cuda:{i} is {quoted(n)}" for i, n in wrong)
        detail = f"{label}: torch says {listed}, expected {expected}"
    else:
        detail = f"{label}: torch names every GPU {expected}"
        return make_check("torch_device_names", True, expected=expected, found=names, detail=detail)
    return make_check("torch_device_names", False, expected=expected, found=names, detail=detail)


def device_count_check(torch, expected, source, label):
    count = torch["device_count"]
    if count == expected:
        detail = f"{label}: torch sees {plural(count, 'GPU')}"
        return make_check("torch_device_count", True, expected=expected, found=count, detail=detail)
    detail = (
        f"{label}: torch sees {plural(count, 'GPU')}, expected {expected} ({source}); {count_cause(torch, expected)}"
    )
    return make_check("torch_device_count", False, expected=expected, found=count, detail=detail)


def torch_checks(spec, torch, *, label, expected_count, count_source, driver):
    """The assertions on the torch probe's answer (:func:`torch_answer`); the acting module only.

    ``driver`` is the driver NVML reports (a CUDA build newer than the driver is one cause of no CUDA).
    """
    if torch["failure"]:
        return [torch_failure_check(spec, torch, label)]
    venv = spec["venv"]
    checks = [
        make_check(
            "torch_import",
            True,
            expected="import torch works",
            found=torch["version"],
            detail=f"{label}: {venv}/bin/python imports torch {torch['version']} in {torch['seconds']} s",
        )
    ]
    where = f"torch.__version__ in {venv}"
    if spec["torch_version"]:
        checks.append(torch_version_check(spec["torch_version"], torch["version"], label, where))
    if spec["cuda_version"]:
        checks.append(cuda_version_check(spec["cuda_version"], torch["cuda"], torch["version"], label, where))
    if not torch["available"]:
        cause = cuda_cause(torch, driver, expected_build(spec, torch["version"]))
        detail = f"{label}: torch.cuda.is_available() is {torch['available']}, expected True; {cause}"
        checks.append(make_check("cuda_available", False, expected=True, found=torch["available"], detail=detail))
        return checks
    checks.append(make_check("cuda_available", True, expected=True, found=True, detail=f"{label}: CUDA is available"))
    checks.append(device_count_check(torch, expected_count, count_source, label))
    if spec["gpu_name"]:
        checks.append(device_names_check(spec, torch, label, driver))
    return checks


# -- the torch probe's answer ------------------------------------------------------------------------------------
def _typed(answer, key, kinds, default=None, *, required=False):
    if key not in answer:
        if required:
            raise VerifyError(f"the torch probe answered no {key!r}", kind="probe")
        return default
    value = answer[key]
    if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        raise VerifyError(f"the torch probe answered {key!r} as {shown(value)}, not {kinds[0].__name__}", kind="probe")
    return value


def _version(answer, key, pattern=VERSION, *, required=False):
    value = _typed(answer, key, (str,), required=required)
    if value is not None and not pattern.match(value):
        raise VerifyError(f"the torch probe answered {key!r} as {shown(value)}, which is not a version", kind="probe")
    return value


def _strings(answer, key, *, required=False, pattern=None):
    value = _typed(answer, key, (list,), [], required=required)
    if value is None or len(value) > MAX_ITEMS or not all(isinstance(v, str) for v in value):
        raise VerifyError(
            f"the torch probe answered {key!r} that is not a list of at most {MAX_ITEMS} strings", kind="probe"
        )
    if pattern is not None and not all(pattern.match(v) for v in value):
        raise VerifyError(
            f"the torch probe answered {key!r} with an entry that does not fit {pattern.pattern}", kind="probe"
        )
    return [v[:300] for v in value]


def check_torch_answer(answer):
    """The torch probe's JSON answer (tests/fixtures/h200/torch_facts.json is one), shape-checked, normalized.

    ``{"torch": "2.11.0+cu130", "cuda": "13.0", "available": true, "count": 1, "names": ["NVIDIA H200"],
    "cudnn": 91900, "dist_version": "2.11.0", "triton": "3.6.0"}`` -> ``{"version": "2.11.0+cu130", "cuda":
    "13.0", "available": True, "device_count": 1, "device_names": ["NVIDIA H200"], "cudnn": 91900, ...,
    "failure": None}``. A key of the wrong type, a version that is not one, too many items: VerifyError.
    """
    if not isinstance(answer, dict):
        raise VerifyError(f"the torch probe answered {type(answer).__name__}, not an object", kind="probe")
    error = _typed(answer, "error", (str,))
    phase = _typed(answer, "error_phase", (str,))
    if phase not in (None, "import", "cuda"):
        raise VerifyError(f"the torch probe answered 'error_phase' as {shown(phase)}", kind="probe")
    imported = phase != "import"
    facts = {
        "version": _version(answer, "torch", required=imported),
        "cuda": _version(answer, "cuda", CUDA_VERSION, required=imported),
        "available": _typed(answer, "available", (bool,), required=imported),
        "device_count": _typed(answer, "count", (int,), required=imported),
        "device_names": _strings(answer, "names", required=imported),
        "cudnn": _typed(answer, "cudnn", (int,)),
        "dist_version": _version(answer, "dist_version"),
        "triton": _version(answer, "triton"),
        "error": error[:1000] if error else None,
        "error_phase": phase,
        "warnings": _strings(answer, "warnings"),
        "devices": _strings(answer, "devices", pattern=DEVICE),
        # Set but empty hides every GPU: "" is a value here, not "unset".
        "cuda_visible_devices": _typed(answer, "cuda_visible_devices", (str,)),
        "python_version": _version(answer, "python"),
        "seconds": _typed(answer, "seconds", (int, float)),
        "failure": "import" if phase == "import" else None,
    }
    if imported and facts["version"] is None:
        raise VerifyError("the torch probe answered no torch version and no import error", kind="probe")
    if facts["available"] and facts["device_count"] is None:
        raise VerifyError("the torch probe answered CUDA available without a device count", kind="probe")
    if facts["cuda_visible_devices"] is not None:
        facts["cuda_visible_devices"] = facts["cuda_visible_devices"][:300]
    return facts


def torch_failure(failure, message, timeout):
    """The torch facts of a probe that gave no answer: ``not_found`` (no venv python), ``timeout``, ``crashed``."""
    facts = dict.fromkeys(TORCH_KEYS)
    facts.update(device_names=[], warnings=[], devices=[], failure=failure, error=message, timeout=timeout)
    return facts


TORCH_KEYS = (
    "python",
    "version",
    "cuda",
    "available",
    "device_count",
    "device_names",
    "cudnn",
    "dist_version",
    "triton",
    "error",
    "error_phase",
    "warnings",
    "devices",
    "cuda_visible_devices",
    "python_version",
    "seconds",
    "failure",
    "timeout",
)


def torch_answer(rc, stdout, stderr, *, truncated=False, timeout=None):
    """What the venv's python printed, as checked torch facts (:func:`check_torch_answer`).

    A python that died (an exit code other than 0: a crash in a CUDA library) gives facts with ``failure``
    "crashed" and the last line of its stderr, quoted; an answer that is too long or not JSON is a VerifyError.
    """
    if rc != 0:
        last = next((line.strip() for line in reversed((stderr or "").splitlines()) if line.strip()), "")
        signal = f" (signal {-rc})" if rc < 0 else (f" (signal {rc - 128})" if rc > 128 else "")
        said = f": {shown(last)}" if last else ""
        return torch_failure("crashed", f"exit {rc}{signal}{said}", timeout)
    if truncated or len(stdout.encode()) > MAX_OUTPUT:
        raise VerifyError(f"the torch probe answered more than {MAX_OUTPUT} bytes", kind="probe")
    try:
        answer = json.loads(stdout)
    except ValueError:
        raise VerifyError(
            f"the torch probe printed no JSON answer: {shown(stdout.strip()) if stdout.strip() else 'nothing'}",
            kind="probe",
            stderr=stderr,
        ) from None
    return dict(check_torch_answer(answer), timeout=timeout)


# -- the fact pass ---------------------------------------------------------------------------------------------
def expected_gpus(spec, devices):
    """``(count, where it comes from)``: the spec's gpu_count, else the target's /dev/nvidiaN nodes."""
    if spec["gpu_count"] is not None:
        return spec["gpu_count"], "verify_gpu_count"
    nodes = [d for d in devices if isinstance(d, str) and _GPU_DEVICE.match(d)]
    return len(nodes), "the target's /dev/nvidiaN nodes"


def check_answer(answer):
    """The fact pass's probe part comes from inside a CT: what is not its answer is a VerifyError."""
    if not isinstance(answer, dict):
        raise VerifyError("the verify probe answered no object", kind="probe")
    for key in ("exists", "python"):
        if not isinstance(answer.get(key), bool):
            raise VerifyError(f"the verify probe answered no {key!r} (bool)", kind="probe")
    version_py = answer.get("torch_version_py")
    if version_py is not None and not isinstance(version_py, dict):
        raise VerifyError("the verify probe answered a torch_version_py that is not an object", kind="probe")
    if answer.get("unsafe") is not None and not isinstance(answer["unsafe"], str):
        raise VerifyError("the verify probe answered an unsafe that is not a sentence", kind="probe")
    if version_py:
        for key, pattern in (("version", VERSION), ("cuda", CUDA_VERSION)):
            value = version_py.get(key)
            if value is not None and not (isinstance(value, str) and pattern.match(value)):
                raise VerifyError(
                    f"the verify probe read torch/version.py's {key} as {shown(value)}, which is not a version",
                    kind="probe",
                )


def venv_step(spec, context):
    """The training_venv step's facts when it is in this pass for this very venv, else None."""
    facts = context["steps"].get("training_venv")
    if not isinstance(facts, dict) or facts.get("error"):
        return None
    path = facts.get("path")
    return facts if isinstance(path, str) and path.rstrip("/") == spec["venv"].rstrip("/") else None


def lock_conflict(spec, lock_torch, label):
    """A failed check when the training_venv lock can never give the torch the spec expects, else None."""
    expected = spec["torch_version"]
    if not lock_torch or not expected:
        return None
    public = lock_torch.partition("+")[0] == expected.partition("+")[0]
    if public and ("+" not in lock_torch or lock_torch == expected):
        return None  # a plain pin names PyPI's wheel, whose local tag only torch/version.py says
    return make_check(
        "torch_version",
        False,
        expected=expected,
        found=lock_torch,
        detail=f"{label}: the training_venv lock pins torch {lock_torch}, expected {expected}; the rebuild this run "
        f"makes cannot pass verify: pin torch=={expected} in the lock, or set verify_torch_version to the lock's",
    )


def torch_file_checks(spec, answer, context, label):
    """``(checks, torch)``: torch_version and cuda_version from torch/version.py (no import), or deferred to the
    venv step when it rebuilds this venv in this run; ``torch`` is what version.py says now."""
    version_py = answer.get("torch_version_py") or {}
    found, cuda = version_py.get("version"), version_py.get("cuda")
    venv = venv_step(spec, context)
    rebuilt = bool(venv is not None and venv.get("pending"))
    torch = {"version": found, "cuda": cuda, "source": "torch/version.py", "rebuilt": rebuilt}
    if not (spec["torch_version"] or spec["cuda_version"]):
        return [], torch
    if rebuilt:
        conflict = lock_conflict(spec, (venv.get("lock") or {}).get("torch"), label)
        why = "the training_venv step rebuilds the venv in this run; checked after it"
        checks = [conflict] if conflict else []
        if spec["torch_version"] and not conflict:
            checks.append(deferred_check("torch_version", spec["torch_version"], f"{label}: torch: {why}"))
        if spec["cuda_version"]:
            checks.append(deferred_check("cuda_version", spec["cuda_version"], f"{label}: CUDA: {why}"))
        return checks, torch
    where = f"torch/version.py in {spec['venv']}" if answer["exists"] else f"no venv at {spec['venv']}"
    checks = []
    if spec["torch_version"]:
        checks.append(torch_version_check(spec["torch_version"], found, label, where))
    if spec["cuda_version"]:
        checks.append(cuda_version_check(spec["cuda_version"], cuda, found, label, where))
    return checks, torch


def memory_deferral(context):
    """Why the memory check is left to the GPU step (it ends the holders in this run, or already says why it
    cannot), or None."""
    facts = context["steps"].get("gpu_processes")
    if isinstance(facts, dict) and facts.get("pending"):
        return "the gpu_processes step ends the processes holding it in this run; it waits until the memory is free"
    if isinstance(facts, dict) and facts.get("problems"):
        return "left to the gpu_processes step, whose problems name the holders"
    return None


def memory_kept(context):
    """The GPUs whose memory an unattended run leaves to the guarded training job (gpu_processes' ``kept_gpus``):
    the job runs as expected, its GPUs are named in ``needs_window``, and the run must not fail for them."""
    facts = context["steps"].get("gpu_processes")
    kept = facts.get("kept_gpus") if isinstance(facts, dict) else None
    return [i for i in kept if isinstance(i, int)] if isinstance(kept, list) else []


def outcome(checks):
    """``(problems, warnings)``: the details of the failed checks, by severity (deferred ones are neither)."""
    problems = [c["detail"] for c in checks if c["ok"] is False and c["severity"] == "fail"]
    warnings = [c["detail"] for c in checks if c["ok"] is False and c["severity"] == "warn"]
    return problems, warnings


def unsafe_problem(label, venv, why):
    """A venv another user than root could change (the probe's ``venv_unsafe``): verify never runs its python as
    root (``-I`` still runs the venv's ``.pth`` files, and the user could swap the venv for theirs). The target's
    text is quoted with repr (one line, every control character escaped), as this module quotes it elsewhere."""
    return (
        f"{label}: the venv {str(venv)!r} could be changed by a user other than root: {str(why)[:300]!r}; verify "
        "does not run its "
        "python as root: make every directory from / to it root's and not writable by a group or other users "
        "(chown root:root, chmod go-w), or set verify_venv to such a place"
    )


def is_pending(spec, context, problems):
    """Whether the acting module runs: "always"; "changed" when another step has work (a real run only)."""
    others = [n for n, f in context["steps"].items() if n != NAME and isinstance(f, dict) and f.get("pending")]
    if problems or spec["import_torch"] == "never":
        return False, others
    if spec["import_torch"] == "always":
        return True, others
    return bool(others) and not context["check_mode"], others


def evaluate_step(spec, answer, node, context):
    """The verify facts of the fact pass: every check made without importing torch, problems, warnings, pending.

    Returns ``{"venv", "expected", "health", "import_torch", "torch", "checks", "warnings", "deferred",
    "steps_with_work", "changes", "problems", "diff", "pending"}``.
    """
    label = context["target"]["label"]
    check_answer(answer)
    preflight = context["steps"].get("preflight") or {}
    gpus = [g for g in preflight.get("gpus") or [] if isinstance(g, dict)]
    count, source = expected_gpus(spec, [d.get("path") for d in preflight.get("devices") or [] if isinstance(d, dict)])
    checks = gpu_checks(
        spec,
        gpus,
        label=label,
        expected_count=count,
        count_source=source,
        memory_deferred=memory_deferral(context),
        memory_kept=memory_kept(context),
    )
    torch_checks_, torch = torch_file_checks(spec, answer, context, label)
    checks += torch_checks_
    problems, warnings = outcome(checks)
    if answer.get("unsafe"):  # its python is never run as root: a problem, so verify is not pending
        problems.insert(0, unsafe_problem(label, spec["venv"], answer["unsafe"]))
    pending, others = is_pending(spec, context, problems)
    return {
        "venv": spec["venv"],
        "expected": {
            "gpu_count": count,
            "gpu_name": spec["gpu_name"] or None,
            "max_memory_used_mib": spec["max_memory_used_mib"],
            "driver_version": spec["driver_version"] or None,
            "torch_version": spec["torch_version"] or None,
            "cuda_version": spec["cuda_version"] or None,
        },
        "health": health_levels(spec),
        "import_torch": spec["import_torch"],
        "torch": torch,
        "checks": checks,
        "warnings": warnings,
        "deferred": [c["name"] for c in checks if c["ok"] is None],
        "steps_with_work": others,
        "changes": [],  # verify changes nothing
        "problems": problems,
        "diff": {"before": "", "after": ""},
        "pending": pending,
    }


def probe_payload(spec, timeout=60):
    """What the probe part reads inside the target: ``{"venv": "/opt/venvs/train"}``."""
    return {"venv": spec["venv"]}


def read_node(spec, target, answer, context):
    """Nothing on the node: the GPUs' facts are preflight's, the venv lives inside the target."""
    return {}
