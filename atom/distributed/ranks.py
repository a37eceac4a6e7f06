"""Start a tensor-parallel engine's ranks: one process per rank, this process is rank 0.

``start_ranks(cfg)`` spawns ranks 1..N-1 (``multiprocessing`` spawn), joins the group as rank
0, builds this rank's split runtime and returns it wrapped in a ``BroadcastRuntime``. Each
other rank builds its own split runtime and then makes the ops rank 0 sends
(``broadcast_runtime.serve_ops``) until ``stop``.

Start: every rank joins rank 0's rendezvous store within ``tensor_parallel_start_timeout_s``
(default 30 s), or the start fails at once naming the rank and the likely cause: a rank that
exited (a spawned rank re-importing an entry script that starts an engine at import: the
missing ``if __name__ == "__main__":`` guard), one that never joined, no port to open
(``rendezvous``).

Lifetimes: a rank whose parent (rank 0's process) dies exits at once (a watchdog thread on the
parent's sentinel), so no rank outlives the engine; a rank that dies makes rank 0's next
collective fail within ``tp_timeout_s`` (an error, never a hang); ``BroadcastRuntime.close``
sends ``stop`` and joins the ranks (killing one that does not exit in time). On CUDA rank r
uses device ``cuda:r``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading

import torch

from atom import kernels
from atom.distributed.broadcast_runtime import BroadcastRuntime, serve_ops
from atom.distributed.parallel_state import ParallelState
from atom.distributed.rendezvous import Rendezvous, join, refuse_reimport
from atom.models.common import glue_compile
from atom.models.common.moe import configure_grouped_mm

log = logging.getLogger("atom.distributed")

#: this process's CPU threads before any engine split them (one engine after another divides
#: the same count, not the last one's share)
_PROCESS_THREADS = torch.get_num_threads()
#: seconds a collective of the forward may take before it fails (a dead rank)
TP_TIMEOUT_S = 30.0
#: seconds a rank waits for rank 0's next op before it gives up on rank 0 (an idle rank 0
#: pings every quarter of it, so idle engines live on)
CONTROL_TIMEOUT_S = 600.0


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


def rank_threads(world: int) -> int:
    """CPU threads each rank computes with: an equal share of rank 0's. Every rank, rank 0
    included, uses the same count (rank 0 passes it to the others), so their CPU kernels
    reduce in the same order and the ranks' whole (unsplit) computations give the same bits:
    their pools and slots hold the same bytes (``broadcast_runtime``). With different counts
    they did not: a few KV values differed in their last bits."""
    return max(1, _PROCESS_THREADS // world)


def build_rank_runtime(cfg, state: ParallelState):
    """This rank's split runtime for the resolved config ``cfg``, of the model's family (the
    splits its layers declare: ``atom.models.common.tensor_parallel``; of a checkpoint only
    this rank's slices are read), at its ``weight_dtype`` (FP8 linears and FP4 experts split
    with their scales at "fp8")."""
    from atom.distributed.split_models import build_tp_model
    from atom.models.registry import family

    model_cfg, path = cfg.resolve_model()
    fam = family(model_cfg)
    kw = dict(
        dtype=getattr(torch, cfg.dtype),
        kv_dtype=cfg.kv_dtype,
        index_dtype=cfg.index_dtype,
        device=rank_device(cfg.device, state.rank),
    )
    model = build_tp_model(
        fam, model_cfg, path, state, seed=cfg.seed, weight_dtype=cfg.weight_dtype, **kw
    )
    # every rank's slots hold the draft state (the images carry it; module broadcast_runtime)
    return fam.get("runtime")(
        model, block_size=cfg.block_size, speculative_tokens=cfg.speculative_tokens
    )


def _rank_main(
    rank: int,
    world: int,
    address: tuple[str, int],
    values: dict,
    tier_conn=None,
    control_timeout_s: float = CONTROL_TIMEOUT_S,
    rank_ops=None,
    threads: int = 1,
) -> None:
    from atom.config import EngineConfig

    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(
            target=lambda: (parent.join(), os._exit(3)), daemon=True, name="parent-watch"
        ).start()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    cfg = EngineConfig(**values)
    kernels.configure(cfg.triton_kernels, cfg.triton_off, cfg.triton_on)  # as rank 0's build
    configure_grouped_mm(cfg.moe_grouped_mm)
    glue_compile.configure(cfg.compile_glue)
    torch.set_num_threads(threads)
    start_s = cfg.tensor_parallel_start_timeout_s
    state = ParallelState.init(
        rank,
        world,
        store=join(address, rank, world, start_s),
        device=rank_device(cfg.device, rank),
        timeout_s=TP_TIMEOUT_S,
        init_timeout_s=start_s,
        control_timeout_s=control_timeout_s,
        all_reduce=cfg.tp_all_reduce,
    )
    runtime = build_rank_runtime(cfg, state)
    serve_ops(runtime, state, rank_ops(rank, tier_conn) if rank_ops is not None else None)
    state.destroy()


def start_ranks(cfg, rank_ops=None) -> BroadcastRuntime:
    """Spawn ranks 1..N-1 of the resolved config ``cfg``, join as rank 0, return its runtime.
    ``rank_ops(rank, conn)`` (picklable: spawned ranks import it) makes each rank's
    ``RankOps``, the ops besides the model's (the tier's), with ``conn`` the rank's outcome
    pipe (write end); None: the ranks make the model's ops only.
    Every rank joins within ``cfg.tensor_parallel_start_timeout_s``, or this raises
    ``TensorParallelStartError`` saying which rank and why (``rendezvous``)."""
    from atom.distributed.split_models import TIER_BYTES_REPLICATED, check_tp_split

    refuse_reimport()  # a spawned rank importing an entry script that starts an engine
    world = cfg.tensor_parallel_size
    threads = rank_threads(world)
    if not cfg.device.startswith("cuda"):
        torch.set_num_threads(threads)  # as every rank (rank_threads)
    model_cfg, _ = cfg.resolve_model()
    # before any process or group exists: the heads, groups and experts divide, and (FP8) no
    # rank would hold part of a weight block
    check_tp_split(model_cfg, world, weight_dtype=cfg.weight_dtype)
    start_s = cfg.tensor_parallel_start_timeout_s
    rendezvous = Rendezvous(world, start_s)
    control_s = CONTROL_TIMEOUT_S
    ctx = mp.get_context("spawn")
    # one pipe per rank for its tier's outcomes (rank 0 reads them on a thread of its own)
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                rank, world, rendezvous.address, cfg.model_dump(), pipes[rank - 1][1], control_s,
                rank_ops, threads,
            ),  # fmt: skip
            name=f"atom-tp-rank{rank}",
            daemon=True,
        )
        for rank in range(1, world)
    ]
    for p in procs:
        p.start()
    for _, send_end in pipes:
        send_end.close()  # the ranks hold them: a rank that exits closes its pipe (EOF here)
    try:
        rendezvous.wait_joined(procs)
        state = ParallelState.init(
            0, world, store=rendezvous.store, device=rank_device(cfg.device, 0),
            timeout_s=TP_TIMEOUT_S, init_timeout_s=start_s, control_timeout_s=control_s,
            all_reduce=cfg.tp_all_reduce,
        )  # fmt: skip
        runtime = build_rank_runtime(cfg, state)
    except BaseException:
        _stop(procs, 0.0)
        raise
    log.info("tensor parallel: %d ranks (pids %s)", world, [p.pid for p in procs])

    def close() -> None:
        _stop(procs, 30.0 if all(p.is_alive() for p in procs) else 0.0)
        state.destroy()

    return BroadcastRuntime(
        runtime,
        state,
        procs,
        on_close=close,
        tier_conns=[recv for recv, _ in pipes],
        rank_replicated=TIER_BYTES_REPLICATED,
        keepalive_s=control_s / 4,
    )


def _stop(procs, timeout_s: float) -> None:
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
