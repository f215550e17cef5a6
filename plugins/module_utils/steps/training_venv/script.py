# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training venv build: build the locked venv beside the old one, check it, swap it in atomically. It ACTS.

Unlike a probe part, ``probe(payload)`` here changes the target. It is called the same way so that it costs one
``pct exec``: ``Target.run_probe``/``run_probes`` ship this file's source to the target's python on stdin; on a bare
host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing of ours but the
container-side modules of ``SHARED`` (the module parses the lock and sends what it means as data), the answer is
plain JSON.

Layout (a venv embeds its own path, so a working venv is never moved while jobs may use it):

* every version is built at ``<path>.<stamp>`` and stays there; ``<path>`` is a symlink to the current one
  (relative: ``train -> train.20261203T101500Z``);
* while it is built, ``<path>.<stamp>/.pve-gpu-recover-building`` marks it unfinished; the marker goes only once
  the check passed. A marked ``<path>.<stamp>`` that is not the link's target is a leftover of an interrupted run
  and the next run removes it (nothing else is ever removed as a leftover);
* ``<path>.<stamp>.lock.txt`` is the lock the version was built from;
* the swap is a temporary symlink renamed over ``<path>`` (rename(2): atomic; a job sees the old or the new);
* the old venv: a version behind the link stays where it is; a real directory at ``<path>`` (made before this
  tool) is renamed to ``<path>.<stamp>-previous`` (it works again only once renamed back). Its freeze goes to
  ``<old dir>.freeze.txt`` before the swap;
* retention (``keep``): the newest ``keep`` finished versions stay, the current one counted; older ones go with
  their lock file (their freeze file stays: the record of what they held), unless a live process uses them.
  ``-previous`` directories are never removed.

Any failure removes what this run built and answers ``{"error": kind, "message": sentence, "stderr_tail", "cmd",
"rc"}``; ``<path>`` is then untouched.

The build's network settings (the payload's ``network``: proxies and other variables, a CA bundle, the system's
certificates, index credentials) reach the commands' environment only (:func:`network_env`); index credentials go
to a netrc file in the build's private directory (mode 0600, removed with it), never into an argv. Every answer is
masked (``pve_ct_act.redact``: each secret, and the user information of any URL) before it leaves the target.

Unattended (``window_check`` in the payload), the last thing before the swap is a look at the live processes: when
one runs from the current venv (a job started while the new one was built), the new version is removed, ``<path>``
is left as it was and the answer is ``{"needs_window": {"path", "users": [{"pid", "name"}]}, "cleaned",
"left_behind"}``, not an error: swapping it needs a window.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=disallowed-name,ansible-bad-function

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_act, pve_ct_progress, pve_ct_venv

# Container-side modules Target.run_probes ships with this part; pve_ct_venv decides what builds the venv, as the
# probe part's fact pass did before anything changed; pve_ct_progress tells what a long build is at.
SHARED = (pve_ct_act, pve_ct_progress, pve_ct_venv)
MARKER = ".pve-gpu-recover-building"
STAMP = re.compile(r"^\d{8}T\d{6}Z$")
_STAMP = r"\d{8}T\d{6}Z"
# Settings of the target's environment that would send the build to other indexes than the lock's, or read
# configuration the lock does not show. Proxy settings stay: an index may only be reachable through one.
FOREIGN_SETTINGS = (
    "UV_INDEX",
    "UV_INDEX_URL",
    "UV_DEFAULT_INDEX",
    "UV_EXTRA_INDEX_URL",
    "UV_FIND_LINKS",
    "UV_NO_INDEX",
    "UV_CONFIG_FILE",
    "UV_PYTHON",
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_FIND_LINKS",
    "PIP_NO_INDEX",
    "PYTHONHOME",
    "PYTHONPATH",
    "VIRTUAL_ENV",
)
BUILD_ENV = {
    "LC_ALL": "C",
    "LANG": "C",
    "UV_NO_CONFIG": "1",
    "UV_PYTHON_DOWNLOADS": "never",  # the venv gets the target's own python, never one fetched during recovery
    "UV_NO_PROGRESS": "1",
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_NO_INPUT": "1",
    "PIP_ROOT_USER_ACTION": "ignore",
}
TAIL_LINES = 40
# What the build's network settings set (module_utils/steps/training_venv/network.py checks them on the node). A CA
# bundle: uv (and OpenSSL, which pip's truststore reads), pip through requests, pip's own --cert.
CA_SETTINGS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT")
# The system's certificate store for uv: UV_SYSTEM_CERTS since uv 0.11, UV_NATIVE_TLS before (uv ignores the old
# one, without its deprecation warning, while the new one is set). pip on Python 3.10+ (truststore) and Debian's
# pip already use the system's store.
SYSTEM_CERTS_SETTINGS = ("UV_SYSTEM_CERTS", "UV_NATIVE_TLS")
PYTHON_CHECK = "import sys; print(tuple(sys.version_info[:2]))"
_PYTHON_TUPLE = re.compile(r"\((\d+), (\d+)\)")
_ERROR = re.compile(r"^(?:error|ERROR)\s*:\s*")
_CAUSE = re.compile(r"^(?:cause|Caused by)\s*:\s*")
# What `python3 -m venv` says without Debian's python3-venv (its message wraps "is not\navailable").
NO_VENV_MODULE = re.compile(r"ensurepip\s+is\s+not\s+available|No module named '?(?:venv|ensurepip)")

# What uv and pip say of a certificate they do not trust (a private CA, a TLS-intercepting proxy).
TLS_FAILURE = re.compile(
    r"invalid peer certificate|UnknownIssuer|certificate verify failed|CERTIFICATE_VERIFY_FAILED|"
    r"problem confirming the ssl certificate|self[- ]signed certificate|unable to get local issuer certificate",
    re.IGNORECASE,
)
# What a failed install says, first match wins: (kind, pattern, what to do).
FAILURES = (
    (
        "no_space",
        re.compile(r"No space left on device|ENOSPC|os error 28", re.IGNORECASE),
        "free space on the target's disk (preflight's min_free_gib) and run again",
    ),
    (
        "tls",
        TLS_FAILURE,
        "the target does not trust the TLS certificate of the index or of a proxy on the way (a private CA, a "
        "TLS-intercepting proxy): set training_venv_ca_bundle to a PEM file inside the target holding that CA, or "
        "training_venv_system_certs: true when the target's system store trusts it",
    ),
    (
        "python",
        re.compile(r"No interpreter found|No Python at|Failed to (?:inspect|query) Python interpreter", re.IGNORECASE),
        "install that python minor in the target, or set the venv's python to one it has",
    ),
    (
        "hash_mismatch",
        re.compile(r"hash mismatch|DO NOT MATCH THE HASHES|hashes? (?:do(?:es)? not|don't) match", re.IGNORECASE),
        "the index serves other files than the lock pins; compile the lock again against that index",
    ),
    (
        "index_auth",
        re.compile(r"\(40[13] |40[13] Client Error|\bUnauthorized\b|\bForbidden\b|missing credentials"),
        "the index refused the build without credentials or with these: give them as training_venv_index_credentials "
        "(host, username, password)",
    ),
    (
        "not_on_index",
        re.compile(
            r"No matching distribution|No solution found|not found in the package registry|"
            r"Could not find a version|was not found in the provided package locations|Because .* was not found",
            re.IGNORECASE,
        ),
        "a pinned version is not on the lock's indexes; check the --index-url lines of the lock",
    ),
    (
        "index_unreachable",
        re.compile(
            r"Failed to fetch|Failed to download|error sending request|tcp connect error|Connection refused|"
            r"connection closed|Connection reset|dns error|Name or service not known|timed out|"
            r"Max retries exceeded|NewConnectionError|IncompleteRead|ProtocolError|Could not fetch URL|"
            r"Network is unreachable|request or response body error",
            re.IGNORECASE,
        ),
        "the target cannot download from the lock's indexes; check its network, or give its proxy as "
        "training_venv_environment (HTTPS_PROXY, NO_PROXY), and run again",
    ),
)


# -- names and layout (pure) -----------------------------------------------------------------------------------
def version_dir(path, stamp):
    """``/opt/venvs/train`` + ``20261203T101500Z`` -> ``/opt/venvs/train.20261203T101500Z``."""
    return f"{path}.{stamp}"


def lock_path(version):
    return f"{version}.lock.txt"


def freeze_path(old_dir):
    return f"{old_dir}.freeze.txt"


def previous_dir(path, stamp):
    """Where a real directory at ``path`` (a venv made before this tool) is moved: ``<path>.<stamp>-previous``."""
    return f"{path}.{stamp}-previous"


def version_pattern(path):
    """The names of ``path``'s versions, exactly: ``train.20261203T101500Z`` matches, ``train.X``,
    ``train.20261203T101500Z-previous`` and ``train.20261203T101500Z.lock.txt`` do not."""
    return re.compile(rf"^{re.escape(os.path.basename(path))}\.(?P<stamp>{_STAMP})$")


def plan_leftovers(path, entries, current):
    """The directories an interrupted run left: ``entries`` are ``(name, is_real_dir, has_marker)`` of ``path``'s
    parent; a leftover is one of our version names, a real directory, marked unfinished, not the link's target.

    ``plan_leftovers("/v/train", [("train.20261203T101500Z", True, True), ("train.20261203T091500Z", True,
    False), ("train.backup", True, True)], "/v/train.20261203T091500Z")`` -> ``["/v/train.20261203T101500Z"]``.
    """
    parent, pattern = os.path.dirname(path), version_pattern(path)
    found = []
    for name, is_real_dir, has_marker in entries:
        full = os.path.join(parent, name)
        if pattern.match(name) and is_real_dir and has_marker and full != current:
            found.append(full)
    return sorted(found)


def plan_retention(versions, current, keep, in_use):
    """Which finished versions retention removes and which it must skip.

    ``versions``: finished version directories (any order; their names sort by stamp); ``keep``: how many stay,
    the current one counted (None: keep all); ``in_use``: ``{version: [pids]}``. Returns ``(remove, skipped)``,
    ``skipped`` as ``[{"path", "pids", "reason"}]``. ``plan_retention(["/v/t.2", "/v/t.1", "/v/t.3"], "/v/t.3", 1,
    {"/v/t.1": [41]})`` -> ``(["/v/t.2"], [{"path": "/v/t.1", "pids": [41], "reason": "in use by pid 41"}])``.
    """
    if keep is None:
        return [], []
    older = [v for v in sorted(versions, reverse=True) if v != current]
    beyond = older[max(keep - (1 if current else 0), 0) :]
    remove, skipped = [], []
    for version in sorted(beyond):
        pids = sorted(in_use.get(version, []))
        if pids:
            reason = f"in use by pid {', '.join(map(str, pids))}"
            skipped.append({"path": version, "pids": pids, "reason": reason})
        else:
            remove.append(version)
    return remove, skipped


def classify_failure(text):
    """``(kind, hint)`` for what a failed install printed; ``("install_failed", hint)`` when nothing matches.

    ``classify_failure("error: Failed to fetch: `http://127.0.0.1:8000/simple/six/`")`` ->
    ``("index_unreachable", "the target cannot download ...")``.
    """
    for kind, pattern, hint in FAILURES:
        if pattern.search(text or ""):
            return kind, hint
    return "install_failed", "read stderr_tail; the old venv is untouched"


def failure_line(text):
    """One line for a failed command's message: its first ``error:`` line and, when it differs, the last cause.

    ``"Resolved 3 packages\nerror: Failed to download `idna==3.10`\n  cause: Failed to fetch: ...\n  cause:
    connection closed before message completed"`` -> ``"Failed to download `idna==3.10`: connection closed before
    message completed"``; without an error line, the last line; ``""`` -> ``"no output"``. uv's ``hint:`` lines
    are left out.
    """
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not lines:
        return "no output"
    # uv's closing `hint:` speaks of its own flags (`--system-certs`); the kind's hint names the role's setting.
    lines = [line for line in lines if not line.startswith("hint:")] or lines
    last = _ERROR.sub("", _CAUSE.sub("", lines[-1]))
    first = next((_ERROR.sub("", line) for line in lines if _ERROR.match(line)), None)
    if first is None or first == last:
        return last
    return f"{first}: {last}"


def differences(expected, installed, ignore):
    """What keeps ``installed`` from being exactly ``expected`` (versions compared as strings), one line each.

    ``differences({"torch": "2.11.0+cu128", "six": "1.17.0"}, {"torch": "2.11.0+cu130", "pip": "25.2"}, ["pip"])``
    -> ``["torch 2.11.0+cu130, expected 2.11.0+cu128", "six 1.17.0 is missing"]``.
    """
    lines = [
        f"{name} {installed[name]}, expected {version}"
        for name, version in sorted(expected.items())
        if name in installed and installed[name] != version
    ]
    lines += [f"{name} {expected[name]} is missing" for name in sorted(set(expected) - set(installed))]
    extra = set(installed) - set(expected) - set(ignore)
    lines += [f"{name} {installed[name]} is not in the lock" for name in sorted(extra)]
    return lines


def freeze_text(versions):
    """``{"torch": "2.11.0+cu128", "six": "1.17.0"}`` -> ``"six==1.17.0\\ntorch==2.11.0+cu128\\n"``."""
    lines = [f"{name}=={one}" for name, joined in versions.items() for one in joined.split(", ")]
    return "".join(f"{line}\n" for line in sorted(lines))


# -- reading a venv --------------------------------------------------------------------------------------------
def read_venv(venv, python=None):
    """What a venv holds, from its files: ``{"records": [(name, version)], "broken": [record], "torch_build"}``.

    ``python`` ("3.11") picks its site-packages; None reads every ``lib/pythonX.Y/site-packages``.
    """
    lib = os.path.join(venv, "lib")
    records, broken, torch_build = [], [], None
    for minor in [python] if python else pve_ct_venv.lib_minors(venv):
        site = os.path.join(lib, f"python{minor}", "site-packages")
        try:
            entries = sorted(e for e in os.listdir(site) if e.endswith((".dist-info", ".egg-info")))
        except OSError:
            continue
        for entry in entries:
            record = os.path.join(site, entry)
            if os.path.isdir(record):
                metadata = os.path.join(record, "METADATA" if entry.endswith(".dist-info") else "PKG-INFO")
            else:
                metadata = record  # a distutils egg-info is one file
            header = pve_ct_venv.metadata_header(metadata)
            if header and header.get("name") and header.get("version"):
                records.append((header["name"], header["version"]))
            else:
                broken.append(entry)
        text = pve_ct_venv.read_small_text(os.path.join(site, "torch", "version.py")) or ""
        version = pve_ct_venv.read_version_py(text, {"__version__": "version"}, pve_ct_venv.string_literal)["version"]
        torch_build = version or torch_build
    return {"records": records, "broken": broken, "torch_build": torch_build}


def processes_using(directories, proc="/proc", cwd=False):
    """``{directory: [pids]}``: live processes whose executable, script interpreter path (argv[0], directory
    resolved), a mapped file (a loaded C extension) or, with ``cwd`` (before a removal), working directory lies in
    one of ``directories``.

    /proc/<pid>/exe alone is not enough: a venv's bin/python is a symlink to the base interpreter, so a job's exe is
    /usr/bin/python3.X whatever venv it runs in.
    """
    roots = {os.path.realpath(d).rstrip("/") + "/": d for d in directories}
    using = {}
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return using
    for pid in pids:
        for found in _paths_of(os.path.join(proc, str(pid)), cwd):
            for root, directory in roots.items():
                if found.startswith(root) and pid not in using.setdefault(directory, []):
                    using[directory].append(pid)
    return {d: sorted(p) for d, p in using.items() if p}


def comm_of(pid, proc="/proc"):
    """The kernel's name of ``pid`` (``python3``), or ``?`` when it cannot be read."""
    try:
        with open(os.path.join(proc, str(pid), "comm"), encoding="utf-8", errors="replace") as handle:
            return handle.read().strip() or "?"
    except OSError:
        return "?"


def _paths_of(proc_pid, cwd=False):
    """The files a process runs from: its exe, its argv[0] (directory resolved), its mapped files and, with
    ``cwd``, its working directory."""
    paths = []
    with contextlib.suppress(OSError):
        paths.append(os.readlink(os.path.join(proc_pid, "exe")))
    if cwd:  # a shell cd'd into a version: removing it would pull the directory from under it
        with contextlib.suppress(OSError):
            paths.append(os.path.join(os.readlink(os.path.join(proc_pid, "cwd")), ""))
    try:
        with open(os.path.join(proc_pid, "cmdline"), "rb") as handle:
            argv0 = handle.read().split(b"\0", 1)[0].decode(errors="replace")
        if argv0.startswith("/"):
            paths.append(os.path.join(os.path.realpath(os.path.dirname(argv0)), os.path.basename(argv0)))
    except OSError:
        pass
    try:
        with open(os.path.join(proc_pid, "maps"), encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    paths.append(fields[5].rstrip("\n"))
    except OSError:
        pass
    return paths


# -- acting ----------------------------------------------------------------------------------------------------
def network_env(network):
    """The variables the build's network settings give its commands: ``environment``, ``secret_environment``, a
    ``ca_bundle`` for each tool (CA_SETTINGS) and ``system_certs`` (SYSTEM_CERTS_SETTINGS); pure.

    ``network_env({"environment": {"HTTPS_PROXY": "http://proxy:3128"}, "ca_bundle": "/etc/ssl/corp.pem",
    "system_certs": True})`` -> ``{"HTTPS_PROXY": "http://proxy:3128", "SSL_CERT_FILE": "/etc/ssl/corp.pem",
    "REQUESTS_CA_BUNDLE": "/etc/ssl/corp.pem", "PIP_CERT": "/etc/ssl/corp.pem", "UV_SYSTEM_CERTS": "true",
    "UV_NATIVE_TLS": "true"}``.
    """
    network = network or {}
    env = {str(k): str(v) for k, v in (network.get("environment") or {}).items()}
    env.update({str(k): str(v) for k, v in (network.get("secret_environment") or {}).items()})
    if network.get("ca_bundle"):
        env.update(dict.fromkeys(CA_SETTINGS, str(network["ca_bundle"])))
    if network.get("system_certs"):
        env.update(dict.fromkeys(SYSTEM_CERTS_SETTINGS, "true"))
    return env


def build_env(network=None):
    """The environment of every command: the target's, minus foreign index settings, plus ours and the build's
    network settings (:func:`network_env`)."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_SETTINGS}
    env.update(BUILD_ENV)
    env.update(network_env(network))
    return env


def write_atomic(path, text):
    """Write ``text`` to ``path`` through a temporary file renamed over it (never a half-written file).

    The module refuses a venv whose parent others may write (the probe's ``venv_unsafe``) before this script
    runs; as a second line all the same, the temporary file gets a name nobody can guess
    and is created exclusively (mkstemp: O_EXCL, so a link planted there is never followed), and the rename
    replaces a link at ``path`` itself rather than writing through it."""
    directory, name = os.path.split(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600: the lock and freeze beside a venv are for every user to read
        os.replace(temporary, path)
    except BaseException:
        _remove(temporary)
        raise


def create_new(path, text, mode=0o644):
    """Write ``text`` to a file that must not exist yet (O_EXCL | O_NOFOLLOW: a planted link is an error, never
    followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with os.fdopen(os.open(path, flags, mode), "w", encoding="utf-8") as stream:
        stream.write(text)


def _remove(path):
    """Remove a file, a symlink or a directory tree; gone already is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(directory):
    """Make a rename in ``directory`` durable (a power cut must not bring the old link back)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(handle)
    finally:
        os.close(handle)


class Build:
    """One build of ``payload``: see the module docstring for the layout it keeps."""

    def __init__(self, payload):
        self.path = os.path.normpath(str(payload["path"]))
        self.stamp = str(payload["stamp"])
        if not os.path.isabs(self.path) or self.path == "/":
            raise pve_ct_act.ActError("invalid", f"path must be an absolute path below /, got {self.path!r}")
        if not STAMP.match(self.stamp):
            raise pve_ct_act.ActError("invalid", f"stamp must look like 20261203T101500Z, got {self.stamp!r}")
        self.lock = str(payload["lock"])
        self.python = payload.get("python")
        self.uv = payload.get("uv") or "uv"
        self.keep = payload.get("keep")
        self.expected = dict(payload["expected"])
        self.ignore = list(payload.get("ignore") or [])
        self.drop_tooling = list(payload.get("drop_tooling") or [])
        self.timeout = float(payload.get("timeout", 1800))
        self.deadline = time.monotonic() + self.timeout
        self.parent = os.path.dirname(self.path)
        self.new = version_dir(self.path, self.stamp)
        self.lock_file = lock_path(self.new)
        self.private = None  # a root-only directory holding the lock the installer reads (made by execute)
        # A pylock.toml is read by uv only under that name (``pylock.toml`` or ``pylock.*.toml``).
        self.lock_name = "pylock.toml" if payload.get("lock_format") == "pylock" else "lock.txt"
        network = dict(payload.get("network") or {})
        self.netrc = network.get("netrc")  # index credentials, written beside the lock the installer reads
        ca_bundle = network.get("ca_bundle")
        if ca_bundle and not os.path.isfile(ca_bundle):
            raise pve_ct_act.ActError(
                "ca_bundle",
                f"the CA bundle {ca_bundle} is not a file in the target; put the PEM file of the CA there, or fix "
                "training_venv_ca_bundle (a path inside the target)",
            )
        self.env = build_env(network)
        self.created = False  # this run made self.new (so a failure removes it)
        self.swapped = False  # self.new is the current venv (so nothing of it is ever removed)
        self.cleaned = []
        self.window_check = bool(payload.get("window_check"))  # unattended: never swap under a live process
        self.prune_only = bool(payload.get("prune_only"))  # in spec, only old versions beyond keep to remove
        # Told only when the module has somewhere to send it (an async job); masked as every answer is.
        secrets = [str(secret) for secret in (network.get("secrets") or [])]
        pve_ct_progress.start(payload.get("progress"), redact=lambda text: pve_ct_act.redact(text, secrets))

    # -- commands ------------------------------------------------------------------------------------------
    def run(self, argv, what):
        """Run ``argv`` (no shell) within the build's deadline; pve_ct_act.ActError when it fails or runs out of time.

        The command stays in this process group, so the `timeout` that wraps the whole pct exec kills it too.
        While it runs, ``what`` and its latest output line are told as progress (pve_ct_progress).
        """
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise pve_ct_act.ActError("timeout", f"the build ran out of its {self.timeout:g} s before {what}", cmd=argv)
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.env,
                cwd="/",  # no project, .python-version or uv.toml of some working directory is read
            )
        except OSError as error:
            raise pve_ct_act.ActError(
                "not_found", f"cannot run `{argv[0]}` for {what}: {error.strerror}", cmd=argv
            ) from None
        pve_ct_progress.phase(what)
        try:
            out, err = pve_ct_progress.communicate(process, remaining)
        except subprocess.TimeoutExpired as expired:
            process.kill()
            try:
                _, rest = process.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # something it started still holds the pipes
                rest = b""
            raise pve_ct_act.ActError(
                "timeout",
                f"{what} did not finish within the build's {self.timeout:g} s (build_timeout) and was killed",
                cmd=argv,
                stderr=((expired.stderr or b"") + (rest or b"")).decode(errors="replace"),
            ) from None
        return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    def must_run(self, argv, what):
        rc, out, err = self.run(argv, what)
        if rc != 0:
            kind, hint = classify_failure(err + out)
            line = failure_line(err or out)
            if kind == "tls":  # pip names the certificate only in a warning before its last error
                said = TLS_FAILURE.search(err + out).group(0)
                line = line if said in line else f"{line} ({said})"
            raise pve_ct_act.ActError(
                kind, f"{what} failed (exit {rc}): {line}; {hint}", cmd=argv, rc=rc, stderr=err or out
            )
        return out

    # -- the steps -----------------------------------------------------------------------------------------
    def current(self):
        """``(kind, directory)`` of ``path``: ("link", its target), ("dir", path) or ("absent", None)."""
        if os.path.islink(self.path):
            return "link", os.path.realpath(self.path)
        if os.path.isdir(self.path):
            return "dir", self.path
        if os.path.lexists(self.path):
            raise pve_ct_act.ActError(
                "layout",
                f"{self.path} is a file, not a venv or a link to one; move it away and run again",
            )
        return "absent", None

    def clean_leftovers(self, current):
        """Remove what interrupted runs left: marked version directories, their lock files, temporary links."""
        try:
            names = os.listdir(self.parent)
        except FileNotFoundError:
            return
        entries = []
        for name in names:
            full = os.path.join(self.parent, name)
            real_dir = os.path.isdir(full) and not os.path.islink(full)
            entries.append((name, real_dir, real_dir and os.path.exists(os.path.join(full, MARKER))))
        for leftover in plan_leftovers(self.path, entries, current):
            _remove(leftover)
            _remove(lock_path(leftover))
            self.cleaned.append(leftover)
        base = re.escape(os.path.basename(self.path))
        temporary_link = re.compile(rf"^{base}\.{_STAMP}\.link$")
        orphan_lock = re.compile(rf"^{base}\.{_STAMP}\.lock\.txt$")
        for name in names:
            full = os.path.join(self.parent, name)
            if temporary_link.match(name) and os.path.islink(full):
                _remove(full)  # made for a swap that never happened
            elif orphan_lock.match(name) and not os.path.isdir(full[: -len(".lock.txt")]):
                _remove(full)  # the lock of a version that is gone

    def builder(self):
        """``("uv", path)`` when uv can be run, else ``("venv+pip", why uv is not used)`` (pve_ct_venv.builder, what
        the fact pass's probe part found beforehand)."""
        return pve_ct_venv.builder(self.uv, self.env.get("PATH"))

    def base_python(self):
        """The interpreter ``-m venv`` runs with: ``python3.X`` for a pinned minor, else ``python3``."""
        name = pve_ct_venv.python_name(self.python)
        found = pve_ct_venv.base_python(self.python, self.env.get("PATH"))
        if not found:
            raise pve_ct_act.ActError(
                "python",
                f"{name} is not on PATH in the target; install python{self.python or '3'} there "
                "(or give the role a uv, which finds installed pythons elsewhere too)",
            )
        return found

    def make_venv_with_uv(self, uv):
        python = self.python or "python3"
        # --allow-existing: the directory exists already, holding the marker that says "unfinished".
        self.must_run([uv, "venv", "--allow-existing", "--python", python, self.new], f"`uv venv` with {python}")
        self.must_run(
            [uv, "pip", "sync", "--python", f"{self.new}/bin/python", "--require-hashes", self.install_lock()],
            "installing the lock with `uv pip sync`",
        )
        version = self.must_run([uv, "--version"], "`uv --version`").split()
        return {"name": "uv", "path": uv, "version": version[1] if len(version) > 1 else None}

    def make_venv_with_pip(self, why_not_uv):
        if self.lock_name == "pylock.toml":
            raise pve_ct_act.ActError(
                "no_builder",
                f"the lock is a pylock.toml, which only uv installs here, and there is no uv ({why_not_uv}); give the "
                "role a uv (training_venv_uv_wheel, or training_venv_uv: its path inside the target)",
            )
        python = self.base_python()
        rc, out, err = self.run([python, "-m", "venv", self.new], f"`{python} -m venv`")
        if rc != 0:
            text = err + out
            if NO_VENV_MODULE.search(text):
                raise pve_ct_act.ActError(
                    "no_builder",
                    f"no way to build a venv: no uv ({why_not_uv}) and `{python} -m venv` fails because "
                    f"ensurepip/venv is missing; install it in the target (`apt install python3-venv`) or give "
                    f"the role a uv (training_venv_uv: the path of uv inside the target)",
                    cmd=[python, "-m", "venv", self.new],
                    rc=rc,
                    stderr=text,
                )
            kind, hint = classify_failure(text)
            raise pve_ct_act.ActError(
                kind if kind != "install_failed" else "venv_failed",
                f"`{python} -m venv` failed (exit {rc}): {failure_line(text)}; {hint}",
                cmd=[python, "-m", "venv", self.new],
                rc=rc,
                stderr=text,
            )
        pip = [f"{self.new}/bin/python", "-B", "-m", "pip"]  # pip's own modules stay uncompiled, as uv leaves them
        self.must_run(
            [*pip, "install", "--no-deps", "--require-hashes", "--no-input", "-r", self.install_lock()],
            "installing the lock with pip",
        )
        version = self.must_run([*pip, "--version"], "`pip --version`").split()
        present = {pve_ct_venv.canonical_name(n) for n, _ in read_venv(self.new)["records"]}
        drop = [name for name in self.drop_tooling if name in present]
        if drop:  # `-m venv` seeds pip/setuptools; with tooling=exact the lock decides whether they stay
            self.must_run([*pip, "uninstall", "--yes", *drop], f"removing {', '.join(drop)} (not in the lock)")
        return {
            "name": "venv+pip",
            "path": python,
            "version": version[1] if len(version) > 1 else None,
            "fallback": why_not_uv,
        }

    def check(self):
        """The new venv's interpreter runs, is the expected minor, and it holds exactly the lock."""
        # -B: the check leaves no __pycache__ behind (what runs inside a venv to look at it writes nothing).
        out = self.must_run([f"{self.new}/bin/python", "-B", "-c", PYTHON_CHECK], "running the new venv's python")
        found = _PYTHON_TUPLE.search(out)
        if not found:
            raise pve_ct_act.ActError("check", f"the new venv's python printed {out.strip()!r}, not its version")
        minor = f"{found.group(1)}.{found.group(2)}"
        if self.python and minor != self.python:
            raise pve_ct_act.ActError("check", f"the new venv's python is {minor}, expected {self.python}")
        venv = read_venv(self.new, minor)
        problems = [f"{record} has no readable Name/Version" for record in venv["broken"]]
        installed = pve_ct_venv.installed_versions(venv["records"], venv["torch_build"], self.expected)
        problems += differences(self.expected, installed, self.ignore)
        if problems:
            raise pve_ct_act.ActError("check", f"the new venv is not the lock: {'; '.join(problems)}")
        return minor

    def save_freeze(self, old_dir, freeze_to):
        venv = read_venv(old_dir)
        write_atomic(
            freeze_to, freeze_text(pve_ct_venv.installed_versions(venv["records"], venv["torch_build"], self.expected))
        )

    def swap(self, kind, old_dir):
        """Point ``path`` at the new version; a real directory there is first renamed aside (and back on failure)."""
        link = f"{self.new}.link"
        os.symlink(os.path.basename(self.new), link)
        moved_to = None
        try:
            if kind == "dir":
                # A directory cannot be replaced by rename(2); for an instant <path> is absent (once per target).
                moved_to = previous_dir(self.path, self.stamp)
                os.rename(old_dir, moved_to)
            os.replace(link, self.path)
        except BaseException:
            _remove(link)
            if moved_to and not os.path.lexists(self.path):
                os.rename(moved_to, self.path)
            raise
        _fsync_dir(self.parent)
        return moved_to

    def retention(self, current):
        """Remove finished versions beyond ``keep`` that no live process uses (nor has as its working directory),
        never ``current``; say what was skipped.

        Runs after the swap (or alone, ``prune_only``): what fails here is reported in ``retention_skipped``, never
        as a failed build.
        """
        if self.keep is None:
            return [], []
        pattern = version_pattern(self.path)
        finished = []
        try:
            names = os.listdir(self.parent)
        except OSError as error:
            return [], [{"path": self.parent, "pids": [], "reason": f"cannot list: {error.strerror}"}]
        for name in names:
            full = os.path.join(self.parent, name)
            real_dir = os.path.isdir(full) and not os.path.islink(full)
            if pattern.match(name) and real_dir and not os.path.exists(os.path.join(full, MARKER)):
                finished.append(full)
        candidates, _ = plan_retention(finished, current, self.keep, {})
        remove, skipped = plan_retention(finished, current, self.keep, processes_using(candidates, cwd=True))
        removed = []
        for version in remove:
            try:
                _remove(version)
                _remove(lock_path(version))
                removed.append(version)
            except OSError as error:
                skipped.append({"path": version, "pids": [], "reason": f"cannot remove: {error.strerror}"})
        return removed, skipped

    def install_lock(self):
        """The lock the installer reads: a copy in a directory of root's own (mkdtemp: mode 0700), since another
        user able to write the venv's parent could swap ``<version>.lock.txt`` between its writing and its
        reading."""
        if self.private is None:
            self.private = tempfile.mkdtemp(prefix="pve-gpu-recover-build-")
            create_new(os.path.join(self.private, self.lock_name), self.lock, 0o600)
            if self.netrc:  # the index credentials: uv and pip (requests) read the file NETRC names
                create_new(os.path.join(self.private, "netrc"), self.netrc, 0o600)
                self.env["NETRC"] = os.path.join(self.private, "netrc")
        return os.path.join(self.private, self.lock_name)

    def drop_private(self):
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)
            self.private = None

    def discard(self):
        """Remove what this run built; None when done, else the path left behind (its marker says unfinished)."""
        left = None
        if self.swapped:
            return None
        for path in (self.new, self.lock_file, f"{self.new}.link"):
            if path == self.new and not self.created:
                continue
            try:
                _remove(path)
            except OSError:
                left = left or path
        return left

    def prune(self):
        """Retention alone (the venv is in spec, old versions are beyond ``keep``): nothing is built."""
        started = time.monotonic()
        _, current = self.current()
        removed, skipped = self.retention(current)
        return {
            "pruned": True,
            "removed": removed,
            "retention_skipped": skipped,
            "seconds": round(time.monotonic() - started, 3),
        }

    def execute(self):
        if self.prune_only:
            return self.prune()
        started = time.monotonic()
        kind, old_dir = self.current()
        self.clean_leftovers(old_dir)
        if os.path.lexists(self.new):
            raise pve_ct_act.ActError("layout", f"{self.new} exists already (a build in the same second?); run again")
        os.makedirs(self.parent, exist_ok=True)
        os.mkdir(self.new)
        self.created = True
        create_new(
            os.path.join(self.new, MARKER), f"being built since {self.stamp}; removed when the build is checked\n"
        )
        write_atomic(self.lock_file, self.lock)
        name, where = self.builder()
        builder = self.make_venv_with_uv(where) if name == "uv" else self.make_venv_with_pip(where)
        python = self.check()
        if self.window_check and old_dir and os.path.isdir(old_dir):
            users = processes_using([old_dir]).get(old_dir, [])
            if users:  # a job started from it while this one was built: swapping it needs a window
                return {
                    "needs_window": {"path": old_dir, "users": [{"pid": pid, "name": comm_of(pid)} for pid in users]},
                    "cleaned": self.cleaned,
                    "left_behind": self.discard(),
                    "seconds": round(time.monotonic() - started, 3),
                }
        os.unlink(os.path.join(self.new, MARKER))
        previous = None
        if old_dir and os.path.isdir(old_dir):
            moved = kind == "dir"
            freeze_to = freeze_path(previous_dir(self.path, self.stamp) if moved else old_dir)
            self.save_freeze(old_dir, freeze_to)
            previous = {"path": previous_dir(self.path, self.stamp) if moved else old_dir, "freeze": freeze_to}
        moved_to = self.swap(kind, old_dir)
        self.swapped = True
        if previous:
            previous["moved"] = bool(moved_to)
            previous["note"] = (
                f"moved from {self.path}: a venv embeds its path, so it works again only once renamed back "
                f"(rm {self.path} && mv {moved_to} {self.path})"
                if moved_to
                else f"unchanged in place; to go back: ln -sfn {os.path.basename(old_dir)} {self.path}"
            )
        removed, skipped = self.retention(self.new)
        return {
            "path": self.path,
            "current": self.new,
            "previous": previous,
            "builder": builder,
            "python": python,
            "lock_file": self.lock_file,
            "cleaned": self.cleaned,
            "removed": removed,
            "retention_skipped": skipped,
            "seconds": round(time.monotonic() - started, 3),
        }


def probe(payload):
    """ACTS: build the venv of ``payload`` beside the old one, check it, swap it in; answer what was done.

    ``payload``: ``{"path", "lock" (its text), "python" ("3.11" or None), "stamp" ("20261203T101500Z"), "uv" (path
    or name), "keep" (int or None), "timeout" (s), "expected" ({canonical name: version}, the lock's pins),
    "ignore" (tooling names not compared), "drop_tooling" (seeded tooling a pip build removes), "window_check"
    (unattended: no swap while a live process uses the current venv; optional), "prune_only" (build nothing, only
    remove versions beyond ``keep``; optional), "lock_format" ("pylock" for a pylock.toml; optional), "network"
    ({"environment", "secret_environment", "ca_bundle", "system_certs", "netrc", "secrets"}: the build's network,
    steps/training_venv/network.py; optional; every answer masks each of "secrets")}``.

    Success: ``{"path", "current", "previous" ({"path", "freeze", "moved", "note"} or None), "builder" ({"name",
    "path", "version"[, "fallback"]}), "python", "lock_file", "cleaned", "removed", "retention_skipped",
    "seconds"}``. Failure: ``{"error", "message", "cmd", "rc", "stdout_tail", "stderr_tail", "cleaned",
    "left_behind"}``. Not swapped because a live process uses the current venv (``window_check``):
    ``{"needs_window", "cleaned", "left_behind", "seconds"}``. ``prune_only``: ``{"pruned": true, "removed",
    "retention_skipped", "seconds"}``.
    """
    secrets = [str(secret) for secret in ((payload.get("network") or {}).get("secrets") or [])]
    try:
        build = Build(payload)
    except (KeyError, TypeError, ValueError) as error:
        return {"error": "invalid", "message": f"the build payload is incomplete: {error}", "cleaned": []}
    except pve_ct_act.ActError as error:
        return pve_ct_act.redact_answer({"error": error.kind, "message": str(error), "cleaned": []}, secrets)
    try:
        return pve_ct_act.redact_answer(build.execute(), secrets)
    except (pve_ct_act.ActError, OSError) as error:
        failure = pve_ct_act.failure(error, TAIL_LINES)
    finally:
        build.drop_private()
    failure.update(cleaned=build.cleaned, left_behind=build.discard())
    return pve_ct_act.redact_answer(failure, secrets)
