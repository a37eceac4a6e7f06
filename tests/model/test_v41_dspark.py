"""DSpark, V4.1's block drafter (``atom.models.deepseek_v41.dspark``), pinned by what its
published definition implies: the block's queries see each other and only the last
``sliding_window`` target positions; the Markov head biases each position by the previous
token's embedding; the confidence head reads the collapsed streams and that embedding; the
stages load from the published ``mtp.*`` tensors."""

from __future__ import annotations

import pytest
import torch

from atom.models.common.config import ConfigError
from atom.models.deepseek_v41.dspark import draft_block
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.presets import PRESETS, preset_config
from atom.models.deepseek_v41.reference import reference_forward, reference_with_hidden

# the v41-tiny-dspark preset's DSpark keys (two stages, blocks of 3, target layers 6/8/9)
DSPARK = {k: v for k, v in PRESETS["v41-tiny-dspark"].items() if k.startswith("dspark_")}


@pytest.fixture(scope="module")
def model():
    return DeepseekV41ForCausalLM(preset_config("v41-tiny", **DSPARK)).init_weights(4)


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_stages_are_built_and_the_main_weights_do_not_depend_on_them(model):
    assert len(model.dspark) == 2 and len(model.mtp) == 0
    assert hasattr(model.dspark[0], "main_proj") and not hasattr(model.dspark[0], "norm")
    assert hasattr(model.dspark[1], "markov_head") and not hasattr(model.dspark[1], "main_proj")
    assert len(model.dspark[0].mlp.experts) == 2 and model.dspark[0].mlp.top_k == 1
    assert model.dspark[0].self_attn.compressor is None  # window-only
    plain = DeepseekV41ForCausalLM(preset_config("v41-tiny")).init_weights(4)
    seq = prompt(20)
    assert torch.equal(reference_forward(plain, seq), reference_forward(model, seq))


def test_target_hidden_is_the_mean_stream_of_each_target_layers_input(model):
    seq = prompt(12)
    logits, hidden = reference_with_hidden(model, seq)
    assert hidden.shape == (12, 3 * model.config.hidden_size)
    seen = []
    orig = model.model.layers[8].block

    def spy(x, pre, rows, attend, tap=None):
        out = orig(x, pre, rows, attend, tap)
        seen.append(x)  # the input before the Engram (layer 8 has none)
        return out

    model.model.layers[8].block = spy
    try:
        reference_with_hidden(model, seq)
    finally:
        del model.model.layers[8].block
    d = model.config.hidden_size
    assert torch.equal(hidden[:, d : 2 * d], seen[0].mean(dim=1))
    assert torch.equal(logits, reference_forward(model, seq))


def draft(model, seq, p, hidden=None):
    if hidden is None:
        hidden = reference_with_hidden(model, seq[: p + 1])[1]
    return draft_block(model, hidden, seq[p + 1], p)


def test_the_block_sees_only_the_last_window_of_target_positions(model):
    seq = prompt(30)
    p, win = 25, model.config.sliding_window
    hidden = reference_with_hidden(model, seq[: p + 1])[1]
    _, logits, conf = draft(model, seq, p, hidden)
    old = hidden.clone()
    old[: p - win + 1] += 1.0  # every position before the window
    assert torch.equal(draft(model, seq, p, old)[1], logits)
    inside = hidden.clone()
    inside[p - win + 1] += 1.0  # the oldest position of the window
    assert not torch.allclose(draft(model, seq, p, inside)[1], logits)


def test_block_queries_see_every_block_key_and_the_first_id_is_the_new_token(model):
    seq = prompt(30)
    p = 20
    hidden = reference_with_hidden(model, seq[: p + 1])[1]
    c = model.config
    ids, logits, conf = draft_block(model, hidden, seq[p + 1], p)
    assert len(ids) == c.dspark_block_size and logits.shape == (3, c.vocab_size)
    other = draft_block(model, hidden, (seq[p + 1] + 1) % 320, p)[1]
    assert not torch.allclose(other[2], logits[2])  # the first id reaches the last position
    # a different noise id changes the first position's logits: it attends the later keys
    c2 = preset_config("v41-tiny", **dict(DSPARK, dspark_noise_token_id=6))
    m2 = DeepseekV41ForCausalLM(c2)
    m2.load_state_dict(model.state_dict())
    assert not torch.allclose(draft_block(m2, hidden, seq[p + 1], p)[1][0], logits[0])


@torch.no_grad()
def test_markov_head_biases_each_position_by_the_previous_token(model):
    seq = prompt(30)
    p = 18
    hidden = reference_with_hidden(model, seq[: p + 1])[1]
    last = model.dspark[-1]
    ids, logits, _ = draft_block(model, hidden, seq[p + 1], p)
    saved = last.markov_head.weight.detach().clone()
    try:
        last.markov_head.weight.zero_()
        _, base, _ = draft_block(model, hidden, seq[p + 1], p, forced=ids)
    finally:
        last.markov_head.weight.copy_(saved)
    prev = [seq[p + 1]] + ids[:-1]
    e = last.markov_embed.weight.float()
    for i, t in enumerate(prev):
        bias = torch.nn.functional.linear(e[t], saved)
        assert torch.allclose(logits[i], base[i] + bias, atol=1e-5)
        assert ids[i] == int(logits[i].argmax())  # each draft is the biased argmax
    assert (logits - base).abs().amax() > 1e-2  # the bias is there


@torch.no_grad()
def test_confidence_reads_the_streams_and_the_markov_embedding(model):
    seq = prompt(30)
    p = 22
    hidden = reference_with_hidden(model, seq[: p + 1])[1]
    last, d = model.dspark[-1], model.config.hidden_size
    saved = last.confidence.weight.detach().clone()
    try:
        w = torch.zeros_like(saved)
        w[0, d:] = 1.0  # only the Markov embedding
        last.confidence.weight.copy_(w)
        ids, _, conf = draft_block(model, hidden, seq[p + 1], p)
    finally:
        last.confidence.weight.copy_(saved)
    prev = [seq[p + 1]] + ids[:-1]
    want = last.markov_embed.weight[prev].float().sum(-1)
    assert torch.allclose(conf, want, atol=1e-5)


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(dspark_block_size=0), "dspark_block_size=0 is invalid"),
        (dict(dspark_noise_token_id=320), "dspark_noise_token_id=320 is invalid"),
        (dict(dspark_target_layer_ids=[9, 6]), "dspark_target_layer_ids=[9, 6] is invalid"),
        (dict(dspark_target_layer_ids=[10]), "dspark_target_layer_ids=[10] is invalid"),
        (dict(dspark_markov_rank=None), "dspark_markov_rank=None is invalid"),
        (dict(dspark_num_experts_per_tok=3), "dspark_num_experts_per_tok=3 is invalid"),
        (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers=1 is invalid"),
    ],
)
def test_bad_dspark_keys_are_refused_by_name(change, needle):
    with pytest.raises(ConfigError) as err:
        preset_config("v41-tiny", **dict(DSPARK, **change))
    assert needle in str(err.value)
