#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: training_venv
short_description: Make a target's training venv exactly the pinned set - rebuilt beside the old one, swapped atomically
description:
  - Reads the venv at I(path) inside the target (its files only, never C(import torch)) and compares it with the
    lock, exact version strings included (C(2.11.0+cu128) is not C(2.11.0+cu130)). It reads again even when the
    fact pass of M(pve_gpu.recover.target_facts) just did, since those facts can be seconds old.
  - When the venv is anything but the lock (missing, polluted by other packages, another torch build, another
    python minor, a broken record), it builds a new venv from the lock BESIDE the old one, checks it, and swaps
    it in; all of it in ONE C(pct exec) (a build script sent to the target's python on stdin).
  - The venv is the lock only when it imports nothing else - C(include-system-site-packages = true) in its
    C(pyvenv.cfg), a C(.pth) file or a C(sitecustomize)/C(usercustomize) module in site-packages that no locked
    distribution's RECORD lists (setuptools' C(distutils-precedence.pth) is fine while its tooling is ignored), or
    an importable top-level entry no RECORD (an C(.egg-info)'s C(top_level.txt)) owns is drift too, and rebuilt.
  - Temporary files are never written under a fixed name in a directory others may write - C(mkstemp) beside the
    venv, renamed over the target name; the lock the installer reads lies in a root-only C(mkdtemp) directory.
  - Layout, since a venv embeds its own path and cannot be moved. Each version is built at C(<path>.<stamp>)
    (UTC, C(20261203T101500Z)) and never moved. I(path) becomes a symlink to the current version, swapped by
    renaming a new symlink over it (rename(2), atomic, so a job sees the old venv or the new one, never half of either).
    The lock a version was built from is kept as C(<path>.<stamp>.lock.txt).
  - While a version is built it holds a marker file, C(.pve-gpu-recover-building), removed only once the check
    passed. A marked version that is not the current one is what an interrupted run left; the next run removes
    it. Nothing else is ever removed as a leftover.
  - The build uses uv (I(uv)) - C(uv venv) then C(uv pip sync --require-hashes) of the lock - and falls back to
    C(python3 -m venv) plus C(pip install --no-deps --require-hashes) when uv is not found. The indexes are only
    the lock's C(--index-url)/C(--extra-index-url) lines; index settings of the target's environment and uv/pip
    configuration files are ignored.
  - Before the swap the new venv's python must run (and be the expected minor) and its installed set must be the
    lock exactly; otherwise the new directory is removed and I(path) is left as it was. After the swap the venv is
    read again through I(path), in the same C(pct exec), by the fact pass's reader and compared by the same
    rules; still out of spec fails the task.
  - The old venv is never deleted by the swap. A previous version behind the symlink stays where it is (and still
    works). A real directory at I(path), a venv made before this module, is renamed to C(<path>.<stamp>-previous);
    it works again only once renamed back, since a venv embeds its path. Either way its freeze
    (C(name==version) lines, torch's exact build from C(torch/version.py)) is saved to C(<old dir>.freeze.txt)
    first.
  - Unattended (I(unattended), the scheduled drift corrector) a venv that needs a rebuild is not swapped while a
    live process of the target runs from it - its C(/proc/<pid>/exe), the argv[0] of a Python interpreter, or a file
    it maps lies under I(path) or the version it points to. Those processes are read on the node (the target's
    processes by their cgroup, C(/lxc/<vmid>/)), only when a rebuild is due, before anything is built; and once
    more inside the target just before the swap, in the build's own C(pct exec), for a job started during the
    build (the new version is then removed). Either way the module does not fail - it builds nothing (or swaps
    nothing), returns C(changed=false) and names the processes in I(needs_window).
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - pve_gpu.recover.pve_target
  - pve_gpu.recover.pve_target.python
attributes:
  check_mode:
    support: full
    details: Reads and compares exactly as a real run does and changes nothing; C(changed) is true exactly when a
      real run would build.
  diff_mode:
    support: full
    details: Before is the venv's freeze (sorted C(name==version) lines; pip, setuptools and wheel left out under
      I(tooling=ignore) when the lock does not pin them), after is the lock's pins.
  platform:
    platforms: posix
options:
  state:
    description:
      - C(present) makes the venv at I(path) exactly the lock.
    type: str
    choices: [present]
    default: present
  path:
    description:
      - Where the venv lives inside the target. After the first build it is a symlink to C(<path>.<stamp>).
    type: path
    default: /opt/venvs/train
  lock:
    description:
      - The lock's TEXT (not a file name), as C(uv pip compile --generate-hashes) writes it. Every line must be an
        exact C(name==version) pin with hashes; its C(--index-url)/C(--extra-index-url) lines are the only indexes.
      - Or a PEP 751 C(pylock.toml) (C(uv pip compile --format pylock.toml)), read into the same pins; it is
        installed by uv only (C(uv pip sync pylock.toml)), so a target without uv needs I(uv_wheel). Reading it
        needs Python 3.11 (C(tomllib)) on the node.
      - A URL with credentials in the lock (C(https://user:token@host/simple)) is refused; give them as
        I(index_credentials).
      - The roles read it on the controller, C(lookup('file', training_venv_lock_file)).
      - Exactly one of I(lock) and I(lock_from_repo).
    type: str
  lock_from_repo:
    description:
      - The lock committed in the training repository instead of I(lock), read inside the target at the pinned
        commit (C(git cat-file) from the object database - the work tree, local changes and HEAD do not matter),
        so the code and its venv move together. git runs as the training code step runs it (none of the
        repository's config, no hook, no filter).
      - A commit the repository does not have yet is compared later in check mode (the training code step fetches
        it first); a real run fails then, as it does when the path is not in that commit.
      - The role fills it from C(training_code_path), C(training_code_commit), C(training_code_git) and
        C(training_venv_lock_from_repo).
    type: dict
    suboptions:
      repo:
        description: The repository's work tree inside the target (C(training_code_path)).
        type: path
        required: true
      commit:
        description: The pinned commit, its full sha (C(training_code_commit)).
        type: str
        required: true
      path:
        description: The lock's path relative to the top of the repository (C(requirements/train.lock)).
        type: str
        required: true
      git:
        description: git inside the target.
        type: str
        default: git
  python_version:
    description:
      - Python minor the venv must have (C(3.11)); the build asks uv for it, or runs C(python3.11 -m venv).
      - Unset, the C(--python-version) in the lock's uv header is used; without one, the one of I(python) in the
        target.
    type: str
  tooling:
    description:
      - C(ignore) leaves pip, setuptools and wheel out of the comparison when the lock does not pin them
        (C(python3 -m venv) seeds them, uv does not).
      - C(exact) counts them as extra; a pip-built venv then has them removed after the install.
    type: str
    choices: [ignore, exact]
    default: ignore
  uv:
    description:
      - uv inside the target, a path or a name looked up on the PATH of a non-login root shell
        (C(pct exec --keep-env 0)), where C(~/.local/bin) is not.
      - When it cannot be run, the build falls back to C(python3 -m venv) and pip; when that cannot work either
        (no C(python3-venv)), the task fails naming both.
    type: str
    default: uv
  uv_wheel:
    description:
      - PyPI's uv wheel (C(uv-<version>-py3-none-manylinux_*_x86_64.whl)) on the node. When a build is due, its
        C(uv) executable is installed into the target at C(/usr/local/lib/pve-gpu-recover/uv-<version>/uv) (kept
        when already there) and used instead of I(uv). Never a C(curl | sh).
      - The role copies the wheel from the controller to the node only when a build is due.
    type: path
  keep:
    description:
      - How many finished versions (C(<path>.<stamp>)) stay, the current one counted (C(1) keeps only the current
        one). Older ones are removed with their lock file; their freeze file stays. Each one removed is a line of
        I(changes) (C(remove old venv version <dir> ...)), in check mode too; a venv in spec with versions beyond
        I(keep) is a change of its own (nothing is built, the old versions are removed).
      - A version that a live process of the target uses (its executable, its argv[0], a mapped file or its working
        directory lies in it) is never removed, nor the current one; the result names it in I(retention_skipped).
      - C(<path>.<stamp>-previous) directories are never removed. Unset, nothing is removed in an attended run, and
        I(unattended_keep) versions stay in an unattended one.
    type: int
  unattended_keep:
    description:
      - I(keep) of an unattended run (I(unattended)) when I(keep) is unset - the current version and the 2 newest
        old ones by default, so that the scheduled drift corrector never fills the disk with a venv (GBs with CUDA
        torch) per rebuild.
    type: int
    default: 3
  build_timeout:
    description:
      - Seconds the build may take; a command still running then is killed and what was built is removed.
        The C(pct exec) gets 60 more seconds for that cleanup.
    type: int
    default: 1800
  unattended:
    description:
      - Never swap the venv under a live process of the target; name the processes in I(needs_window) instead
        (the scheduled drift corrector). The role sets it from C(recover_unattended).
      - Attended (the default) the venv is rebuilt and swapped whatever runs from it.
    type: bool
    default: false
  ending_pids:
    description:
      - Pids (as the target numbers them) that the GPU step ends before this one; they do not count as running from
        the venv. Used only in check mode (the GPU step ended nothing then), as the fact pass does; a real run sees
        them gone. The role passes the fact pass's C(ending_pids).
    type: list
    elements: int
    default: []
  environment:
    description:
      - Environment variables of the build's commands (uv, pip) only, e.g. C(HTTPS_PROXY), C(HTTP_PROXY),
        C(NO_PROXY), C(UV_HTTP_TIMEOUT). C(pct exec --keep-env 0) passes none of the node's.
      - Not secret - they are shown in the invocation. A proxy URL with a password goes in I(secret_environment).
      - Index settings (C(UV_INDEX_URL), C(PIP_INDEX_URL), ...) and what the build sets itself (C(UV_NO_CONFIG),
        C(LC_ALL), ...) are refused; only the lock's indexes count.
    type: dict
    default: {}
  secret_environment:
    description:
      - Like I(environment), for values that are secrets (C(HTTPS_PROXY=http://user:password@proxy:3128),
        C(UV_INDEX_<NAME>_PASSWORD)). C(no_log) - Ansible masks every value in the result and the log, and the
        build script masks them in what it answers.
    type: dict
    default: {}
  ca_bundle:
    description:
      - A PEM file inside the target holding the CA(s) the build must trust - a private index's, or a
        TLS-intercepting proxy's. Given to uv (C(SSL_CERT_FILE)) and pip (C(REQUESTS_CA_BUNDLE), C(PIP_CERT)).
      - It replaces uv's and pip's roots for the build; a build that also reaches public hosts directly needs a
        bundle with the public roots too (C(cat /etc/ssl/certs/ca-certificates.crt corp-ca.pem)).
    type: path
  system_certs:
    description:
      - uv trusts the target's system certificate store instead of its own roots (C(UV_SYSTEM_CERTS), uv 0.11+;
        C(UV_NATIVE_TLS) for older uv); pip on Debian and pip 24.2+ use the system store already.
    type: bool
    default: false
  index_credentials:
    description:
      - Credentials of the lock's indexes, written to a netrc file (mode 0600) in the build's private directory that
        C(NETRC) names for uv and pip; removed with it. Never in an argv, the lock, the result or the log (the
        password is C(no_log)).
    type: list
    elements: dict
    default: []
    suboptions:
      host:
        description: The index's host name (C(pypi.internal)), as netrc matches it.
        type: str
        required: true
      username:
        description: The user name.
        type: str
        required: true
      password:
        description: The password or token.
        type: str
        required: true
requirements:
  - In the target, Python 3.9+ and either uv or the C(venv) module with C(ensurepip) (Debian C(python3-venv)).
  - Network from the target to the lock's indexes (through the proxy of I(environment), trusting I(ca_bundle)).
seealso:
  - module: pve_gpu.recover.target_facts
notes:
  - A job started through I(path) (C(<path>/bin/python)) reads files through the symlink; after a swap, what it
    imports later comes from the new version. Console scripts of a version (C(<path>/bin/torchrun)) name that
    version's own python and stay on it.
  - Retention (I(keep), I(unattended_keep)) is predicted by the fact pass and in check mode (C(remove old venv
    version ...) lines in I(changes)); a venv in spec with versions beyond it is pruned without a build. A converged
    run within I(keep) makes no change at all.
  - Run as an async job (C(async) with C(poll), as the role runs a real rebuild), the module puts the build's
    progress (the phase, the last line uv or pip printed, the elapsed time) into the job's status file while it
    runs; each of Ansible's polls shows it (plugins/module_utils/pve_progress.py).
"""

EXAMPLES = r"""
- name: Make CT 200's training venv exactly the pinned set
  pve_gpu.recover.training_venv:
    vmid: 200
    lock: "{{ lookup('file', 'files/lock_cu128.txt') }}"
    python_version: "3.11"
  delegate_to: pve1

- name: Use the uv installed in root's home, keep the current and one older version
  pve_gpu.recover.training_venv:
    vmid: 200
    lock: "{{ lookup('file', 'files/lock_cu128.txt') }}"
    uv: /root/.local/bin/uv
    keep: 2
  delegate_to: pve1

- name: Build behind a TLS-intercepting proxy whose CA is in a file inside the CT, from a private index
  pve_gpu.recover.training_venv:
    vmid: 200
    lock: "{{ lookup('file', 'files/lock_cu128.txt') }}"
    environment:
      HTTPS_PROXY: http://proxy.corp:3128
      NO_PROXY: pypi.internal
    ca_bundle: /usr/local/share/ca-certificates/corp-ca.crt
    index_credentials:
      - host: pypi.internal
        username: ci
        password: "{{ vault_pypi_internal_token }}"
  delegate_to: pve1

- name: Take the lock committed in the training repository at the pinned commit
  pve_gpu.recover.training_venv:
    vmid: 200
    lock_from_repo:
      repo: /srv/train
      commit: 0123456789abcdef0123456789abcdef01234567
      path: requirements/train.lock
  delegate_to: pve1

- name: Only report what a rebuild would change (run with --check --diff)
  pve_gpu.recover.training_venv:
    vmid: 200
    lock: "{{ lookup('file', 'files/lock_cu128.txt') }}"
  delegate_to: pve1
  check_mode: true
  register: venv_drift
"""

RETURN = r"""
venv:
  description:
    - The venv's path, I(path) (after a build, the symlink to I(current)).
    - Not returned as C(path) - Ansible would add the owner, mode and size of a file of that name on the node,
      which is not the target's venv.
  returned: always
  type: str
  sample: /opt/venvs/train
current:
  description: The version directory this run built and swapped in; null when nothing was built.
  returned: always
  type: str
  sample: /opt/venvs/train.20261203T101500Z
previous:
  description:
    - The venv that was at I(path) before the swap; null when nothing was built or there was none.
    - C(path) where it is now, C(freeze) its freeze file, C(moved) whether it was renamed (a venv made before this
      module, now C(<path>.<stamp>-previous)), C(note) how to go back.
  returned: always
  type: dict
  sample:
    path: /opt/venvs/train.20261120T081500Z
    freeze: /opt/venvs/train.20261120T081500Z.freeze.txt
    moved: false
    note: "unchanged in place; to go back: ln -sfn train.20261120T081500Z /opt/venvs/train"
builder:
  description:
    - What built I(current) - C(name) (C(uv) or C(venv+pip)), C(path), C(version) and, for C(venv+pip),
      C(fallback) (why uv was not used); null when nothing was built.
  returned: always
  type: dict
  sample: {name: uv, path: /usr/local/bin/uv, version: 0.13.9}
lock_file:
  description: The copy of the lock that I(current) was built from; null when nothing was built.
  returned: always
  type: str
  sample: /opt/venvs/train.20261203T101500Z.lock.txt
cleaned:
  description: Unfinished versions left by interrupted runs, removed before this build.
  returned: always
  type: list
  elements: str
removed:
  description: Older versions removed by retention (I(keep), or I(unattended_keep) in an unattended run).
  returned: always
  type: list
  elements: str
needs_window:
  description:
    - Unattended only - one sentence when a rebuild is due but a live process runs from the venv (found before the
      build, or just before the swap); nothing was swapped and the module did not fail. Empty otherwise.
  returned: always
  type: list
  elements: str
  sample:
    - "CT 200 on pve1: the venv at /opt/venvs/train needs a rebuild (torch 2.11.0+cu130 -> 2.11.0+cu128) but pid 516
      (python3, pid 41 inside: 'python3 train.py'; argv0 /opt/venvs/train/bin/python) runs from it: it is not swapped
      under a live process; rebuilding it needs a window (stop the job, or run recover.yml without
      recover_unattended)"
in_use:
  description:
    - Unattended, with a rebuild due - the target's processes running from the venv, each with C(pid) (on the node;
      inside the target when found just before the swap), C(ns_pid), C(name), C(command), C(how) (C(exe),
      C(argv0), C(mapped)) and C(file); C(how) null with C(error) when its files could not be read in time. A
      process the build script found just before the swap has C(pid) and C(ns_pid) as the target numbers it,
      C(name) and C(inside) (true).
  returned: always
  type: list
  elements: dict
retention_skipped:
  description: Versions retention would have removed but kept, each with C(path), C(pids) and C(reason).
  returned: always
  type: list
  elements: dict
  sample: [{path: /opt/venvs/train.20261120T081500Z, pids: [4711], reason: in use by pid 4711}]
installed:
  description: The venv's distributions and their exact versions (after a build, the new venv's).
  returned: always
  type: dict
  sample: {torch: 2.11.0+cu128, six: 1.17.0}
missing:
  description: Locked distributions not installed, each with C(name) and C(locked) (empty after a build).
  returned: always
  type: list
  elements: dict
extra:
  description: Installed distributions the lock does not pin, each with C(name) and C(installed).
  returned: always
  type: list
  elements: dict
wrong:
  description: Distributions installed at another version than locked, each with C(name), C(locked), C(installed).
  returned: always
  type: list
  elements: dict
  sample: [{name: torch, locked: 2.11.0+cu128, installed: 2.11.0+cu130}]
changes:
  description: What the build changes (or, in check mode, would change), one line each; empty when converged.
  returned: always
  type: list
  elements: str
  sample: ["torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)", "remove sglang 0.5.4 (not in the lock)"]
seconds:
  description: Seconds the module took.
  returned: always
  type: float
error:
  description:
    - On failure, what kind of failure it was, stable for code. From the build - C(index_unreachable),
      C(not_on_index), C(hash_mismatch), C(no_space), C(timeout), C(no_builder) (no uv and no working
      C(-m venv)), C(venv_failed), C(python) (the python minor is not in the target), C(not_found), C(check)
      (the new venv was not the lock), C(layout) (I(path) is a file), C(os_error), C(install_failed), C(tls)
      (the target does not trust the index's or a proxy's certificate - I(ca_bundle), I(system_certs)),
      C(index_auth) (the index wants other credentials - I(index_credentials)), C(ca_bundle) (no such file).
      From the module - C(invalid), C(lock) (the lock of I(lock_from_repo) cannot be read), C(problems) (the
      venv could not be read, or a user other than root could change it - a directory above it they own or may
      write, a symlink other than the step's own), C(verify) (still out of spec after the swap), and the
      target's (C(stopped), C(missing), C(probe), ...).
  returned: failure
  type: str
  sample: index_unreachable
cmd:
  description: On failure of a command, the argv that ran (the C(pct exec) wrapper included, or the build's command).
  returned: failure of a command
  type: list
  elements: str
rc:
  description: On failure of a command, its exit code.
  returned: failure of a command
  type: int
stdout_tail:
  description: On failure of a command, the last 20 lines of its stdout.
  returned: failure of a command that printed
  type: str
stderr_tail:
  description: On failure of a command, the last 20 lines of its stderr.
  returned: failure of a command that printed
  type: str
left_behind:
  description: On a failed build, a path of this build that could not be removed (null when everything was); a
    marked version is removed by the next run.
  returned: failure of the build
  type: str
"""

import re
import zipfile

from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_act_runner import (
    ActingStep,
    leftover,
    run_step_module,
    utc_stamp,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_target import (
    PYTHON_ARGUMENT_SPEC,
    TARGET_ARGUMENT_SPEC,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script as venv_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.compare import (
    TOOLING,
    ignored_tooling,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.facts import (
    NAME,
    SPEC,
    effective_keep,
    prune_line,
    window_message,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import (
    VenvError,
    expected_python,
    lock_format,
    parse_lock,
    resolve_lock,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.network import (
    network_payload,
    network_problem,
)

BUILD = "build"
# Where a uv from a wheel goes inside the target, one directory per version.
UV_HOME = "/usr/local/lib/pve-gpu-recover"
UV_IN_WHEEL = re.compile(r"uv-([0-9][^/]*)\.data/scripts/uv")
# The pct exec of a build gets this much more than build_timeout, so the script's own deadline fires first and
# it can still remove what it built and answer.
CLEANUP_GRACE = 60
ARGUMENT_SPEC = {
    **TARGET_ARGUMENT_SPEC,
    "state": {"type": "str", "choices": ["present"], "default": "present"},
    **SPEC,
    "uv": {"type": "str", "default": "uv"},
    "uv_wheel": {"type": "path"},
    "build_timeout": {"type": "int", "default": 1800},
    **PYTHON_ARGUMENT_SPEC,
    "ending_pids": {"type": "list", "elements": "int", "default": []},
    # The build's network (steps/training_venv/network.py): what reaches uv and pip, never the report or the log.
    "environment": {"type": "dict", "default": {}},
    "secret_environment": {"type": "dict", "default": {}, "no_log": True},
    "ca_bundle": {"type": "path"},
    "system_certs": {"type": "bool", "default": False},
    "index_credentials": {
        "type": "list",
        "elements": "dict",
        "default": [],
        "options": {
            "host": {"type": "str", "required": True},
            "username": {"type": "str", "required": True},
            "password": {"type": "str", "required": True, "no_log": True},
        },
    },
}
# What the build script answers on success, and the type of each key (its answer comes from inside the CT).
BUILT_KEYS = {"current": str, "builder": dict, "lock_file": str, "cleaned": list, "removed": list}
BUILT_KEYS.update({"retention_skipped": list, "previous": (dict, type(None))})


def python_option_problem(python):
    """Why ``python`` cannot be the CT's interpreter: before 2.0.0 this module's ``python`` was the venv's version
    (now ``python_version``), and a version given there must not be run as a command. ``""`` when it can."""
    if re.fullmatch(r"\d+\.\d+", python or ""):
        return (
            f"python is {python!r}, a version: python is the CT's interpreter (python3), and the venv's Python "
            f"version is python_version since 2.0.0 (role variable training_venv_python_version)"
        )
    return ""


def build_payload(spec, params, stamp, prune_only=False):
    """What the build script needs, the lock's meaning included (the script parses nothing of ours).

    ``build_payload({"path": "/opt/venvs/train", "lock": "six==1.17.0 --hash=sha256:ab\\n", "python_version": None,
    "tooling": "ignore", "keep": None}, {"uv": "uv", "build_timeout": 1800}, "20261203T101500Z")`` ->
    ``{"path": "/opt/venvs/train", "lock": ..., "python": None, "stamp": "20261203T101500Z", "uv": "uv", "keep":
    None, "timeout": 1800, "expected": {"six": "1.17.0"}, "ignore": ["pip", "setuptools", "wheel"],
    "drop_tooling": [], "prune_only": False}``.
    """
    lock = parse_lock(spec["lock"])
    locked = lock["distributions"]
    exact = spec["tooling"] == "exact"
    payload = {
        "path": spec["path"],
        "lock": spec["lock"],
        "python": expected_python(spec, lock),
        "stamp": stamp,
        "uv": params["uv"],
        "keep": effective_keep(spec),
        "timeout": params["build_timeout"],
        "expected": locked,
        "ignore": sorted(ignored_tooling(locked, spec["tooling"])),
        # `python3 -m venv` seeds pip/setuptools: under tooling=exact a pip build removes those the lock lacks.
        "drop_tooling": sorted(set(TOOLING) - set(locked)) if exact else [],
        "prune_only": prune_only,  # in spec: only old versions beyond keep to remove, nothing built
    } | ({"window_check": True} if spec.get("unattended") else {})
    payload |= {"lock_format": "pylock"} if lock_format(spec["lock"]) == "pylock" else {}
    return payload | network_payload(params)


def built_of(answer, path):
    """The build script's answer when it built and swapped; its structured error as a RecoverError otherwise."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return_text = answer.get("stderr_tail")
        raise VenvError(
            # The script's sentence quotes what uv or pip printed in the target: escaped, one line.
            f"building the venv failed ({printable(answer['error'], 40)}): {printable(answer.get('message'), 1000)}; "
            f"{path} was left as it was",
            kind=printable(answer["error"], 40),
            cmd=answer.get("cmd"),
            rc=answer.get("rc"),
            stderr=return_text if isinstance(return_text, str) else None,
            details={"cleaned": answer.get("cleaned") or [], "left_behind": answer.get("left_behind")},
        )
    if isinstance(answer, dict) and answer.get("pruned") is True:
        for key in ("removed", "retention_skipped"):
            if not isinstance(answer.get(key), list):
                raise VenvError(f"the build script answered no {key!r} in the expected shape", kind="probe")
        return answer
    if isinstance(answer, dict) and "needs_window" in answer:
        window = answer["needs_window"]
        users = window.get("users") if isinstance(window, dict) else None
        if not isinstance(users, list) or not all(isinstance(u, dict) and isinstance(u.get("pid"), int) for u in users):
            raise VenvError("the build script answered a needs_window of the wrong shape", kind="probe")
        return answer
    for key, kind in BUILT_KEYS.items():
        if not isinstance(answer, dict) or not isinstance(answer.get(key), kind):
            raise VenvError(f"the build script answered no {key!r} in the expected shape", kind="probe")
    return answer


def unproven(facts):
    """Why the venv is not the lock (one sentence), or ``""``: a venv that was just built must have no changes.

    Retention's lines do not count: a version a process started to use since is kept (``retention_skipped``)."""
    reasons = leftover(facts, ignore={prune_line(path, facts["keep"]) for path in facts["prune"]})
    if not reasons:
        return ""
    more = f" (and {len(reasons) - 5} more)" if len(reasons) > 5 else ""
    return f"the venv at {facts['path']} is still not the lock after the build: {'; '.join(reasons[:5])}{more}"


def swap_refused(before, built, label):
    """The result when the build script found a live process on the current venv just before the swap: nothing
    was swapped (the new version was removed), no change, the processes in ``needs_window``."""
    users = [
        {"pid": u["pid"], "ns_pid": u["pid"], "name": str(u.get("name")), "inside": True}
        for u in built["needs_window"]["users"]
    ]
    when = " (found when the new version was ready; that version was removed, nothing swapped)"
    sentence = window_message(label, before["path"], before["changes"], users, when)
    stays = before["diff"]["before"]
    return {
        **built_result(dict(before, in_use=users, needs_window=[sentence]), None, None),
        "changed": False,
        "changes": [],
        "diff": {"before": stays, "after": stays},
        "cleaned": built.get("cleaned") or [],
    }


def built_result(before, after, built):
    """What is installed from the last read (the first in check mode), what the build did."""
    facts = after or before
    built = built or {}
    return {
        "needs_window": before["needs_window"],
        "in_use": before["in_use"],
        "venv": before["path"],  # not "path": exit_json would add stats of the node's file of that name
        "current": built.get("current"),
        "previous": built.get("previous"),
        "builder": built.get("builder"),
        "lock_file": built.get("lock_file"),
        "cleaned": built.get("cleaned", []),
        "removed": built.get("removed", []),
        "retention_skipped": built.get("retention_skipped", []),
        "installed": facts["installed"],
        "missing": facts["missing"],
        "extra": facts["extra"],
        "wrong": facts["wrong"],
    }


def uv_from_wheel(wheel_path):
    """``(version, executable bytes)`` of PyPI's uv wheel, whose binary is ``uv-<version>.data/scripts/uv``."""
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            names = [n for n in wheel.namelist() if UV_IN_WHEEL.fullmatch(n)]
            if not names:
                raise VenvError(
                    f"{wheel_path} holds no uv-<version>.data/scripts/uv: give PyPI's uv wheel for this platform "
                    f"(uv-<version>-py3-none-manylinux_*_x86_64.whl)",
                    kind="uv_wheel",
                )
            return UV_IN_WHEEL.fullmatch(names[0]).group(1), wheel.read(names[0])
    except (OSError, zipfile.BadZipFile) as error:
        raise VenvError(f"cannot read the uv wheel {wheel_path}: {error}", kind="uv_wheel") from None


def install_uv(target, wheel_path):
    """Put the wheel's uv into the target at a versioned path (kept when already there); return that path.

    Never a ``curl | sh``: the binary comes from the wheel the controller handed to the node, over the same
    ``pct exec`` as everything else. The temporary file is mktemp's (O_EXCL, a name nobody can guess).
    """
    version, binary = uv_from_wheel(wheel_path)
    path = f"{UV_HOME}/uv-{version}/uv"
    script = (
        'set -e; [ -x "$1" ] && exit 0; mkdir -p "${1%/*}"; t=$(mktemp "$1.XXXXXX"); cat > "$t"; chmod 755 "$t"; '
        'mv -f "$t" "$1"'
    )
    target.run(["sh", "-c", script, "sh", path], stdin=binary)
    return path


class TrainingVenv(ActingStep):
    """Read the venv, and when it is not the lock: build a new version beside it, check it, swap it in, read again
    (or only remove old versions beyond keep)."""

    facts = venv_facts
    argument_spec = ARGUMENT_SPEC
    error = VenvError
    at_least = {"build_timeout": (1, "give the build at least 1 second")}
    progress = "starting the build"  # run as an async job (the role, for a build): followed as it runs

    def check_params(self, params):
        return python_option_problem(params.get("python")) or network_problem(params)

    def evaluate(self, run, answer, done=None):
        if done is None:
            # The lock's text: the option's, or the one the probe read in the training repository at the pinned
            # commit (the build and the re-read use it too).
            run.spec = resolve_lock(run.spec, answer, may_defer=run.check_mode)[0]
        return super().evaluate(run, answer, done)

    def act(self, run, before):
        """One pct exec: build and swap (in spec: only remove old versions beyond keep), then the reader part reads
        the venv again through the new symlink. ``after`` is None when the build script found a live process on the
        current venv just before the swap (unattended: ``built`` then holds ``needs_window``)."""
        rebuild = before["rebuild"]
        payload = build_payload(run.spec, run.params, utc_stamp(), prune_only=not rebuild)
        if run.params["uv_wheel"] and rebuild:
            payload["uv"] = install_uv(run.target, run.params["uv_wheel"])
        parts = run.act_and_reread(BUILD, venv_script, payload, run.params["build_timeout"] + CLEANUP_GRACE)
        built = built_of(run.part(parts, BUILD), run.spec["path"])
        if "needs_window" in built:
            return built, None
        return built, self.evaluate(run, run.part(parts, NAME), built)

    def prove(self, run, after, done):
        details = {key: done.get(key) for key in ("current", "previous", "builder", "lock_file")}
        details.update({key: after[key] for key in ("installed", "missing", "extra", "wrong")})
        return unproven(after), details

    def result(self, run, before, after, done):
        if done is not None and "needs_window" in done:
            return swap_refused(before, done, run.target.label)
        return built_result(before, after, done)


def main():
    run_step_module(TrainingVenv())


if __name__ == "__main__":
    main()
