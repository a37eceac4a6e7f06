"""atom/tier/scheduler_side/confirmations.py on its own: leaders, followers, the ttl, memory."""

from atom.tier.scheduler_side.confirmations import Confirmations


def test_followers_settle_with_their_leader_and_the_answer_lives_for_the_ttl():
    c = Confirmations(ttl_s=1.0)
    assert c.known(7, 0.0) is None and not c.follow(7, "b")
    c.lead(7, "a")
    assert c.follow(7, "b") and c.follow(7, "c")
    assert c.answered(7, "x", 48, 0.1) == []  # not its leader: nothing settled
    assert c.answered(7, "a", 48, 0.1) == ["b", "c"]
    assert c.known(7, 1.1) == 48 and c.known(7, 1.2) is None  # expired after 1 s
    assert c.shared == 3


def test_a_failed_answer_is_not_remembered_and_clear_forgets():
    c = Confirmations(ttl_s=1.0)
    c.lead(1, "a")
    c.follow(1, "b")
    assert c.answered(1, "a", None, 0.0) == ["b"]
    assert c.known(1, 0.0) is None
    c.lead(2, "a")
    c.answered(2, "a", 16, 0.0)
    c.clear()
    assert c.known(2, 0.0) is None


def test_old_answers_are_dropped_as_new_ones_come():
    c = Confirmations(ttl_s=1.0)
    for key in range(1000):
        c.lead(key, "a")
        c.answered(key, "a", 16, key * 0.01)  # 100 answers a second
    assert len(c._known) <= 101
