"""The drift runner. It is plain Python on the controller that imports the collection's module_utils (the registry
of steps, the escaper): a checkout holds the collection under collections/ (a link to itself); an installed
collection lies at <path>/ansible_collections/pve_gpu/recover, so <path> is what goes on sys.path."""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_COLLECTIONS = str(_ROOT / "collections" if (_ROOT / "collections").is_dir() else _ROOT.parents[2])
if _COLLECTIONS not in sys.path:
    sys.path.append(_COLLECTIONS)
