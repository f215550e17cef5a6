# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The verify step's assertions on torch: its version and CUDA build (read from torch/version.py by the fact
pass, from ``torch.__version__`` by the acting module), and, once the acting module imported it, CUDA available
and the GPUs torch sees. A failed one names the likely cause: the wrong index or build, a driver too old for the
build, what CUDA said when it failed to start."""

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import shown
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.torch_build import variant
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.answers import CUDA_VERSION, DRIVER_VERSION
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.gpu_checks import make_check, plural, quoted

# The oldest driver each CUDA major runs on (CUDA minor version compatibility; NVIDIA's CUDA release notes).
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}


# -- wording ---------------------------------------------------------------------------------------------------
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
    """The assertions on the torch probe's answer (:func:`answers.torch_answer`); the acting module only.

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
