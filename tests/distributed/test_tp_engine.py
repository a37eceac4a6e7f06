"""The engine at tensor_parallel_size=2 (CPU, gloo; rank 0 is this process, rank 1 a spawned
one): greedy outputs equal one rank's on the engine-oracle workload (up to near-ties, which are
reported), every rank stops with the engine, a killed rank stops the engine with an error and
no process outlives it, an idle engine outlives its ranks' control timeout (keepalive pings),
and what does not run across ranks is refused by the config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from atom import LLM, SamplingParams
from atom.config import EngineConfigError
from atom.distributed import ranks
from atom.distributed.broadcast_runtime import BroadcastRuntime, RankFailure
from tests.engine.test_engine_oracle import run_checked
from tests.engine.workloads import prefix_tree_prompts
from tests.gpu.test_decode_graphs_cuda import assert_same_greedy

KW = dict(
    block_size=16,
    num_blocks=40,
    max_num_seqs=4,
    max_num_batched_tokens=48,
    dtype="float32",
    kv_dtype="fp32",
    index_dtype="fp32",
    device="cpu",
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("model", ["v41-tiny", "v4-tiny"])
def test_tp2_greedy_equals_one_rank_and_stops_every_rank(model):
    """Both families: each splits what its layers declare (tensor_parallel.split_plan)."""
    prompts = prefix_tree_prompts(12, 16, seed=5)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    one = LLM(model, **KW).generate(prompts, params)
    llm = LLM(model, tensor_parallel_size=2, **KW)
    pids = [p.pid for p in llm.engine.runtime.processes]
    assert len(pids) == 1 and alive(pids[0])
    two = run_checked(llm, prompts, params)
    assert sum(o.hbm_hit_tokens for o in two) > 0, "the tree workload produced no hit"
    # split reductions change the last bits; a token may differ only where one rank's top two
    # were within 1e-3 (a near-tie), and not in more than one sequence
    assert_same_greedy(two, one, eps=1e-3, most=1)
    llm.shutdown()
    assert not alive(pids[0]), "rank 1 outlived the engine"


def test_v4_checkpoint_at_tp2_reads_each_ranks_slices_and_decodes_what_one_rank_does(
    tmp_path, monkeypatch
):
    """A DeepSeek-V4 checkpoint in the published names and formats (FP8 tiles, FP4 experts,
    two files): each rank builds on ``meta``, splits, and has the loader read only its slices
    of the split tensors (rank 0's, recorded here: rank 1 builds in its own process), and TP=2
    decodes what one rank does with the same checkpoint."""
    from atom.distributed import split_models
    from tests.model.test_v4_checkpoint import write_checkpoint

    write_checkpoint(tmp_path)
    prompts = prefix_tree_prompts(6, 16, seed=9)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    one = LLM(str(tmp_path), **KW).generate(prompts, params)
    asked, slices = [], split_models.rank_slices
    monkeypatch.setattr(split_models, "rank_slices", lambda m: asked.append(slices(m)) or asked[-1])
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **KW)
    try:
        wq_b = llm.engine.runtime.model.layers[0].attn.wq_b.weight
        two = run_checked(llm, prompts, params)
    finally:
        llm.shutdown()
    [plan] = asked
    assert {(index, parts) for _, index, parts in plan.values()} == {(0, 2)}
    assert "layers.0.attn.wq_b.weight" in plan and "layers.0.ffn.experts.0.down_proj.weight" in plan
    config = llm.engine.runtime.model.config
    assert wq_b.shape[0] == config.num_attention_heads // 2 * config.head_dim
    assert_same_greedy(two, one, eps=1e-3, most=1)


@pytest.mark.parametrize("preset", ["v41-tiny-fp8", "v4-tiny-fp8"])
def test_stored_precision_checkpoint_at_tp2_decodes_what_one_rank_does(preset, tmp_path):
    """``weight_dtype: fp8`` across ranks: a published-format checkpoint (FP8 in 32 x 32
    blocks, FP4 experts, V4.1's FP8 Engram tables and its tokenizer's compressed vocabulary;
    the tiny model widened so that each rank holds whole blocks) runs as FP8 linears, FP4
    experts and FP8 row tables on every rank, split with their scales (rank 0's shapes here;
    tests/model/test_tp_stored_precision.py checks every rank's bytes, in-process), and TP=2
    decodes what one rank does at the same precision."""
    from atom.models.common.fp4_linear import Fp4Linear
    from atom.models.common.fp8_linear import Fp8Linear
    from atom.models.common.fp8_rows import Fp8RowTable
    from tests.model.test_tp_stored_precision import _write

    _write(preset, tmp_path)
    prompts = prefix_tree_prompts(6, 16, seed=9)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    one_llm = LLM(str(tmp_path), weight_dtype="fp8", **KW)
    whole = one_llm.engine.runtime.model
    one = one_llm.generate(prompts, params)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, weight_dtype="fp8", **KW)
    try:
        assert llm.engine.config.weight_dtype == "fp8"
        model = llm.engine.runtime.model
        two = run_checked(llm, prompts, params)
    finally:
        llm.shutdown()
    kinds = {n: type(m) for n, m in model.named_modules()}
    assert kinds == {n: type(m) for n, m in whole.named_modules()}
    moe = "model.layers.0.mlp" if preset.startswith("v41") else "layers.0.ffn"
    for sub, kind, dim in (
        ("shared_experts.gate_proj", Fp8Linear, 0),
        ("experts.1.down_proj", Fp4Linear, 1),
    ):
        part, full = model.get_submodule(f"{moe}.{sub}"), whole.get_submodule(f"{moe}.{sub}")
        assert type(part) is kind
        for t in ("weight", "weight_scale"):
            assert getattr(part, t).shape[dim] * 2 == getattr(full, t).shape[dim]
    if preset.startswith("v41"):  # the Engram tables: FP8 rows, half the columns a rank
        part = model.get_submodule("model.layers.1.engram.embed")
        full = whole.get_submodule("model.layers.1.engram.embed")
        assert type(part) is type(full) is Fp8RowTable
        assert part.weight.shape[1] * 2 == full.weight.shape[1]
        # 16 of 32 columns: the rank holds the one scale group it shares with rank 1
        assert part.weight_scale.shape == full.weight_scale.shape
        assert not model.engram_hash.needs_token_map  # the tokenizer's map, on rank 0 too
    # at stored precision a split sum's last-bit difference can flip an activation's E4M3
    # rounding (a step of 1/16 of its value) in the next FP8 linear, so TP=2 parts from one
    # rank at wider gaps than in bf16: up to 0.03 in top-1 logprob on this V4.1 checkpoint
    # (bf16, the same checkpoint: 5e-7), and a parting at a top-2 gap of 0.049
    assert_same_greedy(two, one, eps=0.1, most=1)


def test_a_killed_rank_stops_the_engine_with_an_error():
    llm = LLM("v41-tiny", tensor_parallel_size=2, **KW)
    (proc,) = llm.engine.runtime.processes
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    steps = []

    def kill_on_third(engine):
        steps.append(1)
        if len(steps) == 3:
            os.kill(proc.pid, signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited with code -9") as err:
        llm.generate(prefix_tree_prompts(4, 16, seed=6), params, on_step=kill_on_third)
    took = time.monotonic() - t0
    assert took < 40, f"the engine took {took:.0f} s to notice a dead rank"
    assert len(steps) >= 3
    print(f"dead rank noticed after {took:.1f} s: {type(err.value).__name__}: {err.value}")
    proc.join(5)
    assert not proc.is_alive()
    t0 = time.monotonic()
    llm.shutdown()  # stops what is left and leaves the group, without waiting on the dead rank
    assert time.monotonic() - t0 < 10


def test_ranks_exit_when_rank_0_is_killed(tmp_path):
    script = tmp_path / "tp_rank0.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from atom import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM("v41-tiny", tensor_parallel_size=2, **{KW!r})
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
            print("PIDS", *[p.pid for p in llm.engine.runtime.processes], flush=True)
            sys.stdin.read()  # until the test kills this process
    """))
    rank0 = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = rank0.stdout.readline()
            assert line, "rank 0 exited before starting its ranks"
        (pid,) = [int(x) for x in line.split()[1:]]
        assert alive(pid)
        rank0.kill()
        rank0.wait(30)
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # allowed: polling another process's exit, bounded
        assert not alive(pid), "rank 1 outlived a killed rank 0"
    finally:
        rank0.kill()


CONTROL_S = 6.0  # the ranks' control timeout in the idle tests (the default is 600 s)


def test_an_idle_engine_outlives_the_ranks_control_timeout(monkeypatch):
    monkeypatch.setattr(ranks, "CONTROL_TIMEOUT_S", CONTROL_S)
    prompts = prefix_tree_prompts(4, 16, seed=7)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM("v41-tiny", tensor_parallel_size=2, **KW)
    rt = llm.engine.runtime
    (proc,) = rt.processes
    first = run_checked(llm, prompts, params)
    idle_from, pings = time.monotonic(), rt.pings
    deadline = idle_from + 60
    while (rt.pings < pings + 6 or time.monotonic() - idle_from < 1.5 * CONTROL_S) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)  # allowed: the engine must sit idle past the timeout; polls the pings
    idle = time.monotonic() - idle_from
    assert idle > CONTROL_S and rt.pings >= pings + 6, (idle, rt.pings)
    assert proc.is_alive()
    second = llm.generate(prompts, params)
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    llm.shutdown()
    assert not proc.is_alive()


def test_without_pings_an_idle_rank_gives_up_on_rank_0(monkeypatch):
    """The control timeout the previous test outlives is real: with no pings rank 1 exits
    once it passes, and the engine's next request fails with an error (no hang)."""
    monkeypatch.setattr(ranks, "CONTROL_TIMEOUT_S", CONTROL_S)
    monkeypatch.setattr(BroadcastRuntime, "_keep_alive", lambda self, every_s: None)
    llm = LLM("v41-tiny", tensor_parallel_size=2, **KW)
    (proc,) = llm.engine.runtime.processes
    proc.join(60)  # rank 1 waits for an op that never comes, then exits
    assert not proc.is_alive() and proc.exitcode != 0
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) exited"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    llm.shutdown()


@pytest.mark.parametrize(
    "extra, needle",
    [
        (dict(batch_invariant=True), "batch_invariant=true"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    ],
)
def test_config_refuses_what_does_not_run_across_ranks(extra, needle):
    values = {**KW, "model": "v41-tiny", "tensor_parallel_size": 2, **extra}
    model = values.pop("model")
    with pytest.raises(EngineConfigError, match=needle):
        LLM(model, **values)


def test_a_world_size_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(Exception, match="tensor_parallel_size=3|world size 3|3 ranks") as err:
        LLM("v41-tiny", tensor_parallel_size=3, **KW)
    print(err.value)
