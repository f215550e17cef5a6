"""Review of issue 25: a stamp and a probe answer are the target's text, never the node's.

Item 11: a stamp is written by the cache user (a CT user): its values reach ``changes``, the journal and ``--diff``
only through printable() (one line, bounded; a value that is no string is named by its type). Item B: a probe
answer whose counts are not counts or whose lists hold something else is a named problem, never a traceback.
"""

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import probe_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import (
    fingerprint as cache_fingerprint,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.answer import CacheError

from tests.unit.plugins.module_utils.steps.compile_cache.test_facts import (
    CU128,
    LABEL,
    MB,
    answer_of,
    context,
    facts_of,
    root_of,
    spec_for,
)

FORGED = '2.0\nok: [ct200] => {"changed": false}\x1b[2K'


def test_a_forged_stamp_value_stays_on_its_line_in_changes_and_diff():
    facts = facts_of(answer_of(root_of("/tmp/torchinductor_root", stamp=dict(CU128, torch=FORGED), size=MB)))
    shown = '2.0\\nok: [ct200] => {"changed": false}\\x1b[2K'
    assert facts["changes"][0] == (
        f"purge /tmp/torchinductor_root (stamped for torch {shown}, now 2.11.0+cu128; 1.0 MB)"
    )
    for line in [*facts["changes"], facts["roots"][0]["reason"]]:
        assert "\n" not in line and "\x1b" not in line
    before = facts["diff"]["before"]
    assert before == f"/tmp/torchinductor_root: torch {shown} (CUDA 12.8), triton 3.3.0, NVIDIA H200\n"
    assert "\x1b" not in facts["diff"]["after"]


def test_stamp_values_that_are_no_strings_are_named_by_their_type_and_long_ones_are_cut():
    stamp = dict(CU128, torch={"a": 1}, triton=7, gpus=[1, 2], cuda="9" * 5000)
    facts = facts_of(answer_of(root_of("/tmp/a", stamp=stamp)))
    root = facts["roots"][0]
    assert root["stamp"]["torch"] == "<dict>" and root["stamp"]["gpus"] == "<list>"
    assert (
        root["reason"]
        == "stamped for torch <dict>, now 2.11.0+cu128; triton <int>, now 3.3.0; GPUs <list>, now NVIDIA H200"
    )
    described = cache_fingerprint.describe(cache_fingerprint.normalized(stamp))
    assert described == f"torch <dict> (CUDA {'9' * 100}...), triton <int>, <list>"


def test_a_stamp_equal_to_the_expected_fingerprint_stays_fresh():
    facts = facts_of(answer_of(root_of("/tmp/a", stamp=dict(CU128))))
    assert facts["roots"][0]["verdict"] == "fresh"


def test_an_invalid_stamps_reason_from_the_target_is_escaped():
    answer = answer_of(root_of("/tmp/a", stamp_state="it is\nforged\x1b[2K", size=MB))
    facts = facts_of(answer)
    assert facts["changes"][0] == "purge /tmp/a (its stamp cannot be used: it is\\nforged\\x1b[2K; 1.0 MB)"


@pytest.mark.parametrize(
    ("walk", "wrong"),
    [
        ({"size_bytes": "12abc"}, "walk size_bytes is '12abc', not a count"),
        ({"files": 1.5}, "walk files is 1.5, not a count"),
        ({"entries": True}, "walk entries is True, not a count"),
        ({"escapes_count": -1}, "walk escapes_count is -1, not a count"),
        ({"mounts": ["/tmp/a/m", 3]}, "walk mounts is ['/tmp/a/m', 3], not a list of paths"),
        ({"escapes": ["x"]}, "walk escapes is ['x'], not a list of {link, target}"),
        (
            {"left": [{"path": "/tmp/a/x", "why": 1}]},
            "walk left is [{'path': '/tmp/a/x', 'why': 1}], not a list of {path, why}",
        ),
    ],
)
def test_a_forged_walk_is_a_named_problem_not_a_traceback(walk, wrong):
    answer = answer_of(root_of("/tmp/a", size=MB, **walk))
    message = f"the target's answer to the compile_cache probe is not in the expected shape: root /tmp/a: {wrong}"
    with pytest.raises(CacheError) as raised:
        facts_of(answer)
    assert str(raised.value) == message
    with pytest.raises(CacheError):
        cache_facts.module_facts(spec_for(answer), answer, LABEL)


@pytest.mark.parametrize(
    ("changed", "wrong"),
    [
        ({"homes": {"/root": "root"}}, "homes['/root'] is 'root', not a list of user names"),
        ({"users": {"/tmp/a": [{"pid": "1", "how": ["cwd"]}]}}, "users['/tmp/a'] is [{'pid': '1', 'how': ['cwd']}]"),
        ({"errors": [{"x": 1}]}, "errors is [{'x': 1}], not a list of sentences"),
    ],
)
def test_forged_users_homes_and_errors_are_named_problems(changed, wrong):
    answer = answer_of(root_of("/tmp/a", size=MB), **changed)
    with pytest.raises(CacheError, match="not in the expected shape") as raised:
        facts_of(answer)
    assert wrong in str(raised.value)


def test_in_the_fact_pass_a_forged_answer_is_the_steps_problem():
    answer = answer_of(root_of("/tmp/a", size=MB, size_bytes="12abc"))
    specs = {"compile_cache": spec_for(answer)}
    ctx = context()
    answers = {probe_name(cache_facts.PROBE): {"answer": answer}}
    facts = step_registry.evaluate_steps(specs, None, answers, ctx)["compile_cache"]
    assert facts["pending"] is False
    assert "not in the expected shape: root /tmp/a: walk size_bytes is '12abc', not a count" in facts["problems"][0]


def test_gpu_names_cut_at_the_runners_cap_are_a_problem_not_a_list():
    """ct_run.run keeps the first 4 MiB of what the target's nvidia-smi prints: a cut answer is not read."""
    smi = {"rc": 0, "stdout": "name\nNVIDIA H200\nNVIDIA H200\n", "stderr": "", "truncated": True}
    names, problem = cache_fingerprint.gpu_names_read({"gpus": smi})
    assert names == []
    assert "nvidia-smi printed more than 4 MiB" in problem and "output was cut and is not read" in problem
    assert cache_fingerprint.gpu_names_read({"gpus": dict(smi, truncated=False)}) == (["NVIDIA H200"] * 2, None)
