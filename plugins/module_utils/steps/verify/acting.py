# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The verify step's acting half (library/verify.py wires it): read the GPUs with nvidia-smi and, unless never,
torch in the venv's own python; assert them against the spec. Read-only: it never acts, so check mode runs the
same; a failed assertion fails the module with its whole result."""

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import ActingStep
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import NvidiaSmi
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.probes import module_source
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import TargetError
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import facts as verify_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import probe as verify_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.answers import (
    VerifyError,
    torch_answer,
    torch_failure,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.facts import expected_gpus, outcome
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.gpu_checks import gpu_checks, health_levels
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.torch_checks import torch_checks


def torch_argv(venv):
    """``/opt/venvs/train/bin/python -I -B -``: the venv's own python, isolated (no PYTHON* variables, no user site,
    no current directory on sys.path), writing no bytecode (importing torch would leave ``__pycache__`` in the venv:
    a verify writes nothing), reading the script from stdin."""
    return [f"{venv}/bin/python", "-I", "-B", "-"]


# -I makes this python ignore it; a python that torch or triton starts in turn inherits it and writes no bytecode.
TORCH_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


def read_torch(target, venv, timeout):
    """What the venv's python says about torch and CUDA: ONE command in the target, within ``timeout`` seconds.

    A venv without python and a run past the deadline are answers too (``failure`` ``not_found``, ``timeout``):
    verify names them; anything else the target does wrong raises.
    """
    argv = torch_argv(venv)
    try:
        source = module_source(verify_probe)
        result = target.run(argv, stdin=source, timeout=timeout, env=TORCH_ENV, check=False)
    except TargetError as error:
        if error.kind in ("not_found", "timeout"):
            return dict(torch_failure(error.kind, str(error), timeout), python=argv[0])
        raise
    answer = torch_answer(result.rc, result.stdout, result.stderr, truncated=result.truncated, timeout=timeout)
    return dict(answer, python=argv[0])


def assert_all(spec, gpus, torch, label, memory_kept=()):
    """``(checks, expected)``: every assertion on nvidia-smi's GPUs and (unless None) the torch facts; pure.

    ``memory_kept``: the GPUs (indexes) whose memory the guarded training job keeps (left out of the memory check).
    """
    if spec["gpu_count"] is None and torch and torch.get("devices"):
        count, source = expected_gpus(spec, torch["devices"])
    elif spec["gpu_count"] is None:
        count, source = len(gpus), "the GPUs nvidia-smi lists"
    else:
        count, source = expected_gpus(spec, [])
    checks = gpu_checks(spec, gpus, label=label, expected_count=count, count_source=source, memory_kept=memory_kept)
    if torch is not None:
        driver = gpus[0].get("driver_version") if gpus else None
        checks += torch_checks(spec, torch, label=label, expected_count=count, count_source=source, driver=driver)
    expected = {
        "gpu_count": count,
        "gpu_name": spec["gpu_name"] or None,
        "max_memory_used_mib": spec["max_memory_used_mib"],
        "driver_version": spec["driver_version"] or None,
        "torch_version": spec["torch_version"] or None,
        "cuda_version": spec["cuda_version"] or None,
        "health": health_levels(spec),
    }
    return checks, expected


class Verify(ActingStep):
    """Read-only: read the GPUs and (unless never) torch, assert them; a failed assertion fails the module with
    its whole result. It never acts, so check mode runs the same."""

    facts = verify_facts
    error = VerifyError
    at_least = {"torch_timeout": (1, "give torch at least 1 second")}

    def read(self, run):
        smi = NvidiaSmi(run.target.run, timeout=run.params["timeout"])
        gpus = smi.gpus()  # before torch: the memory it reads is the jobs', not the script's
        import_torch = run.spec["import_torch"] != "never"
        torch = read_torch(run.target, run.spec["venv"], run.params["torch_timeout"]) if import_torch else None
        checks, expected = assert_all(run.spec, gpus, torch, run.target.label, run.params["memory_kept_gpus"])
        facts = {"checks": checks, "torch": torch, "gpus": gpus, "expected": expected, "notices": smi.notices}
        return dict(facts, pending=False, problems=[], changes=[], diff=None)

    def result(self, run, before, after, done):
        return {
            "checks": before["checks"],
            "torch": before["torch"],
            "gpus": before["gpus"],
            "venv": run.spec["venv"],
            "expected": before["expected"],
        }

    def verdict(self, run, before, result):
        """Every failed assertion at once, `` | ``-joined (each names the target); warnings as warnings."""
        for notice in before["notices"]:
            run.warn(f"{run.target.label}: {notice['message'][:300]}")
        failed, warnings = outcome(result["checks"])
        for warning in warnings:
            run.warn(warning)
        return " | ".join(failed)
