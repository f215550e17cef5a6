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
  and torch imported by the venv's own python in ONE process (:func:`answers.torch_answer` checks what it
  printed).

Every failed assertion is one sentence: what was expected, what was found, and the likely cause. Everything read
inside a CT is untrusted: versions are checked against a strict pattern before they reach a message, other text
(an error, a GPU name) is quoted and shortened (``shown``), and advice names only our settings and values the
nvidia-smi parser validated (GPU UUIDs).

The step's modules, by concern: this one (NAME, SPEC, the settings check, the fact pass's evaluation),
``answers`` (VerifyError; what the probes answered, shape-checked before any of it is used), ``gpu_checks`` (one
check's shape and the assertions on nvidia-smi's facts: count, model, memory, driver, health) and
``torch_checks`` (the assertions on torch: its version and CUDA build, CUDA available, the GPUs it sees).
"""

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.torch_build import cuda_of, variant
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import probe as verify_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.answers import (
    CUDA_VERSION,
    DRIVER_VERSION,
    VERSION,
    check_answer,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.gpu_checks import (
    HEALTH_DEFAULTS,
    LEVELS,
    deferred_check,
    gpu_checks,
    health_levels,
    make_check,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.torch_checks import (
    cuda_version_check,
    torch_version_check,
)

NAME = "verify"
PROBE = verify_probe
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


_GPU_DEVICE = re.compile(r"^/dev/nvidia(\d+)$")


# -- settings --------------------------------------------------------------------------------------------------
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


# -- the fact pass ---------------------------------------------------------------------------------------------
def expected_gpus(spec, devices):
    """``(count, where it comes from)``: the spec's gpu_count, else the target's /dev/nvidiaN nodes."""
    if spec["gpu_count"] is not None:
        return spec["gpu_count"], "verify_gpu_count"
    nodes = [d for d in devices if isinstance(d, str) and _GPU_DEVICE.match(d)]
    return len(nodes), "the target's /dev/nvidiaN nodes"


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
