# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, the venv build's commands: their environment and what their failures mean.

Shipped with the build script (its ``SHARED``) and imported on a node as any module_util (the node checks the
build's network settings against :data:`BUILD_ENV` and :data:`FOREIGN_SETTINGS`; the controller's uv_lock lookup
reads uv's failures with :func:`failure_line`): standard library only, Python 3.9+, nothing of ours imported.
"""

import os
import re

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
    # The build's cache is its own (layout.cache_dir), linked into each version, never another one.
    "UV_CACHE_DIR",
    "UV_NO_CACHE",
    "UV_LINK_MODE",
    "PIP_CACHE_DIR",
    "PIP_NO_CACHE_DIR",
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
# What the build's network settings set (module_utils/steps/training_venv/network.py checks them on the node). A CA
# bundle: uv (and OpenSSL, which pip's truststore reads), pip through requests, pip's own --cert.
CA_SETTINGS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT")
# The system's certificate store for uv: UV_SYSTEM_CERTS since uv 0.11, UV_NATIVE_TLS before (uv ignores the old
# one, without its deprecation warning, while the new one is set). pip on Python 3.10+ (truststore) and Debian's
# pip already use the system's store.
SYSTEM_CERTS_SETTINGS = ("UV_SYSTEM_CERTS", "UV_NATIVE_TLS")
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


# -- wheels only -------------------------------------------------------------------------------------------------
def wheels_only(locked, allowed):
    """The installer's options that keep it from building any source distribution of ``locked`` (canonical names)
    but those in ``allowed``: building one runs the package's own code (its build backend) as root in the target,
    which no hash in the lock vouches for. uv pip and pip read them alike. Pure.

    ``wheels_only(["six", "torch"], [])`` -> ``["--only-binary", ":all:"]``; ``wheels_only(["six", "torch"],
    ["six"])`` -> ``["--only-binary", "torch"]``; ``[]`` when every locked package may build.
    """
    if not allowed:
        return ["--only-binary", ":all:"]
    binary_only = sorted(set(locked) - set(allowed))
    return ["--only-binary", ",".join(binary_only)] if binary_only else []


def wheel_missing(text):
    """``(name, version)`` of the pin the installer found no wheel of, from what it printed, or None.

    uv: ``Because srconly==1.0 has no usable wheels and you require srconly==1.0, ...``; pip (``--only-binary``):
    ``No matching distribution found for srconly==1.0`` (pip says the same of a version the index lacks: the
    message names both). Read line by line with ``split``/``partition``, in linear time.
    """
    for line in (text or "").splitlines():
        words = line.split()
        if "has no usable wheels" in line and "has" in words[1:]:
            pin = words[words.index("has", 1) - 1]
        elif "No matching distribution found for" in line and words:
            pin = words[-1]
        else:
            continue
        name, equals, version = pin.partition("==")
        if equals and name and version:
            return name, version
    return None
