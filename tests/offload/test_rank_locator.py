"""``RankLocator`` (rank 0's locate across ranks without rank collapse) on answers it cannot use:
a server module that locates one rank's objects only (no ``ranks`` in its answer: an older atom)
turns engine-driven loads off with the reason, a definite no; an answer whose other ranks'
objects do not match rank 0's (another count, the wrong rank count) is no location, and that
hit loads through the server. The real server's answers are tests/distributed/test_tp_tier.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atom.tier.worker_side.locator import Located, Locator
from atom.tier.worker_side.rank_locator import RankLocator
from atom.tier.worker_side.server_probe import UNSUPPORTED

IDENT = SimpleNamespace(name="seg")
ROW = ((0, 64), (64, 64))  # rank 0's two page objects


@pytest.fixture
def locator(monkeypatch):
    located = Located(SimpleNamespace(ident=IDENT), ROW, (128, 32), 32, 0.0)
    monkeypatch.setattr(Locator, "located_of", lambda self, answer, hit: located)
    loc = RankLocator(
        url="tcp://127.0.0.1:1", zmq_context=None, namespace="ns", world_size=3, chunk=16,
        mappings=None,
    )  # fmt: skip
    yield loc
    loc.probe.close()


def test_a_module_without_every_ranks_objects_turns_engine_driven_loads_off(locator):
    assert locator.located_of({"found": True}, 32) is None
    assert locator.probe.state == UNSUPPORTED
    assert "locates one rank's objects only" in locator.probe.why


def test_every_other_ranks_objects_ride_on_rank_0s_location(locator):
    ranks = [[[[256, 64], [320, 64]], [[384, 32]]], [[[512, 64], [576, 64]], [[640, 32]]]]
    got = locator.located_of({"ranks": ranks}, 32)
    assert [w.pages for w in got.ranks] == [((256, 64), (320, 64)), ((512, 64), (576, 64))]
    assert [w.image for w in got.ranks] == [(384, 32), (640, 32)]
    assert all(w.ident is IDENT and w.end == 32 for w in got.ranks)


@pytest.mark.parametrize(
    "ranks",
    [
        [[[[256, 64]], [[384, 32]]], [[[512, 64], [576, 64]], [[640, 32]]]],  # one page short
        [[[[256, 64], [320, 64]], [[384, 32]]]],  # one rank short
        [[[[256, 64], [320, 64]], []], [[[512, 64], [576, 64]], [[640, 32]]]],  # no image
    ],
)
def test_an_answer_whose_ranks_do_not_match_is_no_location(locator, ranks):
    assert locator.located_of({"ranks": ranks}, 32) is None
    assert locator.probe.state != UNSUPPORTED  # that hit loads through the server
