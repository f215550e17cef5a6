# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
name: uv_lock
short_description: A hashed lock compiled on the controller from a short requirements list with uv pip compile
description:
  - Runs C(uv pip compile --generate-hashes) on the controller for the target's Python and platform, with torch's own
    index as an extra index that uv prefers (C(--index-strategy first-index)), so no other index can supply torch.
  - The lock is cached under I(cache_dir) by a hash of the requirements and every option, so a run compiles (and
    reaches the indexes) only when one of them changed; every later run reads the cached file.
  - Returns the lock's text, which the training_venv role hands to the fact pass and the module.
version_added: "0.3.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
options:
  _terms:
    description: Requirement lines (C(torch==2.11.0+cu128), C(transformers), ...).
    required: true
    type: list
    elements: str
  python_version:
    description: The target venv's Python minor.
    type: str
    default: "3.11"
  python_platform:
    description: The target's platform, as uv names it.
    type: str
    default: x86_64-manylinux_2_28
  index_url:
    description: The default index.
    type: str
    default: https://pypi.org/simple
  torch_index_url:
    description: torch's own index (the build variant lives there), preferred for what it has.
    type: str
    default: https://download.pytorch.org/whl/cu128
  cache_dir:
    description:
      - Where compiled locks are kept on the controller. In an ephemeral execution environment (AWX, AAP) put it on
        storage that outlives the job, or every job compiles the lock again (docs/awx.md).
      - An empty value (the training_venv role's default) leaves the configured one, from the environment or
        ansible.cfg, else the default.
    type: path
    default: ~/.cache/pve-gpu-recover/locks
    env:
      - name: PVE_GPU_RECOVER_LOCK_CACHE_DIR
        version_added: "1.1.0"
    ini:
      - section: pve_gpu_recover
        key: lock_cache_dir
        version_added: "1.1.0"
  uv:
    description: uv on the controller.
    type: str
    default: uv
"""

EXAMPLES = r"""
- name: Show the lock a requirements list compiles to
  ansible.builtin.debug:
    msg: "{{ lookup('pve_gpu.recover.uv_lock', ['torch==2.11.0+cu128', 'transformers'], python_version='3.11') }}"
"""

RETURN = r"""
_raw:
  description: The lock's text (one element).
  type: list
  elements: str
"""

import hashlib
import json
import os
import subprocess
import tempfile

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase


def compile_argv(uv, options, output):
    """The ``uv pip compile`` argv for ``options`` (pure; the requirements go on stdin)."""
    return [
        uv,
        "pip",
        "compile",
        "--quiet",
        "--generate-hashes",
        "--emit-index-url",
        "--emit-index-annotation",  # `# from URL` under each pin: where torch comes from is part of the lock
        "--python-version",
        options["python_version"],
        "--python-platform",
        options["python_platform"],
        "--index-url",
        options["index_url"],
        "--extra-index-url",
        options["torch_index_url"],
        "--index-strategy",
        "first-index",
        "--output-file",
        output,
        "-",
    ]


def cache_key(requirements, options):
    """One file name per requirements set and options: ``<sha256 of both>.lock``."""
    data = json.dumps({"requirements": list(requirements), "options": options}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:24] + ".lock"


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        # An empty cache_dir (the training_venv role's default) is no choice: the environment's or ansible.cfg's
        # applies, which is how an execution environment points every job at persistent storage.
        direct = {key: value for key, value in kwargs.items() if not (key == "cache_dir" and not value)}
        self.set_options(var_options=variables, direct=direct)
        # lookup('pve_gpu.recover.uv_lock', ['a', 'b']) passes the list as one term; lookup('pve_gpu.recover.uv_lock',
        # 'a', 'b') as several.
        flat = [item for term in terms for item in (term if isinstance(term, list) else [term])]
        requirements = [str(item).strip() for item in flat if str(item).strip()]
        if not requirements:
            raise AnsibleError("uv_lock: no requirements given")
        options = {k: self.get_option(k) for k in ("python_version", "python_platform", "index_url", "torch_index_url")}
        cache_dir = os.path.expanduser(self.get_option("cache_dir"))
        path = os.path.join(cache_dir, cache_key(requirements, options))
        if not os.path.exists(path):
            os.makedirs(cache_dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".partial", delete=False) as handle:
                partial = handle.name
            try:
                done = subprocess.run(
                    compile_argv(self.get_option("uv"), options, partial),
                    input="\n".join(requirements) + "\n",
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as error:
                os.unlink(partial)
                raise AnsibleError(f"uv_lock: cannot run uv pip compile: {error}") from None
            if done.returncode != 0:
                os.unlink(partial)
                raise AnsibleError(
                    f"uv_lock: uv pip compile failed for {requirements} (exit {done.returncode}): "
                    f"{done.stderr.strip()[-1500:]}"
                )
            os.replace(partial, path)  # a reader never sees half a lock
        with open(path, encoding="utf-8") as handle:
            return [handle.read()]
