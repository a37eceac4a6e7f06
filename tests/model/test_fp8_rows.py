"""Tables at stored precision (atom/models/common/fp8_rows.py): V4.1's Engram tables kept as
FP8 rows with E8M0 scales per 32 values, as the published checkpoint stores them.

- A lookup gives the dequantized table's rows bit for bit, in float32 and bf16; the table
  holds 1 + 1/32 bytes per value (bf16: 2).
- Split by columns over 2 and 4 ranks, also where a rank's columns cut a scale group (v41-tiny's
  tables are 32 wide: 16 and 8 columns per rank), every rank's rows are the unsplit rows'
  columns, and the ranks' parts concatenate into the unsplit rows.
- An FP8-stored preset at weight_dtype fp8 holds ``Fp8RowTable``s whose rows are exactly the
  tables the bf16 run of that preset holds (both precisions run one model).
- A published checkpoint's FP8 rows and scales are loaded byte for byte, whole and as rank
  slices (the scale groups a rank's columns touch); a bf16 re-export is quantized to the same
  values.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom.distributed.split_models import build_tp_model
from atom.models.common.fp8_rows import Fp8RowTable, covering_groups, quantize_tables
from atom.models.common.tensor_parallel import shard_model
from atom.models.deepseek_v41.engram import dequantise_rows
from atom.models.deepseek_v41.presets import preset_config
from atom.models.registry import build_model, family, load_runtime, resolve_config


def _dense(rows=50, dim=96, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, dim, generator=gen) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lookup_is_the_dequantized_tables_rows_exactly(dtype):
    table = Fp8RowTable.from_dense(_dense(dtype=dtype))
    ids = torch.tensor([[3, 3, 49], [0, 17, 2]])
    got = table(ids)
    want = dequantise_rows(table.weight, table.weight_scale).to(dtype)[ids]
    assert got.dtype == dtype and torch.equal(got, want)
    again = Fp8RowTable.from_dense(table.dense())  # quantizing dequantized rows: same values
    assert torch.equal(again.dense(), table.dense())
    held = sum(t.numel() * t.element_size() for t in table.buffers())
    assert held == 50 * 96 + 50 * 96 // 32  # against 2 * 50 * 96 in bf16


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dim", [32, 96])
def test_a_column_split_gives_every_rank_its_columns_also_across_a_cut_group(world, dim):
    whole = Fp8RowTable.from_dense(_dense(dim=dim))
    ids = torch.arange(50).flip(0)
    want = whole(ids)
    parts = []
    for r in range(world):
        net = torch.nn.Module()
        net.config = SimpleNamespace(
            num_attention_heads=4, o_groups=4, moe_intermediate_size=4, vocab_size=4
        )
        net.embed = Fp8RowTable.from_dense(_dense(dim=dim))
        net.layer = _Layer(net.embed)
        net.tp_layers = lambda net=net: {"layer": net.layer}
        shard_model(net, r, world, reduce=None)
        n = dim // world
        assert net.layer.table is net.embed
        assert net.embed.weight.shape == (50, n)
        assert net.embed.col0 == (r * n) % 32
        assert net.embed.weight_scale.shape[1] == covering_groups(net.embed.col0, n)
        got = net.embed(ids)
        assert torch.equal(got, want[:, r * n : (r + 1) * n])
        parts.append(got)
    assert torch.equal(torch.cat(parts, dim=-1), want)


class _Layer(torch.nn.Module):
    """A split layer holding just a table (split by columns, as Engram's is)."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def tp_splits(self):
        return {"table.weight": 1}

    def tp_narrow(self, world, reduce, gather):
        pass


def test_an_fp8_preset_at_fp8_holds_fp8_rows_equal_to_its_bf16_tables():
    kw = dict(dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32", block_size=16, device="cpu")
    fp8 = load_runtime("v41-tiny-fp8", seed=0, weight_dtype="fp8", **kw).model
    bf16 = load_runtime("v41-tiny-fp8", seed=0, weight_dtype="bf16", **kw).model
    plain = load_runtime("v41-tiny", seed=0, weight_dtype="bf16", **kw).model
    for i in fp8.config.engram_layer_ids:
        table = fp8.model.layers[i].engram.embed
        dense = bf16.model.layers[i].engram.embed.weight
        assert isinstance(table, Fp8RowTable)
        assert torch.equal(table.dense(), dense)  # one model at both precisions
        # the preset's tables are v41-tiny's rounded through FP8 rows
        rounded = Fp8RowTable.from_dense(plain.model.layers[i].engram.embed.weight).dense()
        assert torch.equal(dense, rounded)


# experts 64 wide, so that 2 ranks hold whole FP4 scale groups of them (the tables need not)
WIDE = {"moe_intermediate_size": 64}


def _published_tables(tmp_path, bf16: bool = False):
    """A published-format V4.1 checkpoint (FP8 Engram rows with E8M0 scales, or, ``bf16``,
    its rows re-exported dequantized); returns the stored rows' dequantized values by layer."""
    from tests.model.test_v41_published_checkpoint import write_checkpoint

    extra = None
    if bf16:  # a re-export: the tables as bf16, no scale
        from safetensors import safe_open

        write_checkpoint(tmp_path, shape=WIDE)
        extra = {}
        for f in sorted(tmp_path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if name.endswith("engram.embed.weight"):
                        scale = _find(tmp_path, name.removesuffix(".weight") + ".scale")
                        extra[name] = dequantise_rows(sf.get_tensor(name), scale)
        for f in tmp_path.iterdir():
            f.unlink()
    exact = write_checkpoint(tmp_path, extra=extra, drop=_scales(extra), shape=WIDE)
    config = preset_config("v41-tiny")
    return {i: exact[f"model.layers.{i}.engram.embed.weight"] for i in config.engram_layer_ids}


def _find(path, name):
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            if name in sf.keys():
                return sf.get_tensor(name)
    raise KeyError(name)


def _scales(extra):
    return tuple(n.removesuffix(".weight") + ".scale" for n in (extra or {}))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp8-stored", "bf16-re-export"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_published_checkpoint_loads_the_tables_rows_exactly(tmp_path, world, bf16):
    """At world 2 each rank reads its 16 of the 32 columns, which cut the one scale group
    both ranks then hold."""
    tables = _published_tables(tmp_path, bf16)
    config, path = resolve_config(str(tmp_path))
    kw = dict(dtype=torch.float32, kv_dtype="fp32", index_dtype="fp32", device="cpu", seed=None)
    for r in range(world):
        if world == 1:
            net = build_model(config, path, weight_dtype="fp8", **kw)
        else:
            state = SimpleNamespace(rank=r, world_size=world, all_reduce=None, all_gather=None)
            net = build_tp_model(family(config), config, path, state, weight_dtype="fp8", **kw)
        for i, want in tables.items():
            table = net.model.layers[i].engram.embed
            assert isinstance(table, Fp8RowTable)
            n = want.shape[1] // world
            assert torch.equal(table.dense().float(), want[:, r * n : (r + 1) * n].float())


def test_quantize_tables_keeps_a_table_of_cut_groups_dense():
    net = torch.nn.Module()
    net.embed = torch.nn.Embedding(10, 16)
    assert quantize_tables(net, ["embed"]) == 0
    assert isinstance(net.embed, torch.nn.Embedding)
