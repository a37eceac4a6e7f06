"""How the transfer thread hands saves to the engine-driven path (``local_save.EngineSaves``):
the reservations a step sends ahead of its forward, and the saves of a round.

  ahead     ``send`` a step's ``SaveAhead``s in one reserve call (if saves are engine-driven
            and the tier is up) and keep each item by its key (request, start, end);
            ``give_back`` what the step's saves did not claim (an abort of whatever the answer
            grants), after those saves were taken (the step queues its end behind them).
  a save    ``claim``: the reservation sent ahead with its key (its ``EngineSave``), or None:
            it is reserved with the round's others (``reserve``: one call; where that call
            cannot be sent, each is the server's store).

A prediction that misses costs one aborted reservation, never a save: an unclaimed key is
given back, and a save with no reservation ahead is reserved as it comes.
"""

from __future__ import annotations

import logging
from typing import Any

from atom.tier.operations import SaveAhead, TransferOp

log = logging.getLogger("atom.offload")


class SaveIntake:
    """The transfer thread's (every method runs on it)."""

    def __init__(self, saves):
        self.saves = saves  # local_save.EngineSaves (its ``fallback``: the server's store)
        self._ahead: dict[tuple, tuple] = {}  # SaveAhead.key -> (reserve call, its item)

    def send(self, aheads: list[SaveAhead]) -> None:
        """One reserve call for a step's expected saves (nothing when saves are not
        engine-driven now: its saves reserve as they come, or are the server's)."""
        if not self.saves.ready:
            return
        try:
            call = self.saves.send_reserve(aheads)
        except Exception as exc:
            log.debug("reservations ahead not sent: %r", exc)
            return
        for index, ahead in enumerate(aheads):
            self._ahead[ahead.key] = (call, index)

    def give_back(self) -> None:
        """The step's saves were taken: every reservation still unclaimed is given back."""
        for call, index in self._ahead.values():
            self.saves.orphan_item(call, index)
            self.saves.ahead["unclaimed"] += 1
        self._ahead.clear()

    def engine_driven(self) -> bool:
        """Saves go engine-driven now (else each is the server's store)."""
        return self.saves.ready

    def claim(self, op: TransferOp):
        """``op``'s ``EngineSave`` on the reservation sent ahead for it, or None (none was)."""
        claimed = self._ahead.pop((op.lmc_id, op.start, op.end), None)
        return None if claimed is None else self.saves.claim(op, *claimed)

    def reserve(self, ops: list[TransferOp]) -> list[tuple[TransferOp, Any, str]]:
        """One reserve call for ``ops``: (op, its future, "") each; where the call cannot be
        sent each is the server's store, and (op, None, why) where that is refused too."""
        try:
            return [(op, fut, "") for op, fut in zip(ops, self.saves.reserve(ops))]
        except Exception as exc:
            log.debug("reserve not sent (%r): the server stores %d saves", exc, len(ops))
        out = []
        for op in ops:
            try:
                out.append((op, self.saves.fallback(op), ""))
            except Exception as err:
                out.append((op, None, f"refused: {err!r}"))
        return out
