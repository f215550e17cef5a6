# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Node side: the Xid errors the NVIDIA driver logged in the node's kernel log, per GPU (by its PCI address).

The driver writes each one as a kernel message, ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the
bus.``; the kernel keeps its messages in a ring buffer since boot, which ``/dev/kmsg`` gives one record per read
(``<priority>,<sequence>,<microseconds since boot>,<flags>;<message>``; lines of ``key=value`` that start with a
space continue a record). A GPU passed through to a CT keeps the node's PCI address, so the CT's ``pci.bus_id``
finds its Xids. Read once per module execution and node (shared_reads), only by root, never in a CT.
"""

from __future__ import annotations

import errno
import os
import re

KERNEL_LOG = "/dev/kmsg"
# The kernel's buffer is 128 KiB to a few MiB; past this the rest is left (the newest records come last).
MAX_BYTES = 16 * 1024 * 1024
# A message of the driver's: the GPU's PCI domain, bus and device (some drivers add the function), the Xid code.
XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?\): (\d{1,5})\b")
# nvidia-smi's pci.bus_id: ``00000000:3B:00.0``.
BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.[0-7]$")
MAX_CODES = 32  # distinct Xid codes kept per GPU
# Records lost to a kernel that logs faster than they are read (EPIPE) before the read stops with what it has.
MAX_LOST = 1000


def pci_key(domain, bus, device):
    """``("0000", "3B", "00")`` -> ``"0000:3b:00"``: the GPU's address as the kernel and nvidia-smi both give it."""
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"


def bus_key(bus_id):
    """``"00000000:3B:00.0"`` -> ``"0000:3b:00"``; None for anything else."""
    found = BUS_ID.match(bus_id) if isinstance(bus_id, str) else None
    return pci_key(*found.groups()) if found else None


def read_kernel_log(path=KERNEL_LOG, limit=MAX_BYTES):
    """The kernel's messages as text, one record a line; None when the log cannot be read (no such file, not root,
    ``kernel.dmesg_restrict``). A record overwritten while it is read (EPIPE) is skipped, as dmesg does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    chunks, size, lost = [], 0, 0
    try:
        while size < limit and lost < MAX_LOST:
            try:
                chunk = os.read(fd, 65536)  # /dev/kmsg: one record; a file (tests): the next bytes
            except BlockingIOError:
                break  # the end of the buffer
            except OSError as error:
                if error.errno == errno.EPIPE:
                    lost += 1
                    continue
                if not chunks:
                    return None
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def boot_time(stat="/proc/stat"):
    """The node's boot as Unix time (``btime`` of /proc/stat), or None."""
    try:
        with open(stat, encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("btime "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def parse_xids(text, booted):
    """``{"0000:3b:00": {79: {"count": 2, "last_timestamp": 1796690000.5}}}`` from the kernel log's records:
    per GPU address and Xid code, how many the log holds and when the last was logged (``booted`` plus its
    microseconds since boot; None without ``booted``)."""
    found = {}
    for line in (text or "").splitlines():
        if "NVRM: Xid" not in line:  # most records: the cheap test first
            continue
        head, sep, message = line.partition(";")
        fields = head.split(",")
        # The kernel's own records only (facility 0: priority below 8); a process that writes to /dev/kmsg
        # gets the user facility, so a line it wrote is not the driver's.
        if not sep or line.startswith(" ") or not fields[0].isdigit() or int(fields[0]) >= 8:
            continue
        xid = XID.match(message)
        if not xid:
            continue
        micros = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else None
        codes = found.setdefault(pci_key(*xid.groups()[:3]), {})
        code = int(xid.group(4))
        if code not in codes and len(codes) >= MAX_CODES:
            continue
        entry = codes.setdefault(code, {"count": 0, "last_timestamp": None})
        entry["count"] += 1
        if booted is not None and micros is not None:
            entry["last_timestamp"] = round(booted + micros / 1e6, 3)
    return found


def read_xids(path=KERNEL_LOG):
    """The node's Xids by GPU address (parse_xids), or None when its kernel log cannot be read."""
    text = read_kernel_log(path)
    return None if text is None else parse_xids(text, boot_time())


def gpu_xids(xids, bus_id):
    """One GPU's ``[{xid, count, last_timestamp}]`` by code; None when the log was not read."""
    if xids is None:
        return None
    return [{"xid": code, **entry} for code, entry in sorted(xids.get(bus_key(bus_id), {}).items())]
