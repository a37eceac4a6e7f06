"""The multi-token spans of a forward as one batch: indices computed on the host, used by
``paged_attention`` to run every span of every sequence through one set of operations per layer.

Tokens of the longer spans ("prefill tokens", flat order) are cut into tiles of ``q`` tokens,
a tile never crossing spans (the last tile of a span is padded by repeating its first token;
padded rows are computed and dropped). A tile starting at position p0 attends window keys of
positions [p0 + q - L, p0 + q), L >= window - 1 + q a multiple of 64: the ring rows before its
span's start, then the span's own KV, with each query's window mask (``window_mask``); so each
query sees exactly the keys the per-sequence formula gives it. Index scores and top-k
selections are per token (flat order); only the compressed rows' gathers and the attention run
in tile layout.

Host arrays here index a source buffer each layer builds:
  window keys: cat(ring rows of the spans' positions before their start, the spans' own KV);
  compressor groups (per ratio r): cat(ring values of a straddling group's earlier tokens, the
      spans' own projections), r sources per completed group;
  a group's predecessor (ratios whose groups overlap, V4's CSA): cat(each span's overlap fields
      [S], one empty entry (group 0 has none), the completed groups themselves [G]).

Both families use it: V4.1 (compressor rings of ``compressor_rows`` rows) and V4 (a ratio-r
group's partial rows, r of them, row = position % r: a ring of r rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from atom.kernels import invariant

MAX_TILE = 64


@dataclass
class CompressorPlan:
    """One ratio's compressor work: ring reads, groups completing in the spans, ring refresh."""

    c_slot: torch.Tensor  # [Mc] carried ring rows (slot, row) of straddling groups
    c_row: torch.Tensor
    g_src: torch.Tensor  # [G, r] each group's tokens in cat(carried, own projections)
    g_row: torch.Tensor  # [G] the group's row id
    g_span: torch.Tensor  # [G] the group's span (row of ``tables``)
    rr_slot: torch.Tensor  # [Mr] ring refresh: (slot, row) <- own projection rr_src
    rr_row: torch.Tensor
    rr_src: torch.Tensor
    # overlapping ratios only: each group's predecessor in cat(overlap fields of ov_slots [S]
    # (group ov_group: the one before the span's first), the empty entry, the groups [G]); the
    # overlap fields of ow_slot take group ow_src (group id ow_group): each span's last
    # ``overlap_entries`` completed groups (one entry per group id modulo the entries)
    ov_slots: torch.Tensor | None = None
    ov_group: torch.Tensor | None = None
    prev_src: torch.Tensor | None = None
    ow_slot: torch.Tensor | None = None
    ow_src: torch.Tensor | None = None
    ow_group: torch.Tensor | None = None


@dataclass
class PrefillBatch:
    """The longer spans of one forward, on the device. ``positions`` (flat order of their
    tokens) is what tests hook on; selections flow from index layers to REUSE layers here."""

    positions: torch.Tensor  # [N] each prefill token's position
    tok: torch.Tensor  # [N] its index in the forward's flat batch
    pad_src: torch.Tensor  # [P] tile row -> prefill token
    unpad: torch.Tensor  # [N] prefill token -> tile row
    tile_span: torch.Tensor  # [nt] each tile's span
    tables: torch.Tensor  # [S, blocks] block tables (padded with block 0, never read as rows)
    kpos: torch.Tensor  # [nt, L] positions of each tile's window keys (< 0: none)
    win_src: torch.Tensor  # [nt, L] the keys in cat(ring rows, own KV)
    ring_slot: torch.Tensor  # [M] ring rows (slot, row) read for the window keys
    ring_row: torch.Tensor
    ww_slot: torch.Tensor  # [Mw] window ring writes: (slot, row) <- own KV ww_src
    ww_row: torch.Tensor
    ww_src: torch.Tensor
    comp: dict[int, CompressorPlan]
    rows: dict[int, int]  # ratio -> largest row count of the spans (index keys read per span)
    q: int  # tile size
    all_tokens: bool  # the prefill tokens are the whole flat batch, in order
    selections: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tiles(self) -> int:
        return self.kpos.shape[0]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of a flat-batch tensor at the prefill tokens."""
        return x if self.all_tokens else x[self.tok]

    def window_mask(self, window: int) -> torch.Tensor:
        """[nt, q, L]: query (tile row) sees key j (``window_mask`` of their positions; keys
        before position 0 do not exist). The same for every layer: computed once a forward."""
        got = self._masks.get(window)
        if got is None:
            qpos = self.positions[self.pad_src].view(self.num_tiles, self.q)
            diff = qpos[:, :, None] - self.kpos[:, None, :]
            got = (diff >= 0) & (diff < window) & (self.kpos >= 0)[:, None, :]
            self._masks[window] = got
        return got


def _cat(parts: list[torch.Tensor], cols: int | None = None) -> torch.Tensor:
    if parts:
        return torch.cat(parts)
    return torch.zeros((0,) if cols is None else (0, cols), dtype=torch.int64)


class PrefillHost:
    """Host side: computes the arrays from the spans and adds them to the forward's one upload
    (``put(tensor) -> key``); ``resolve(parts)`` builds the ``PrefillBatch`` from the uploaded
    pieces. ``window``/``window_rows``/``compressor_rows``: the config's and the geometry's
    (``compressor_rows``: one ring size, or one per ratio); ``ratios``: the compression ratios
    of the model's compressed layers; ``overlap``: those whose groups overlap (their plans
    carry each group's predecessor), whose state keeps ``overlap_entries`` groups."""

    def __init__(
        self,
        spans,
        los,
        n_total,
        window,
        window_rows,
        compressor_rows,
        ratios,
        put,
        overlap=(),
        overlap_entries=1,
    ):
        self.overlap_entries = overlap_entries
        self.spans, self.n = spans, sum(sp.num_tokens for sp in spans)
        w, rw = window, window_rows
        ring = compressor_rows if isinstance(compressor_rows, dict) else None
        longest = max(sp.num_tokens for sp in spans)
        q = 1
        while q < min(longest, MAX_TILE):
            q *= 2
        if invariant.enabled():  # one tile shape whatever the batch's longest span
            q = MAX_TILE
        # window keys per tile: w - 1 + q, rounded up to a multiple of 64 (aligned matmul
        # operands; the extra keys are earlier than any query's window: masked)
        self.q, lk = q, -(-(w - 1 + q) // 64) * 64
        m_off, acc = [], 0
        for sp in spans:
            m_off.append(acc)
            acc += sp.num_tokens
        prev_lo = [max(0, sp.start - w + 1) for sp in spans]
        r_off, acc = [], 0
        for sp, p0 in zip(spans, prev_lo):
            r_off.append(acc)
            acc += sp.start - p0
        ring_total = acc
        tok, pad_src, unpad, tile_span, kpos, win_src = [], [], [], [], [], []
        ring_slot, ring_row, ww_slot, ww_row, ww_src = [], [], [], [], []
        ar_q, ar_l = torch.arange(q), torch.arange(lk)
        for k, (sp, lo, m, p0, r0) in enumerate(zip(spans, los, m_off, prev_lo, r_off)):
            s, e, t = sp.start, sp.end, sp.num_tokens
            tok.append(torch.arange(lo, lo + t))
            prev = torch.arange(p0, s)
            ring_slot.append(torch.full_like(prev, sp.slot))
            ring_row.append(prev % rw)
            for a in range(0, t, q):
                n_in = min(q, t - a)
                unpad.append(len(tile_span) * q + torch.arange(n_in))
                pad_src.append(m + a + torch.where(ar_q < n_in, ar_q, 0))
                tile_span.append(k)
                kp = s + a + q - lk + ar_l
                src = torch.where(kp < s, r0 + kp - p0, ring_total + m + kp - s)
                kpos.append(kp)
                win_src.append(torch.where((kp >= p0) & (kp < e), src, 0))
            keep = min(rw, t)
            pos = torch.arange(e - keep, e)
            ww_slot.append(torch.full_like(pos, sp.slot))
            ww_row.append(pos % rw)
            ww_src.append(m + pos - s)
        self.keys = {
            "tok": put(torch.cat(tok)),
            "pad_src": put(torch.cat(pad_src)),
            "unpad": put(torch.cat(unpad)),
            "tile_span": put(torch.tensor(tile_span, dtype=torch.int64)),
            "kpos": put(torch.stack(kpos)),
            "win_src": put(torch.stack(win_src)),
            "ring_slot": put(_cat(ring_slot)),
            "ring_row": put(_cat(ring_row)),
            "ww_slot": put(torch.cat(ww_slot)),
            "ww_row": put(torch.cat(ww_row)),
            "ww_src": put(torch.cat(ww_src)),
        }
        self.all_tokens = n_total == self.n
        self.nt = len(tile_span)
        self.comp_keys = {
            r: self._compressor(r, ring[r] if ring else compressor_rows, m_off, put, r in overlap)
            for r in sorted(set(ratios))
        }
        self.rows = {r: max(sp.end // r for sp in spans) for r in self.comp_keys}
        self.host_tables = all(sp.block_table.device.type == "cpu" for sp in spans)
        if self.host_tables:
            tables = pad_sequence([sp.block_table.reshape(-1) for sp in spans], True)
            self.width = tables.shape[1]
            self.keys["tables"] = put(tables)
        else:  # device tables as they are; host ones join the upload
            self.table_keys = {
                k: put(sp.block_table)
                for k, sp in enumerate(spans)
                if sp.block_table.device.type == "cpu"
            }

    def _compressor(self, r: int, rc: int, m_off: list[int], put, overlap: bool) -> dict:
        spans = self.spans
        firsts = [(sp.start // r) * r for sp in spans]
        c_total = sum(sp.start - f for sp, f in zip(spans, firsts))
        c_slot, c_row, g_src, g_row, g_span, rr_slot, rr_row, rr_src = ([] for _ in range(8))
        c0 = 0
        for k, (sp, m, f) in enumerate(zip(spans, m_off, firsts)):
            s, e = sp.start, sp.end
            carried = torch.arange(f, s)
            c_slot.append(torch.full_like(carried, sp.slot))
            c_row.append(carried % rc)
            groups = torch.arange(s // r, e // r)
            gpos = groups[:, None] * r + torch.arange(r)
            g_src.append(torch.where(gpos < s, c0 + gpos - f, c_total + m + gpos - s))
            g_row.append(groups)
            g_span.append(torch.full_like(groups, k))
            c0 += s - f
            if r > 1:
                pos = torch.arange(e - min(rc, e - s), e)
                rr_slot.append(torch.full_like(pos, sp.slot))
                rr_row.append(pos % rc)
                rr_src.append(m + pos - s)
        keys = {} if not overlap else self._overlap(r, g_row, put)
        return keys | {
            "c_slot": put(_cat(c_slot)),
            "c_row": put(_cat(c_row)),
            "g_src": put(_cat(g_src, r)),
            "g_row": put(_cat(g_row)),
            "g_span": put(_cat(g_span)),
            "rr_slot": put(_cat(rr_slot)),
            "rr_row": put(_cat(rr_row)),
            "rr_src": put(_cat(rr_src)),
        }

    def _overlap(self, r: int, g_row: list[torch.Tensor], put) -> dict:
        """Each group's predecessor: the group before it in its span, else (the span's first
        group j > 0) the span's overlap fields, else (group 0) the empty entry; and the last
        ``overlap_entries`` groups of each span, which the overlap fields keep."""
        n_span, keep, g0 = len(self.spans), self.overlap_entries, 0
        prev_src, ow_slot, ow_src, ow_group = [], [], [], []
        for k, (sp, groups) in enumerate(zip(self.spans, g_row)):
            n = groups.numel()
            if not n:
                continue
            own = n_span + 1 + g0 + torch.arange(n)  # this span's groups in the source
            first = k if sp.start // r > 0 else n_span
            prev_src.append(torch.cat([torch.tensor([first]), own[:-1]]))
            last = torch.arange(max(0, n - keep), n)
            ow_slot.append(torch.full_like(last, sp.slot))
            ow_src.append(g0 + last)
            ow_group.append(groups[last])
            g0 += n
        return {
            "ov_slots": put(torch.tensor([sp.slot for sp in self.spans], dtype=torch.int64)),
            "ov_group": put(torch.tensor([sp.start // r - 1 for sp in self.spans])),
            "prev_src": put(_cat(prev_src)),
            "ow_slot": put(_cat(ow_slot)),
            "ow_src": put(_cat(ow_src)),
            "ow_group": put(_cat(ow_group)),
        }

    def resolve(self, parts: list[torch.Tensor], positions: torch.Tensor) -> PrefillBatch:
        """``parts``: the uploaded pieces; ``positions``: the forward's token positions."""
        got = {name: parts[key] for name, key in self.keys.items()}
        nt, q = self.nt, self.q
        if self.host_tables:
            got["tables"] = got["tables"].view(len(self.spans), self.width)
        else:
            tables = [
                parts[self.table_keys[k]] if k in self.table_keys else sp.block_table.reshape(-1)
                for k, sp in enumerate(self.spans)
            ]
            got["tables"] = pad_sequence(tables, True)
        comp = {}
        for r, keys in self.comp_keys.items():
            c = {name: parts[key] for name, key in keys.items()}
            c["g_src"] = c["g_src"].view(-1, r)
            comp[r] = CompressorPlan(**c)
        tok = got["tok"]
        return PrefillBatch(
            positions=positions if self.all_tokens else positions[tok],
            tok=tok,
            pad_src=got["pad_src"],
            unpad=got["unpad"],
            tile_span=got["tile_span"],
            tables=got["tables"],
            kpos=got["kpos"].view(nt, -1),
            win_src=got["win_src"].view(nt, -1),
            ring_slot=got["ring_slot"],
            ring_row=got["ring_row"],
            ww_slot=got["ww_slot"],
            ww_row=got["ww_row"],
            ww_src=got["ww_src"],
            comp=comp,
            rows=self.rows,
            q=q,
            all_tokens=self.all_tokens,
        )
