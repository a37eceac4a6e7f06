"""What reached an LMCache server, by the server's own account (its Prometheus endpoint).

The server counts transfers through an event bus that drains asynchronously, so a reading
taken right after a run may not yet show that run. ``ServerView.settled`` makes a reading
trustworthy: it runs a marker engine (save on, a prompt of its own) and waits until the
server shows exactly the marker's stores on top of everything before. The bus is FIFO, so once
the marker's stores are counted, every store sent before them is counted too.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass

STORES = "lmcache_mp_num_submitted_stores_total"
RETRIEVES = "lmcache_mp_num_submitted_retrieves_total"
LOOKUPS = "lmcache_mp_lookups_requests_total"


@dataclass(frozen=True)
class Reading:
    stores: float
    retrieves: float
    lookups: float


class ServerView:
    def __init__(self, server):
        self.server = server

    def read(self) -> Reading:
        text = urllib.request.urlopen(self.server.metrics_url, timeout=10).read().decode()

        def total(name: str) -> float:
            pat = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
            return sum(float(v) for v in re.findall(pat, text, re.MULTILINE))

        return Reading(total(STORES), total(RETRIEVES), total(LOOKUPS))

    def settled(self, before: Reading, mark, timeout_s: float = 60.0) -> Reading:
        """What reached the server since ``before``, less the marker's own traffic.
        ``mark()`` runs a save-on engine on a prompt the server has never seen (a miss: no
        retrieve) to its shutdown and returns its (done saves, lookups sent). The reading is
        taken once the server counted those saves (polled, with a deadline)."""
        saves, lookups = mark()
        assert saves > 0, "the marker engine stored nothing: the reading would prove nothing"
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.read()
            if now.stores - before.stores >= saves:
                break
            assert time.monotonic() < deadline, f"the server never counted the marker: {now}"
            time.sleep(0.05)  # allowed: a poll round of the server's metrics, with a deadline
        return Reading(
            now.stores - before.stores - saves,
            now.retrieves - before.retrieves,
            now.lookups - before.lookups - lookups,
        )
