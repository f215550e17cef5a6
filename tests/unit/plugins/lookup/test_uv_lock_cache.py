"""plugins/lookup/uv_lock.py: a cached lock is used only when it is the user's own and what its key names; anything
someone else could have written is compiled again, with a warning, never used (issue 40, item 6)."""

import os
import pwd
import sys

import pytest
from ansible.module_utils import _internal as module_internal

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "plugins" / "lookup"))
controller = module_internal.is_controller
import uv_lock  # noqa: E402
from ansible.plugins.loader import lookup_loader  # noqa: E402

lookup_loader.add_directory(str(ROOT / "plugins" / "lookup"))
module_internal.is_controller = controller

OPTIONS = {
    "python_version": "3.11",
    "python_platform": "x86_64-manylinux_2_28",
    "index_url": "https://pypi.org/simple",
    "torch_index_url": "https://download.pytorch.org/whl/cu128",
}
VERSION = "uv 0.13.9 (x86_64-unknown-linux-gnu)"


@pytest.fixture
def uv(tmp_path):
    """A uv that says its version and, asked to compile, writes `six==1.17.0` to --output-file and counts it."""
    wrapper = tmp_path / "bin" / "uv"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = --version ] && {{ echo "{VERSION}"; exit 0; }}\n'
        f'echo compiled >> "{tmp_path}/compilations"\n'
        'while [ "$1" != --output-file ]; do shift; done\necho "six==1.17.0" > "$2"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


@pytest.fixture
def warnings(monkeypatch):
    said = []
    monkeypatch.setattr(uv_lock.display, "warning", said.append)
    return said


def compilations(uv):
    path = uv.parent.parent / "compilations"
    return len(path.read_text().splitlines()) if path.exists() else 0


def lookup(uv, cache):
    return lookup_loader.get("uv_lock").run([["six"]], variables={}, uv=str(uv), cache_dir=str(cache))[0]


def entry(cache):
    return cache / uv_lock.cache_key(["six"], dict(OPTIONS, uv_version=VERSION))


def nobody():
    return pwd.getpwnam("nobody").pw_uid


def test_a_kept_lock_is_the_users_own_file_with_its_key_and_hash_and_is_read_again(tmp_path, uv, warnings):
    cache = tmp_path / "home" / "locks"
    assert lookup(uv, cache) == "six==1.17.0\n"
    assert lookup(uv, cache) == "six==1.17.0\n"
    assert compilations(uv) == 1
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    assert oct(entry(cache).stat().st_mode & 0o777) == "0o600"
    first, rest = entry(cache).read_text().split("\n", 1)
    assert first.startswith(f"# pve-gpu-recover uv_lock {entry(cache).stem} sha256:")
    assert rest == "six==1.17.0\n"
    assert warnings == []


@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        (lambda path: path.write_text(path.read_text().replace("six==1.17.0", "evil==6.6.6")), "does not match"),
        (lambda path: path.write_text("evil==6.6.6\n"), "does not name its key"),
        (lambda path: path.chmod(0o666), "writable by group or others"),
        (lambda path: os.chown(path, nobody(), -1), "owned by uid"),
    ],
    ids=["changed", "no-header", "group-writable", "another-owner"],
)
def test_a_cached_lock_someone_else_could_have_written_is_compiled_again_with_a_warning(
    tmp_path, uv, warnings, tamper, why
):
    cache = tmp_path / "locks"
    lookup(uv, cache)
    tamper(entry(cache))
    assert lookup(uv, cache) == "six==1.17.0\n"
    assert compilations(uv) == 2
    assert len(warnings) == 1
    assert f"the cached lock {entry(cache)} is ignored" in warnings[0]
    assert why in warnings[0]
    assert lookup(uv, cache) == "six==1.17.0\n"  # replaced by the user's own: read again, no warning
    assert (compilations(uv), len(warnings)) == (2, 1)


def test_another_keys_lock_under_this_key_is_never_used(tmp_path, uv, warnings):
    cache = tmp_path / "locks"
    cache.mkdir(mode=0o700)
    other = uv_lock.entry_text("0" * 24, "evil==6.6.6\n")
    entry(cache).write_text(other)
    entry(cache).chmod(0o600)
    assert lookup(uv, cache) == "six==1.17.0\n"
    assert "names the key 000000000000000000000000, not its own" in warnings[0]


def test_a_link_at_the_entry_is_ignored_and_replaced_never_followed(tmp_path, uv, warnings):
    cache = tmp_path / "locks"
    lookup(uv, cache)
    planted = tmp_path / "planted"
    planted.write_text(entry(cache).read_text())
    entry(cache).unlink()
    entry(cache).symlink_to(planted)
    assert lookup(uv, cache) == "six==1.17.0\n"
    assert "symbolic link" in warnings[0]
    assert not entry(cache).is_symlink()
    assert planted.read_text().endswith("six==1.17.0\n")  # not written through


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda cache: (cache.mkdir(), cache.chmod(0o777)), "writable by group or others"),
        (lambda cache: (cache.mkdir(), os.chown(cache, nobody(), -1)), "owned by uid"),
        (
            lambda cache: ((cache.parent / "real").mkdir(mode=0o700), cache.symlink_to(cache.parent / "real")),
            "is a symbolic link",
        ),
        (
            lambda cache: (cache.parent.chmod(0o777), cache.mkdir(mode=0o700)),
            "writable by others",
        ),
    ],
    ids=["group-writable-dir", "another-owners-dir", "link-to-dir", "parent-writable-by-others"],
)
def test_a_cache_directory_someone_else_could_write_is_not_used_nor_written(tmp_path, uv, warnings, make, why):
    cache = tmp_path / "parent" / "locks"
    cache.parent.mkdir()
    make(cache)
    planted = cache / entry(cache).name
    if os.access(cache, os.W_OK) and not cache.is_symlink():
        planted.write_text(uv_lock.entry_text(planted.stem, "evil==6.6.6\n"))
        os.chown(planted, os.geteuid(), -1)
        planted.chmod(0o600)
    assert lookup(uv, cache) == "six==1.17.0\n"
    assert compilations(uv) == 1
    assert len(warnings) == 1
    assert f"the lock cache {cache} is not used" in warnings[0]
    assert why in warnings[0]
    assert not (tmp_path / "real" / planted.name).exists()  # nothing written through the link either


def test_a_cache_directory_of_the_user_made_0755_before_is_made_private_and_used(tmp_path, uv, warnings):
    cache = tmp_path / "locks"
    cache.mkdir(mode=0o755)
    cache.chmod(0o755)
    lookup(uv, cache)
    assert lookup(uv, cache) == "six==1.17.0\n"
    assert compilations(uv) == 1
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    assert warnings == []


def test_a_sticky_directory_writable_by_all_may_be_on_the_way(tmp_path, uv, warnings):
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    lookup(uv, shared / "mine" / "locks")
    assert lookup(uv, shared / "mine" / "locks") == "six==1.17.0\n"
    assert (compilations(uv), warnings) == (1, [])
