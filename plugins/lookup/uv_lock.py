# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
name: uv_lock
short_description: A hashed lock compiled on the controller from a short requirements list with uv pip compile
description:
  - Runs C(uv pip compile --generate-hashes) on the controller for the target's Python and platform, with torch's own
    index as an extra index that uv prefers (C(--index-strategy first-index)), so no other index can supply torch.
  - The lock is cached under I(cache_dir) by a hash of the requirements, every option that shapes the lock and the
    C(uv --version) of I(uv), so a run compiles (and reaches the indexes) only when one of them changed (another uv
    may resolve differently); every later run reads the cached file. The network options (I(environment),
    I(system_certs), I(index_credentials)) only say how the indexes are reached and are not part of the key.
  - Behind a proxy or a private CA, I(environment) gives C(uv pip compile) its variables (C(HTTPS_PROXY),
    C(SSL_CERT_FILE), ...), I(system_certs) makes uv trust the system's certificate store, and I(index_credentials)
    go into a netrc file (mode 0600, in a private temporary directory, removed after the run) that C(NETRC)
    names. A password never goes into an argv, the lock, the cache key or an error message (uv's output is masked).
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
  environment:
    description: Environment variables of C(uv pip compile) beside the controller's own (its proxy, C(SSL_CERT_FILE)).
    type: dict
    default: {}
  system_certs:
    description: uv trusts the system's certificate store (C(UV_SYSTEM_CERTS); C(UV_NATIVE_TLS) for uv before 0.11).
    type: bool
    default: false
  index_credentials:
    description: Credentials of the indexes, C([{host, username, password}]), given to uv through a private netrc file.
    type: list
    elements: dict
    default: []
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
import shutil
import subprocess
import tempfile

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_ct_act import redact
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import network
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script as venv_script

TLS_HINT = (
    "the controller does not trust the TLS certificate of the index or of a proxy on the way: give its CA as "
    "SSL_CERT_FILE in training_venv_compile_environment, or set training_venv_system_certs: true when the "
    "controller's system store trusts it"
)
_UV_VERSIONS = {}  # (uv's path, mtime, size) -> its `uv --version`: asked once per controller process


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
    """One file name per requirements set and options (``uv_version`` among them: another uv may resolve
    differently): ``<sha256 of both>.lock``."""
    data = json.dumps({"requirements": list(requirements), "options": options}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:24] + ".lock"


def uv_version(uv, env=None):
    """``uv --version`` of ``uv`` (``uv 0.13.9 (x86_64-unknown-linux-gnu)``), asked once per process and file."""
    found = shutil.which(uv) if "/" not in uv else uv
    try:
        info = os.stat(found or uv)
    except OSError:
        raise AnsibleError(f"uv_lock: cannot run {uv}: it is not found on the controller; install uv there") from None
    key = (os.path.realpath(found or uv), info.st_mtime_ns, info.st_size)
    if key not in _UV_VERSIONS:
        try:
            done = subprocess.run([uv, "--version"], capture_output=True, text=True, timeout=60, check=False, env=env)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise AnsibleError(f"uv_lock: cannot run `{uv} --version`: {error}") from None
        if done.returncode != 0 or not done.stdout.strip():
            raise AnsibleError(f"uv_lock: `{uv} --version` failed (exit {done.returncode}): {done.stderr.strip()}")
        _UV_VERSIONS[key] = done.stdout.strip()
    return _UV_VERSIONS[key]


def compile_env(settings, netrc_path=None):
    """The environment of ``uv pip compile``: the controller's, plus the network settings (``environment``,
    ``system_certs``) and ``NETRC`` when credentials were written to ``netrc_path``."""
    env = dict(os.environ)
    env.update(venv_script.network_env(settings))
    if netrc_path:
        env["NETRC"] = netrc_path
    return env


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
        settings = {k: self.get_option(k) for k in ("environment", "system_certs", "index_credentials")}
        wrong = network.network_problem(settings)
        if wrong:
            raise AnsibleError(f"uv_lock: {wrong} (training_venv_compile_environment, training_venv_index_credentials)")
        uv = self.get_option("uv")
        options["uv_version"] = uv_version(uv, compile_env(settings))
        cache_dir = os.path.expanduser(self.get_option("cache_dir"))
        path = os.path.join(cache_dir, cache_key(requirements, options))
        if not os.path.exists(path):
            self.compile(uv, requirements, options, settings, path)
        with open(path, encoding="utf-8") as handle:
            return [handle.read()]

    @staticmethod
    def compile(uv, requirements, options, settings, path):
        """Compile into ``path`` through a temporary file (a reader never sees half a lock); the credentials go to a
        netrc file in a private temporary directory, removed after."""
        cache_dir = os.path.dirname(path)
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".partial", delete=False) as handle:
            partial = handle.name
        secrets = network.secrets_of(settings)
        private = tempfile.mkdtemp(prefix="pve-gpu-recover-uv-lock-")  # mode 0700
        try:
            netrc_path = None
            if settings["index_credentials"]:
                netrc_path = os.path.join(private, "netrc")
                with open(os.open(netrc_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as netrc:
                    netrc.write(network.netrc_text(settings["index_credentials"]))
            done = subprocess.run(
                compile_argv(uv, options, partial),
                input="\n".join(requirements) + "\n",
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
                env=compile_env(settings, netrc_path),
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            os.unlink(partial)
            raise AnsibleError(f"uv_lock: cannot run uv pip compile: {redact(str(error), secrets)}") from None
        finally:
            shutil.rmtree(private, ignore_errors=True)
        if done.returncode != 0:
            os.unlink(partial)
            said = redact(done.stderr.strip()[-1500:], secrets)
            hint = f"; {TLS_HINT}" if venv_script.TLS_FAILURE.search(done.stderr) else ""
            raise AnsibleError(
                f"uv_lock: uv pip compile failed for {requirements} (exit {done.returncode}): {said}{hint}"
            )
        os.replace(partial, path)
