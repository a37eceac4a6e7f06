"""The step loop: schedule -> run -> sample -> commit -> completions."""

from __future__ import annotations

import logging
import time

import torch

from atom.config import EngineConfig
from atom.engine.block_pool import BlockPool
from atom.engine.checkpoints import CheckpointStore
from atom.engine.model_runner import ModelRunner
from atom.engine.sampler import Sampler
from atom.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from atom.engine.sequence import SeqStatus, Sequence
from atom.models.registry import load_runtime
from atom.sampling_params import SamplingParams

log = logging.getLogger("atom.engine")


class RequestError(ValueError):
    """A request the engine cannot serve as given; nothing was admitted."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = cfg = config.resolved()
        torch.manual_seed(cfg.seed)
        self.runtime = load_runtime(
            cfg.model,
            dtype=getattr(torch, cfg.dtype),
            kv_dtype=cfg.kv_dtype,
            index_dtype=cfg.index_dtype,
            block_size=cfg.block_size,
            device=cfg.device,
            seed=cfg.seed,
        )
        self.spec = self.runtime.spec
        self.pool = BlockPool(cfg.num_blocks)
        self.store = CheckpointStore(self.pool, self.spec.units_per_image)
        self.runner = ModelRunner(self.runtime, cfg.num_blocks, cfg.max_num_seqs)
        self.runner.bind()
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                checkpoint_interval=cfg.checkpoint_interval,
                max_model_len=cfg.max_model_len,
                prefix_caching=cfg.enable_prefix_caching,
                take_images=cfg.enable_prefix_caching,
            ),
            self.pool,
            self.store,
            num_slots=cfg.max_num_seqs,
        )
        self.sampler = Sampler(cfg.seed)
        self.requests: dict[str, Sequence] = {}
        self.steps = 0
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
        cfg = self.config
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        if not prompt:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.runtime.vocab_size
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if len(prompt) >= cfg.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt)} tokens; this model allows at most "
                f"{cfg.max_model_len - 1} (max_model_len={cfg.max_model_len}, minus one to "
                "generate)"
            )
        need = -(-(len(prompt) + 1) // cfg.block_size)
        if need > cfg.num_blocks:
            raise RequestError(
                f"prompt of {len(prompt)} tokens needs {need} PAGE blocks; the pool has "
                f"{cfg.num_blocks} (raise num_blocks or pool_memory_gb)"
            )
        seq = Sequence(list(prompt), params, request_id=request_id or "", eos_token_id=eos_token_id)
        seq.arrival_time = time.perf_counter()
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences that finished in it."""
        out: SchedulerOutput = self.scheduler.schedule()
        if not out.spans:
            return []
        try:
            logits = self.runner.execute(out.spans)
        except Exception:
            for sp in out.spans:
                self.scheduler.abandon(sp)
            raise
        self.steps += 1
        sampling = [i for i, sp in enumerate(out.spans) if sp.samples]
        tokens = self.sampler.sample(logits[sampling], [out.spans[i].seq for i in sampling])
        sampled = dict(zip(sampling, tokens))
        finished = []
        now = time.perf_counter()
        for i, sp in enumerate(out.spans):
            self.scheduler.commit(sp)
            if i in sampled:
                seq = sp.seq
                seq.tokens.append(sampled[i])
                seq.token_times.append(now)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = self._stop_reason(seq)
                if reason:
                    self._finish(seq, reason)
                    finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence) -> str | None:
        tok, p = seq.tokens[-1], seq.params
        if tok in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and seq.eos_token_id is not None and tok == seq.eos_token_id:
            return "stop"
        if len(seq.output) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seq.finish_time = time.perf_counter()
        self.sampler.forget(seq)
        self.requests.pop(seq.request_id, None)

    # ---- introspection ------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and unpinned image (only when nothing is running)."""
        if self.scheduler.has_work():
            raise RuntimeError("reset_prefix_cache() needs an idle engine")
        while self.store.evict_lru():
            pass
        for b in range(self.pool.num_blocks):
            if self.pool.is_cached(b):
                self.pool.forget(b)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

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
            "steps": self.steps,
        }

    def shutdown(self) -> None:
        for seq in list(self.requests.values()):
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, "abort")
