"""Reads of /proc that cannot block (issue 25 item 6): a GPU holder's fds are told by their link text alone."""

import os

from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp


def fake_proc(tmp_path, links):
    """A proc root with pid 4242 whose fd N links to ``links[N]`` (what readlink of /proc/<pid>/fd/N prints)."""
    fd_dir = tmp_path / "proc" / "4242" / "fd"
    fd_dir.mkdir(parents=True)
    for number, target in enumerate(links):
        os.symlink(target, fd_dir / str(number))
    return str(tmp_path / "proc")


def never_stat(*args, **kwargs):  # what a hung NFS/FUSE mount does to a stat through the fd: it never returns
    raise AssertionError("device_fds stat'ed an open file: on a hung mount this blocks for ever")


def without_stat(monkeypatch, function, *args):
    """``function(*args)`` with os.stat failing the test (undone before anything else, pytest's report included)."""
    monkeypatch.setattr(pp.os, "stat", never_stat)
    try:
        return function(*args)
    finally:
        monkeypatch.undo()


def test_gpu_files_are_found_by_the_link_text_without_asking_any_filesystem(tmp_path, monkeypatch):
    proc = fake_proc(
        tmp_path,
        [
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-caps/nvidia-cap1",
            "/dev/nvidia3 (deleted)",
            "/mnt/hung-nfs/checkpoint.pt",  # the fd that blocked the old stat for ever
            "/dev/nvidia0",
            "socket:[12345]",
            "/dev/null",
            "/home/nvidia0",
        ],
    )
    assert without_stat(monkeypatch, pp.device_fds, 4242, proc) == [
        "/dev/nvidia-caps/nvidia-cap1",
        "/dev/nvidia-uvm",
        "/dev/nvidia0",
        "/dev/nvidia3",
        "/dev/nvidiactl",
    ]


def test_a_real_process_holding_a_file_is_read_by_link_without_stat(tmp_path, monkeypatch):
    held = tmp_path / "nvidia-like"
    held.write_text("")
    with open(held, "rb"):
        assert without_stat(monkeypatch, pp.device_fds, os.getpid()) == []
