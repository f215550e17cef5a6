#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Fill the lab's package indexes and write the venv scenario's locks (test code).

    make_venv_index.py INDEX_DIR LOCK_DIR [--uv-wheel-dir DIR]

INDEX_DIR (the lab's ``index`` directory, served inside a CT by ``labctl index-serve`` on 127.0.0.1:8900) gets two
PEP 503 indexes, as a real node sees PyPI and PyTorch's own index:

* ``pypi``: real wheels of small packages downloaded from PyPI now (six, idna), torch ``2.11.0+cu130`` (a small
  wheel built here whose ``torch/version.py`` reads like that build's; PyPI's default torch is a cu130 build), a
  package that polluted the real venv (``flashinfer-python``), and ``bigdata`` (30 MiB, to fill a small disk);
* ``cu128``: torch ``2.11.0+cu128``, the known-good build.

LOCK_DIR gets ``good.lock`` (six, idna, torch 2.11.0+cu128 from the cu128 index), ``big.lock`` (the same plus
bigdata) and ``tls.lock`` (good.lock's pins from the same indexes served over HTTPS only, on 127.0.0.1:8943:
``labctl index-serve --port 8943 --tls-cert ...``), in ``uv pip compile --generate-hashes`` format with the files'
real sha256. With ``--uv-wheel-dir``, PyPI's uv wheel of the version the controller venv runs is downloaded there
(the role installs it into the CT).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wheelhouse

URL = "http://127.0.0.1:8900"
TLS_URL = "https://127.0.0.1:8943"  # the same indexes over HTTPS, with a private CA's certificate
REAL = (("six", "1.17.0"), ("idna", "3.10"))


def download(requirement, directory, *extra):
    """A wheel from PyPI (the package registries are reachable from the controller, not from the CT)."""
    before = set(Path(directory).glob("*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            directory,
            *extra,
            requirement,
        ],
        check=True,
    )
    found = sorted(set(Path(directory).glob("*.whl")) - before) or sorted(Path(directory).glob("*.whl"))
    return [w for w in found if wheelhouse.wheel_project(w) == wheelhouse.canonical_name(requirement.split("==")[0])]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("index_dir", type=Path)
    parser.add_argument("lock_dir", type=Path)
    parser.add_argument("--uv-wheel-dir", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build = Path(tmp)
        real = {name: download(f"{name}=={version}", tmp) for name, version in REAL}
        cu130 = wheelhouse.build_wheel(
            build / "pypi",
            "torch",
            "2.11.0+cu130",
            {
                "torch/__init__.py": wheelhouse.GUARD,
                "torch/version.py": wheelhouse.torch_version_py("2.11.0+cu130", "13.0"),
            },
        )
        cu128 = wheelhouse.build_wheel(
            build / "cu128",
            "torch",
            "2.11.0+cu128",
            {
                "torch/__init__.py": wheelhouse.GUARD,
                "torch/version.py": wheelhouse.torch_version_py("2.11.0+cu128", "12.8"),
            },
        )
        pollution = wheelhouse.build_wheel(build / "pypi", "flashinfer-python", "0.2.0")
        big = wheelhouse.build_wheel(build / "pypi", "bigdata", "1.0", padding=30 * 1024 * 1024)
        pypi = [w for wheels in real.values() for w in wheels] + [cu130, pollution, big]
        wheelhouse.write_index(args.index_dir / "pypi", pypi)
        wheelhouse.write_index(args.index_dir / "cu128", [cu128])
        pins = [(name, version, real[name]) for name, version in REAL] + [("torch", "2.11.0+cu128", [cu128])]
        args.lock_dir.mkdir(parents=True, exist_ok=True)
        options = {"index_url": f"{URL}/pypi/simple", "extra_index_urls": [f"{URL}/cu128/simple"]}
        (args.lock_dir / "good.lock").write_text(wheelhouse.lock_text(pins, **options))
        (args.lock_dir / "big.lock").write_text(wheelhouse.lock_text([*pins, ("bigdata", "1.0", [big])], **options))
        tls = {"index_url": f"{TLS_URL}/pypi/simple", "extra_index_urls": [f"{TLS_URL}/cu128/simple"]}
        (args.lock_dir / "tls.lock").write_text(wheelhouse.lock_text(pins, **tls))
    if args.uv_wheel_dir:
        version = metadata.version("uv")
        download(f"uv=={version}", str(args.uv_wheel_dir), "--platform", "manylinux_2_17_x86_64")
    print(f"indexes in {args.index_dir}, locks in {args.lock_dir}")


if __name__ == "__main__":
    main()
