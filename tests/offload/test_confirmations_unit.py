"""atom/tier/scheduler_side/confirmations.py on its own: leaders, followers, the ttl, memory."""

from types import SimpleNamespace

from atom.tier.scheduler_side.confirmations import CONFIRM_LEAD, Confirmations, confirm_end


def test_followers_settle_with_their_leader_and_the_answer_lives_for_the_ttl():
    c = Confirmations(ttl_s=1.0)
    assert c.known(7, 0.0) is None and not c.follow(7, "b")
    c.lead(7, "a")
    assert c.follow(7, "b") and c.follow(7, "c")
    assert c.answered(7, "x", 48, 0.1) == []  # not its leader: nothing settled
    assert c.answered(7, "a", 48, 0.1) == ["b", "c"]
    assert c.known(7, 1.1) == 48 and c.known(7, 1.2) is None  # expired after 1 s


def test_join_reuses_an_answer_follows_a_lookup_in_flight_or_leads():
    c = Confirmations(ttl_s=1.0)
    assert c.join(5, "a", 0.0) == ("leading", None)
    assert c.join(5, "b", 0.1) == ("following", None)
    assert c.answered(5, "a", 32, 0.2) == ["b"]
    assert c.join(5, "c", 0.5) == ("known", 32)
    assert c.join(5, "d", 1.3) == ("leading", None)  # the answer expired: ask again


def seq(num_tokens, num_prompt, num_computed, max_tokens, hashed):
    return SimpleNamespace(
        num_tokens=num_tokens, num_prompt=num_prompt, num_computed=num_computed,
        max_tokens=max_tokens, block_hashes=list(range(hashed)),
    )  # fmt: skip


def test_confirm_end_asks_near_the_boundary_up_to_what_exists():
    chunk, bs, at = 256, 16, 512  # HBM covered [0, 256); the first boundary to store: 512
    lead = int(CONFIRM_LEAD * chunk)
    early = seq(300, 300, 300, 400, 300 // bs)
    assert confirm_end(early, at, chunk, bs, now=False) is None  # not near 512 yet
    assert confirm_end(early, at, chunk, bs, now=True) == 256  # 512's tokens do not exist
    near = seq(at - lead, 300, at - lead, 400, (at - lead) // bs)
    assert confirm_end(near, at, chunk, bs, now=False) == 256
    full = seq(at, at, at - lead, 400, at // bs)  # a prompt ending on the boundary
    assert confirm_end(full, at, chunk, bs, now=False) == at
    short = seq(at - lead, 300, at - lead, 212, (at - lead) // bs)  # ends at 511
    assert confirm_end(short, at, chunk, bs, now=False) is None


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
