"""``RankedTransfers`` (rank 0's fan-out of tier ops) with a fake rank 0 transfer thread and a
real pipe standing for rank 1: failure paths a real server and rank do not produce on cue.

- The owned server dies while rank 1's part of a load is late: rank 1's transfer thread does
  not know the server, so rank 0 fails that part; the op resolves FAILED and its blocks can
  come back (before, it stayed LATE until shutdown).
- A malformed message from a rank is logged and the reader goes on with the next one.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

from atom.distributed.parallel_state import RankChannels
from atom.tier.operations import OpState, TransferOp
from atom.tier.worker_side.tier_ranks import RankedTransfers


class FakeLocal:
    """Rank 0's transfer thread: keeps the parts it is given; the test resolves them."""

    def __init__(self):
        self.server_up = True
        self.server_alive = lambda: self.server_up
        self.on_outcome = None
        self.parts: list[TransferOp] = []
        self.cfg = SimpleNamespace(rpc_timeout_s=0.1)

    def submit(self, op: TransferOp) -> None:
        op.mark_submitted(None)
        self.parts.append(op)

    def start(self, wait_s: float) -> bool:
        return True

    def stop(self, drain_s: float) -> None:
        pass


class Outcomes:
    def __init__(self):
        self.cond = threading.Condition()
        self.seen: list[OpState] = []

    def __call__(self, op: TransferOp) -> None:
        with self.cond:
            self.seen.append(op.state)
            self.cond.notify_all()

    def wait_for(self, n: int, timeout_s: float = 10.0) -> list[OpState]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.seen) >= n, timeout_s), self.seen
            return list(self.seen)


def ranked(local: FakeLocal, outcomes: Outcomes):
    recv, send = mp.Pipe(duplex=False)
    sent = []
    ranks = RankChannels(
        world_size=2, rank_replicated=True, send=lambda *op: sent.append(op), conns=[recv]
    )
    spec = SimpleNamespace(collapse=True)
    rt = RankedTransfers(local=local, ranks=ranks, spec=spec, on_outcome=outcomes)
    rt.start(0.0)
    send.send(("health", True, 0, ""))
    return rt, send, sent


def load_op() -> TransferOp:
    image = SimpleNamespace(units=[7])
    return TransferOp("load", "req-1", list(range(32)), 0, 32, [1, 2], image, time.monotonic())


def test_a_dead_server_fails_the_late_parts_of_other_ranks():
    local, outcomes = FakeLocal(), Outcomes()
    rt, rank1, sent = ranked(local, outcomes)
    try:
        op = load_op()
        rt.submit(op)
        assert [m[0] for m in sent] == ["tier_attach", "tier_op"]  # rank 1 got its part
        (mine,) = local.parts
        mine.resolve(True)
        rt._local_outcome(mine)  # rank 0's part is done
        rank1.send(("part", op.op_id, "late", False, "deadline passed", None))
        assert outcomes.wait_for(1) == [OpState.LATE]
        assert op.state is OpState.LATE  # rank 1's part may still write its pool: held
        local.server_up = False  # the owned server died; rank 1's part can never complete
        assert outcomes.wait_for(2) == [OpState.LATE, OpState.FAILED]
        assert "the server is gone" in op.error
        assert rt.stats[1].failed["load"] == 1 and rt.stats[0].parts["load"] == 1
        rank1.send(("part", op.op_id, "done", True, "", 0.01))  # too late: ignored
        rank1.send(("stopped",))
    finally:
        rt.stop(0.0)
    assert outcomes.seen == [OpState.LATE, OpState.FAILED]


def test_a_malformed_rank_message_does_not_stop_the_reader():
    local, outcomes = FakeLocal(), Outcomes()
    rt, rank1, _ = ranked(local, outcomes)
    try:
        op = load_op()
        rt.submit(op)
        (mine,) = local.parts
        mine.resolve(True)
        rt._local_outcome(mine)
        rank1.send(("part", op.op_id))  # too few fields: the reader logs it and goes on
        rank1.send(("part", op.op_id, "done", True, "", 0.02))
        assert outcomes.wait_for(1) == [OpState.DONE]
        assert rt.stats[1].parts["load"] == 1
        rank1.send(("stopped",))
    finally:
        rt.stop(0.0)
