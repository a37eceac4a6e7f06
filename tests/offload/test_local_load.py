"""Engine-driven loads without a server (local_load.py): how copies are merged into runs, what
``LocalLoads.plan`` refuses, and that ``plan`` + ``copy`` put the located bytes in the right
pool blocks. A small CPU pool; the server's L1 segment is a plain uint8 tensor behind a fake
mapping."""

from __future__ import annotations

import pytest
import torch

from atom.model_api import StateSpec, pool_bytes
from atom.tier.worker_side.local_load import LocalLoadError, LocalLoads, runs
from atom.tier.worker_side.locator import Located

BS, BB, CHUNK = 4, 64, 8  # tokens per block, bytes per block, tokens per chunk (2 blocks)
SPEC = StateSpec(
    block_size=BS,
    block_bytes=BB,
    state_bytes=100,  # an image takes 2 units
    layout_id="0123456789abcdef0123456789abcdef",
    header_offset=80,  # in the image's second unit
)
K = SPEC.units_per_image
NUM_BLOCKS = 16
SEGMENT = 4096


# ---- runs() ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pieces, want",
    [
        ([], []),
        ([(0, 5, 1)], [(0, 5, 1)]),
        # source bytes and destination blocks both continue: one run
        ([(0, 5, 1), (64, 6, 1), (128, 7, 1)], [(0, 5, 3)]),
        # multi-block pieces merge as well
        ([(0, 0, 2), (128, 2, 3), (320, 5, 1)], [(0, 0, 6)]),
        # a gap in the source splits
        ([(0, 5, 1), (192, 6, 1)], [(0, 5, 1), (192, 6, 1)]),
        # a gap in the destination splits
        ([(0, 5, 1), (64, 7, 1)], [(0, 5, 1), (64, 7, 1)]),
        # destination going backwards splits, even with contiguous source
        ([(0, 6, 1), (64, 5, 1)], [(0, 6, 1), (64, 5, 1)]),
        # source going backwards splits, even with contiguous destination
        ([(64, 5, 1), (0, 6, 1)], [(64, 5, 1), (0, 6, 1)]),
        # a run resumes after a split and merges again
        (
            [(0, 1, 1), (64, 2, 1), (640, 9, 1), (704, 10, 1), (768, 11, 2)],
            [(0, 1, 2), (640, 9, 4)],
        ),
    ],
)
def test_runs_merge_contiguous_pieces_and_split_at_gaps(pieces, want):
    assert runs(pieces, BB) == want


def test_runs_keep_every_block_in_order():
    pieces = [(i * BB, 3 + i, 1) for i in range(4)] + [(1000, 20, 1), (1000 + BB, 21, 1)]
    merged = runs(pieces, BB)
    assert merged == [(0, 3, 4), (1000, 20, 2)]
    unrolled = [(s + j * BB, d + j) for s, d, n in merged for j in range(n)]
    assert unrolled == [(s, d) for s, d, _ in pieces]


# ---- a fake segment, a CPU pool ---------------------------------------------------------


def segment() -> torch.Tensor:
    """A fake L1 segment whose every byte says where it is (position mod 251)."""
    return (torch.arange(SEGMENT, dtype=torch.int64) % 251).to(torch.uint8)


def put_header(data: torch.Tensor, image_off: int, tag: int, position: int) -> None:
    at = image_off + SPEC.header_offset
    data[at : at + 16] = torch.tensor([tag, position], dtype=torch.int64).view(torch.uint8)


class FakeMapping:
    """What a load reads of an ``L1Mapping``: ``data`` (uint8 tensor over the segment) and
    ``read(offset, n)`` (host bytes)."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n].numpy().tobytes()


def located(data, pages, image, end) -> Located:
    return Located(FakeMapping(data), tuple(pages), image, end, 0.0)


def loads() -> LocalLoads:
    pool = torch.zeros(SPEC.pool_shape(NUM_BLOCKS), dtype=SPEC.pool_dtype)
    return LocalLoads(SPEC, pool, CHUNK)


PAGE = (CHUNK // BS) * BB  # a chunk's pages object: 2 blocks


def three_chunks():
    """A located hit of [0, 24): chunk 0 and 1 adjacent in the segment, chunk 2 elsewhere,
    the image after it (header: this layout, boundary 24)."""
    data = segment()
    pages = [(0, PAGE), (PAGE, PAGE), (1024, PAGE)]
    image = (2048, K * BB)
    put_header(data, image[0], SPEC.layout_tag, 24)
    return data, pages, image


# ---- plan() refusals --------------------------------------------------------------------


def test_plan_refuses_a_located_answer_that_ends_elsewhere():
    data, pages, image = three_chunks()
    with pytest.raises(LocalLoadError, match="located up to 24, load ends at 16"):
        loads().plan(located(data, pages, image, 24), 0, 16, [1, 2, 3, 4], [10, 11])


def test_plan_refuses_a_page_object_of_another_length():
    data, pages, image = three_chunks()
    pages[1] = (PAGE, PAGE - 1)
    with pytest.raises(LocalLoadError, match=f"chunk 1: object of {PAGE - 1} B"):
        loads().plan(located(data, pages, image, 24), 0, 24, list(range(6)), [10, 11])


def test_plan_refuses_an_image_object_of_another_length():
    data, pages, image = three_chunks()
    with pytest.raises(LocalLoadError, match="image object of"):
        loads().plan(located(data, pages, (image[0], BB), 24), 0, 24, list(range(6)), [10, 11])


def test_plan_refuses_a_wrong_number_of_destination_blocks_or_units():
    data, pages, image = three_chunks()
    loc = located(data, pages, image, 24)
    with pytest.raises(LocalLoadError, match="5 blocks for chunks"):
        loads().plan(loc, 0, 24, list(range(5)), [10, 11])
    with pytest.raises(LocalLoadError, match="image object of"):
        loads().plan(loc, 0, 24, list(range(6)), [10])


def test_plan_refuses_an_image_of_another_layout():
    data, pages, image = three_chunks()
    other = SPEC.layout_tag ^ 1
    put_header(data, image[0], other, 24)
    with pytest.raises(LocalLoadError, match=f"another layout \\(tag {other:#x}\\)"):
        loads().plan(located(data, pages, image, 24), 0, 24, list(range(6)), [10, 11])


def test_plan_refuses_an_image_of_another_boundary():
    data, pages, image = three_chunks()
    put_header(data, image[0], SPEC.layout_tag, 16)
    with pytest.raises(LocalLoadError, match="image of boundary 16, expected 24"):
        loads().plan(located(data, pages, image, 24), 0, 24, list(range(6)), [10, 11])


def test_a_refused_plan_copies_nothing():
    data, pages, image = three_chunks()
    put_header(data, image[0], SPEC.layout_tag, 16)
    ll = loads()
    with pytest.raises(LocalLoadError):
        ll.plan(located(data, pages, image, 24), 0, 24, list(range(6)), [10, 11])
    assert ll.copies == 0 and ll.bytes == 0 and not ll.blocks.any()


# ---- plan() + copy() ------------------------------------------------------------------


def check_copied(ll, data, pages, image, start, end, page_blocks, units):
    loc = located(data, pages, image, end)
    plan = ll.plan(loc, start, end, page_blocks, units)
    done = []
    ll.copy(loc, plan, done.append)
    assert len(done) == 1 and isinstance(done[0], float)  # on CPU: complete on return
    assert ll.in_flight == 0
    blocks = pool_bytes(ll.blocks)
    expect = {}  # destination block -> source offset
    bpc, first = CHUNK // BS, start // CHUNK
    for i in range(first, end // CHUNK):
        for j in range(bpc):
            expect[page_blocks[(i - first) * bpc + j]] = pages[i][0] + j * BB
    for j in range(K):
        expect[units[j]] = image[0] + j * BB
    for b in range(NUM_BLOCKS):
        if b in expect:
            assert torch.equal(blocks[b], data[expect[b] : expect[b] + BB]), f"block {b}"
        else:
            assert not blocks[b].any(), f"block {b} was written"
    return plan


def test_plan_and_copy_put_each_object_in_its_blocks():
    data, pages, image = three_chunks()
    ll = loads()
    # chunks 0 and 1 are adjacent in the segment and land in consecutive blocks 2..5: one run;
    # chunk 2 lands in 9, 8 (backwards: two runs); the image in 12, 13 (one run)
    plan = check_copied(ll, data, pages, image, 0, 24, [2, 3, 4, 5, 9, 8], [12, 13])
    assert plan == [(0, 2, 4), (1024, 9, 1), (1024 + BB, 8, 1), (2048, 12, 2)]
    assert ll.copies == 4 and ll.bytes == (6 + K) * BB


def test_plan_and_copy_of_a_load_that_starts_past_the_resident_prefix():
    # [8, 24): chunk 0 is resident already; the answer locates every chunk from 0
    data, pages, image = three_chunks()
    ll = loads()
    plan = check_copied(ll, data, pages, image, 8, 24, [6, 7, 0, 1], [14, 15])
    assert plan == [(PAGE, 6, 2), (1024, 0, 2), (2048, 14, 2)]


def test_copy_merges_an_image_that_follows_its_last_chunk():
    # the image sits right after chunk 2's pages and lands right after its blocks: one run
    data = segment()
    pages = [(0, PAGE), (PAGE, PAGE), (2 * PAGE, PAGE)]
    image = (3 * PAGE, K * BB)
    put_header(data, image[0], SPEC.layout_tag, 24)
    ll = loads()
    plan = check_copied(ll, data, pages, image, 0, 24, list(range(1, 7)), [7, 8])
    assert plan == [(0, 1, 8)]
    assert ll.copies == 1


def test_an_unknown_copier_is_refused_and_the_kernel_copier_is_ignored_on_cpu():
    """``lmcache.load_copy`` reaches LocalLoads: a copier it does not know is a clear error;
    ``kernel`` on a CPU pool copies as before (there is no device to gather onto)."""
    pool = torch.zeros(SPEC.pool_shape(NUM_BLOCKS), dtype=SPEC.pool_dtype)
    with pytest.raises(ValueError, match="'dma'.*copy_engine.*kernel"):
        LocalLoads(SPEC, pool, CHUNK, copier="dma")
    loads = LocalLoads(SPEC, pool, CHUNK, copier="kernel")
    assert loads.gathers == 0 and loads._gather is None
