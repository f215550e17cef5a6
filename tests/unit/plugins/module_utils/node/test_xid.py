"""The node's Xids: /dev/kmsg's records (tests/fixtures/kmsg/xid.kmsg) read, parsed and matched to GPUs."""

import os

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import xid

from tests.conftest import ROOT

KMSG = ROOT / "tests" / "fixtures" / "kmsg" / "xid.kmsg"
BOOTED = 1796600000


def test_the_drivers_xids_are_counted_per_gpu_and_code_with_the_time_of_the_last():
    found = xid.parse_xids(KMSG.read_text(), BOOTED)
    assert found == {
        "0000:1b:00": {
            48: {"count": 2, "last_timestamp": BOOTED + 9200.0},
            63: {"count": 1, "last_timestamp": round(BOOTED + 8823.411301, 3)},
        },
        "0000:3b:00": {79: {"count": 1, "last_timestamp": BOOTED + 9123.4}},
        "0000:00:06": {13: {"count": 1, "last_timestamp": BOOTED + 9300.0}},
    }
    # The line of the user facility (a process wrote it to /dev/kmsg) is not the driver's: no 0000:00:07.
    assert "0000:00:07" not in found


def test_without_the_boot_time_the_counts_stay_and_no_time_is_made_up():
    found = xid.parse_xids(KMSG.read_text(), None)
    assert found["0000:3b:00"] == {79: {"count": 1, "last_timestamp": None}}


def test_a_gpu_is_found_by_nvidia_smis_bus_id_and_one_without_xids_has_none():
    found = xid.parse_xids(KMSG.read_text(), BOOTED)
    assert xid.gpu_xids(found, "00000000:1B:00.0") == [
        {"xid": 48, "count": 2, "last_timestamp": BOOTED + 9200.0},
        {"xid": 63, "count": 1, "last_timestamp": round(BOOTED + 8823.411301, 3)},
    ]
    assert xid.gpu_xids(found, "00000000:00:06.0") == [{"xid": 13, "count": 1, "last_timestamp": BOOTED + 9300.0}]
    assert xid.gpu_xids(found, "00000000:00:07.0") == []
    assert xid.gpu_xids(found, "[N/A]") == []
    assert xid.gpu_xids(None, "00000000:1B:00.0") is None  # the log was not read: not "no Xids"


def test_codes_per_gpu_are_bounded():
    lines = [f"4,{n},{n},-;NVRM: Xid (PCI:0000:1b:00): {n}, pid=1, name=x, text" for n in range(1, 100)]
    assert len(xid.parse_xids("\n".join(lines), BOOTED)["0000:1b:00"]) == xid.MAX_CODES


def test_the_log_is_read_from_its_path_and_an_unreadable_one_is_none(tmp_path):
    assert xid.read_kernel_log(str(KMSG)) == KMSG.read_text()
    assert xid.read_kernel_log(str(tmp_path / "none")) is None
    link = tmp_path / "link"
    link.symlink_to(KMSG)
    assert xid.read_kernel_log(str(link)) is None  # never through a link
    assert xid.read_kernel_log(str(KMSG), limit=10)[:10] == KMSG.read_text()[:10]


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="the machine's /dev/kmsg is not readable here")
def test_the_machines_own_kernel_log_reads_as_records():
    """The real /dev/kmsg (one record per read, non-blocking to its end): these machines have no NVIDIA driver, so
    no Xids, but every record is read as a line of the format parse_xids takes."""
    text = xid.read_kernel_log()
    assert text is not None and text.endswith("\n")
    assert all(line.startswith(" ") or line.split(";", 1)[0].count(",") >= 3 for line in text.splitlines())
    assert xid.boot_time() is not None
    assert isinstance(xid.read_xids(), dict)


def test_a_kernel_that_logs_faster_than_the_read_does_not_keep_it_reading(monkeypatch):
    """Each EPIPE is a record overwritten before it was read: the read skips it, as dmesg does, but stops after
    MAX_LOST of them with what it has instead of chasing a flood."""
    reads = []

    def overwritten(fd, size):
        reads.append(fd)
        if len(reads) == 1:
            return b"4,1,1,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
        raise OSError(xid.errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(xid.os, "read", overwritten)
    text = xid.read_kernel_log(str(KMSG))
    assert xid.parse_xids(text, BOOTED)["0000:1b:00"][79]["count"] == 1
    assert len(reads) == 1 + xid.MAX_LOST
