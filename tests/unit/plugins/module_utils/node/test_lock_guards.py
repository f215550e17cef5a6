"""Guards that no other test would notice missing (issue 8): a lock holds until exactly created + ttl and is stale
one second later."""

from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock as node_lock

# -- the lock's ttl boundary ---------------------------------------------------------------------------------------
OTHER = {"run_id": "other", "owner": "bob@ctl", "created": 1000, "ttl": 60}


def test_a_lock_holds_until_exactly_created_plus_ttl():
    assert node_lock.stale_reason(OTHER, 1060, 7200) is None
    assert node_lock.plan_lock("present", OTHER, "mine", 1060) == ("locked", False)


def test_a_lock_one_second_after_created_plus_ttl_is_taken_over():
    assert node_lock.stale_reason(OTHER, 1061, 7200) == "it expired 1 s ago (ttl 60 s)"
    assert node_lock.plan_lock("present", OTHER, "mine", 1061) == ("taken_over", True)


def test_a_lock_without_ttl_uses_the_finding_runs_ttl_to_the_second():
    lock = {"run_id": "other", "owner": "bob@ctl", "created": 1000}
    assert node_lock.plan_lock("present", lock, "mine", 1000 + 7200, 7200) == ("locked", False)
    assert node_lock.plan_lock("present", lock, "mine", 1000 + 7201, 7200) == ("taken_over", True)
