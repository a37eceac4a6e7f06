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


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"num_attention_heds": 4}, "['num_attention_heds'] name no field of V41Config"),
        ("{heads: 4}", "not valid JSON"),
        ([4], "must be a mapping of model config fields, got list"),
        ({"num_attention_heads": 0}, "num_attention_heads=0 is invalid"),
        ({"num_hidden_layers": 4}, "compress_ratios="),  # the lists no longer fit
    ],
)
def test_model_overrides_are_refused_at_build_naming_the_field(overrides, needle):
    with pytest.raises(EngineConfigError) as err:
        EngineConfig.build(model="v41-tiny", model_overrides=overrides)
    assert needle in str(err.value) and "model_overrides" in str(err.value)


def test_model_overrides_build_that_model_and_key_its_own_namespace():
    """The JSON string of --model-overrides and a dict build the same model; the overridden
    config enters the layout id (so a tier never mixes it with the preset's objects)."""
    wide = EngineConfig.build(
        model="v41-tiny", model_overrides='{"num_attention_heads": 4, "o_groups": 4}'
    )
    assert wide.model_overrides == {"num_attention_heads": 4, "o_groups": 4}
    llm = LLM("v41-tiny", model_overrides=wide.model_overrides, num_blocks=30, device="cpu")
    plain = LLM("v41-tiny", num_blocks=30, device="cpu")
    try:
        assert llm.engine.runtime.model.config.num_attention_heads == 4
        assert plain.engine.runtime.model.config.num_attention_heads == 2
        assert llm.engine.spec.layout_id != plain.engine.spec.layout_id
        out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
    finally:
        llm.shutdown()
        plain.shutdown()


def test_model_overrides_apply_to_a_checkpoints_config(tmp_path):
    """A checkpoint's config.json field is replaced (max_position_embeddings bounds
    max_model_len); a shape its weights do not have is refused by the loader."""
    from tests.model.test_v41_published_checkpoint import write_checkpoint

    write_checkpoint(tmp_path)
    cfg = EngineConfig.build(
        model=str(tmp_path), model_overrides={"max_position_embeddings": 512}, device="cpu"
    )
    assert cfg.resolved().max_model_len == 512
    with pytest.raises(Exception, match="does not fit the model: tensor .*wo_a.weight has shape"):
        LLM(str(tmp_path), model_overrides={"o_lora_rank": 64}, num_blocks=30, device="cpu")
