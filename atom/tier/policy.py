"""What this engine may do with the tier: the config's restricting switches, decided once.

One object answers each question, and each question is asked at the one place that acts on it:

  may_store      ``lmcache.save``: the connector's save planner (``_plan_saves``) is the only
                 code that makes a save, and it asks first. Every store of every path goes
                 through it: the step's committed forwards (drafts included), a lookup's
                 answer that arrives after admission (CONFIRMING), a finished or preempted
                 request's tail, a load's recomputed span; across ranks every rank's part is
                 a part of an op rank 0's connector made. So ``save: false`` stores nothing.
  may_load       ``lmcache.load``: no lookup is sent (so nothing is ever loaded).
  engine_copies  ``load_mode`` resolved to engine_driven (``OffloadConfig.load_path``: auto is
                 engine_driven, on one rank and across ranks, with rank collapse or without)
                 and loads on: loads are local copies (on every rank) located by the server
                 module; otherwise the server copies every load.
  engine_saves   ``save_mode`` resolved to engine_driven (``OffloadConfig.save_path``) and saves
                 on: a save is copied by the engine into space the server module reserved in
                 its shared-memory L1 (worker_side/local_save.py); otherwise the server copies
                 every save (its store).
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.tier.config import OffloadConfig


@dataclass(frozen=True)
class TierPolicy:
    may_store: bool
    may_load: bool
    engine_copies: bool
    engine_saves: bool = False

    @classmethod
    def of(cls, config: OffloadConfig, tp_size: int = 1, collapse: bool = False) -> TierPolicy:
        """The policy of ``config`` for an engine of ``tp_size`` ranks, sharing one copy when
        ``collapse`` (``OffloadConfig.load_path``; engine-driven saves run on rank 0 alone:
        one rank, or ranks sharing one copy, ``OffloadConfig.save_path``)."""
        mode, _ = config.load_path(tp_size, collapse)
        save_mode, _ = config.save_path(tp_size, collapse)
        return cls(
            may_store=config.save,
            may_load=config.load,
            engine_copies=mode == "engine_driven" and config.load,
            engine_saves=save_mode == "engine_driven" and config.save,
        )
