"""plugins/module_utils/node/torch_build.py: what a torch version says about its build; and what the fact pass
imports."""

import subprocess
import sys

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import torch_build

from tests.conftest import ROOT


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.11.0+cu128", "cu128"),
        ("2.11.0+cu130", "cu130"),
        ("2.13.0+cpu", "cpu"),
        ("2.11.0+rocm6.4", "rocm6.4"),
        ("2.1.0+cu121.with.pypi.cudnn", "cu121"),
        ("2.11.0+xpu", "xpu"),
        ("2.11.0", None),
        ("1.0+local", None),
        (None, None),
    ],
)
def test_the_build_variant_is_the_local_tag_of_a_torch_build(version, expected):
    assert torch_build.variant(version) == expected


@pytest.mark.parametrize(
    ("variant", "cuda"), [("cu128", "12.8"), ("cu130", "13.0"), ("cu118", "11.8"), ("cpu", None), (None, None)]
)
def test_the_cuda_of_a_build_variant(variant, cuda):
    assert torch_build.cuda_of(variant) == cuda


def test_the_verify_step_imports_none_of_the_other_steps_modules():
    """The node compiles every module the fact pass imports, every run: verify alone must not pull in the venv,
    compile-cache or GPU steps' modules (a converged run with those steps off pays for none of them)."""
    program = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import facts;"
        "prefix = 'ansible_collections.pve_gpu.recover.plugins.module_utils.';"
        "print(' '.join(sorted(m[len(prefix):] for m in sys.modules if m.startswith(prefix))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(ROOT / "collections")], capture_output=True, text=True, check=True
    )
    # ct.venv: the venv-safety check its probe part ships into the target (SHARED), a few dozen lines.
    assert done.stdout.split() == [
        "ct",
        "ct.venv",
        "node",
        "node.errors",
        "node.nvidia_smi",
        "node.torch_build",
        "steps",
        "steps.verify",
        "steps.verify.answers",
        "steps.verify.facts",
        "steps.verify.gpu_checks",
        "steps.verify.probe",
        "steps.verify.torch_checks",
    ]
