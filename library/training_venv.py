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
    C(python3 -I -m venv --without-pip), C(-I -m ensurepip) and C(pip install --no-deps --require-hashes) when uv
    is not found. The indexes are only the lock's C(--index-url)/C(--extra-index-url) lines; index settings of the
    target's environment and uv/pip configuration files are ignored.
  - Wheels only - C(--only-binary=:all:) for uv and pip - unless I(build_from_source) names packages that may be
    built from their source distribution; building one runs the package's own code as root in the target, which
    no hash of the lock vouches for. A pinned package that has only a source distribution fails the build
    (C(no_wheel)) naming it. Every interpreter of the new venv the build runs (its check, pip, ensurepip) starts
    isolated (C(-I)); uv runs it with C(-I) itself.
  - The build keeps a package cache beside the versions, C(<path>.cache) (uv's in C(uv/), pip's in C(pip/)),
    root's alone (mode 0700), never a link; on the venv's file system, so uv hard-links each file of a version
    from it (C(UV_LINK_MODE=hardlink)) and a rebuild of cached pins downloads and copies nothing. Retention never
    removes it. After a build, when the bytes that only the cache holds (files no kept version links) pass
    I(cache_max_gib), it is removed (the next build downloads again).
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
  - pve_gpu.recover.pve_target.run_lock
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
      - PyPI's uv wheel on the node, under PyPI's file name (C(uv-<version>-py3-none-manylinux_*_x86_64.whl)) - the
        version is read from the name, and a name that does not say it is refused. When a build is due, its C(uv)
        is used instead of I(uv), from C(/usr/local/lib/pve-gpu-recover/uv-<version>/uv) in the target.
      - The module's read says whether root's uv is there already (a regular executable file of root's that no
        group or other user may write, below real directories from C(/) that only root can change). Only when it
        is not is the wheel opened and its C(uv) piped into the target (a link, another owner's file or one others
        may write there is replaced by root's own). A directory on that path another user could change is a
        problem, and nothing is built. Never a C(curl | sh).
      - The role copies the wheel from the controller to the node only when a build is due and the fact pass did
        not find that uv in the target (C(uv_installed)).
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
  build_from_source:
    description:
      - Names of the lock's packages that may be built from their source distribution (sdist) when they have no
        wheel for the target. Building runs the package's own build code as root in the target; every other
        package is installed from wheels only (C(--only-binary)).
    type: list
    elements: str
    default: []
  cache_max_gib:
    description:
      - The most GiB the build's package cache (C(<path>.cache)) may hold of files that no kept version links;
        past it, the cache is removed after the build. Right after a build the cache holds about nothing of its
        own (every file is linked into the new version); what it holds grows as old versions are removed
        (I(keep)) and locks change. C(0) keeps no cache.
    type: float
    default: 20
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
    runs; each of Ansible's polls shows it (plugins/module_utils/node/progress.py).
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
cache:
  description: After a build, the build's package cache - its C(path), C(own_bytes) (what no kept version links;
    null when it could not be read) and whether it was C(dropped) (past I(cache_max_gib)); null when nothing was
    built.
  returned: always
  type: dict
  sample: {"path": "/opt/venvs/train.cache", "own_bytes": 0, "dropped": false}
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
      C(-m venv)), C(no_wheel) (a package has only a source distribution - I(build_from_source)),
      C(venv_failed), C(python) (the python minor is not in the target), C(not_found), C(check)
      (the new venv was not the lock), C(layout) (I(path) is a file, or C(<path>.cache) is not the build's own),
      C(os_error), C(install_failed), C(tls)
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

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import run_step_module
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.run_lock import RUN_LOCK_ARGUMENT_SPEC
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import (
    PYTHON_ARGUMENT_SPEC,
    TARGET_ARGUMENT_SPEC,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.acting import (
    CACHE_MAX_GIB,
    TrainingVenv,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.facts import SPEC

ARGUMENT_SPEC = {
    **TARGET_ARGUMENT_SPEC,
    **RUN_LOCK_ARGUMENT_SPEC,
    "state": {"type": "str", "choices": ["present"], "default": "present"},
    **SPEC,
    "build_timeout": {"type": "int", "default": 1800},
    "build_from_source": {"type": "list", "elements": "str", "default": []},
    "cache_max_gib": {"type": "float", "default": CACHE_MAX_GIB},
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


def main():
    run_step_module(TrainingVenv(ARGUMENT_SPEC))


if __name__ == "__main__":
    main()
