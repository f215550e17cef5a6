# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fact pass's AnsiballZ payload kept between runs, on the controller (the target_facts action).

Building the payload is the largest controller cost of a converged run (recursive_finder parses every module_utils
file the module reaches with ``ast``: about 0.45 s of a 2.7 s run, docs/benchmarks.md), and Ansible caches it only
inside one ansible-playbook process. The action keeps the payload Ansible built in ``pve-gpu-recover-ansiballz``
beside Ansible's own local temp directories (``local_tmp``), under a key made of everything that goes into it
(ansible-core's version and location, the controller's Python, the module's bytes and every file of every
``module_utils`` directory), and puts it back where Ansible looks before it would build it again. A changed file is
a new key, so a stale payload is never used; the store keeps the newest KEEP keys. Anything unexpected (a store
that is not the user's own, a read-only home, any exception of the store) leaves the action exactly as ``normal``:
it only ever saves time.

Where Ansible keeps its cache (``<local_tmp>/ansiballz_cache``) and how it names a payload there
(``<fqn>-<compression>-<extension set>``) are ansible-core internals, so the store is used only on the ansible-core
versions it was written and tested for, KNOWN_ANSIBLE (the project's supported range: ``make test`` runs the unit
tests, these included, on both ends); on any other version Ansible builds the payload itself, as it always does.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib.util
import io
import marshal
import os
import re
import shutil
import stat
import sys
import tempfile
import zipfile

import ansible
from ansible.utils.display import Display

display = Display()

STORE_NAME = "pve-gpu-recover-ansiballz"


# ansible-core versions (major, minor) whose AnsiballZ cache the store was written and tested for: 2.19 to 2.21.
KNOWN_ANSIBLE = frozenset({(2, 19), (2, 20), (2, 21)})


KEEP = 4  # payload keys kept: one per version of the code a controller still runs, about 0.3 MB each


def known_ansible(version):
    """Whether ansible-core ``version`` (``2.19.14``, ``2.21.0rc1``) is one the payload store knows (KNOWN_ANSIBLE)."""
    match = re.match(r"([0-9]+)\.([0-9]+)(?:\.|$)", str(version))
    return bool(match) and (int(match[1]), int(match[2])) in KNOWN_ANSIBLE


def guarded(what, function, *args):
    """``function(*args)``, or None after any exception, said at -vvv: the store only ever saves time, so nothing it
    does may fail the task (Ansible then builds the payload as it always does)."""
    try:
        return function(*args)
    except Exception as error:  # by design: no failure of the store is a failure of the run
        display.vvv(f"target_facts: AnsiballZ payload not {what}: {type(error).__name__}: {error}")
        return None


def payload_key(module_path, utils_dirs, *, ansible_version=None, python=None):
    """A hex digest of everything an AnsiballZ payload of ``module_path`` is built from; pure but for reading."""
    digest = hashlib.sha256()
    digest.update(f"{ansible_version or ansible.__version__}\0{os.path.dirname(ansible.__file__)}\0".encode())
    digest.update(f"{python or sys.version}\0".encode())
    for path in [module_path, *sorted(python_files(utils_dirs))]:
        digest.update(path.encode() + b"\0")
        with open(path, "rb") as handle:
            digest.update(hashlib.sha256(handle.read()).digest())
    return digest.hexdigest()[:32]


def python_files(dirs):
    """Every ``.py`` file under ``dirs`` (recursively), missing directories skipped."""
    found = []
    for top in dirs:
        for root, subdirs, files in os.walk(top):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            found += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return found


def module_fqn(module_path):
    """The name Ansible's payload cache files a module under: ``ansible_collections.pve_gpu.recover.plugins.modules.
    target_facts`` for a collection's module (ansible-core's own rule, an internal), ``ansible.legacy.<name>`` for
    one found on a library path."""
    from ansible.executor.module_common import _get_ansible_module_fqn  # noqa: PLC0415 (an internal: known versions)

    try:
        return _get_ansible_module_fqn(module_path)
    except ValueError:
        return f"ansible.legacy.{os.path.splitext(os.path.basename(module_path))[0]}"


def private_dir(path):
    """``path`` made if missing (mode 0700); whether it is a directory of this user that nobody else can write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def cached_names(directory, fqn):
    """The payload files Ansible's cache holds for module ``fqn`` (one per compression and extension set)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(f"{fqn}-") and not n.endswith(".lock"))


def copy_atomically(source, target):
    """``source`` to ``target`` through a temporary file in its directory: a reader never sees half a payload."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out)
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise


def restore(store, key, local_cache, fqn):
    """Put the kept payloads of ``key`` where Ansible looks for them; how many were put back."""
    kept = os.path.join(store, key)
    names = [n for n in cached_names(kept, fqn) if not os.path.exists(os.path.join(local_cache, n))]
    if names:
        os.makedirs(local_cache, mode=0o700, exist_ok=True)
    for name in names:
        copy_atomically(os.path.join(kept, name), os.path.join(local_cache, name))
    return len(names)


def keep(store, key, local_cache, fqn, limit=KEEP):
    """Keep the payloads Ansible built for ``fqn`` under ``key``, then drop all but the ``limit`` newest keys;
    how many payloads were kept."""
    kept = os.path.join(store, key)
    names = [n for n in cached_names(local_cache, fqn) if not os.path.exists(os.path.join(kept, n))]
    if not names:
        return 0
    os.makedirs(kept, mode=0o700, exist_ok=True)
    for name in names:
        copy_atomically(os.path.join(local_cache, name), os.path.join(kept, name))
        guarded("compiled", with_bytecode, os.path.join(kept, name))
    os.utime(kept)
    keys = sorted((os.path.join(store, k) for k in os.listdir(store)), key=os.path.getmtime, reverse=True)
    for old in keys[limit:]:
        shutil.rmtree(old, ignore_errors=True)
    return len(names)


def bytecode(source, name):
    """A checked hash-based ``.pyc`` of ``source`` (bytes of the file ``name``) for this Python (pure): the importer
    uses it only when its magic number is its own and the source's hash matches, else compiles the source."""
    code = compile(source, name, "exec", dont_inherit=True)
    flags = 0b11  # hash-based, checked against the source (PEP 552)
    return (
        importlib.util.MAGIC_NUMBER
        + flags.to_bytes(4, "little")
        + importlib.util.source_hash(source)
        + marshal.dumps(code)
    )


def with_bytecode(path):
    """Add each module's bytecode beside its source in the payload Ansible cached at ``path``; whether it did.

    The node's Python imports every module of the payload from the zip, and compiles each from source every run:
    0.25 s of a converged run's 0.45 s module start on the lab's node (docs/benchmarks.md). With the ``.pyc`` beside
    it (for this controller's Python: the node's Python of the same minor uses it, another one compiles the source
    as before), it only loads them. How Ansible caches a payload (``_CachedModule``: a pickle holding the base64 zip)
    is an ansible-core internal: KNOWN_ANSIBLE only, and any failure leaves the payload as Ansible built it."""
    from ansible.executor.module_common import _CachedModule  # noqa: PLC0415 (an internal: known versions)

    cached = _CachedModule.load(path)
    source = zipfile.ZipFile(io.BytesIO(base64.b64decode(cached.zip_data)))
    if any(name.endswith(".pyc") for name in source.namelist()):
        return False
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as payload:
        for info in source.infolist():
            data = source.read(info)
            payload.writestr(info, data)
            if info.filename.endswith(".py"):
                compiled = zipfile.ZipInfo(info.filename + "c", date_time=info.date_time)
                payload.writestr(compiled, bytecode(data, info.filename), compress_type=zipfile.ZIP_DEFLATED)
    dataclasses.replace(cached, zip_data=base64.b64encode(out.getvalue())).dump(path)
    return True


def place(module_path, local_tmp, utils_paths=()):
    """``(store, key, local_cache, fqn)`` of the payload of ``module_path`` (``local_tmp``: Ansible's per-process
    directory, whose cache is ``<it>/ansiballz_cache``; ``utils_paths``: the configured module_utils directories),
    or None when it is not to be kept (an ansible-core the store does not know, a store that is not private)."""
    if not known_ansible(ansible.__version__):
        display.vvv(
            f"target_facts: ansible-core {ansible.__version__} is not one the AnsiballZ payload store knows "
            f"({', '.join(f'{major}.{minor}' for major, minor in sorted(KNOWN_ANSIBLE))}): Ansible builds the "
            "payload itself"
        )
        return None
    try:
        store = os.path.join(os.path.dirname(local_tmp), STORE_NAME)
        if not private_dir(store):
            return None
        # The collection's module_utils (plugins/modules/../module_utils) and any configured directory.
        collection_utils = os.path.join(os.path.dirname(os.path.dirname(module_path)), "module_utils")
        key = payload_key(module_path, [collection_utils, *(utils_paths or [])])
        fqn = module_fqn(module_path)
    except (OSError, AttributeError, ValueError) as error:
        display.vvv(f"target_facts: AnsiballZ payload not kept: {error}")
        return None
    return store, key, os.path.join(local_tmp, "ansiballz_cache"), fqn
