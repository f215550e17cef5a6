# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The drift runner's command line: its options, and the clear errors a person meets first (no inventory, no
recover.yml, a textfile directory that does not exist, --correct on a checkout that does not run unattended)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from drift import unattended
from drift.errors import DriftError
from drift.playbook import PLAYBOOK
from drift.text import one_line

EXIT_FAILED = 1
# The extra variable a correction run sets; the roles leave what is unsafe unattended to a window.
UNATTENDED = unattended.UNATTENDED
# At most this many seconds of --timeout for --correct's proof that the checkout runs unattended.
PROBE_TIMEOUT = 120


class Parser(argparse.ArgumentParser):
    """Usage errors exit 1: the runner's exit 2 means drift, which a typo must never look like."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_FAILED, f"{self.prog}: error: {message}\n")


def parse_args(argv):
    root = Path(__file__).resolve().parent.parent
    parser = Parser(
        prog="drift/runner.py",
        description="Run recover.yml in check mode (--check --diff) through ansible-runner, write a JSON summary "
        "and a Prometheus textfile. Exit 0: all in spec; 2: drift; 1: a failure (wins over drift).",
    )
    parser.add_argument(
        "--inventory", "-i", action="append", required=True, help="inventory file or directory (repeatable)"
    )
    parser.add_argument(
        "--project",
        type=Path,
        default=root,
        help="the collection whose recover.yml runs: a checkout or an installed copy (default: %(default)s)",
    )
    parser.add_argument(
        "--textfile", type=Path, help="Prometheus textfile to write atomically (e.g. .../pve_gpu_recover.prom)"
    )
    parser.add_argument("--summary", default="-", help="JSON summary path, '-' for stdout (default)")
    parser.add_argument(
        "--correct",
        action="store_true",
        help=f"after the check, recover the drifting targets for real with {UNATTENDED}=true",
    )
    parser.add_argument("--limit", "-l", help="ansible --limit pattern")
    parser.add_argument("--forks", "-f", type=int, help="ansible --forks")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3000,
        help="seconds for the whole run, check and correction (default: %(default)s)",
    )
    parser.add_argument("--extra-vars", "-e", action="append", default=[], help="ansible -e (repeatable; @file works)")
    parser.add_argument(
        "--reports-dir", type=Path, help="where each run keeps its reports and logs (default: PROJECT/reports/drift)"
    )
    parser.add_argument(
        "--keep-runs", type=int, default=48, help="run directories kept under --reports-dir (default: %(default)s)"
    )
    parser.add_argument("--lock-file", type=Path, help="the runner's lock (default: REPORTS_DIR/drift.lock)")
    args = parser.parse_args(argv)
    if args.timeout < 1:
        parser.error("--timeout must be at least 1 second")
    if args.keep_runs < 1:
        parser.error("--keep-runs must be at least 1")
    if args.forks is not None and args.forks < 1:
        parser.error("--forks must be at least 1")
    return args


def check_options(args):
    """Absolute paths, and the clear errors a person meets first: no inventory, no recover.yml, --correct unsafe."""
    args.project = args.project.expanduser().resolve()
    playbook = args.project / PLAYBOOK
    if not playbook.is_file():
        raise DriftError(
            f"{playbook} not found: --project must be the pve_gpu.recover collection (a checkout or an installed "
            f"copy) that holds {PLAYBOOK} (got {args.project})"
        )
    inventories = []
    for inventory in args.inventory:
        path = Path(inventory).expanduser()
        if not path.exists():
            raise DriftError(
                f"inventory {inventory} not found (from {Path.cwd()}): pass an inventory file or directory, "
                f"e.g. --inventory {args.project / 'inventory' / 'proxmox'}"
            )
        inventories.append(str(path.resolve()))
    args.inventory = inventories
    # Absolute, links not resolved: the runner checks the path itself (a planted link is refused, not followed).
    args.reports_dir = Path(os.path.abspath((args.reports_dir or args.project / "reports" / "drift").expanduser()))
    args.lock_file = Path(os.path.abspath((args.lock_file or args.reports_dir / "drift.lock").expanduser()))
    if args.textfile is not None:
        args.textfile = args.textfile.expanduser().resolve()
        if not args.textfile.parent.is_dir():
            raise DriftError(
                f"the textfile's directory {args.textfile.parent} does not exist: create it (node_exporter's "
                "--collector.textfile.directory) or pass another --textfile"
            )
    return args


def check_unattended(ansible_runner, project, *, timeout, cancel=lambda: False):
    """Refuse --correct unless the checkout's recover.yml hands ``recover_unattended`` to the fact pass and to each
    acting module (drift/unattended.py runs it, in check mode, with stand-in modules, in about 2 s)."""
    problems = unattended.probe(ansible_runner, project, timeout=min(timeout, PROBE_TIMEOUT), cancel=cancel)
    if problems:
        raise DriftError(
            f"--correct refused: {project}'s recover.yml, run in check mode with {UNATTENDED}=true against a "
            f"stand-in target, does not run its steps unattended ({'; '.join(one_line(p) for p in problems)}), so "
            "a real run could end a live training job or swap a venv under it; run without --correct (check only) "
            "until the roles pass it on"
        )
