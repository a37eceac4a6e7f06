"""The tier's Prometheus metrics: counters the connector increments, gauges computed from it."""

from __future__ import annotations

from atom.metrics import Registry


class TierMetrics:
    def __init__(self, m: Registry, connector):
        self.lookups = m.counter("tier_lookups_total", "Tier lookups by outcome.")
        self.loads = m.counter("tier_loads_total", "Tier loads by outcome.")
        self.saves = m.counter("tier_saves_total", "Tier saves by outcome.")
        self.bytes = m.counter("tier_bytes_total", "Bytes moved to/from the tier by direction.")
        self.latency = m.histogram("tier_transfer_seconds", "Load/save latency, submit to end.")
        self.lookup_latency = m.histogram("tier_lookup_seconds", "Lookup latency.")
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
