"""What one forward's batch computes once and reuses (index math, RoPE angles, reads): the
memo both families' decode batches keep. It lives as long as the batch (one forward), so a
graph captures the one computation and no later forward reads an earlier one's tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ForwardMemo:
    """A mixin: ``_once(key, compute)`` returns ``compute()``, remembered under ``key`` (a tuple
    whose first item names what is kept) for the rest of the forward; ``_forget(prefix)`` drops
    the entries whose keys start with ``prefix`` (what a write made stale)."""

    def _memo(self) -> dict[tuple, Any]:
        return self.__dict__.setdefault("_forward_memo", {})

    def _once(self, key: tuple, compute: Callable[[], Any]) -> Any:
        memo = self._memo()
        got = memo.get(key)
        if got is None:
            got = memo[key] = compute()
        return got

    def _forget(self, prefix: tuple) -> None:
        memo = self._memo()
        for key in [k for k in memo if k[: len(prefix)] == prefix]:
            del memo[key]
