"""The published DeepSeek-V4.1 Engram: layout, token map, hash and gate, on hand-worked cases."""

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from atom.models.deepseek_v41.engram import Engram, dequantise_rows, e8m0_to_float
from atom.models.deepseek_v41.ngram_hash import (
    BEFORE_START,
    DEAD,
    EngramSpec,
    HashLayout,
    NgramHasher,
    build_layout,
    check_token_map_size,
    initial_state,
    layer_multipliers,
)
from atom.models.deepseek_v41.primes import is_prime
from atom.models.deepseek_v41.token_map import build_compressed_token_map, identity_token_map

TINY = EngramSpec(
    layer_ids=(0, 1),
    num_embeddings=(60, 120),
    max_ngram_size=3,
    vocab_size=10,
    n_heads=2,
    head_dim=32,
    pad_token_id=0,
    compressed_vocab_size=5,
)


def test_is_prime_small_and_carmichael():
    assert [n for n in range(40) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]
    # 561 and 41041 are Carmichael numbers (fool Fermat tests); 2^31 - 1 is prime.
    assert not is_prime(561) and not is_prime(41041) and is_prime(2**31 - 1)
    assert not is_prime(3215031751)  # strong pseudoprime to bases 2, 3, 5, 7


def test_prime_layout_tiny():
    layout = build_layout(TINY)
    # Layer 0, n=2: from 9 -> 11, 13; n=3 restarts at 9, skips the used 11, 13 -> 17, 19.
    # Layer 1 restarts at 9 again and skips all four -> 23, 29 | 31, 37.
    assert layout.primes == (((11, 13), (17, 19)), ((23, 29), (31, 37)))
    # Offsets: running sums of 11, 13, 17 (layer 0) and 23, 29, 31 (layer 1).
    assert layout.offsets == (((0, 11), (24, 41)), ((0, 23), (52, 83)))
    assert layout.table_rows(0) == 60 and layout.table_rows(1) == 120


def test_prime_search_is_strictly_above_vocab_minus_one():
    # engram_vocab_size 11 is itself prime: the search starts at 10, so 11 is taken first.
    spec = EngramSpec((3,), (24,), 2, 11, 2, 32, pad_token_id=0, compressed_vocab_size=5)
    assert build_layout(spec).primes == (((11, 13),),)


def test_prime_layout_refuses_small_table():
    spec = EngramSpec(**{**TINY.__dict__, "num_embeddings": (60, 119)})
    with pytest.raises(ValueError, match=r"need 120 rows .* gives 119"):
        build_layout(spec)


def test_published_layout_fills_published_tables():
    # The released config's table sizes are exactly the sums of its primes.
    spec = EngramSpec.from_text_config(
        {
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4,
            "engram_vocab_size": 16000000,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_pad_id": 2,
            "engram_compressed_vocab_size": 99092,
        }
    )
    layout = build_layout(spec)
    assert spec.pad_token_id == 2
    assert [layout.table_rows(i) for i in range(2)] == [384006168, 384016682]
    assert layout.primes[0][0][0] == 16000057  # smallest prime above 16e6 - 1
    flat = [p for layer in layout.primes for per_n in layer for p in per_n]
    assert len(set(flat)) == 48


def test_multipliers_are_the_numpy_draw():
    cvs = 99092
    bound = (np.iinfo(np.int64).max // cvs) // 2
    expected = np.random.default_rng(10007 * 14).integers(0, bound, size=4, dtype=np.int64) * 2 + 1
    got = layer_multipliers(14, 4, cvs)
    assert got == [int(v) for v in expected]
    assert all(v % 2 == 1 for v in got)
    assert got != layer_multipliers(1, 4, cvs)
    # Largest possible product still fits int64.
    assert max(got) * (cvs - 1) < np.iinfo(np.int64).max


def _hand_hasher() -> NgramHasher:
    # One layer, n-gram sizes 2 and 3, two heads, multipliers set by hand; pad token 0 maps to
    # compressed id 2 through the token map below.
    spec = EngramSpec((0,), (60,), 3, 10, 2, 32, pad_token_id=0, compressed_vocab_size=10)
    layout = HashLayout(
        layer_ids=(0,),
        max_ngram_size=3,
        n_heads=2,
        primes=(((11, 13), (17, 19)),),
        offsets=(((0, 11), (24, 41)),),
        multipliers=((3, 5, 7),),
    )
    return NgramHasher(spec, ([2, 1, 0, 3, 4, 5, 6, 7, 8, 9], 10), layout=layout)


def test_hash_hand_computed():
    hasher = _hand_hasher()
    assert hasher.pad == 2
    rows, state = hasher.hash_span([5, 9, 1], initial_state(3))
    # t=0: looks [5, pad, pad] = [5, 2, 2]; products [15, 10, 14].
    #   n=2: 15^10 = 5 -> 5 % 11 = 5, 5 % 13 = 5 + 11 = 16; n=3: 5^14 = 11 -> 11+24, 11+41.
    # t=1: looks [9, 5, 2]; products [27, 25, 14]. n=2: 27^25 = 2 -> 2, 2+11;
    #   n=3: 2^14 = 12 -> 12+24, 12+41.
    # t=2: looks [1, 9, 5]; products [3, 45, 35]. n=2: 3^45 = 46 -> 46%11 = 2, 46%13 = 7 + 11;
    #   n=3: 46^35 = 13 -> 13+24, 13+41.
    assert rows[:, 0].tolist() == [[5, 16, 35, 52], [2, 13, 36, 53], [2, 18, 37, 54]]
    assert state == (9, 1)


def test_hash_dead_blocks_cumulatively():
    hasher = _hand_hasher()
    rows, state = hasher.hash_span([5, DEAD, 1], initial_state(3))
    # t=1 is dead itself: looks [2, 2, 2], products [6, 10, 14]: 6^10 = 12 -> 12%11 = 1,
    #   12%13 = 12 + 11 = 23; 12^14 = 2 -> 26, 43.
    # t=2: shift 1 is dead, so shift 2 is pad too although c[0] = 5 is real: looks [1, 2, 2],
    #   products [3, 10, 14]: 3^10 = 9 -> 9, 20; 9^14 = 7 -> 31, 48.
    assert rows[:, 0].tolist() == [[5, 16, 35, 52], [1, 23, 26, 43], [9, 20, 31, 48]]
    assert state == (DEAD, 1)


def test_state_round_trip():
    hasher = _hand_hasher()
    assert initial_state(3) == (BEFORE_START, BEFORE_START)
    assert hasher.hash_span([], initial_state(3))[1] == (BEFORE_START, BEFORE_START)
    _, state = hasher.hash_span([7], initial_state(3))
    assert state == (BEFORE_START, 7)
    rows, state2 = hasher.hash_span([4], state)
    assert state2 == (7, 4)
    # Resuming from the state gives the rows of the whole sequence's last position.
    whole, _ = hasher.hash_span([7, 4], initial_state(3))
    assert torch.equal(rows[0], whole[1])
    with pytest.raises(ValueError, match="2 ids"):
        hasher.hash_span([1], (1, 2, 3))


def test_chunked_equals_whole_sequence():
    spec = EngramSpec((1, 14), (10**6, 10**6), 4, 1000, 3, 32, 2, 50)
    hasher = NgramHasher(spec, identity_token_map(50))
    rng = random.Random(0)
    for _ in range(20):
        length = rng.randint(0, 30)
        cids = [DEAD if rng.random() < 0.15 else rng.randrange(50) for _ in range(length)]
        whole, whole_state = hasher.hash_span(cids, initial_state(4))
        assert whole.shape == (length, 2, 9)
        cuts = sorted(rng.sample(range(length + 1), k=min(4, length + 1)))
        state, parts = initial_state(4), []
        for a, b in zip([0, *cuts], [*cuts, length]):
            rows, state = hasher.hash_span(cids[a:b], state)
            parts.append(rows)
        assert torch.equal(torch.cat(parts), whole)
        assert state == whole_state


def test_batched_flat_equals_per_request():
    spec = EngramSpec((1,), (10**6,), 4, 1000, 2, 32, 2, 50)
    hasher = NgramHasher(spec, identity_token_map(50))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (n,), generator=gen) for n in (7, 0, 3, 12)]
    prefix = [2, 0, 1, 5]  # tokens already hashed before this batch
    states, expected, expected_states = [], [], []
    for seq, p in zip(seqs, prefix):
        _, st = hasher.hash_span(seq[:p], initial_state(4)) if p else (None, initial_state(4))
        states.append(st)
        full, full_state = hasher.hash_span(seq, initial_state(4))
        expected.append(full[p:])
        expected_states.append(full_state)
    spans = [seq[p:] for seq, p in zip(seqs, prefix)]
    rows, new_states = hasher.hash_batch(
        torch.cat(spans), torch.tensor(states), [len(s) for s in spans]
    )
    assert torch.equal(rows, torch.cat(expected))
    assert new_states.tolist() == [list(s) for s in expected_states]


def test_compress_marks_dead():
    hasher = _hand_hasher()
    got = hasher.compress(torch.tensor([0, 1, 3]), dead=torch.tensor([False, True, False]))
    assert got.tolist() == [2, DEAD, 3]


def test_compressed_token_map_word_level():
    from tokenizers import Tokenizer, models

    vocab = {"The": 0, "the": 1, " the": 2, "THE": 3, "é": 4, "e": 5, " ": 6, "<pad>": 7}
    vocab["\u0301"] = 8  # a lone combining accent: normalises to "", keyed by its raw text
    vocab["\t\n"] = 9  # whitespace runs collapse to " " and survive Strip via the sentinel
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    lookup, size = build_compressed_token_map(tok)
    # the-group -> 0, e-group -> 1, " " -> 2, "<pad>" -> 3, accent -> 4, "\t\n" -> " " -> 2.
    assert lookup == [0, 0, 0, 0, 1, 1, 2, 3, 4, 2]
    assert size == 5
    check_token_map_size(size, EngramSpec(**{**TINY.__dict__, "compressed_vocab_size": 5}))
    with pytest.raises(ValueError, match=r"has 5 ids .* is 6"):
        check_token_map_size(size, EngramSpec(**{**TINY.__dict__, "compressed_vocab_size": 6}))
    with pytest.raises(ValueError, match=r"has 5 ids .* is 99092"):
        NgramHasher(EngramSpec(**{**TINY.__dict__, "compressed_vocab_size": 99092}), (lookup, size))


def test_compressed_token_map_partial_bytes():
    from tokenizers import Tokenizer, decoders, models

    # Byte-level: "Ã" and "Ä" are the lone bytes 0xC3 and 0xC4, each decoding to U+FFFD; they
    # must stay apart (keyed by token string), while "a" and "Ġa" (" a") merge.
    tok = Tokenizer(models.WordLevel({"Ã": 0, "Ä": 1, "a": 2, "Ġa": 3}, unk_token="a"))
    tok.decoder = decoders.ByteLevel()
    assert build_compressed_token_map(tok) == ([0, 1, 2, 2], 3)


def test_identity_map():
    assert identity_token_map(4) == ([0, 1, 2, 3], 4)


def test_e8m0_and_dequantise_rows():
    scale = torch.tensor([[127, 130], [120, 0]], dtype=torch.uint8)
    assert e8m0_to_float(scale).tolist() == [[1.0, 8.0], [2.0**-7, 2.0**-127]]
    w = torch.zeros(2, 64)
    w[0, 0], w[0, 31], w[0, 32], w[0, 63] = 1.5, -0.25, 448.0, -3.0
    w[1, 0], w[1, 32] = 6.0, 1.0
    got = dequantise_rows(w.to(torch.float8_e4m3fn), scale)
    assert got.dtype == torch.bfloat16
    want = torch.zeros(2, 64)
    # Row 0: first 32 times 2^0, next 32 times 2^3 (130 - 127).
    want[0, 0], want[0, 31], want[0, 32], want[0, 63] = 1.5, -0.25, 448.0 * 8, -3.0 * 8
    # Row 1: 6 * 2^-7 = 0.046875; 1 * 2^-127.
    want[1, 0], want[1, 32] = 6.0 / 128, 2.0**-127
    assert torch.equal(got.float(), want)


def _gate_module() -> Engram:
    # hc=2, dim=4, one hash column of 32 values. Table row 0 = one-hot at 0, row 1 = one-hot
    # at 1 (scale 2^0), so wkv's column j is the kv of a token whose row id is j.
    mod = Engram(dim=4, hc=2, rows=2, head_dim=32, n_hash_cols=1, eps=1e-20, dtype=torch.float32)
    table = torch.zeros(2, 32)
    table[0, 0] = table[1, 1] = 1.0
    mod.embed.weight.data.copy_(table)
    wkv = torch.zeros(12, 32)
    # kv = key copy 0 (4) | key copy 1 (4) | value (4).
    wkv[:, 0] = torch.tensor([2.0] * 4 + [4.0] * 4 + [1.0, 2.0, 3.0, 4.0])
    wkv[:, 1] = torch.tensor([2.0] * 4 + [-1.0] * 4 + [-1.0, 0.0, 1.0, 0.5])
    mod.wkv.weight.data.copy_(wkv)
    mod.q_weight.data.copy_(torch.tensor([[2.0] * 4, [2.0] * 4]))
    mod.k_weight.data.copy_(torch.tensor([[1.0] * 4, [0.5] * 4]))  # weight = [[2]*4, [1]*4]
    return mod


def test_gate_hand_computed():
    mod = _gate_module()
    x = torch.tensor(
        [
            [[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]],
            [[1.0, -1.0, 1.0, -1.0], [2.0, 2.0, 2.0, 2.0]],
        ]
    )
    out = mod(x, torch.tensor([[0], [1]]))

    def sig(v):
        return 1.0 / (1.0 + math.exp(-v))

    # Token 0, copy 0: h = 1s, key = 2s, w = 2. rstd = 1/sqrt(1) * 1/sqrt(4) = 1/2;
    #   sum = 4 * (1*2*2) = 16; dot = 16 * 1/2 * 4^-0.5 = 4 -> gate = sig(sqrt 4) = sig(2).
    # Token 0, copy 1: h = -1s, key = 4s, w = 1. rstd = 1 * 1/4 (own copy's key only: a joint
    #   mean over both copies would give 1/sqrt(10)); sum = -16; dot = -16/4/2 = -2
    #   -> gate = sig(-sqrt 2) (signed sqrt).
    # Token 1, copy 0: h = [1,-1,1,-1], key = 2s: sum = 0 -> dot = 0 -> clamped to 1e-6,
    #   sqrt = 1e-3, sign of +0 -> gate = sig(1e-3) (not 1/2).
    # Token 1, copy 1: h = 2s, key = -1s, w = 1. rstd = 1/2 * 1; sum = 4 * (2*1*-1) = -8;
    #   dot = -8 * 1/2 * 1/2 = -2 -> gate = sig(-sqrt 2).
    g = [[sig(2.0), sig(-math.sqrt(2.0))], [sig(1e-3), sig(-math.sqrt(2.0))]]
    values = [[1.0, 2.0, 3.0, 4.0], [-1.0, 0.0, 1.0, 0.5]]
    want = torch.tensor(
        [
            [[xv + g[t][c] * v for xv, v in zip(x[t, c].tolist(), values[t])] for c in range(2)]
            for t in range(2)
        ]
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    assert abs(sig(1e-3) - 0.5) > 1e-4  # the clamp is visible at this tolerance

    masked = mod(x, torch.tensor([[0], [1]]), token_mask=torch.tensor([True, False]))
    torch.testing.assert_close(masked[0], want[0], rtol=0, atol=1e-6)
    assert torch.equal(masked[1], x[1])


def test_gate_keeps_input_dtype_and_names():
    mod = _gate_module()
    names = {n: tuple(p.shape) for n, p in mod.state_dict().items()}
    assert names == {
        "embed.weight": (2, 32),
        "wkv.weight": (12, 32),
        "q_weight": (2, 4),
        "k_weight": (2, 4),
    }
    assert mod.embed.weight.dtype == torch.float32  # the compute dtype (FP8 decoded on load)
    assert mod.q_weight.dtype == torch.float32
    x = torch.ones(3, 2, 4, dtype=torch.bfloat16)
    assert mod(x, torch.zeros(3, 1, dtype=torch.int64)).dtype == torch.bfloat16


def test_act_fp8_rounds_wkv_input():
    mod = _gate_module()
    e = torch.zeros(1, 32)
    e[0, 0], e[0, 1] = 1.0, 1.0 + 2.0**-6  # 1 + 2^-6 needs 7 mantissa bits; e4m3 has 3
    assert torch.equal(mod.wkv_input(e), e)
    mod.act_fp8 = True
    # Block amax ~1.016 -> scale 2^-8 (448 * 2^-8 = 1.75 covers it); 1.015625 / 2^-8 = 260
    # rounds to the e4m3 grid point 256 (step 32 in [256, 448]) -> 1.0.
    assert mod.wkv_input(e)[0, :2].tolist() == [1.0, 1.0]


def test_a_published_checkpoint_hashes_over_its_tokenizers_compressed_vocabulary(tmp_path):
    """A config whose engram_compressed_vocab_size is not its vocabulary (the published
    models': 99092 of 129280) takes the map from the tokenizer.json beside the weights: the
    model builds without it (on meta too) but refuses to hash, the loader refuses a
    checkpoint without its tokenizer (naming the file) or with a foreign one (naming both
    sizes), and with it every token id hashes through the tokenizer's map, the ids past the
    tokenizer's vocabulary through compressed id 0."""
    import shutil

    from tokenizers import Tokenizer

    from atom import LLM, SamplingParams
    from atom.models.common.weights import WeightLoadError
    from atom.models.deepseek_v41.weights import load_weights
    from atom.models.registry import build_model, resolve_config
    from tests.model.test_v41_published_checkpoint import write_checkpoint

    byte_tokenizer = Path(__file__).parents[2] / "atom" / "byte_tokenizer" / "tokenizer.json"
    lookup, size = build_compressed_token_map(Tokenizer.from_file(str(byte_tokenizer)))
    assert (len(lookup), size) == (258, 229)  # 258 token ids, 229 after normalising
    write_checkpoint(tmp_path, shape={"engram_compressed_vocab_size": size})
    config, path = resolve_config(str(tmp_path))
    kw = dict(dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32", device="cpu", seed=None)
    with pytest.raises(WeightLoadError, match=r"tokenizer\.json not found: .* 229 ids"):
        build_model(config, path, weight_dtype="bf16", **kw)
    shutil.copy(byte_tokenizer, tmp_path / "tokenizer.json")
    net = build_model(config, path, weight_dtype="bf16", **kw)
    hashing = net.engram_hash
    assert not hashing.needs_token_map
    assert hashing.lookup.tolist() == lookup + [0] * (config.vocab_size - 258)
    grams = torch.tensor([[-1, 5, 65, 97], [3, 300, 65, 97]])
    padded = torch.tensor(lookup + [0] * (config.vocab_size - 258))
    window = grams[:, 4 - config.engram_max_ngram_size :]
    cids = torch.where(window >= 0, padded[window.clamp(min=0)], BEFORE_START)
    want = NgramHasher(config.engram_spec, (padded.tolist(), size))
    assert torch.equal(hashing.rows(grams), want.rows(cids[:, -1], cids[:, :-1]))
    # a foreign tokenizer: the map's size is not the config's
    other = resolve_config(str(tmp_path), {"engram_compressed_vocab_size": 230})[0]
    fresh = type(net)(other, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="compressed vocabulary of 230 ids"):
        fresh.engram_rows(grams)
    with pytest.raises(WeightLoadError, match="map of 229 ids over 258 tokens.*=230"):
        load_weights(fresh, tmp_path)
    # the engine serves it (the map reaches the runtime through the loader)
    llm = LLM(str(tmp_path), num_blocks=30, device="cpu", dtype="float32")
    try:
        out = llm.generate(["hello engram"], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        llm.shutdown()
