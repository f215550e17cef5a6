"""The drift runner. It is plain Python on the controller that imports the collection's module_utils (the registry
of steps, the escaper): a checkout holds the collection under collections/ (a link to itself); an installed
collection lies at <path>/ansible_collections/pve_gpu/recover, so <path> is what goes on sys.path."""

import configparser
import contextlib
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# Where the collection this runner belongs to lies: a checkout's collections/, or an installed copy's <path>.
COLLECTIONS = str(_ROOT / "collections" if (_ROOT / "collections").is_dir() else _ROOT.parents[2])
if COLLECTIONS not in sys.path:
    sys.path.append(COLLECTIONS)

# ansible-core's own default collections_path.
DEFAULT_COLLECTIONS_PATH = "~/.ansible/collections:/usr/share/ansible/collections"


def collections_path(first, project):
    """ANSIBLE_COLLECTIONS_PATH for an ansible-playbook the runner starts in ``project``: ``first`` (where the
    collection it must run lies), then what that run would have used anyway: this process's
    ANSIBLE_COLLECTIONS_PATH (an AWX job's), else the project's ansible.cfg ``collections_path``, else Ansible's
    default. Set in the environment it replaces ansible.cfg's, hence the rest; relative entries are made absolute
    from where they were meant (this directory for the environment's, the project for ansible.cfg's), since the
    nested run works in the project."""
    inherited = os.environ.get("ANSIBLE_COLLECTIONS_PATH")
    if inherited is not None:
        entries, base = inherited.split(os.pathsep), Path.cwd()
    else:
        config = configparser.ConfigParser(interpolation=None)
        with contextlib.suppress(OSError, configparser.Error):
            config.read(Path(project) / "ansible.cfg", encoding="utf-8")
        value = config.get("defaults", "collections_path", fallback=DEFAULT_COLLECTIONS_PATH)
        entries, base = value.split(os.pathsep), Path(project)
    absolute = [e if e.startswith(("/", "~")) else str(base / e) for e in (e.strip() for e in entries) if e]
    return os.pathsep.join(dict.fromkeys([str(first), *absolute]))
