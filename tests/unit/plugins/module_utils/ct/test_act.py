"""ct/act.py: an acting script's failure answer and the masking of credentials in what its commands printed (the
target's untrusted output, masked in linear time)."""

import random
import re
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act

# What the masking did before it was made linear: the same answers, on every input.
PATTERN = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@")


def by_pattern(text):
    return PATTERN.sub(lambda m: f"{m.group('scheme')}{ct_act.MASK}@", text)


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (
            "Failed to fetch https://bob:t0ken@idx/simple (proxy http://u:p@proxy:3128)",
            "Failed to fetch https://********@idx/simple (proxy http://********@proxy:3128)",
        ),
        ("git+ssh://git@host/x and 1abc://u@h", "git+ssh://********@host/x and 1abc://********@h"),
        (
            "no userinfo: https://host/path@x, ://u@h, https://@h",
            "no userinfo: https://host/path@x, ://u@h, https://@h",
        ),
        ("a://b://c@d", "a://b://********@d"),
    ],
)
def test_the_user_information_of_every_url_is_masked(text, masked):
    assert ct_act.redact(text) == masked == by_pattern(text)


def test_the_masking_answers_as_the_old_pattern_on_random_text():
    rng = random.Random(7)  # noqa: S311 (test data, not a secret)
    alphabet = "ab1+.-:/@ \tZ\u00e9"
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert ct_act.mask_userinfo(text) == by_pattern(text), repr(text)


@pytest.mark.parametrize(
    "text",
    [
        "a" * 1_000_000 + "://",
        "a" * 500_000 + "://" + "b" * 500_000,
        "a://" * 250_000,
        ("x" * 50 + "://" + "y" * 50 + " ") * 10_000,
    ],
    ids=["letters", "userinfo_without_at", "many_schemes", "many_urls"],
)
def test_a_hostile_output_of_a_megabyte_is_masked_in_well_under_a_second(text):
    started = time.process_time()
    ct_act.redact(text, ["secret"])
    assert time.process_time() - started < 1.0
