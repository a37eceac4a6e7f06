"""No host synchronization inside the V4.1 and V4 paged forwards (#14 item 2), checked on CPU.

The forward runs with the model, the pool and the state slots on the ``meta`` device: tensors
without data. Whatever would synchronize a CUDA forward fails or is seen there:

* reading device values on the host (``.item()``, ``.tolist()``, ``bool``/``int`` of a tensor,
  ``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``: data-dependent shapes)
  raises on meta tensors, and the dispatch mode below records those ops by name as well;
* a host tensor reaching a device op (a CPU index into a device tensor, a list index, a
  Python scalar stored into a device tensor) is a host-to-device copy, which on CUDA without
  pinned memory synchronizes: recorded, except the forward's one upload (``ForwardPlan``);
* device-to-host copies are recorded.

Only the host mirror's verification (``StateSlots.verify``, tests/debug mode) reads the device
on purpose; it is off here, as it is by default on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from atom.model_api import Span
from atom.models.deepseek_v41.model import DeepseekV41ForCausalLM
from atom.models.deepseek_v41.paged import PagedKV, StateSlots
from atom.models.deepseek_v41.presets import preset_config
from atom.models.deepseek_v41.runtime import V41Runtime

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.equal,
    aten.is_nonzero,
    aten.bincount,
    aten.histc,
}
COPIES = {aten._to_copy, aten.copy_, aten.copy}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class SyncTrap(TorchDispatchMode):
    """Records what would make a CUDA forward wait for the device (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        ins = list(_tensors((args, kwargs)))
        if func.overloadpacket in SYNC_OPS or (
            func.overloadpacket is aten.repeat_interleave and "Tensor" in name
        ):  # (tensor repeats: the output size is read on the host)
            self.syncs.append(name)  # recorded before running: most raise on meta tensors
            return func(*args, **kwargs)
        devs_in = {t.device.type for t in ins}
        if func.overloadpacket in COPIES:
            src = args[1] if func.overloadpacket is aten.copy_ else args[0]
            dst = args[0].device if func.overloadpacket is aten.copy_ else kwargs.get("device")
            if dst is not None and torch.device(dst).type != src.device.type:
                if torch.device(dst).type == "meta":
                    self.uploads += 1
                else:
                    self.syncs.append(f"{name} device-to-host")
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        devs_out = {t.device.type for t in _tensors(out)}
        if "meta" in devs_in | devs_out and any(t.device.type == "cpu" and t.dim() for t in ins):
            self.syncs.append(f"{name} with a host tensor argument")
        elif func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):
            idx = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(t is not None and t.dtype == torch.bool for t in idx):
                self.syncs.append(f"{name} with a boolean mask")
        return out


@pytest.fixture
def no_scalar_stores(monkeypatch):
    """``device_tensor[i] = number`` builds the value on the host and copies it: a sync."""
    stores: list[str] = []
    real = torch.Tensor.__setitem__

    def setitem(self, index, value):
        if self.device.type != "cpu" and not isinstance(value, torch.Tensor):
            stores.append(f"store of {type(value).__name__} into a {self.device.type} tensor")
        if isinstance(index, list) or (
            isinstance(index, tuple) and any(isinstance(i, list) for i in index)
        ):
            stores.append("list index (a host tensor)")
        return real(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)
    return stores


def _meta_runtime(num_slots: int, positions: list[int]):
    cfg = preset_config("v41-tiny")
    model = DeepseekV41ForCausalLM(
        cfg, dtype=torch.bfloat16, kv_dtype="bf16", index_dtype="bf16", device="meta"
    )
    rt = V41Runtime(model, block_size=16)
    spec = rt.spec
    pool = torch.empty(spec.pool_shape(64), dtype=spec.pool_dtype, device="meta")
    slot_bytes = torch.empty(num_slots, spec.state_bytes, dtype=torch.uint8, device="meta")
    rt.pool, rt.slot_bytes = pool, slot_bytes
    rt.kv = PagedKV(rt.geometry, pool)
    refresh = StateSlots.refresh
    StateSlots.refresh = lambda self, slot=None: None  # nothing to read on meta: set below
    try:
        rt.slots = StateSlots(rt.geometry, slot_bytes)
    finally:
        StateSlots.refresh = refresh
    rt.slots.host_position = list(positions)
    rt.slots.host_tag = [rt.slots.tag] * num_slots
    rt.slots.verify = False
    return rt


def _run(rt, spans, host_tables=True):
    ids = torch.zeros(sum(sp.num_tokens for sp in spans), dtype=torch.int64)
    rt.forward(ids, spans)  # warm: per-device caches (RoPE frequencies) fill on first use
    for sp in spans:  # the mirror advanced; step it back to run the same spans again
        rt.slots.host_position[sp.slot] = sp.start
    trap = SyncTrap()
    with trap:
        logits = rt.forward(ids, spans)
    assert logits.shape == (len(spans), rt.vocab_size)
    return trap


def test_decode_batch_forward_has_no_host_sync(no_scalar_stores):
    positions = [40, 41, 7, 63, 2, 16, 17, 33]
    rt = _meta_runtime(len(positions), positions)
    spans = [
        Span(p, p + 1, slot, torch.arange(slot * 6, slot * 6 + 6))
        for slot, p in enumerate(positions)
    ]
    trap = _run(rt, spans)
    assert trap.syncs == [] and no_scalar_stores == []
    assert trap.uploads == 1  # the forward's indices, in one copy


def test_prefill_forward_has_no_host_sync(no_scalar_stores):
    """Chunks from 0 (slot resets) and resumed at odd and even positions, with a decode token
    alongside, more tokens than the MoE's dense limit (the routed experts run grouped)."""
    positions = [0, 21, 32, 0, 50]
    rt = _meta_runtime(len(positions), positions)
    spans = [
        Span(0, 40, 0, torch.arange(0, 6)),
        Span(21, 45, 1, torch.arange(6, 12)),
        Span(32, 64, 2, torch.arange(12, 18)),
        Span(0, 1, 3, torch.arange(18, 24)),
        Span(50, 51, 4, torch.arange(24, 30)),
    ]
    trap = _run(rt, spans)
    assert trap.syncs == [] and no_scalar_stores == []
    assert trap.uploads == 1


def test_device_block_tables_need_no_copy(no_scalar_stores):
    """Block tables already on the device (as the profile passes them) are used in place."""
    positions = [40, 9]
    rt = _meta_runtime(2, positions)
    spans = [
        Span(40, 41, 0, torch.arange(0, 6, device="meta")),
        Span(9, 30, 1, torch.arange(6, 12, device="meta")),
    ]
    trap = _run(rt, spans)
    assert trap.syncs == [] and no_scalar_stores == []
    assert trap.uploads == 1


def test_the_trap_sees_the_syncs_it_should(no_scalar_stores):
    """The checks above would fail on the patterns they look for."""
    x = torch.zeros(4, 3, device="meta")
    trap = SyncTrap()
    with trap:
        x[torch.tensor([1, 2])]  # a host index into a device tensor
        with pytest.raises(NotImplementedError):
            torch.ops.aten.nonzero(x)  # data-dependent: fails on meta, and is recorded
        with pytest.raises(NotImplementedError):
            x.cpu()  # no data to copy out of meta, and recorded
    assert len(trap.syncs) == 3, trap.syncs
    x[0] = 1.0
    x[[0, 1]] = torch.ones(2, 3, device="meta")
    assert len(no_scalar_stores) == 2


def _v4_meta_runtime(positions: list[int], monkeypatch):
    from atom.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from atom.models.deepseek_v4.paged import V4PagedKV, V4StateSlots
    from atom.models.deepseek_v4.presets import preset_config as v4_preset
    from atom.models.deepseek_v4.runtime import V4Runtime

    model = DeepseekV4ForCausalLM(
        v4_preset("v4-tiny"),
        dtype=torch.bfloat16,
        kv_dtype="bf16",
        index_dtype="bf16",
        device="meta",
    )
    rt = V4Runtime(model, block_size=16)
    spec = rt.spec
    pool = torch.empty(spec.pool_shape(64), dtype=spec.pool_dtype, device="meta")
    n = len(positions)
    slot_bytes = torch.empty(n, spec.state_bytes, dtype=torch.uint8, device="meta")
    rt.kv = V4PagedKV(rt.geometry, pool)
    with monkeypatch.context() as m:  # the mirror's first read: nothing to read on meta
        m.setattr(torch.Tensor, "tolist", lambda self: [0] * self.shape[0])
        rt.slots = V4StateSlots(rt.geometry, slot_bytes)
    rt.slots.host_position = list(positions)
    rt.slots.host_tag = [rt.slots.tag] * n
    return rt


def test_v4_decode_batch_forward_has_no_host_sync(no_scalar_stores, monkeypatch):
    """V4's batched decode (``deepseek_v4.paged_decode``): fixed shapes and masks, so the
    forward reads nothing back and uploads its indices and token ids in one copy, at
    positions where groups of both ratios complete and where they do not."""
    positions = [40, 43, 7, 63, 2, 15, 17, 31]
    rt = _v4_meta_runtime(positions, monkeypatch)
    spans = [
        Span(p, p + 1, slot, torch.arange(slot * 6, slot * 6 + 6))
        for slot, p in enumerate(positions)
    ]
    trap = _run(rt, spans)
    assert trap.syncs == [] and no_scalar_stores == []
    assert trap.uploads == 1


def test_v4_prefill_forward_has_no_host_sync(no_scalar_stores, monkeypatch):
    """V4's batched prefill (``deepseek_v4.forward_plan``): chunks from 0 (slot resets) and
    resumed inside CSA and HCA groups, a one-token prompt, and decode tokens alongside, in one
    forward that reads nothing back and uploads its indices in one copy."""
    positions = [0, 21, 34, 0, 50, 9]
    rt = _v4_meta_runtime(positions, monkeypatch)
    spans = [
        Span(0, 40, 0, torch.arange(0, 6)),
        Span(21, 45, 1, torch.arange(6, 12)),
        Span(34, 64, 2, torch.arange(12, 18)),
        Span(0, 1, 3, torch.arange(18, 24)),
        Span(50, 51, 4, torch.arange(24, 30)),
        Span(9, 10, 5, torch.arange(30, 36)),
    ]
    trap = _run(rt, spans)
    assert trap.syncs == [] and no_scalar_stores == []
    assert trap.uploads == 1
