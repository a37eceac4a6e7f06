import pytest

from atom import LLM, EngineConfig, SamplingParams
from atom.config import EngineConfigError
from atom.engine.engine import RequestError
from atom.models.deepseek_v41.pool_geometry import build_v41_pool_geometry
from atom.models.deepseek_v41.presets import preset_config


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(max_num_seqs=0), "max_num_seqs=0: must be >= 1"),
        (dict(dtype="float64"), "dtype='float64'"),
        (dict(device="tpu"), "device='tpu': allowed: auto, cpu, cuda, cuda:N"),
        (dict(num_blocks=10, pool_memory_gb=1.0), "set only one"),
        (dict(block_size=256, max_num_batched_tokens=100), "max_num_batched_tokens=100"),
        (dict(max_num_seqs="four"), "max_num_seqs='four'"),
        (dict(blocksize=16), "blocksize=16: unknown field"),
    ],
)
def test_config_errors_name_field_value_and_allowed(kw, needle):
    with pytest.raises(EngineConfigError) as err:
        EngineConfig.build(**kw)
    assert needle in str(err.value)


def test_yaml_with_overrides(tmp_path):
    f = tmp_path / "engine.yaml"
    f.write_text("model: v41-tiny\nmax_num_seqs: 3\nnum_blocks: 50\n")
    cfg = EngineConfig.from_yaml(f, max_num_seqs=5)
    assert (cfg.model, cfg.max_num_seqs, cfg.num_blocks) == ("v41-tiny", 5, 50)
    f.write_text("model: v41-tiny\nmax_num_seq: 3\n")
    with pytest.raises(EngineConfigError, match="max_num_seq=3: unknown field"):
        EngineConfig.from_yaml(f)
    f.write_text("model: [v41\n")
    with pytest.raises(EngineConfigError, match="not valid YAML"):
        EngineConfig.from_yaml(f)


def test_resolved_config_fills_auto_fields():
    cfg = EngineConfig.build(model="v41-mini", pool_memory_gb=0.01, device="cpu").resolved()
    assert cfg.block_size == 256 and cfg.dtype == "float32" and cfg.kv_dtype == "fp32"
    geo = build_v41_pool_geometry(
        preset_config("v41-mini"),
        kv_dtype="fp32",
        index_dtype="fp32",
        block_size=256,
        speculative_tokens=0,
    )
    assert cfg.num_blocks == int(0.01 * 2**30 // geo.block_bytes)
    with pytest.raises(EngineConfigError, match="pool needs at least"):
        EngineConfig.build(model="v41-mini", num_blocks=3, device="cpu").resolved()
    with pytest.raises(Exception, match="neither a preset"):
        EngineConfig.build(model="no-such-model").resolved()


def test_bad_requests_are_refused_and_the_engine_keeps_serving():
    llm = LLM("v41-tiny", num_blocks=30, max_model_len=64, device="cpu")
    eng = llm.engine
    with pytest.raises(RequestError, match="prompt is empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(RequestError, match=r"must be in \[0, 320\)"):
        eng.add_request([1, 2, 999], SamplingParams())
    with pytest.raises(RequestError, match="prompt has 64 tokens; this model allows at most 63"):
        eng.add_request([1] * 64, SamplingParams())
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="max_tokens=10 does not fit.*at most 4 can be"):
        eng.add_request([1] * 60, SamplingParams(max_tokens=10))
    # the KV of every token but the last must fit the pool (30 blocks x 16 = 480 tokens)
    big = LLM("v41-tiny", num_blocks=6, max_model_len=512, device="cpu").engine
    with pytest.raises(RequestError, match="needs 9 PAGE blocks; the pool has 6"):
        big.add_request([1] * 70, SamplingParams(max_tokens=64))
    assert big.add_request([1] * 70, SamplingParams(max_tokens=None)).max_tokens == 96 - 70 + 1
    assert not eng.has_unfinished()
    # unset: as many as fit max_model_len
    out = llm.generate([[1] * 60], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
