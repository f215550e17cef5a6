# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the venv build needs to reach its indexes: proxies, a private CA, the system's certificates, credentials.

A CT that reaches PyPI only through a proxy (a TLS-intercepting one included), or an index of its own with its own
CA and credentials, cannot build with the target's environment alone: ``pct exec --keep-env 0`` passes none, and
uv trusts only its own roots. These settings reach the build's commands (uv, pip) and nothing else: the fact pass
reads files, never an index. The same checks serve the controller's lock compilation (plugins/lookup/uv_lock.py).

Secrets stay out of the report, the log, the diff and every message:

* ``secret_environment``'s values and each credential's ``password`` are ``no_log`` in the module's argument spec,
  so Ansible masks them in the result, its ``invocation`` and any message;
* the build script masks them too, with the user information of any URL (``ct_act.redact``), in what it
  answers, before the answer leaves the target;
* credentials never go into an argv or the lock: they go into a netrc file (mode 0600) in the build's private
  directory, removed with it, that ``NETRC`` names for uv and pip; a lock whose URLs carry credentials is refused.

Node side and controller side: pure, standard library only.
"""

from __future__ import annotations

import posixpath
import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import commands as venv_commands

# The build's options that are its network settings (the module's argument spec, the role's training_venv_*).
OPTIONS = ("environment", "secret_environment", "ca_bundle", "system_certs", "index_credentials")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?$")
# netrc separates its tokens by white space and reads `#` as a comment and `"` as a quote.
NETRC_TOKEN = re.compile(r'^[^\s#"][^\s]*$')
# What the build decides itself: index settings the lock overrules, and what makes the build's commands reproducible.
RESERVED = frozenset(venv_commands.FOREIGN_SETTINGS) | frozenset(venv_commands.BUILD_ENV)


def _environment_problem(option, environment):
    """Why ``environment`` (``option``'s dict) cannot be given to the build's commands, or ``""``."""
    if not isinstance(environment, dict):
        return f"{option} is not a dict of variable names and values"
    for name, value in environment.items():
        if not ENV_NAME.match(str(name)):
            return f"{option} names {name!r}, which is not an environment variable's name"
        if name in RESERVED:
            return (
                f"{option} sets {name}, which the build decides itself (only the lock's indexes count, and no "
                "configuration file is read); remove it"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return f"{option} gives {name} a {type(value).__name__}; give it a string"
    return ""


def credentials_problem(credentials):
    """Why ``index_credentials`` cannot go into a netrc file (one sentence, no password in it), or ``""``."""
    for number, entry in enumerate(credentials or []):
        where = f"index_credentials[{number}]"
        if not isinstance(entry, dict):
            return f"{where} is not a dict of host, username and password"
        host = entry.get("host")
        if not isinstance(host, str) or not HOST.match(host):
            return (
                f"{where}.host is {host!r}; expected the index's host name alone (pypi.internal, no scheme, port "
                "or path): netrc matches credentials by host"
            )
        if not isinstance(entry.get("username"), str) or not NETRC_TOKEN.match(entry["username"]):
            return f"{where}.username for {host} is empty or holds white space, '#' or '\"', which netrc cannot hold"
        if not isinstance(entry.get("password"), str) or not NETRC_TOKEN.match(entry["password"]):
            return (
                f"{where}.password for {host} is empty or holds white space, '#' or '\"', which netrc cannot hold; "
                "give such a secret as training_venv_secret_environment instead"
            )
    return ""


def network_problem(params):
    """Why the build's network settings in ``params`` (the module's options) cannot work: one sentence naming the
    option, never a secret's value; ``""`` when they can."""
    environment = params.get("environment") or {}
    secret = params.get("secret_environment") or {}
    for option, given in (("environment", environment), ("secret_environment", secret)):
        wrong = _environment_problem(option, given)
        if wrong:
            return wrong
    both = sorted(set(environment) & set(secret))
    if both:
        return f"{both[0]} is in both environment and secret_environment; give it once"
    managed = {name: "ca_bundle" for name in venv_commands.CA_SETTINGS if params.get("ca_bundle")}
    managed.update({name: "system_certs" for name in venv_commands.SYSTEM_CERTS_SETTINGS if params.get("system_certs")})
    managed.update({"NETRC": "index_credentials"} if params.get("index_credentials") else {})
    clash = sorted((set(environment) | set(secret)) & set(managed))
    if clash:
        return f"{clash[0]} is set by {managed[clash[0]]} and by the environment; give it once ({managed[clash[0]]})"
    ca_bundle = params.get("ca_bundle")
    if ca_bundle and not posixpath.isabs(ca_bundle):
        return f"ca_bundle is {ca_bundle!r}; expected the absolute path of a PEM file inside the target"
    return credentials_problem(params.get("index_credentials"))


def netrc_text(credentials):
    """The netrc file of ``index_credentials``: ``[{"host": "pypi.internal", "username": "ci", "password": "s"}]``
    -> ``"machine pypi.internal login ci password s\\n"`` (checked by :func:`credentials_problem` first)."""
    return "".join(
        f"machine {entry['host']} login {entry['username']} password {entry['password']}\n" for entry in credentials
    )


def secrets_of(params):
    """The strings every answer and message masks: ``secret_environment``'s values and the passwords."""
    found = [str(value) for value in (params.get("secret_environment") or {}).values()]
    found += [entry["password"] for entry in params.get("index_credentials") or []]
    return sorted({secret for secret in found if secret})


def network_payload(params):
    """The build payload's ``{"network": {...}}`` for ``params`` (the module's options), or ``{}`` when none is set.

    ``network_payload({"environment": {"HTTPS_PROXY": "http://proxy:3128"}, "ca_bundle": "/etc/ssl/corp.pem"})``
    -> ``{"network": {"environment": {"HTTPS_PROXY": "http://proxy:3128"}, "secret_environment": {}, "ca_bundle":
    "/etc/ssl/corp.pem", "system_certs": False, "netrc": None, "secrets": []}}``.
    """
    if not any(params.get(option) for option in OPTIONS):
        return {}
    credentials = params.get("index_credentials") or []
    return {
        "network": {
            "environment": {str(k): str(v) for k, v in (params.get("environment") or {}).items()},
            "secret_environment": {str(k): str(v) for k, v in (params.get("secret_environment") or {}).items()},
            "ca_bundle": params.get("ca_bundle") or None,
            "system_certs": bool(params.get("system_certs")),
            "netrc": netrc_text(credentials) if credentials else None,
            "secrets": secrets_of(params),
        }
    }
