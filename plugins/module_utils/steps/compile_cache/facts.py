# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The compile cache step: is each torch.compile cache built for the torch, triton, CUDA and GPUs in use.

A cache root (TORCHINDUCTOR_CACHE_DIR, default ``/tmp/torchinductor_<user>``; TRITON_CACHE_DIR, default
``~<user>/.triton/cache``) holds a stamp, ``.pve-gpu-recover-stamp``: JSON naming the fingerprint the cache was
built for, ``{"torch": "2.11.0+cu128", "variant": "cu128", "cuda": "12.8", "triton": "3.3.0", "gpus": ["NVIDIA
H200"]}``. Per root: a stamp equal to the expected fingerprint is ``fresh`` (kept); another stamp is ``stale``
(purged, then stamped); no stamp is ``unstamped`` (adopted: stamped as it is) unless the venv is rebuilt in this
run, which makes every cache stale; an absent root is ``missing`` (nothing to do); a root that could take more
than a cache with it (:func:`refusal`), or that the probe could not open without trusting a user who could have
changed it (``unsafe``: a symlink on the way, a directory above it others may write, a root of another user in
``/tmp``), is ``refused``. A root refused by its setting stops the run before anything is deleted; one refused
for what was found at its path (``unsafe``, a file in its place, a symlink it resolves through: any user of the
target can make those) is refused alone (``alone``): left as it is, a warning (``warnings``), unattended a line of
``needs_window``, never a problem, no change, and no warm-up runs; the other roots are handled as usual.

Its probe part (``cache_probe``) reads the roots by ``lstat`` only, the stamps, the venv's
``torch/version.py`` and triton's METADATA (never ``import torch``), the users' homes and which live processes
use a root. Everything here is pure: the probe's answer and the facts of the steps before in, facts out.

A stale root that a live process uses (its cwd, an open or a mapped file in it; the GPU step's processes aside,
they are ended first) is never purged. Attended, that is a problem: the run stops before anything is deleted.
Unattended (``unattended``, the scheduled drift corrector), that root is left as it is (not purged, not stamped)
and named in ``needs_window``; the other roots are purged and stamped as usual, no warm-up runs (the caches it
would fill are in use) and the run does not fail for it.

Here: NAME, SPEC and the settings check, the evaluation of the fact pass and of the module, and the payloads of
the probe and the acting script. Beside it: fingerprint.py (the stamps and what is expected), answer.py (the
probe's answer checked, CacheError), verdicts.py (each root judged, :func:`judge`) and warmup.py.
"""

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import query_gpu_argv
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import ENV_NAME
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.answer import check_answer
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.fingerprint import (
    GPU_NAME_FIELDS,
    gpu_names_of,
    gpu_names_read,
    planned_fingerprint,
    venv_fingerprint,
    venv_plan_of,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.verdicts import judge
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.warmup import (
    THREADS,
    warmup_environment,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.handoff import (
    ending_pids_of,  # pids the GPU step ends before this step runs
)

NAME = "compile_cache"
PROBE = cache_probe
STAMP_NAME = ".pve-gpu-recover-stamp"
# torch's and triton's own defaults, expanded inside the target for the user ({user}: its name, {home}: its home).
DEFAULT_ROOTS = ["/tmp/torchinductor_{user}", "{home}/.triton/cache"]  # noqa: S108 (torch's default, not ours)
SPEC = {
    # The user training runs as: names the default roots, and the warm-up runs as this user.
    "user": {"type": "str", "default": "root"},
    # The venv whose torch and triton the caches are for (read from its files, never imported).
    "venv": {"type": "path", "default": "/opt/venvs/train"},
    # The cache directories, `{user}`/`{home}` expanded in the target. The first is the warm-up's
    # TORCHINDUCTOR_CACHE_DIR. Only these are ever purged, and only inside them.
    "roots": {"type": "list", "elements": "str", "default": list(DEFAULT_ROOTS)},
    # The stamp's file name inside each root.
    "stamp_name": {"type": "str", "default": STAMP_NAME},
    # A command (argv) that compiles what training compiles first, run once after a purge; empty: no warm-up.
    "warmup": {"type": "list", "elements": "str", "default": []},
    "warmup_timeout": {"type": "int", "default": 900},
    # Environment of the warm-up, on top of what the step sets (it may not change TORCHINDUCTOR_COMPILE_THREADS).
    "warmup_env": {"type": "dict", "default": {}},
    # The scheduled drift corrector: a stale root in use is left for a window (needs_window), not a problem.
    "unattended": {"type": "bool", "default": False},
}
SPEC_DEFAULTS = {name: option.get("default") for name, option in SPEC.items()}
PLANNED_FROM = "training_venv lock (the venv is rebuilt in this run)"
_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$")


# -- settings --------------------------------------------------------------------------------------------------
def check_spec(spec):
    """Why the step's settings cannot work (one sentence), or ``""``: called once the SPEC types are checked."""
    if not _USER.match(spec["user"]):
        return f"user is {spec['user']!r}, which is not a user name"
    if not spec["venv"].startswith("/"):
        return f"venv is {spec['venv']!r}; give the venv's absolute path inside the target"
    name = spec["stamp_name"]
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        return f"stamp_name is {name!r}; give a plain file name such as {STAMP_NAME}"
    return _check_roots(spec["roots"]) or _check_warmup(spec)


def _check_roots(roots):
    if not roots:
        return "roots is empty; give the cache directories (default: /tmp/torchinductor_{user}, {home}/.triton/cache)"
    for root in roots:
        unknown = [p for p in _PLACEHOLDER.findall(root) if p not in ("{user}", "{home}")]
        if unknown:
            return f"the root {root!r} uses {unknown[0]}; only {{user}} and {{home}} are expanded"
        if not root.startswith(("/", "{home}")) or "\0" in root:
            return f"the root {root!r} is not an absolute path (nor one that starts with {{home}})"
    return ""


def _check_warmup(spec):
    if spec["warmup"] and not spec["warmup"][0]:
        return "warmup starts with an empty command name"
    if spec["warmup_timeout"] < 1:
        return f"warmup_timeout is {spec['warmup_timeout']}; give the warm-up at least 1 second"
    for key, value in (spec["warmup_env"] or {}).items():
        if not ENV_NAME.match(str(key)):
            return f"warmup_env has {key!r}, which is not an environment variable name"
        if isinstance(value, (dict, list)) or value is None:
            return f"warmup_env's {key} is {value!r}; give a string"
        if key == THREADS:
            return f"warmup_env sets {THREADS}; the warm-up compiles single-threaded ({THREADS}=1) by design"
    return ""


def evaluate_step(spec, answer, node, context):
    """The compile cache facts of the fact pass.

    The expected fingerprint: torch's build and CUDA from the venv's torch/version.py, triton from its METADATA
    (what the acting module reads too), the GPU models from preflight. When the training venv step is in the pass
    for this venv and will rebuild it, the lock's torch names what is expected (its CUDA from the build variant,
    triton unknown until the rebuild) and every cache is stale: none is kept or adopted.
    """
    label = context["target"]["label"]
    check_answer(answer, spec)
    gpus = gpu_names_of(context)
    venv_changes, lock_torch = venv_plan_of(spec, context)
    if venv_changes:
        expected, expected_from = planned_fingerprint(lock_torch, gpus), PLANNED_FROM
    else:
        expected = venv_fingerprint(answer, gpus)
        expected_from = "venv"
    return judge(
        spec,
        answer,
        label,
        expected=expected,
        expected_from=expected_from,
        venv_changes=venv_changes,
        ending=ending_pids_of(context),
    )


def module_facts(
    spec, answer, label, *, venv_pending=False, planned_torch=None, check_mode=False, ending=(), window=()
):
    """The same facts for the acting module, from its own probe read (GPU names from its own nvidia-smi);
    ``window``: real paths the acting script left in use (see :func:`judge`). ``venv_pending`` in ``check_mode``:
    the venv step built nothing, so the venv in the target (none, on a fresh one) is not what the caches are for;
    they are judged against the lock's torch (``planned_torch``), as the fact pass judged them."""
    check_answer(answer, spec)
    gpus, problem = gpu_names_read(answer)
    if venv_pending and check_mode:
        expected, expected_from = planned_fingerprint(planned_torch, gpus), PLANNED_FROM
    else:
        expected, expected_from = venv_fingerprint(answer, gpus), "venv"
    return judge(
        spec,
        answer,
        label,
        expected=expected,
        expected_from=expected_from,
        venv_changes=venv_pending,
        ending=ending,
        extra_problems=[f"{label}: {problem}"] if problem else [],
        window=window,
    )


# -- the fact pass ---------------------------------------------------------------------------------------------
def probe_payload(spec, timeout=60, *, gpus=False):
    """What the probe part reads inside the target; ``gpus`` adds the nvidia-smi query of the GPU names (the
    fact pass has them from preflight)."""
    return {
        "user": spec["user"],
        "venv": spec["venv"],
        "roots": list(spec["roots"]),
        "stamp_name": spec["stamp_name"],
        "timeout": timeout,
        "nvidia_smi_argv": query_gpu_argv(GPU_NAME_FIELDS) if gpus else None,
    } | (
        # Where the warm-up's command would be found: a warm-up that cannot start fails before any purge.
        {"warmup": {"command": spec["warmup"][0], "path": warmup_environment(spec, None, "")["PATH"]}}
        if spec["warmup"]
        else {}
    )


def read_node(spec, target, answer, context):
    """Nothing on the node: the caches live inside the target."""
    return {}


# -- acting ----------------------------------------------------------------------------------------------------
def act_payload(spec, facts, answer, timeout):
    """What the acting script needs: each root's action, the fingerprint to stamp, the warm-up."""
    actions = {"stale": "purge", "unstamped": "stamp"}  # a root that needs a window: no action
    user = answer["user"]
    warmup = None
    if facts["warmup"] and facts["warmup"]["planned"]:
        home = user.get("home")
        warmup = {
            "argv": list(spec["warmup"]),
            "env": warmup_environment(spec, home, facts["roots"][0]["path"]),
            "timeout": spec["warmup_timeout"],
            "cwd": home or "/",
            "user": spec["user"],
            "uid": user.get("uid"),
            "gid": user.get("gid"),
        }
    return {
        "roots": [
            {
                "path": r["path"],
                "real_path": r["real_path"],
                "id": r["id"],  # the script acts only on the very directory judged here
                "action": None if r.get("window") else actions.get(r["verdict"]),
            }
            for r in facts["roots"]
        ],
        "fingerprint": facts["expected"],
        "stamp_name": spec["stamp_name"],
        "homes": answer["homes"],
        "uid": user.get("uid"),
        "warmup": warmup,
        "timeout": timeout,
    } | ({"unattended": True} if spec.get("unattended") else {})
