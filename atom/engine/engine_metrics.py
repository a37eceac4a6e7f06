"""The engine's Prometheus metrics: counters the step loop increments, gauges computed from the
scheduler, the pool and the checkpoint store."""

from __future__ import annotations

from atom.metrics import Registry
from atom.model_api import RuntimeCapabilities
from atom.thread_cpu import thread_cpu_seconds


def graph_stats(runtime) -> dict:
    """The runtime's CUDA graph counts by kind (``graph_stats``; empty when it has none)."""
    read = RuntimeCapabilities.of(runtime).graph_stats
    return read() if read is not None else {}


class EngineMetrics:
    def __init__(self, m: Registry, sched, store, pool, runtime=None):
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

        def graphs(field: str):
            return lambda: {(("kind", k),): v[field] for k, v in graph_stats(runtime).items()}

        m.gauge("cuda_graphs_captured", "CUDA graphs captured, by kind.", graphs("captured"))
        m.gauge(
            "cuda_graph_replays_total",
            "Forwards that replayed a CUDA graph, by kind (decode, verify, draft).",
            graphs("replays"),
            "counter",
        )
        m.gauge(
            "cuda_graph_capture_failures_total",
            "CUDA graph captures that failed (those shapes run eagerly; the log says why).",
            graphs("failed"),
            "counter",
        )
        m.gauge(
            "checkpoint_images_created_total", "Images taken.", lambda: store.created, "counter"
        )
        m.gauge(
            "thread_cpu_seconds_total",
            "CPU seconds this process's live threads have used, by thread name (the step "
            "thread, the tier's transfer and lookup threads, the client library's polling loop, "
            "torch's pool): what else competes for the cores and the interpreter lock.",
            lambda: {(("thread", k),): v for k, v in sorted(thread_cpu_seconds().items())},
            "counter",
        )
        m.gauge(
            "checkpoint_images_evicted_total",
            "Images evicted (LRU) or dropped with their prefix.",
            lambda: store.evicted + store.dropped_with_prefix,
            "counter",
        )


class SpecStats:
    """Speculative decoding's counters: drafts verified, drafts accepted, verify spans."""

    def __init__(self, m: Registry):
        self.proposed = self.accepted = self.verifies = self.device_walks = 0
        self._proposed = m.counter("spec_draft_tokens_total", "Draft tokens verified.")
        self._accepted = m.counter("spec_accepted_tokens_total", "Draft tokens accepted.")
        self._verifies = m.counter("spec_verify_spans_total", "Decode spans that verified drafts.")
        self._device_walks = m.counter(
            "spec_device_walk_steps_total",
            "Speculative steps whose accept walk and draft layers ran on the device.",
        )

    def observe(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verifies += 1
        self._proposed.inc(proposed)
        self._accepted.inc(accepted)
        self._verifies.inc()

    def walked_on_device(self) -> None:
        self.device_walks += 1
        self._device_walks.inc()

    def as_dict(self) -> dict:
        """Totals, the acceptance rate and the mean tokens a verify span emits."""
        return {
            "draft_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "verify_spans": self.verifies,
            "device_walk_steps": self.device_walks,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "tokens_per_verify": (
                (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0
            ),
        }
