"""The step loop: schedule -> run -> sample -> commit -> completions."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from atom.config import EngineConfig
from atom.engine.block_pool import BlockPool
from atom.engine.checkpoints import CheckpointStore
from atom.engine.connector import Connector
from atom.engine.drafters import make_drafter
from atom.engine.engine_metrics import EngineMetrics, SpecStats, graph_stats
from atom.engine.integrity import check_integrity
from atom.engine.model_runner import ModelRunner
from atom.engine.sampler import (
    Sampler,
    needs_prompt_logits,
    record_prompt_logprobs,
    token_logprobs,
)
from atom.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from atom.engine.sequence import SeqStatus, Sequence
from atom.engine.spec_step import speculative_step
from atom.metrics import Registry
from atom.model_api import ModelRuntime, RuntimeCapabilities
from atom.sampling_params import SamplingParams

log = logging.getLogger("atom.engine")


class RequestError(ValueError):
    """A request the engine cannot serve as given; nothing was admitted."""


@dataclass(frozen=True)
class StepResult:
    """What one step did: whether a forward ran, which requests finished, and whether the
    driver should wait (nothing could run: only tier lookups or transfers are outstanding, or
    the engine is idle with tier work still to settle)."""

    ran: bool
    finished: list[Sequence]
    must_wait: bool


class Tier(Protocol):
    """An attached external KV tier, as the engine holds it."""

    connector: Connector

    def health(self) -> dict: ...

    def clear(self) -> None: ...

    def shutdown(self, timeout_s: float) -> None: ...


class LLMEngine:
    """One engine over one resolved config and one model runtime.

    ``attach_tier`` (optional) is called once the pool exists and before the model derives
    its views from it (a tier may move the pool's storage); it returns the attached Tier.
    Build engines with ``atom.builder.build_engine``.
    """

    def __init__(
        self,
        config: EngineConfig,
        runtime: ModelRuntime,
        attach_tier: Callable[[LLMEngine], Tier] | None = None,
    ):
        self.config = cfg = config
        self.runtime = runtime
        self.spec = runtime.spec
        self.metrics = Registry()
        self.pool = BlockPool(cfg.num_blocks)
        self.store = CheckpointStore(self.pool, self.spec.units_per_image)
        self.runner = ModelRunner(runtime, cfg.num_blocks, cfg.max_num_seqs)
        self._progress = threading.Event()
        self.on_progress = None  # extra wake-up hook (the server's engine loop)
        self.tier = attach_tier(self) if attach_tier is not None else None
        self.runner.bind()
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                checkpoint_interval=cfg.checkpoint_interval,
                max_model_len=cfg.max_model_len,
                prefix_caching=cfg.enable_prefix_caching,
                take_images=cfg.enable_prefix_caching or self.tier is not None,
            ),
            self.pool,
            self.store,
            num_slots=cfg.max_num_seqs,
            connector=self.tier.connector if self.tier is not None else None,
        )
        self.sampler = Sampler(cfg.seed)
        self.drafter = self.spec_stats = None
        # a speculative step of greedy decode spans walks its drafts and runs the draft layers
        # on the device, reading back once (``greedy_walk``); False walks on the host (the
        # path every other step takes), for comparisons
        self.device_walk = True
        if cfg.speculative_tokens:
            self.drafter = make_drafter(cfg, runtime, self.sampler)
            self.spec_stats = SpecStats(self.metrics)
        self.requests: dict[str, Sequence] = {}
        self.steps = 0
        self.engine_metrics = EngineMetrics(
            self.metrics, self.scheduler, self.store, self.pool, runtime
        )
        self.kv_events = None  # prefix-cache events for routers (atom.kv_events), from here on
        if cfg.kv_events is not None:
            from atom.kv_events.events import start_kv_events

            self.kv_events = start_kv_events(
                cfg.kv_events, cfg.block_size, self.scheduler, self.metrics
            )
            if self.tier is not None:  # saves that settle: blocks the tier holds
                self.tier.connector.kv_events = self.kv_events
        log.info(
            "engine ready: model=%s device=%s dtype=%s kv=%s index=%s block=%d pool=%d blocks "
            "x %d B, image=%d B (%d units)",
            cfg.model,
            cfg.device,
            cfg.dtype,
            cfg.kv_dtype,
            cfg.index_dtype,
            cfg.block_size,
            cfg.num_blocks,
            self.spec.block_bytes,
            self.spec.state_bytes,
            self.spec.units_per_image,
        )

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        eos_token_id: int | None = None,
    ) -> Sequence:
        """Validate and queue a request; raises RequestError (admitting nothing) if it cannot
        be served."""
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        if not prompt:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.runtime.vocab_size
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        max_tokens = self._resolve_max_tokens(len(prompt), params.max_tokens)
        seq = Sequence(
            list(prompt),
            params,
            request_id=request_id or "",
            eos_token_id=eos_token_id,
            max_tokens=max_tokens,
        )
        seq.arrival_time = time.perf_counter()
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _resolve_max_tokens(self, n_prompt: int, asked: int | None) -> int:
        """``asked``, or what fits when None; a request that cannot run to its end is refused:
        its prompt plus max_tokens must fit max_model_len, and its KV (every token but the last
        generated one) must fit the pool on its own."""
        cfg = self.config
        room_len = cfg.max_model_len - n_prompt
        room_pool = cfg.num_blocks * cfg.block_size - n_prompt + 1
        if room_len < 1:
            raise RequestError(
                f"prompt has {n_prompt} tokens; this model allows at most "
                f"{cfg.max_model_len - 1} (max_model_len={cfg.max_model_len}, minus one to "
                "generate)"
            )
        if room_pool < 1:
            raise RequestError(
                f"prompt of {n_prompt} tokens needs {-(-n_prompt // cfg.block_size)} PAGE blocks; "
                f"the pool has {cfg.num_blocks} (raise num_blocks or pool_memory_gb)"
            )
        if asked is None:
            return min(room_len, room_pool)
        if asked > room_len:
            raise RequestError(
                f"max_tokens={asked} does not fit: the prompt has {n_prompt} tokens and "
                f"max_model_len is {cfg.max_model_len}, so at most {room_len} can be generated "
                "(lower max_tokens, or leave it unset to generate what fits)"
            )
        if asked > room_pool:
            blocks = -(-(n_prompt + asked - 1) // cfg.block_size)
            raise RequestError(
                f"prompt of {n_prompt} tokens plus max_tokens={asked} needs {blocks} PAGE blocks; "
                f"the pool has {cfg.num_blocks}, so at most {room_pool} tokens can be generated "
                "(lower max_tokens, or raise num_blocks or pool_memory_gb)"
            )
        return asked

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now; ``reason`` is its finish reason ("abort", or "stop" when a front
        end matched a stop string). False if it is not in flight."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, reason)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def notify_progress(self) -> None:
        """Called (from any thread) when something a waiting request needs has finished."""
        self._progress.set()
        hook = self.on_progress
        if hook is not None:
            hook()

    def wait_for_progress(self, timeout: float) -> bool:
        """Block until ``notify_progress`` or ``timeout``; True if notified."""
        hit = self._progress.wait(timeout)
        self._progress.clear()
        return hit

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> StepResult:
        """Run one engine step (settling the tier's outcomes first, also when idle)."""
        out: SchedulerOutput = self.scheduler.schedule()
        if not out.spans:
            self.scheduler.no_forward()
            return StepResult(False, [], self.scheduler.has_work() or self.tier_busy())
        t0 = time.perf_counter()
        self.scheduler.before_forward(out.spans)  # the tier's reservations overlap the forward
        if self.drafter is not None:
            finished = speculative_step(self, out)
            self.engine_metrics.step.observe(time.perf_counter() - t0)
            return StepResult(True, finished, False)
        # spans of requests asking for prompt logprobs need every token's logits
        full = [i for i, sp in enumerate(out.spans) if needs_prompt_logits(sp.seq, sp.start)]
        try:
            if full:
                logits = self.runner.execute(out.spans, full)
            else:
                logits = self.runner.execute(out.spans)
        except Exception:
            for sp in out.spans:
                self.scheduler.abandon(sp)
            raise
        self.steps += 1
        self.scheduler.while_forward()  # before sampling waits for the forward
        for i in full:
            record_prompt_logprobs(out.spans[i].seq, out.spans[i].start, self.runner.span_logits[i])
        sampling = [i for i, sp in enumerate(out.spans) if sp.samples]
        tokens = self.sampler.sample(logits[sampling], [out.spans[i].seq for i in sampling])
        sampled = dict(zip(sampling, tokens))
        finished = []
        now = time.perf_counter()
        for sp in out.spans:
            self.scheduler.commit(sp)
        self.scheduler.after_step([sp.seq for sp in out.spans])
        for i, sp in enumerate(out.spans):
            if i in sampled:
                seq = sp.seq
                if seq.params.logprobs is not None:  # recorded before the token is visible
                    seq.logprobs += token_logprobs(
                        logits[i : i + 1], [sampled[i]], seq.params.logprobs
                    )
                seq.tokens.append(sampled[i])
                self.token_emitted(seq, now)
                reason = self._stop_reason(seq)
                if reason:
                    self._finish(seq, reason)
                    finished.append(seq)
        self.engine_metrics.step.observe(time.perf_counter() - t0)
        return StepResult(True, finished, False)

    def token_emitted(self, seq: Sequence, now: float) -> None:
        """Timings and counters of one output token of ``seq`` made visible at ``now``."""
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.engine_metrics.ttft.observe(now - seq.arrival_time)
        else:
            self.engine_metrics.itl.observe(now - seq.token_times[-1])
        seq.token_times.append(now)
        self.engine_metrics.gen.inc()

    # ---- driving ------------------------------------------------------------------------

    #: how long a driver blocks when a step could not run, before stepping again anyway (the
    #: tier's deadlines are swept by steps; a tier outcome wakes the driver at once)
    WAIT_S = 1.0

    def run_once(self, wait: Callable[[float], object] | None = None) -> StepResult:
        """One step; if it could not run, block in ``wait(timeout)`` (default: until the tier
        reports progress) so that no driver spins. Every driver loop is built on this."""
        result = self.step()
        if result.must_wait:
            (wait or self.wait_for_progress)(self.WAIT_S)
        return result

    def run_until(self, done: Callable[[], bool], on_step=None) -> None:
        """Drive the engine until ``done()``."""
        while not done():
            self.run_once()
            if on_step is not None:
                on_step(self)

    def tier_busy(self) -> bool:
        """A tier lookup or transfer is outstanding (its outcome still has to be settled)."""
        connector = self.scheduler.connector
        return connector is not None and connector.busy()

    def _stop_reason(self, seq: Sequence) -> str | None:
        tok, p = seq.tokens[-1], seq.params
        stoppable = len(seq.output) > p.min_tokens  # the sampler masks them before min_tokens
        if stoppable and tok in p.stop_token_ids:
            return "stop"
        eos = not p.ignore_eos and seq.eos_token_id is not None and tok == seq.eos_token_id
        if stoppable and eos:
            return "stop"
        if len(seq.output) >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        c = seq.counters
        self.engine_metrics.requests.inc(finish_reason=reason)
        self.engine_metrics.prompt.inc(c.hbm_hit_tokens, source="hbm")
        self.engine_metrics.prompt.inc(c.tier_hit_tokens, source="tier")
        self.engine_metrics.prompt.inc(c.computed_prompt_tokens, source="computed")
        seq.finish_time = time.perf_counter()
        self.sampler.forget(seq)
        self.requests.pop(seq.request_id, None)

    # ---- introspection ------------------------------------------------------------------

    def reset_prefix_cache(self, tier: bool = False) -> None:
        """Forget every cached block and unpinned image (only when nothing is running). A
        PENDING image (a tier load still in flight for an aborted request) is dropped too: it
        would otherwise become a hit when its load lands. ``tier``: empty the tier too."""
        if self.scheduler.has_work():
            raise RuntimeError("reset_prefix_cache() needs an idle engine")
        if tier:
            if self.tier is None:
                raise RuntimeError("reset_prefix_cache(tier=True): no tier is attached")
            self.tier.clear()
        while self.store.evict_fewest_dependents():
            pass
        for ckpt in [c for c in self.store.images.values() if not c.ready]:
            self.store.drop(ckpt)
        for b in range(self.pool.num_blocks):
            if self.pool.is_cached(b):
                self.pool.forget(b)
        if self.kv_events is not None and not self.pool.by_hash:
            self.kv_events.cleared()

    def check_integrity(self) -> None:
        check_integrity(self.scheduler)

    def stats(self) -> dict:
        s = self.scheduler
        return {
            "waiting": len(s.waiting),
            "running": len(s.running),
            "free_blocks": self.pool.num_free,
            "cached_blocks": self.pool.num_cached,
            "images": self.store.counts(),
            "images_created": self.store.created,
            "images_evicted": self.store.evicted,
            "preemptions": s.preemptions,
            "tier_tokens_recomputed": s.tier_tokens_recomputed,
            "steps": self.steps,
            **({"speculative": self.spec_stats.as_dict()} if self.spec_stats else {}),
            **({"cuda_graphs": g} if (g := graph_stats(self.runtime)) else {}),
        }

    def tier_health(self) -> dict:
        return self.tier.health() if self.tier is not None else {"attached": False}

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is unfinished, let pending tier stores finish (bounded), detach."""
        for seq in list(self.requests.values()):
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, "abort")
        if self.tier is not None:
            tier, self.tier = self.tier, None
            self.scheduler.apply(tier.shutdown(timeout_s))
        if self.kv_events is not None:  # after the last blocks were released: all sent
            self.kv_events.close(min(timeout_s, 5.0))
        close = RuntimeCapabilities.of(self.runtime).close  # a tensor-parallel runtime's ranks
        if close is not None:
            close()
