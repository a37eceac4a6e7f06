"""The PAGE row-write kernel against its torch expression: the same bytes in every plane, rows
whose flag is off untouched; on CUDA or under Triton's interpreter. Skipped elsewhere."""

import pytest
import torch

import atom.kernels.page_write as page_write_module
from atom.kernels.page_write import write_rows_where, write_rows_where_torch
from atom.models.common.geometry import FP8_DTYPE
from tests.kernels.runnable import DEVICE, cpu_harness_only, needs_kernel, refuse_fallback

pytestmark = needs_kernel


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """The kernel may not fall back to its torch expression here."""
    refuse_fallback(monkeypatch, page_write_module, "write_rows_where_torch", "page_write")


def _pool(blocks: int, per_block: int, main_dim: int, index_dim: int, fp8: bool, seed: int):
    """Planes laid out as PagedKV lays them: views into one byte tensor per block."""
    g = torch.Generator().manual_seed(seed)
    index_bytes = index_dim + 4 if fp8 else 2 * index_dim
    block_bytes = per_block * (2 * main_dim + index_bytes) + 24  # a gap after the planes
    raw = torch.randint(0, 256, (blocks, block_bytes), generator=g, dtype=torch.uint8)
    raw = raw.to(DEVICE)
    main = raw[:, : per_block * 2 * main_dim].view(torch.bfloat16).view(blocks, per_block, -1)
    rest = raw[:, per_block * 2 * main_dim : per_block * (2 * main_dim + index_bytes)]
    rows = rest.view(blocks, per_block, index_bytes)
    if fp8:
        planes = [
            main,
            rows[..., :index_dim].view(FP8_DTYPE),
            rows[..., index_dim:].view(torch.float32),
        ]
    else:
        planes = [main, rows.view(torch.bfloat16)]
    return raw, planes


def _rows(planes, b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in planes:
        shape = (b,) + tuple(p.shape[2:])
        if p.dtype == FP8_DTYPE:
            out.append(torch.randn(shape, generator=g).to(FP8_DTYPE).to(DEVICE))
        else:
            out.append(torch.randn(shape, generator=g).to(p.dtype).to(DEVICE))
    return out


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("b,per_block,main_dim", [(1, 4, 8), (6, 8, 64), (17, 16, 512)])
def test_the_kernel_writes_the_torch_expressions_bytes(fp8, b, per_block, main_dim):
    blocks = 3 * b + 2
    raw, planes = _pool(blocks, per_block, main_dim, 32, fp8, seed=b * main_dim)
    want_raw, want_planes = _pool(blocks, per_block, main_dim, 32, fp8, seed=b * main_dim)
    g = torch.Generator().manual_seed(b)
    tables = torch.randperm(blocks, generator=g)[: 3 * b].view(b, 3).to(DEVICE)
    ids = torch.randint(0, 3 * per_block, (b,), generator=g).to(DEVICE)
    where = (torch.rand(b, generator=g) < 0.6).to(DEVICE)
    where[0] = True
    new = _rows(planes, b, seed=7 * b)
    write_rows_where(planes, new, tables, ids, where, per_block)
    write_rows_where_torch(want_planes, new, tables, ids, where, per_block)
    assert torch.equal(raw, want_raw)
    blk = tables[0, ids[0] // per_block]
    assert torch.equal(planes[0][blk, ids[0] % per_block], new[0][0])  # the row was written
    assert not torch.equal(raw, _pool(blocks, per_block, main_dim, 32, fp8, seed=b * main_dim)[0])


def test_rows_whose_flag_is_off_keep_their_bytes():
    raw, planes = _pool(4, 4, 8, 16, True, seed=3)
    before = raw.clone()
    tables = torch.tensor([[0, 1], [2, 3]], device=DEVICE)
    ids = torch.tensor([1, 6], device=DEVICE)
    new = _rows(planes, 2, seed=4)
    write_rows_where(planes, new, tables, ids, torch.tensor([False, False], device=DEVICE), 4)
    assert torch.equal(raw, before)
    write_rows_where(planes, new, tables, ids, torch.tensor([False, True], device=DEVICE), 4)
    changed = (raw != before).any(1).nonzero().flatten().tolist()
    assert changed == [3]  # row 6 of sequence 1: its table's second block, 3
    assert torch.equal(planes[2][3, 2], new[2][1])


def test_rows_of_another_width_are_refused():
    _, planes = _pool(2, 4, 8, 16, False, seed=5)
    new = _rows(planes, 1, seed=6)
    new[1] = new[1][:, :8]
    tables, ids = torch.zeros(1, 1, dtype=torch.int64, device=DEVICE), torch.zeros(
        1, dtype=torch.int64, device=DEVICE
    )
    with pytest.raises(ValueError, match="page rows of"):
        write_rows_where(
            planes, new, tables, ids, torch.ones(1, dtype=torch.bool, device=DEVICE), 4
        )


@cpu_harness_only
@pytest.mark.parametrize("index_dtype", ["fp8", "bf16"])
def test_decode_steps_write_the_same_pool_with_the_kernel(monkeypatch, index_dtype):
    """v41-tiny decoding four sequences (ratio-2 groups completing for some rows and not for
    others): the pool's bytes and the logits with the kernel (which may not fall back here)
    equal those of the torch expression. (CPU harness: under Triton's interpreter only; on
    CUDA, tests/gpu runs the decode path, where the kernel is on by default.)"""
    from atom.kernels import KERNELS
    from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from atom.models.deepseek_v41.presets import preset_config
    from tests.model.harness import prefill_then_decode
    from tests.model.test_paged_vs_reference import tokens

    # the other kernels off: this compares page_write alone (and is quicker interpreted)
    monkeypatch.setenv("ATOM_TRITON_OFF", ",".join(sorted(KERNELS - {"page_write"})))
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(
        preset_config("v41-tiny"), kv_dtype="bf16", index_dtype=index_dtype
    ).init_weights(0)
    import atom.models.common.paged as paged_module

    calls = []
    real = paged_module.write_rows_where
    monkeypatch.setattr(paged_module, "write_rows_where", lambda *a: calls.append(1) or real(*a))
    seqs = [tokens(20, seed=30 + i) for i in range(4)]
    runs = []
    for on in (True, False):
        if not on:  # the torch expression, by the kernel's own switch
            monkeypatch.setattr(page_write_module, "write_rows_where_torch", write_rows_where_torch)
            monkeypatch.setenv("ATOM_TRITON_ON", "")
        runs.append(prefill_then_decode(model, seqs))
        assert len(calls) >= 3  # a ratio-2 owner's write in every decode step
        calls.clear()
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])
