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
            "issue), issue (host, issuing them), wait (device, the copy stream behind the "
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
