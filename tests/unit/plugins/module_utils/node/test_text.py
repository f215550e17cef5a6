"""plugins/module_utils/node/text.py: text a container chose is shown on one line, every control character escaped."""

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("python3", "python3"),
        ("train\nok: [pve1] => forged", "train\\nok: [pve1] => forged"),
        ("a\x1b[2Jb", "a\\x1b[2Jb"),
        ("tab\there\r", "tab\\there\\r"),
        ("del\x7f and csi\x9b", "del\\x7f and csi\\x9b"),
        ("evil\u202egnp.exe", "evil\\u202egnp.exe"),
        ("line\u2028sep", "line\\u2028sep"),
        ("back\\slash", "back\\\\slash"),
        ("ünïcode 名前", "ünïcode 名前"),
        (b"bytes\xff\n", "bytes\\\\xff\\n"),
        (None, None),
        (42, "42"),
    ],
)
def test_every_control_character_is_escaped_and_the_rest_kept(raw, shown):
    assert printable(raw) == shown


def test_the_result_is_one_line_whatever_the_input():
    hostile = "".join(chr(code) for code in range(0x00, 0x100)) + "\u2028\u2029\u202e"
    shown = printable(hostile)
    assert shown.splitlines() == [shown]
    assert all(char.isprintable() for char in shown)


def test_a_limit_cuts_the_escaped_text():
    assert printable("x" * 10, limit=4) == "xxxx..."
    assert printable("\n" * 3, limit=4) == "\\n\\n..."
    assert printable("short", limit=10) == "short"
