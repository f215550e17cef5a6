# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whether two drift runs of the same fleet said the same: their summaries' targets and their textfiles, less what
names or times a run (run ids, report paths, seconds, timestamps, durations).

    python3 same_drift.py SUMMARY_A TEXTFILE_A SUMMARY_B TEXTFILE_B

Exit 0 when they agree; 1 with every difference on stderr. Molecule's recover scenario compares a run that reads
each node's CTs in one execution (``preflight_per_node``, the default) with one that reads each CT alone.
"""

from __future__ import annotations

import json
import re
import sys

# What names or times one run: never the same in two runs, whatever they found.
RUN_KEYS = frozenset({"report", "run_id", "seconds"})
RUN_SERIES = re.compile(r"^pve_gpu_recover_\w*_seconds\b")  # timestamps and durations
RUN_LABEL = re.compile(r'run_id="[^"]*",?')


def comparable_summary(summary):
    """The summary's targets, every run-naming key dropped at any depth."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in RUN_KEYS}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(summary.get("targets") or {})


def comparable_textfile(text):
    """The textfile's series lines that do not time a run, less the label that names it, sorted."""
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    return sorted(RUN_LABEL.sub("", line) for line in series if not RUN_SERIES.search(line))


def differences(summary_a, text_a, summary_b, text_b):
    """Every difference, one line each; empty when the two runs said the same."""
    found = []
    targets_a, targets_b = comparable_summary(summary_a), comparable_summary(summary_b)
    for name in sorted(set(targets_a) | set(targets_b)):
        if targets_a.get(name) != targets_b.get(name):
            found.append(f"target {name}: {json.dumps(targets_a.get(name))} != {json.dumps(targets_b.get(name))}")
    lines_a, lines_b = comparable_textfile(text_a), comparable_textfile(text_b)
    found += [f"only in the first textfile: {line}" for line in sorted(set(lines_a) - set(lines_b))]
    found += [f"only in the second textfile: {line}" for line in sorted(set(lines_b) - set(lines_a))]
    return found


def main(argv):
    if len(argv) != 4:
        sys.exit(__doc__)
    summary_a, text_a, summary_b, text_b = argv
    with open(summary_a, encoding="utf-8") as a, open(summary_b, encoding="utf-8") as b:
        first, second = json.load(a), json.load(b)
    with open(text_a, encoding="utf-8") as a, open(text_b, encoding="utf-8") as b:
        found = differences(first, a.read(), second, b.read())
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
