"""A rebuild reuses what is there (issue 41 item 3): the build's own package cache beside the venv.

uv's cache lives at ``<path>.cache/uv`` (pip's at ``<path>.cache/pip``): on the venv's own file system, root's,
mode 0700, so uv hard-links each file of a distribution from it into the new version instead of copying it, and a
rebuild of a lock whose files are cached downloads and copies nothing. Retention never removes it; past
``cache_max_gib`` of bytes that only the cache holds (files no kept version links), it is dropped after the build.

Real builds on a bare host with the real uv (and ``python3 -m venv`` + pip) from the local indexes of
test_training_venv.py; link counts and inode numbers read with os.stat.
"""

# ruff: noqa: F811 (the builds' fixtures, host and indexes, are test_training_venv.py's)

import os
import stat
from pathlib import Path

from tests.unit.library.test_training_venv import GOOD, SMALLER, STAMPS, host, indexes  # noqa: F401


def cache_of(host):
    return Path(f"{host.path}.cache")


def inodes(root):
    """``{(st_dev, st_ino): path}`` of every regular file under ``root``."""
    found = {}
    for directory, _, files in os.walk(root):
        for name in files:
            info = os.lstat(os.path.join(directory, name))
            if stat.S_ISREG(info.st_mode):
                found[(info.st_dev, info.st_ino)] = os.path.join(directory, name)
    return found


def package_files(version, package):
    """The files of ``package`` (its import package, not its .dist-info, which the installer writes) in a version."""
    site = Path(version) / "lib" / "python3.11" / "site-packages"
    found = [site / f"{package}.py"] if (site / f"{package}.py").exists() else []
    return found + [p for p in (site / package).rglob("*") if p.is_file()]


def assert_own_cache(cache):
    info = os.lstat(cache)
    assert stat.S_ISDIR(info.st_mode), f"{cache} is no directory"
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.geteuid(), 0o700)


def test_a_rebuild_links_every_file_from_the_cache_beside_the_venv(host, capsys):
    first = host.run(capsys, GOOD)
    assert first["changed"] is True, first.get("msg")
    cache = cache_of(host)
    assert_own_cache(cache)
    assert_own_cache(cache / "uv")
    second = host.run(capsys, SMALLER)  # idna is no longer in the lock: a rebuild
    assert second["changed"] is True and second["current"] == str(host.version(STAMPS[1])), second.get("msg")
    cached = inodes(cache)
    files = package_files(second["current"], "torch") + package_files(second["current"], "six")
    assert len(files) >= 3
    for file in files:
        info = os.stat(file)
        assert (info.st_dev, info.st_ino) in cached, f"{file} was copied, not linked from the cache"
        # One inode for the cache, the first version and the rebuild: the rebuild wrote no byte of it.
        old = host.version(STAMPS[0]) / file.relative_to(second["current"])
        assert os.stat(old).st_ino == info.st_ino and info.st_nlink >= 3
    assert second["cache"] == {"path": str(cache), "own_bytes": second["cache"]["own_bytes"], "dropped": False}


def test_pruning_old_versions_never_removes_the_cache(host, capsys):
    host.run(capsys, GOOD)
    host.run(capsys, SMALLER)
    before = inodes(cache_of(host))
    result = host.run(capsys, GOOD, keep=1)
    assert result["removed"] == [str(host.version(STAMPS[0])), str(host.version(STAMPS[1]))], result.get("msg")
    assert_own_cache(cache_of(host))
    assert set(before) <= set(inodes(cache_of(host)))  # every cached file is still there
    again = host.run(capsys, SMALLER, keep=1)  # a rebuild after the prune still links from the cache
    assert again["removed"] == [result["current"]]
    cached = inodes(cache_of(host))
    for file in package_files(again["current"], "torch"):
        info = os.stat(file)
        assert (info.st_dev, info.st_ino) in cached


def test_the_cache_past_its_bound_is_dropped_after_the_build(host, capsys):
    kept = host.run(capsys, SMALLER)
    assert kept["cache"]["dropped"] is False and cache_of(host).is_dir()
    # Right after a build every cached file is linked into the new version: the cache itself holds (almost) nothing.
    assert kept["cache"]["own_bytes"] < 64 * 1024, kept["cache"]
    dropped = host.run(capsys, GOOD, cache_max_gib=0)
    assert dropped["changed"] is True, dropped.get("msg")
    assert dropped["cache"] == {
        "path": str(cache_of(host)),
        "own_bytes": dropped["cache"]["own_bytes"],
        "dropped": True,
    }
    assert not cache_of(host).exists()
    assert dropped["installed"] == GOOD  # the venv keeps its files: they were links, not the cache's own


def test_a_link_or_a_directory_of_someone_else_at_the_cache_path_is_refused(host, capsys, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache_of(host).symlink_to(elsewhere)
    result = host.run(capsys, GOOD)
    assert (result["failed"], result["error"]) == (True, "layout")
    assert f"{cache_of(host)} is a symlink" in result["msg"]
    assert list(elsewhere.iterdir()) == []  # nothing written through it
    assert not host.path.exists()
    cache_of(host).unlink()
    cache_of(host).mkdir(mode=0o755)
    os.chown(cache_of(host), 65534, 65534)
    result = host.run(capsys, GOOD)
    assert (result["failed"], result["error"]) == (True, "layout")
    assert "owned by uid 65534" in result["msg"]


def test_a_cache_directory_others_may_read_is_made_roots_alone(host, capsys):
    cache_of(host).mkdir(mode=0o755)
    result = host.run(capsys, GOOD)
    assert result["changed"] is True, result.get("msg")
    assert_own_cache(cache_of(host))


def test_pip_keeps_its_cache_beside_the_venv_too(host, capsys):
    # pip caches what it downloads over HTTPS, or from a host the lock trusts (the loopback index is plain HTTP).
    lock = "--trusted-host 127.0.0.1\n" + host.indexes.lock(GOOD)
    result = host.run(capsys, GOOD, uv="/nonexistent/uv", lock=lock)
    assert result["builder"]["name"] == "venv+pip", result.get("msg")
    assert_own_cache(cache_of(host))
    assert_own_cache(cache_of(host) / "pip")
    cached = [p for p in cache_of(host).joinpath("pip").rglob("*") if p.is_file()]
    assert len(cached) >= len(GOOD), cached  # each wheel it downloaded
