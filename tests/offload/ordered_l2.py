"""A test L2 adapter that the LMCache server loads as a plugin: lmcache's fs adapter with the
order of issue 41's race made certain instead of left to timing.

The race: two lookups of one prefix reach a server whose L1 lacks it and whose L2 holds it.
The first one's prefetch loads the objects from L2 into L1. The second one read-locked L1
before they landed (nothing), finds them in L2, and then fails to reserve them in L1 because
they are resident by then (lmcache 0.5.6: ``KEY_NOT_WRITABLE``, "l1_contended"); its prefetch
keeps only what its L1 pass locked and answers short (0 when the contended chunks come first),
within milliseconds. Over Redis this happens when the second lookup's L2 answer comes after
the first one's L2 load has landed, in about a third to most of such pairs on 2 cores.

Here, per L2 answer that found something:
  - it waits for a second lookup of overlapping keys to be submitted (a pair barrier, bounded
    by ``pair_timeout_s``, so that a lookup without a mate is answered anyway);
  - it waits while an earlier lookup of overlapping keys is unanswered or a load of
    overlapping keys is in flight (the first of a pair loads; the second is answered after).
So the second of two overlapping lookups is always answered between the first one's load and
its own reservation. Every answer that found something and was held back behind another
lookup appends its task id to ``<base_path>/held``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

__all__ = ["OrderedFSL2Adapter", "held_answers", "plugin_spec"]


def plugin_spec(base_path: str, pair_timeout_s: float = 2.0) -> dict:
    """The ``l2_adapters`` entry that runs this adapter on ``base_path``."""
    return {
        "type": "plugin",
        "module_path": __name__,
        "class_name": "OrderedFSL2Adapter",
        "adapter_params": {"base_path": base_path, "pair_timeout_s": pair_timeout_s},
    }


def held_answers(base_path: str) -> int:
    """How many L2 answers that found objects the adapter on ``base_path`` held back behind
    another lookup (each a provoked race)."""
    log = Path(base_path) / "held"
    return len(set(log.read_text().split())) if log.exists() else 0


class OrderedFSL2Adapter(FSL2Adapter):
    """fs, with overlapping lookups answered one after the other's load (see the module)."""

    def __init__(self, params: dict, l1_memory_desc=None):
        super().__init__(FSL2AdapterConfig(base_path=params["base_path"]))
        self._held_log = Path(params["base_path"]) / "held"
        self._pair_timeout_s = float(params.get("pair_timeout_s", 2.0))
        self._gate = threading.Lock()
        self._lookups: dict[int, tuple[set, float]] = {}  # unanswered: keys, submit time
        self._paired: set[int] = set()  # lookups a later overlapping lookup was submitted for
        self._loading: dict[int, set] = {}  # load task -> keys, until its result is taken
        self._answers: dict[int, object] = {}  # lookup task -> its L2 answer, held back

    def _poke(self) -> None:
        self._lookup_efd.notify()  # the controller queries the held answers again

    def submit_lookup_and_lock_task(self, keys, group_layout_descs):
        mine = set(keys)
        with self._gate:
            task = super().submit_lookup_and_lock_task(keys, group_layout_descs)
            mates = {t for t, (k, _) in self._lookups.items() if k & mine}
            if mates:
                self._paired |= mates | {task}
            self._lookups[task] = (mine, time.monotonic())
        if mates:
            self._poke()
        else:  # answered alone once the bound passes
            timer = threading.Timer(self._pair_timeout_s, self._poke)
            timer.daemon = True
            timer.start()
        return task

    def query_lookup_and_lock_result(self, task_id):
        with self._gate:
            answer = self._answers.pop(task_id, None)
            if answer is None:
                answer = super().query_lookup_and_lock_result(task_id)
            if answer is None:
                return None
            keys, since = self._lookups[task_id]
            alone = time.monotonic() - since >= self._pair_timeout_s
            wait_mate = answer.popcount() > 0 and task_id not in self._paired and not alone
            earlier = any(t < task_id and k & keys for t, (k, _) in self._lookups.items())
            loading = any(keys & k for k in self._loading.values())
            if wait_mate or earlier or loading:
                if (earlier or loading) and answer.popcount() > 0:
                    with open(self._held_log, "a") as f:
                        f.write(f"{task_id}\n")
                self._answers[task_id] = answer
                return None
            del self._lookups[task_id]
            self._paired.discard(task_id)
        self._poke()  # a later lookup may have waited for this one
        return answer

    def submit_load_task(self, keys, objects):
        with self._gate:
            task = super().submit_load_task(keys, objects)
            self._loading[task] = set(keys)
        return task

    def query_load_result(self, task_id):
        result = super().query_load_result(task_id)
        if result is not None:
            with self._gate:
                self._loading.pop(task_id, None)
            self._poke()
        return result
