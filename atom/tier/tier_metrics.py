"""The tier's Prometheus metrics: counters the connector increments, gauges computed from it."""

from __future__ import annotations

from atom.metrics import Registry


class TierMetrics:
    def __init__(self, m: Registry, connector):
        self.lookups = m.counter("tier_lookups_total", "Tier lookups by outcome.")
        self.loads = m.counter("tier_loads_total", "Tier loads by outcome.")
        self.saves = m.counter("tier_saves_total", "Tier saves by outcome.")
        self.bytes = m.counter("tier_bytes_total", "Bytes moved to/from the tier by direction.")
        self.local_loads = m.counter(
            "tier_local_loads_total",
            "Engine-driven loads: copied from the server's L1 by the engine, or sent through "
            "the server (via_server) because the located answer could not serve them.",
        )
        self.latency = m.histogram(
            "tier_transfer_seconds",
            "Load latency (the decision to load to the copy's completion) and save latency.",
        )
        self.save_hold = m.histogram(
            "tier_save_hold_seconds",
            "How long a save held its source blocks: its submission to their release, at the "
            "copy's completion for an engine-driven save (its commit follows), at the store's "
            "end otherwise.",
        )
        self.lookup_latency = m.histogram("tier_lookup_seconds", "Lookup latency.")
        self.load_phases = m.histogram(
            "tier_load_phase_seconds",
            "An engine-driven load's latency by phase: plan (host, the decision to the copies' "
            "issue), issue (host, issuing them; issue_cpu: the step thread's CPU time within it), "
            "wait (device, the copy stream behind the "
            "compute stream's earlier work), copy (device, the copies).",
        )
        self.save_phases = m.histogram(
            "tier_save_phase_seconds",
            "An engine-driven save's latency by phase: reserve (the reserve call, sent to "
            "answer seen; one sent ahead of the forward counts from the save's submission), "
            "copy (the copy's issue to its completion seen), commit (the commit call, sent to "
            "answer seen), queued (submitted to the reserve's send).",
        )
        m.gauge(
            "tier_transfers_in_flight",
            "Loads and saves not yet terminal.",
            lambda: connector.live_ops,
        )
        m.gauge(
            "tier_quarantined_blocks",
            "Blocks held by transfers of unknown fate.",
            lambda: connector.quarantined_blocks,
        )


def worker_gauges(m: Registry, lookups, transfers, saves) -> None:
    """The worker side's counters, read when /metrics renders: the lookup path's server calls,
    the transfer thread's polling rounds (this rank's: rank 0's across ranks), and the engine-
    driven saves' outcomes and reservations ahead (``saves``: None when saves are the
    server's)."""
    _counts(
        m,
        "tier_lookup_server_calls_total",
        "Round-trips to the LMCache server on the lookup path, by kind: lookup, query and "
        "locate (LMCache's lookup, its status polls, atom.locate), lookup_locate and "
        "lookup_poll (atom.lookup_locate: one call per lookup).",
        "kind",
        lambda: lookups.calls,
    )
    m.gauge(
        "tier_transfer_rounds_total",
        "Polling rounds the transfer thread ran (one every poll interval while loads or "
        "saves are in flight; none while idle).",
        lambda: transfers.rounds,
        kind="counter",
    )
    if saves is None:
        return
    _counts(
        m,
        "tier_save_reserves_ahead_total",
        "Engine-driven saves' reservations sent before the step's forward: claimed by "
        "the save the step made (answered_before: of those, answered before the save "
        "was made), or unclaimed (the step made another, or none) and given back.",
        "outcome",
        lambda: saves.ahead,
    )
    _counts(
        m,
        "tier_local_saves_total",
        "Engine-driven saves by outcome: copied (into the server's L1, committed), "
        "resident (the server held every object already), via_server (the server "
        "stored it: reserve refused, no module, segment not mapped yet), aborted (late "
        "before its copy), failed.",
        "outcome",
        lambda: saves.counts,
    )


def _counts(m: Registry, name: str, help_: str, label: str, read) -> None:
    """A counter kept elsewhere as a dict {label value: count}, one series per key."""
    m.gauge(
        name, help_, lambda: {((label, k),): n for k, n in sorted(read().items())}, kind="counter"
    )
