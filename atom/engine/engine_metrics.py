"""The engine's Prometheus metrics: counters the step loop increments, gauges computed from the
scheduler, the pool and the checkpoint store."""

from __future__ import annotations

from atom.metrics import Registry


class EngineMetrics:
    def __init__(self, m: Registry, sched, store, pool):
        self.requests = m.counter("requests_total", "Finished requests by finish reason.")
        self.prompt = m.counter(
            "prompt_tokens_total", "Prompt tokens by source: hbm, tier or computed."
        )
        self.gen = m.counter("generation_tokens_total", "Generated tokens.")
        self.step = m.histogram("step_seconds", "Engine step wall time.")
        self.ttft = m.histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = m.histogram("inter_token_latency_seconds", "Time between output tokens.")
        m.gauge("requests_waiting", "Requests queued.", lambda: len(sched.waiting))
        m.gauge(
            "requests_running", "Requests holding blocks and a slot.", lambda: len(sched.running)
        )
        m.gauge(
            "preemptions_total",
            "Preemptions (recompute) so far.",
            lambda: sched.preemptions,
            "counter",
        )
        m.gauge(
            "tier_tokens_recomputed_total",
            "Prompt tokens the tier held that were computed: no room to load them.",
            lambda: sched.tier_tokens_recomputed,
            "counter",
        )
        m.gauge(
            "pool_blocks",
            "PAGE blocks by state.",
            lambda: {
                (("state", "free"),): pool.num_free,
                (("state", "cached"),): pool.num_cached,
                (("state", "image"),): store.counts()["units"],
                (("state", "total"),): pool.num_blocks,
            },
        )
        m.gauge(
            "checkpoint_images_ready", "READY checkpoint images.", lambda: store.counts()["ready"]
        )
        m.gauge(
            "checkpoint_images_created_total", "Images taken.", lambda: store.created, "counter"
        )
        m.gauge(
            "checkpoint_images_evicted_total",
            "Images evicted (LRU) or dropped with their prefix.",
            lambda: store.evicted + store.dropped_with_prefix,
            "counter",
        )
