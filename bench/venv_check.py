#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark (not a test): the venv step's in-spec check against `import torch`, on a venv with a real torch.

    .venv/bin/python bench/venv_check.py [--venv DIR] [--runs 7] [--wheel /opt/wheels/torch-...whl]
    .venv/bin/python bench/venv_check.py --venv DIR --write-lock FILE [--torch 2.11.0+cu128 --torch-index URL]

Without ``--venv`` it builds one in a temporary directory with uv: the CPU torch wheel FILE (``--wheel``; these
machines keep torch 2.13.0+cpu for Python 3.11 in /opt/wheels) and its runtime dependencies from PyPI. With
``--venv`` it measures that venv as it is (the H200 hardware run points it at the machine's own training venv).

Interleaved in one loop, medians of ``--runs``:

* ``check``: the fact pass's venv part as a converged run ships it: plugins/module_utils/steps/training_venv/probe.py
fed to
  ``python3 -I -S -c PROBES_MAIN`` (``probes_argv``) with the probe runner (Target.run_probes' program), then
  ``venv_facts.evaluate_step`` against a lock made from the venv itself (in spec);
* ``import``: ``<venv>/bin/python -c "import torch"``, what a check that imports torch costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import conftest  # noqa: E402,F401  (the collection importable as ansible_collections.pve_gpu.recover)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import probes_argv, probes_input  # noqa: E402
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import (  # noqa: E402
    compare as venv_compare,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import (  # noqa: E402
    facts as venv_facts,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import (  # noqa: E402
    probe as venv_probe,
)

WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
TORCH_DEPS = ("filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec")


def build_venv(directory, wheel):
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or "uv"
    subprocess.run([uv, "venv", "--quiet", "--python", "/usr/bin/python3.11", directory], check=True)
    python = f"{directory}/bin/python"
    subprocess.run([uv, "pip", "install", "--quiet", "--python", python, str(wheel), *TORCH_DEPS], check=True)
    return directory


def timed(argv, stdin=None):
    started = time.perf_counter()
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{argv[0]} failed: {done.stderr[-2000:]}")
    return seconds, done.stdout


def read_venv(venv, python):
    """The probe part's answer for ``venv``, run as the fact pass runs it: ``(seconds, answer)``."""
    program = probes_input({"training_venv": (venv_probe, {"path": venv, "timeout": 60})})
    seconds, out = timed(probes_argv(python), stdin=program)
    return seconds, json.loads(out)["training_venv"]["answer"]


def lock_of(answer, torch=None, torch_index=None):
    """A lock pinning exactly what the venv holds (``torch`` replaces torch's version: the other build's lock).

    The hashes are placeholders: the in-spec check compares names and versions, and this lock is never built from.
    """
    versions = venv_compare.installed_versions(answer)
    if torch:
        versions["torch"] = torch
    header = "# lock made by bench/venv_check.py from the venv itself (placeholder hashes: never built from)\n"
    index = f"--extra-index-url {torch_index}\n" if torch_index else ""
    pins = "".join(f"{name}=={version} --hash=sha256:{'0' * 64}\n" for name, version in sorted(versions.items()))
    return header + index + pins


def check_once(venv, python):
    """The converged fact pass's venv work: probe in a fresh python, then the comparison with the lock."""
    started = time.perf_counter()
    seconds, answer = read_venv(venv, python)
    versions = venv_compare.installed_versions(answer)
    spec = dict(venv_facts.SPEC_DEFAULTS, path=venv, lock=lock_of(answer))
    context = {"target": {"label": "bench", "vmid": None, "node": "bench"}, "steps": {}}
    facts = venv_facts.evaluate_step(spec, answer, {}, context)
    if facts["pending"] or facts["problems"]:
        sys.exit(f"the venv is not in spec against its own lock: {facts['changes'] + facts['problems']}")
    return time.perf_counter() - started, seconds, len(versions), facts["torch"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--wheel", type=Path, default=WHEEL)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the probe (python3)")
    parser.add_argument("--write-lock", type=Path, help="only write a lock of --venv as it is, and exit")
    parser.add_argument("--torch", help="with --write-lock: pin torch to this version instead (another build)")
    parser.add_argument("--torch-index", help="with --write-lock and --torch: the index torch comes from")
    args = parser.parse_args()
    if args.write_lock:
        args.write_lock.write_text(lock_of(read_venv(args.venv, args.python)[1], args.torch, args.torch_index))
        return
    with tempfile.TemporaryDirectory(prefix="pgr-venv-bench-") as tmp:
        if args.venv:
            venv = args.venv
        elif args.wheel.exists():
            venv = build_venv(f"{tmp}/venv", args.wheel)
        else:
            sys.exit(f"bench: no --venv and no {args.wheel}")
        timed([f"{venv}/bin/python", "-c", "import torch"])  # warm the page cache once, for both
        checks, probes, imports = [], [], []
        for _ in range(args.runs):
            total, probe, count, torch = check_once(venv, args.python)
            checks.append(total)
            probes.append(probe)
            imports.append(timed([f"{venv}/bin/python", "-c", "import torch"])[0])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "venv": venv if args.venv else f"uv venv + {args.wheel.name} and its dependencies",
        "distributions": count,
        "torch": torch,
        "runs": args.runs,
        "check_median_s": round(statistics.median(checks), 4),
        "probe_process_median_s": round(statistics.median(probes), 4),
        "import_torch_median_s": round(statistics.median(imports), 4),
    }
    result["import_over_check"] = round(result["import_torch_median_s"] / result["check_median_s"], 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
