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
  - A cached lock is used only when nobody else could have written it - I(cache_dir) reached from C(/) through no
    symbolic link, each directory above it root's or this user's and writable by nobody else (or sticky), the
    directory itself this user's with mode 0700, the file this user's regular file writable by nobody else - and
    when its first line names its key and the sha256 of the rest, which must match. Anything else is compiled
    again, with a warning naming what was found; a directory that cannot be trusted is not written to either.
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
    description:
      - uv on the controller. A name without C(/) is looked for first beside the Python that runs Ansible (a
        venv's C(bin), so C(.venv/bin/ansible-playbook) finds C(.venv/bin/uv) without an activated venv), then
        on C(PATH).
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
import re
import shutil
import subprocess
import sys
import tempfile

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase
from ansible.utils.display import Display
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct.act import redact
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import commands as venv_commands
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import network
from ansible_collections.pve_gpu.recover.plugins.plugin_utils import private_dir

display = Display()

TLS_HINT = (
    "the controller does not trust the TLS certificate of the index or of a proxy on the way: give its CA as "
    "SSL_CERT_FILE in training_venv_compile_environment, or set training_venv_system_certs: true when the "
    "controller's system store trusts it"
)
_UV_VERSIONS = {}  # (uv's path, mtime, size) -> its `uv --version`: asked once per controller process
# A cached lock's first line: its key and the sha256 of the rest (the lock as uv wrote it).
ENTRY_HEADER = re.compile(r"# pve-gpu-recover uv_lock ([0-9a-f]{24}) sha256:([0-9a-f]{64})\n")


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


def find_uv(uv, python=None, path=None):
    """The uv to run for the option ``uv``: a path as given; a name beside ``python`` (the Python that runs Ansible,
    ``sys.executable``: ``.venv/bin/ansible-playbook`` run without an activated venv finds ``.venv/bin/uv``), else
    on ``path`` (``$PATH``). AnsibleError naming both places when it is in neither."""
    if "/" in uv:
        if os.path.isfile(uv) and os.access(uv, os.X_OK):
            return uv
        raise AnsibleError(f"uv_lock: cannot run {uv}: no such executable on the controller; install uv there")
    here = os.path.dirname(python or sys.executable)
    beside = os.path.join(here, uv)
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(uv, path=path)
    if found:
        return found
    raise AnsibleError(
        f"uv_lock: cannot run {uv}: it is not found on the controller, neither beside the Python that runs Ansible "
        f"({here}) nor on PATH; install uv there (`make setup` puts it in .venv/bin) or set its path"
    )


def uv_version(uv, env=None):
    """``uv --version`` of ``uv`` (a path: find_uv) (``uv 0.13.9 (x86_64-unknown-linux-gnu)``), asked once per
    process and file."""
    try:
        info = os.stat(uv)
    except OSError:
        raise AnsibleError(f"uv_lock: cannot run {uv}: it is not found on the controller; install uv there") from None
    key = (os.path.realpath(uv), info.st_mtime_ns, info.st_size)
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
    env.update(venv_commands.network_env(settings))
    if netrc_path:
        env["NETRC"] = netrc_path
    return env


def entry_text(key, lock):
    """A cache file's text: ENTRY_HEADER (``key``, the sha256 of ``lock``), then ``lock`` as uv wrote it (pure)."""
    return f"# pve-gpu-recover uv_lock {key} sha256:{hashlib.sha256(lock.encode()).hexdigest()}\n{lock}"


def entry_lock(key, raw):
    """The lock a cache file's bytes ``raw`` hold for ``key``; private_dir.Untrusted when they are not what
    entry_text wrote for that key (another key's lock, a changed lock, no header: never used) (pure)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise private_dir.Untrusted("it is not UTF-8 text") from None
    header = ENTRY_HEADER.match(text)
    if header is None:
        raise private_dir.Untrusted("its first line does not name its key and the sha256 of the lock")
    lock = text[header.end() :]
    if header[1] != key:
        raise private_dir.Untrusted(f"it names the key {header[1]}, not its own ({key})")
    if hashlib.sha256(lock.encode()).hexdigest() != header[2]:
        raise private_dir.Untrusted("its lock does not match the sha256 its first line names (changed since)")
    return lock


def open_cache(cache_dir):
    """The cache directory's descriptor, or None (with a warning) when someone else could write there."""
    try:
        return private_dir.open_private_dir(cache_dir)
    except (private_dir.Untrusted, OSError) as why:
        display.warning(
            f"uv_lock: the lock cache {cache_dir} is not used ({why}): the lock is compiled and not kept; make it a "
            "directory of your own with mode 0700 reached through no symbolic link, or set "
            "training_venv_lock_cache_dir (PVE_GPU_RECOVER_LOCK_CACHE_DIR) to one"
        )
        return None


def cached_lock(dir_fd, cache_dir, name):
    """The lock kept as ``name``, or None (none kept, or one that cannot be trusted: with a warning)."""
    try:
        raw = private_dir.read_private(dir_fd, name)
        return None if raw is None else entry_lock(name.removesuffix(".lock"), raw)
    except (private_dir.Untrusted, OSError) as why:
        display.warning(f"uv_lock: the cached lock {os.path.join(cache_dir, name)} is ignored ({why}); compiling again")
        return None


def failure_message(requirements, rc, stderr, secrets):
    """What a failed ``uv pip compile`` says: the cause and the fix on the first line (a TLS failure names the
    certificate and the settings that fix it), then uv's own last lines; the secrets masked (pure)."""
    line = redact(venv_commands.failure_line(stderr), secrets)
    tls = venv_commands.TLS_FAILURE.search(stderr or "")
    if tls:
        said = line if tls.group(0) in line else f"{line} ({tls.group(0)})"
        first = f"uv_lock: {TLS_HINT} (uv pip compile for {requirements}: {said})"
    else:
        first = f"uv_lock: uv pip compile failed for {requirements} (exit {rc}): {line}"
    return f"{first}\n{redact(stderr.strip()[-1500:], secrets)}"


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
        uv = find_uv(self.get_option("uv"))
        options["uv_version"] = uv_version(uv, compile_env(settings))
        cache_dir = os.path.abspath(os.path.expanduser(self.get_option("cache_dir")))
        name = cache_key(requirements, options)
        dir_fd = open_cache(cache_dir)
        try:
            lock = None if dir_fd is None else cached_lock(dir_fd, cache_dir, name)
            if lock is None:
                lock = self.compile(uv, requirements, options, settings)
                if dir_fd is not None:
                    private_dir.write_private(dir_fd, name, entry_text(name.removesuffix(".lock"), lock).encode())
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        return [lock]

    @staticmethod
    def compile(uv, requirements, options, settings):
        """The lock's text, compiled in a private temporary directory (mode 0700, removed after) that also holds
        the credentials' netrc file."""
        secrets = network.secrets_of(settings)
        private = tempfile.mkdtemp(prefix="pve-gpu-recover-uv-lock-")  # mode 0700
        try:
            netrc_path = None
            if settings["index_credentials"]:
                netrc_path = os.path.join(private, "netrc")
                with open(os.open(netrc_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as netrc:
                    netrc.write(network.netrc_text(settings["index_credentials"]))
            output = os.path.join(private, "lock.txt")
            try:
                done = subprocess.run(
                    compile_argv(uv, options, output),
                    input="\n".join(requirements) + "\n",
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=False,
                    env=compile_env(settings, netrc_path),
                )
            except (OSError, subprocess.TimeoutExpired) as error:
                raise AnsibleError(f"uv_lock: cannot run uv pip compile: {redact(str(error), secrets)}") from None
            if done.returncode != 0:
                raise AnsibleError(failure_message(requirements, done.returncode, done.stderr, secrets))
            with open(output, encoding="utf-8") as handle:
                return handle.read()
        finally:
            shutil.rmtree(private, ignore_errors=True)
