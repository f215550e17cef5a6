# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""nvidia-smi: the argv shapes this project uses, the ONE parser of their CSV, and its exit codes as clear errors.

Formats follow real captures from an NVIDIA H200 (driver 580.159.04; tests/fixtures/h200):

* ``--format=csv``: a header of canonical field names with units (``memory.used [MiB]``), values with units
  (``0 MiB``, ``123.99 W``), fields joined by ``", "``; ``noheader`` drops the header, ``nounits`` the units.
* ``[N/A]`` / ``[Not Supported]`` / ``[Unknown Error]`` / ``[GPU requires reset]``..., any bracketed cell, mean
  "no value" and become None; where the value matters (memory used, index, uuid) or the marker is more than "not
  available", the row's ``unreadable`` dict keeps the cell as printed, so callers name it and never read None as 0.
* The header prints the canonical name of an alias (``clocks_throttle_reasons.active`` ->
  ``clocks_event_reasons.active``, ``used_memory`` -> ``used_gpu_memory``).
* Processes are reported by HOST pid and ``gpu_uuid``; in a container the index of a GPU may differ from the
  node's, so GPUs are always matched by UUID.

Pure functions (``parse_*``, ``classify_failure``) take text and return plain data; :class:`NvidiaSmi` only
wires them to a ``run(argv) -> CommandResult`` callable (a Target's ``run`` or ``run_on_node``).
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError

EXECUTABLE = "nvidia-smi"

# (field as asked, key in our facts, converter name). The header check maps aliases with ALIASES.
GPU_FIELDS = (
    ("index", "index", "int"),
    ("name", "name", "str"),
    ("uuid", "uuid", "str"),
    ("pci.bus_id", "bus_id", "str"),
    ("driver_version", "driver_version", "str"),
    ("memory.total", "memory_total_mib", "int"),
    ("memory.used", "memory_used_mib", "int"),
    ("memory.free", "memory_free_mib", "int"),
    ("utilization.gpu", "utilization_gpu_pct", "int"),
    ("temperature.gpu", "temperature_c", "int"),
    ("persistence_mode", "persistence_mode", "enabled"),
    ("compute_mode", "compute_mode", "str"),
    ("ecc.errors.uncorrected.volatile.total", "ecc_uncorrected_volatile", "int"),
    ("clocks_event_reasons.active", "clocks_event_reasons_active", "str"),
    ("pcie.link.gen.current", "pcie_link_gen", "int"),
    ("pcie.link.width.current", "pcie_link_width", "int"),
    ("power.draw", "power_draw_w", "float"),
    ("mig.mode.current", "mig_mode", "str"),
    ("retired_pages.pending", "retired_pages_pending", "yes_no"),
    ("remapped_rows.pending", "remapped_rows_pending", "yes_no"),
    ("remapped_rows.failure", "remapped_rows_failure", "yes_no"),
    ("pcie.link.gen.max", "pcie_link_gen_max", "int"),
    ("pcie.link.width.max", "pcie_link_width_max", "int"),
    ("gpu_recovery_action", "recovery_action", "str"),
    ("ecc.errors.uncorrected.aggregate.total", "ecc_uncorrected_aggregate", "int"),
)
# Fields older drivers do not know (exit 2 "is not a valid field"): dropped and asked again once, then None.
OPTIONAL_GPU_FIELDS = ("remapped_rows.failure", "gpu_recovery_action")
# The seed query of the memory-free poll: cheap (about 23 ms on an H200) and all the wait needs.
MEMORY_FIELDS = (
    ("index", "index", "int"),
    ("uuid", "uuid", "str"),
    ("memory.used", "memory_used_mib", "int"),
)
# What preflight asks inside a target: are the GPUs there and which driver does NVML report.
DRIVER_FIELDS = (
    ("index", "index", "int"),
    ("uuid", "uuid", "str"),
    ("driver_version", "driver_version", "str"),
)
APP_FIELDS = (
    ("pid", "pid", "int"),
    ("process_name", "process_name", "str"),
    ("used_memory", "used_memory_mib", "int"),
    ("gpu_uuid", "gpu_uuid", "str"),
)

# alias -> canonical name as nvidia-smi prints it in a csv header (from `nvidia-smi --help-query-*`).
ALIASES = {
    "gpu_name": "name",
    "gpu_serial": "serial",
    "gpu_uuid": "uuid",
    "gpu_bus_id": "pci.bus_id",
    "used_memory": "used_gpu_memory",
    "inforom.image": "inforom.img",
    "inforom.power": "inforom.pwr",
}
APP_ALIASES = {"name": "process_name", "used_memory": "used_gpu_memory"}
THROTTLE_PREFIX = "clocks_throttle_reasons."
EVENT_PREFIX = "clocks_event_reasons."

# Anything nvidia-smi prints in brackets instead of a value: [N/A], [Not Supported], [Unknown Error],
# [Insufficient Permissions], [GPU is lost], [GPU requires reset], [Requested functionality has been deprecated]...
NO_VALUE = re.compile(r"^\[[^\[\]\n]*\]$")
# Markers that only say "this GPU or driver has no such value": normal for an optional health field.
NOT_AVAILABLE = ("[N/A]", "[Not Supported]")
# Fields whose value the recovery needs: a marker there is recorded (row["unreadable"]) so callers can name it.
REQUIRED_KEYS = frozenset({"index", "uuid", "memory_used_mib", "memory_total_mib", "pid", "gpu_uuid"})
# A GPU UUID as nvidia-smi prints it (``GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff9``); MIG device UUIDs are not
# printed by --query-gpu. Anything else read inside a CT is refused before it can reach a message or advice.
GPU_UUID = re.compile(r"GPU-[0-9a-fA-F-]{1,64}")
SHOWN_RAW = 60  # how many characters of an unexpected cell a message quotes
UNIT_VALUE = re.compile(r"^(-?\d+(?:\.\d+)?) (MiB|KiB|GiB|%|W|MHz|us|C)$")
HEADER_UNIT = re.compile(r"^(.*?) \[[^\]]+\]$")
PCI_BUS_ID = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d"
GPU_LOST = re.compile(rf"Unable to determine the device handle for GPU ?({PCI_BUS_ID}): (.*)")
INFOROM = re.compile(r"WARNING: infoROM is corrupted at gpu ([0-9A-Fa-f:.]+)")
BAD_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
KERNEL_MODULE = re.compile(r"NVRM version: .*?Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
NVML_LIBRARY = re.compile(r"libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)$")

# nvidia-smi exit codes (nvidia-smi(1), RETURN VALUE) and what a tired person should do about each.
EXIT_CODES = {
    2: (
        "bad_argument",
        "a field or argument is invalid for this driver",
        "the driver is older or newer than expected; run `nvidia-smi --help-query-gpu` on it",
    ),
    3: ("not_supported", "the requested operation is not available on this GPU", "nothing to fix on the node"),
    4: ("no_permission", "no permission to query the GPUs", "run as root (become: true)"),
    6: (
        "no_devices",
        "nvidia-smi found no GPU (No devices were found)",
        "check that the GPUs are passed through to the target (device nodes and cgroup device rules of a CT) and "
        "that the node sees them (`nvidia-smi -L` there)",
    ),
    8: ("power_cables", "a GPU's external power cables are not attached", "check the GPU power cabling"),
    9: (
        "driver_not_loaded",
        "the NVIDIA kernel driver is not loaded",
        "load it (`modprobe nvidia`, or reboot after a driver update) and check `dmesg | grep -i nvrm`",
    ),
    10: (
        "interrupt",
        "the NVIDIA kernel driver detected an interrupt issue with a GPU",
        "check `dmesg` for Xid errors; a reboot is likely needed",
    ),
    12: (
        "no_nvml",
        "the NVML library (libnvidia-ml.so) was not found",
        "install the NVIDIA userspace driver (in a CT: the same version as the node, without the kernel module)",
    ),
    13: (
        "nvml_function",
        "this NVML does not implement the requested function",
        "the userspace driver is older than expected; install the node's driver version",
    ),
    14: ("inforom", "a GPU's InfoROM is corrupted", "the GPU still works but needs an RMA/firmware check"),
    15: (
        "gpu_lost",
        "a GPU has fallen off the bus or is otherwise inaccessible",
        "reboot the node (a GPU that fell off the bus does not come back without one)",
    ),
    18: (
        "driver_mismatch",
        "Driver/library version mismatch",
        "the NVIDIA userspace library differs from the loaded kernel module: install the node's driver "
        "version (without kernel module) in the CT, or reboot the node after a driver update",
    ),
    255: ("internal", "nvidia-smi failed with an internal or driver error", "check `dmesg` for Xid errors"),
}


class NvidiaSmiError(RecoverError):
    """nvidia-smi failed or printed something unexpected. ``kind`` is stable; str() is the one-line message."""

    error_prefix = "nvidia_smi_"


# -- argv shapes ---------------------------------------------------------------------------------------------
def query_gpu_argv(fields=GPU_FIELDS, fmt="csv"):
    """``nvidia-smi --query-gpu=a,b --format=csv``: header kept so the parser can check the columns."""
    return [EXECUTABLE, "--query-gpu=" + ",".join(_names(fields)), f"--format={fmt}"]


def query_apps_argv(fields=APP_FIELDS, fmt="csv"):
    return [EXECUTABLE, "--query-compute-apps=" + ",".join(_names(fields)), f"--format={fmt}"]


def _names(fields):
    return [f[0] if isinstance(f, tuple) else f for f in fields]


# -- parsing -------------------------------------------------------------------------------------------------
def canonical_field(name, apps=False):
    """The name nvidia-smi prints in a csv header for field ``name`` (units stripped, alias resolved)."""
    name = name.strip()
    unit = HEADER_UNIT.match(name)
    if unit:
        name = unit.group(1)
    if name.startswith(THROTTLE_PREFIX):
        name = EVENT_PREFIX + name[len(THROTTLE_PREFIX) :]
    table = APP_ALIASES if apps else ALIASES
    return table.get(name, name)


def split_notices(text):
    """Separate data lines from nvidia-smi's own notices (lost GPU, InfoROM warning) in a query's output.

    Returns ``(data_lines, notices)`` where each notice is a dict ``{kind, bus_id, message}``.
    """
    data, notices = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        lost = GPU_LOST.search(line)
        if lost:
            notices.append({"kind": "gpu_lost", "bus_id": lost.group(1), "message": line.strip()})
            continue
        inforom = INFOROM.search(line)
        if inforom:
            notices.append({"kind": "inforom", "bus_id": inforom.group(1), "message": line.strip()})
            continue
        data.append(line)
    return data, notices


def valid_uuid(text):
    """True when ``text`` is a GPU UUID (``GPU-`` and hex digits/dashes) and nothing else, e.g. no shell syntax.

    >>> valid_uuid("GPU-993fc641-cebc-abe5-5c7f-fa80fed8aff9"), valid_uuid("GPU-1; reboot")
    (True, False)
    """
    return isinstance(text, str) and GPU_UUID.fullmatch(text) is not None


def shown(raw):
    """An untrusted cell as messages quote it: repr (so it stays inert) of at most SHOWN_RAW characters."""
    text = str(raw)
    return repr(text if len(text) <= SHOWN_RAW else text[:SHOWN_RAW] + "...")


def parse_value(raw):
    """One csv cell: units stripped (``"143771 MiB"`` -> ``"143771"``), ``[N/A]``-style markers -> None."""
    value = raw.strip()
    if NO_VALUE.match(value):
        return None
    unit = UNIT_VALUE.match(value)
    return unit.group(1) if unit else value


def parse_csv(text, fields, *, header=True, apps=False, raws=None):
    """Rows of an nvidia-smi csv as dicts keyed by our fact keys, values still strings (or None).

    ``fields`` is a sequence of ``(field, key, converter)``. With ``header``, the header must name the requested
    fields (aliases resolved) in order, or NvidiaSmiError(kind="format") says what differed. A row with more
    cells than fields (a process name containing ", ") folds the extra cells into its one free-text column.
    ``raws``, when a list, receives each row's cells as printed (and the line as ``_line``).
    """
    if not isinstance(text, str):
        raise NvidiaSmiError(f"nvidia-smi output is a {type(text).__name__}, not text", kind="probe")
    lines, _ = split_notices(text)
    names = _names(fields)
    if header:
        if not lines:
            raise NvidiaSmiError("nvidia-smi printed no csv header", kind="format", stdout=text)
        got = [canonical_field(h, apps) for h in lines[0].split(", ")]
        want = [canonical_field(n, apps) for n in names]
        if got != want:
            raise NvidiaSmiError(
                f"nvidia-smi csv header is {lines[0]!r}, expected the fields {', '.join(want)}",
                kind="format",
                stdout=text,
            )
        lines = lines[1:]
    rows = []
    for line in lines:
        cells = line.split(", ")
        if len(cells) > len(names) and "process_name" in [canonical_field(n, apps) for n in names]:
            at = [canonical_field(n, apps) for n in names].index("process_name")
            extra = len(cells) - len(names)
            cells[at : at + extra + 1] = [", ".join(cells[at : at + extra + 1])]
        if len(cells) != len(names):
            raise NvidiaSmiError(
                f"nvidia-smi csv row has {len(cells)} cells, expected {len(names)}: {line!r}",
                kind="format",
                stdout=text,
            )
        rows.append({f[1]: parse_value(cell) for f, cell in zip(fields, cells, strict=True)})
        if raws is not None:
            raws.append(dict({f[1]: cell for f, cell in zip(fields, cells, strict=True)}, _line=line))
    return rows


def convert(value, how):
    """Typed value of one parsed cell: int, float, bool (``Enabled``/``Yes``) or str; None stays None.

    Raises ValueError for a number that is not one (``typed_rows`` turns that into None plus a note).
    """
    if value is None:
        return None
    if how == "int":
        return int(value, 0) if value.startswith("0x") else int(float(value))
    if how == "float":
        return float(value)
    if how == "enabled":
        return value == "Enabled"
    if how == "yes_no":
        return value == "Yes"
    return value


def typed_row(row, fields, raw=None):
    """One row with typed values; a value that cannot be read is None, and ``unreadable`` notes why.

    ``unreadable`` (only present when needed) maps a key to the cell as printed: every marker in a REQUIRED_KEYS
    field (``memory_used_mib: "[GPU requires reset]"``), markers other than [N/A]/[Not Supported] in the others,
    and any number that is not one. Callers name the GPU and this raw value instead of guessing (None is never 0).
    """
    typed, unreadable = {}, {}
    for _, key, how in fields:
        cell = (raw or {}).get(key, "")
        try:
            typed[key] = convert(row.get(key), how)
        except (ValueError, OverflowError):
            typed[key] = None
            unreadable[key] = cell.strip()[:SHOWN_RAW]
            continue
        marker = typed[key] is None and NO_VALUE.match(cell.strip())
        if marker and (key in REQUIRED_KEYS or cell.strip() not in NOT_AVAILABLE):
            unreadable[key] = cell.strip()[:SHOWN_RAW]
    if unreadable:
        typed["unreadable"] = unreadable
    return typed


def typed_rows(rows, fields, raws=None):
    return [typed_row(row, fields, raw) for row, raw in zip(rows, raws or [None] * len(rows), strict=True)]


def parse_gpus(text, fields=GPU_FIELDS, *, header=True):
    """GPU facts from ``--query-gpu`` csv: a list of dicts with typed values (see GPU_FIELDS for the keys).

    The output may come from inside a CT, which is not trusted: a ``uuid`` that is not a GPU UUID raises
    NvidiaSmiError(kind="probe") naming the row, so it never reaches a message or the advice a person copies into
    a root shell (``nvidia-smi --gpu-reset -i <uuid>``).
    """
    raws = []
    rows = parse_csv(text, fields, header=header, raws=raws)
    typed = typed_rows(rows, fields, raws)
    if any(key == "uuid" for _, key, _ in fields):
        for number, (row, raw) in enumerate(zip(typed, raws, strict=True), 1):
            if not valid_uuid(row["uuid"]):
                raise NvidiaSmiError(
                    f"nvidia-smi row {number} names GPU {row.get('index')} with uuid {shown(raw['uuid'].strip())}, "
                    f"which is not a GPU UUID (GPU-<hex digits and dashes>); is something in the target replacing "
                    f"nvidia-smi?",
                    kind="probe",
                    stdout=text,
                    details={"bad_row": shown(raw["_line"])},
                )
    return typed


def parse_apps(text, fields=APP_FIELDS, *, header=True):
    """Compute processes from ``--query-compute-apps`` csv: pid (host pid), process_name, used_memory_mib, gpu_uuid."""
    raws = []
    rows = parse_csv(text, fields, header=header, apps=True, raws=raws)
    return typed_rows(rows, fields, raws)


def parse_kernel_driver_version(text):
    """``580.159.04`` from /proc/driver/nvidia/version (proprietary or open kernel module), or None."""
    match = KERNEL_MODULE.search(text or "")
    return match.group(1) if match else None


def parse_library_version(filename):
    """``580.159.04`` from a ``libnvidia-ml.so.580.159.04`` file name, or None (e.g. the ``.so.1`` link)."""
    match = NVML_LIBRARY.search(filename or "")
    return match.group(1) if match and match.group(1).count(".") >= 1 else None


def classify_failure(rc, stdout, stderr, truncated=False):
    """NvidiaSmiError for a failed nvidia-smi run, or None when the output can be used (rc 0, or 14 = warning).

    The version-mismatch message is recognised whatever the exit code, since it is the one users search for.
    ``truncated``: the target's runner kept only the first bytes of what it printed (ct_run.OUTPUT_CAP): its
    output is untrusted and not read.
    """
    if truncated:
        return NvidiaSmiError(
            "nvidia-smi printed more than 4 MiB (a few KB per GPU expected): its output was cut and is not read; "
            "check what runs as nvidia-smi in the target",
            kind="probe",
            rc=rc,
        )
    text = f"{stdout}\n{stderr}"
    if "Driver/library version mismatch" in text:
        library = re.search(r"NVML library version: (\S+)", text)
        return NvidiaSmiError(
            "NVML says Driver/library version mismatch" + (f" (NVML library {library.group(1)})" if library else ""),
            kind="driver_mismatch",
            hint=EXIT_CODES[18][2],
            rc=rc,
            stdout=stdout,
            stderr=stderr,
        )
    if rc in (0, 14):
        return None
    if rc == 2:
        bad = BAD_FIELD.search(text)
        if bad:
            return NvidiaSmiError(
                f"this driver does not know the query field {bad.group(1)!r} (nvidia-smi exit 2)",
                kind="bad_field",
                hint=EXIT_CODES[2][2],
                rc=rc,
                stdout=stdout,
                stderr=stderr,
                details={"field": bad.group(1)},
            )
    kind, what, hint = EXIT_CODES.get(rc, ("failed", f"nvidia-smi failed with exit code {rc}", None))
    if rc == 15:
        lost = sorted({n["bus_id"] for n in split_notices(text)[1] if n["kind"] == "gpu_lost"})
        if lost:
            what = f"GPU {', '.join(lost)} has fallen off the bus or is otherwise inaccessible"
        return NvidiaSmiError(
            f"{what} (nvidia-smi exit 15)",
            kind=kind,
            hint=hint,
            rc=rc,
            stdout=stdout,
            stderr=stderr,
            details={"lost_bus_ids": lost},
        )
    said = next((line.strip() for line in text.splitlines() if line.strip()), "")
    message = f"{what} (nvidia-smi exit {rc})" + (f": {said}" if said and rc not in (6, 9, 12) else "")
    return NvidiaSmiError(message, kind=kind, hint=hint, rc=rc, stdout=stdout, stderr=stderr)


class NvidiaSmi:
    """nvidia-smi through ``run(argv, check=False) -> CommandResult`` (Target.run or Target.run_on_node)."""

    def __init__(self, run, *, timeout=30):
        self.run = run
        self.timeout = timeout
        self.notices = []

    def _query(self, argv):
        result = self.run(argv, timeout=self.timeout, check=False)
        failure = classify_failure(result.rc, result.stdout, result.stderr)
        if failure:
            failure.cmd = result.argv
            raise failure
        self.notices.extend(split_notices(result.stdout)[1])
        return result.stdout

    def gpus(self, fields=GPU_FIELDS):
        """Typed facts of every GPU this target sees; optional fields unknown to an old driver are None."""
        asked = tuple(fields)
        while True:
            try:
                rows = parse_gpus(self._query(query_gpu_argv(asked)), asked)
                break
            except NvidiaSmiError as error:
                field = error.details.get("field")
                if error.kind != "bad_field" or field not in OPTIONAL_GPU_FIELDS:
                    raise
                asked = tuple(f for f in asked if f[0] != field)
        missing = [key for _, key, _ in fields if all(key != k for _, k, _ in asked)]
        for row in rows:
            row.update(dict.fromkeys(missing))
        return rows

    def memory(self):
        """index, uuid and memory_used_mib of every GPU: the cheap query a memory-free poll repeats."""
        return parse_gpus(self._query(query_gpu_argv(MEMORY_FIELDS)), MEMORY_FIELDS)

    def compute_apps(self):
        """Every compute process NVML knows on the GPUs this target sees (HOST pids, keyed by gpu_uuid)."""
        return parse_apps(self._query(query_apps_argv(APP_FIELDS)), APP_FIELDS)
