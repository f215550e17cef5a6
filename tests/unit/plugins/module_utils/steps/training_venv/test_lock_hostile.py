"""A hostile lock costs linear time (issue 40 item 3).

A lock read from the training repository is the CT's word: up to 4 MiB come from the target (ct_git.BLOB_LIMIT) and
the node parses it in its fact pass, holding the run lock of every other CT of the node. Every shape below once made
the parser's regular expressions backtrack for minutes (80 KB of spaces on one line: 60 s). Each is refused or read
in well under a second, measured as CPU time: at 4 MiB (above the node's cap, refused before any parsing) and just
under the cap (parsed, line by line, in linear time).
"""

import contextlib
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import lock as venv_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import VenvError

MIB = 1024 * 1024
# Generous on a slow, shared machine: a linear parse of these takes tens of milliseconds, the old one minutes.
BOUND = 1.0
HASH = "--hash=sha256:" + "ab" * 32


def fill(head, unit, tail, size):
    """``head + unit * n + tail`` of about ``size`` characters."""
    return head + unit * max((size - len(head) - len(tail)) // len(unit), 1) + tail


SHAPES = {
    "spaces in a pin": lambda size: fill("six", " ", "x\n", size),
    "spaces before ==": lambda size: fill("six", " ", "==1.0 x\n", size),
    "spaces before a hash": lambda size: fill("six==1.0", " ", "--hash\n", size),
    "spaces before a comment": lambda size: fill("six==1.0", " ", "x#\n", size),
    "spaces in an option": lambda size: fill("--index-url", " ", "x y\n", size),
    "spaces in a source comment": lambda size: fill("six==1.0\n#", " ", "from x y\n", size),
    "spaces in uv's header": lambda size: fill("# uv pip compile --python-version", " ", "x\nsix==1.0\n", size),
    "a run of #": lambda size: fill("six==1.0 ", "#", "\n", size),
    "a line of # only": lambda size: fill("", "#", "\nsix==1.0\n", size),
    "a run of ==": lambda size: fill("six", "==", "\n", size),
    "a run of = in uv's header": lambda size: fill("# uv pip compile --python", "=", "x\nsix==1.0\n", size),
    "backslash continuations": lambda size: fill("", "six==1.0 \\\n", "", size),
    "continued spaces": lambda size: fill("", " \\\n", "six==1.0\n", size),
    "a long hash": lambda size: fill("six==1.0 --hash=sha256:", "a", "\n", size),
    "hash after hash": lambda size: fill("six==1.0 ", f"{HASH} ", "\n", size),
    "many pins": lambda size: "".join(f"p{n:07d}==1.0 {HASH}\n" for n in range(size // (len(HASH) + 15))),
    "many short pins": lambda size: "".join(f"p{n:07d}==1\n" for n in range(size // 12)),
    "many index lines": lambda size: fill("six==1.0\n", "--extra-index-url https://example.org/simple\n", "", size),
    "a long name": lambda size: fill("", "a", "==1.0\n", size),
    "a long marker": lambda size: fill("six==1.0 ; ", "x ", "\n", size),
    "a long extra": lambda size: fill("six[", "a,", "]==1.0\n", size),
    "a url with credentials": lambda size: fill("--index-url https://", "a", "@b\n", size),
    "a url with credentials and a long host": lambda size: fill("--index-url https://a@", "a", "\n", size),
    "a url with no end": lambda size: fill("--index-url ", "a", "\n", size),
    "nested pylock arrays": lambda size: fill('lock-version = "1.0"\nx = ', "[", "\n", size),
    "nested pylock tables": lambda size: fill('lock-version = "1.0"\nx = ', "{a=", "\n", size),
    "spaces in pylock": lambda size: fill('lock-version = "1.0"\n[[packages]]\nname = "six"', " ", "x\n", size),
}


def timed(text):
    """CPU seconds :func:`parse_lock` took on ``text``, refused or read."""
    venv_lock._parse_lock.cache_clear()
    started = time.process_time()
    with contextlib.suppress(VenvError):
        venv_lock.parse_lock(text)
    return time.process_time() - started


@pytest.mark.parametrize("shape", SHAPES)
def test_a_hostile_lock_of_4_mib_is_refused_before_it_is_parsed(shape):
    text = SHAPES[shape](4 * MIB)
    assert len(text) >= 4 * MIB - 64
    venv_lock._parse_lock.cache_clear()
    started = time.process_time()
    with pytest.raises(
        VenvError, match=r"the lock is 4,\d{3},\d{3} bytes; a lock here is at most 1,048,576 bytes"
    ) as raised:
        venv_lock.parse_lock(text)
    assert time.process_time() - started < BOUND
    assert raised.value.kind == "lock"
    assert len(str(raised.value)) < 400  # none of the text in the message


@pytest.mark.parametrize("shape", SHAPES)
def test_a_hostile_lock_just_under_the_cap_is_read_or_refused_in_linear_time(shape):
    text = SHAPES[shape](venv_lock.LOCK_MAX_BYTES - 64)
    assert len(text.encode()) <= venv_lock.LOCK_MAX_BYTES
    assert timed(text) < BOUND, shape


def test_a_refused_hostile_line_is_shown_bounded():
    """The line a refusal quotes is the CT's: escaped and cut, never 1 MiB of it in a message and the report."""
    with pytest.raises(VenvError) as raised:
        venv_lock.parse_lock(fill("six", " ", "x\n", venv_lock.LOCK_MAX_BYTES - 64))
    assert "line 1: `six" in str(raised.value)
    assert len(str(raised.value)) < 400


def test_the_cap_counts_bytes_not_characters():
    text = "six==1.17.0\n# " + "é" * (venv_lock.LOCK_MAX_BYTES // 2) + "\n"  # half as many characters as bytes
    with pytest.raises(VenvError, match=r"the lock is 1,048,\d{3} bytes; a lock here is at most 1,048,576 bytes"):
        venv_lock.parse_lock(text)


def test_the_cap_holds_for_a_lock_read_in_the_repository_and_names_where():
    spec = {"lock": None, "python_version": None}
    spec["lock_from_repo"] = {"repo": "/srv/train", "commit": "a" * 40, "path": "requirements/train.lock"}
    answer = {"repo_lock": {"text": SHAPES["spaces in a pin"](4 * MIB), "missing": None, "error": None}}
    started = time.process_time()
    with pytest.raises(VenvError, match=r"the lock requirements/train.lock at commit a{12} of /srv/train: the lock is"):
        venv_lock.resolve_lock(spec, answer, may_defer=False)
    assert time.process_time() - started < BOUND


def test_a_pylock_nested_past_pythons_recursion_limit_is_a_clear_refusal():
    with pytest.raises(VenvError, match=r"the lock \(pylock\.toml\) nests deeper than") as raised:
        venv_lock.parse_lock('lock-version = "1.0"\nx = ' + "[" * 100_000 + "\n")
    assert raised.value.kind == "lock"


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("six==1.17.0", {"six": "1.17.0"}),
        ("Six == 1.17.0", {"six": "1.17.0"}),
        ("six[extra] == 1.17.0 ; python_version >= '3.9'", {"six": "1.17.0"}),
        (f"six==1.17.0 {HASH} --hash sha256:{'cd' * 32}", {"six": "1.17.0"}),
        ("six==1.17.0\t# a comment", {"six": "1.17.0"}),
        ("six==1.17.0 #", {"six": "1.17.0"}),
    ],
)
def test_pins_in_every_spelling_read_as_before(line, found):
    assert venv_lock.parse_lock(line + "\n")["distributions"] == found


@pytest.mark.parametrize(
    "line",
    [
        "six==1.17.0 x",
        "six===1.17.0",
        "six==1.17.0==2",
        "six ==",
        "==1.17.0",
        "six[extra==1.17.0",
        "six[a]b]==1.17.0",
        "six#x==1.17.0",
        "six==1.17.0 ;",
        "-ihttps://example.org/simple",
        "--index-url",
    ],
)
def test_what_is_no_exact_pin_stays_refused(line):
    with pytest.raises(VenvError, match=r"line 1: `"):
        venv_lock.parse_lock(line + "\nidna==3.10\n")


def test_uvs_header_python_in_every_spelling():
    for header, python in [
        ("#    uv pip compile train.in --python-version 3.11 --generate-hashes", "3.11"),
        ("#    uv pip compile train.in --python-version=3.12.4", "3.12"),
        ("#    uv pip compile -p 3.10 train.in", "3.10"),
        ("#    uv pip compile --python=3.13", "3.13"),
        ("#    uv pip compile --python 3.11rc1", None),
        ("#    uv pip compile --python python3", None),
        ("#    uv pip --python-version 3.11", None),  # not uv's compile header
    ]:
        assert venv_lock.parse_lock(f"{header}\nsix==1.17.0\n")["python"] == python, header
