"""Confirmation lookups of HBM-covered requests (atom/tier/scheduler_side/confirmations.py), on
a real engine over a fake tier: asked only near the first boundary the request would store
(one that finishes first asks nothing, and sends the server nothing at all), shared by the
requests of one prefix (one lookup in flight and for CONFIRM_TTL_S after, its answer applied
to every follower: what the tier lost is stored again, once), a failed one leaving them
unknown (no saves), and no lookup for a prompt shorter than a chunk."""

from __future__ import annotations

from atom.tier.scheduler_side.confirmations import CONFIRM_TTL_S

from .fakes import prompt_of

PREFIX = prompt_of(80, 5)  # 5 chunks of 16: a request of PREFIX + 3 tokens stores at 96
LONG = 16  # output tokens that carry such a request past 96 (it asks at 92)


def warm(h) -> None:
    """Run the prefix once, every save completing, so HBM and the tier both hold it."""
    h.transfers.auto = {"save"}
    seq = h.add(PREFIX + [1, 2, 3], max_tokens=2)
    h.run([seq])
    h.step()


def warmed(make, answer: bool):
    """A harness whose HBM and tier hold the prefix; lookups answered at once (``answer``) or
    only when the test answers them."""
    h = make(auto_lookups=False)
    h.lookups.auto = True
    warm(h)
    h.lookups.auto = answer
    return h


def lookups_of(h, seqs) -> list:
    return [op for op in h.lookups.ops if op.owner.seq in seqs]


def shared_count(h) -> float:
    return h.engine.metrics._metrics["atom_tier_lookups_total"].get(outcome="shared")


def test_a_request_that_stores_nothing_new_calls_the_server_not_once(make):
    """(Its prefix this connector stored itself: had the tier been lost since, it would
    confirm at admission; see the next test.)"""
    h = warmed(make, answer=True)
    calls = len(h.lookups.ops), len(h.lookups.free_calls), len(h.lookups.ended)
    # 82 + 12 tokens: it comes within the lead of 96 (asked from 92) but ends before it
    seqs = [h.add(PREFIX + [9, i], max_tokens=12) for i in range(3)]
    h.run(seqs)
    h.step()
    assert all(s.counters.hbm_hit_tokens == 80 for s in seqs)
    assert (len(h.lookups.ops), len(h.lookups.free_calls), len(h.lookups.ended)) == calls
    h.shutdown()


def test_after_a_tier_loss_a_covered_prefix_is_confirmed_at_once_and_stored_again(make):
    h = warmed(make, answer=True)
    h.server.forget()
    h.connector.tier_lost()  # as a re-registration after a restart calls it
    saves = len(h.transfers.saves)
    seq = h.add(PREFIX + [9, 9], max_tokens=2)  # stores nothing new of its own
    h.step()
    (asked,) = lookups_of(h, [seq])
    assert asked.token_ids == PREFIX and seq.counters.hbm_hit_tokens == 80
    h.run([seq])
    h.step()
    stored = sorted((op.start, op.end) for op in h.transfers.saves[saves:])
    assert stored == [(b, b + 16) for b in range(0, 80, 16)]
    assert h.server.hit(PREFIX) == 80
    h.shutdown()


def test_requests_of_one_prefix_ask_once_near_their_boundary_and_settle_with_the_answer(make):
    h = warmed(make, answer=False)
    h.server.forget()  # the tier lost the prefix; HBM still has it
    saves = len(h.transfers.saves)
    seqs = [h.add(PREFIX + [9, i, i], max_tokens=LONG) for i in range(4)]
    h.step_until(lambda: lookups_of(h, seqs))
    (leader,) = lookups_of(h, seqs)  # one lookup for four requests, sent near 92
    assert all(s.counters.hbm_hit_tokens == 80 and 92 <= s.num_computed < 96 for s in seqs)
    assert leader.token_ids == PREFIX  # the prefix HBM gave them
    assert shared_count(h) == 3
    h.lookups.answer(leader)  # the tier holds none of it
    h.run(seqs)
    states = [h.tier_state(s) for s in seqs]
    assert [st.tier_has for st in states] == [0, 0, 0, 0]  # the leader's answer, for all
    stored = sorted((op.start, op.end) for op in h.transfers.saves[saves:])
    # the lost prefix stored again, each chunk once; each request's own chunk [80, 96)
    assert stored == [(b, b + 16) for b in range(0, 80, 16)] + [(80, 96)] * 4
    assert h.server.hit(PREFIX) == 80
    h.shutdown()
    ids = {st.lmc_id for st in states}  # a follower never frees locks: it took none
    assert {i for i, _, _ in h.lookups.free_calls if i in ids} <= {leader.lmc_id}


def test_an_answer_is_reused_for_its_ttl_then_asked_again(make):
    h = warmed(make, answer=True)
    first = h.add(PREFIX + [4, 4], max_tokens=LONG)
    h.run([first])
    h.step()  # its answer folded in
    (asked,) = lookups_of(h, [first])
    assert asked.hit == 80
    h.clock.advance(CONFIRM_TTL_S / 2)
    within = h.add(PREFIX + [5, 5], max_tokens=LONG)
    h.run([within])
    assert lookups_of(h, [within]) == []  # the answer is fresh: no lookup
    assert h.tier_state(within).tier_has == 80
    h.clock.advance(CONFIRM_TTL_S)
    after = h.add(PREFIX + [6, 6], max_tokens=LONG)
    h.run([after])
    assert len(lookups_of(h, [after])) == 1  # stale: asked again
    h.shutdown()


def test_a_failed_confirmation_leaves_its_followers_unknown(make):
    h = warmed(make, answer=False)
    saves = len(h.transfers.saves)
    seqs = [h.add(PREFIX + [7, i], max_tokens=LONG) for i in range(3)]
    h.step_until(lambda: lookups_of(h, seqs))
    (leader,) = lookups_of(h, seqs)
    h.lookups.fail(leader)
    h.run(seqs)
    assert [h.tier_state(s).tier_has for s in seqs] == [None, None, None]
    assert h.transfers.saves[saves:] == []  # unknown: neither load nor store
    # and the failure is not remembered as an answer: the next request asks
    again = h.add(PREFIX + [8], max_tokens=LONG)
    h.step_until(lambda: lookups_of(h, [again]))
    h.lookups.answer(lookups_of(h, [again])[0])
    h.run([again])
    h.shutdown()


def test_a_prompt_shorter_than_a_chunk_sends_no_lookup(make):
    h = make(auto_lookups=False)
    h.transfers.auto = {"save"}
    seq = h.add(prompt_of(12, 3), max_tokens=6)  # 12 + 6 tokens: it stores its first chunk
    h.run([seq])
    assert lookups_of(h, [seq]) == []
    assert h.tier_state(seq).tier_has is not None
    assert any(op.end == 16 for op in h.transfers.saves)
    h.shutdown()


def test_a_lost_tier_forgets_the_shared_answers(make):
    h = warmed(make, answer=True)
    first = h.add(PREFIX + [4, 4], max_tokens=LONG)
    h.run([first])
    h.step()
    h.connector.tier_lost()  # e.g. the server restarted
    again = h.add(PREFIX + [5, 5], max_tokens=LONG)
    h.run([again])
    assert len(lookups_of(h, [again])) == 1
    h.shutdown()


def test_a_prompt_that_ends_on_a_boundary_confirms_that_chunk_and_stores_nothing_twice(make):
    """A repeated prompt of 96 tokens: HBM covers 80 (a token is left to compute), the
    prefill computes [80, 96), whose tokens are the prompt's own: the confirmation covers 96,
    which the tier holds from the first run, so nothing is stored again."""
    h = make(auto_lookups=False)
    h.lookups.auto = True
    h.transfers.auto = {"save"}
    prompt = PREFIX + prompt_of(16, 8)
    first = h.add(prompt, max_tokens=2)
    h.run([first])
    h.step()
    assert h.server.hit(prompt) == 96
    saves = len(h.transfers.saves)
    again = h.add(prompt, max_tokens=2)
    h.run([again])
    h.step()
    (asked,) = lookups_of(h, [again])
    assert asked.token_ids == prompt and asked.hit == 96
    assert again.counters.hbm_hit_tokens == 80
    assert h.transfers.saves[saves:] == []
    h.shutdown()
