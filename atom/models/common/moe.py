"""The mixture of experts both DeepSeek families run: clamped SwiGLU experts, a shared expert,
and three ways to dispatch the routed ones (per-expert loop, dense, grouped GEMMs), all the
same math.

The module is configured by the config fields it reads (``hidden_size``,
``moe_intermediate_size``, ``n_routed_experts``, ``n_shared_experts``, ``num_experts_per_tok``,
``routed_scaling_factor``, ``swiglu_limit``), not by a family: each family's router decides
which experts a token visits (``route`` here is top-k of score + bias; a family may replace it)
and ``mix`` runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels import invariant
from atom.kernels.fp4_gemm import fp4_grouped_linear, fp4_tiles, fp4_usable
from atom.kernels.fp8_gemm import fp8_act_round
from atom.kernels.moe_combine import moe_combine
from atom.kernels.route import route
from atom.kernels.swiglu import swiglu
from atom.models.common.fp4_linear import Fp4Linear
from atom.models.common.glue_compile import region
from atom.models.common.grouped_mm import (  # the switch; its two setters re-exported
    _GROUPED_MM,
    _grouped_mm_usable,
    configure_grouped_mm,
    grouped_mm_enabled,
)
from atom.models.common.layers import linear
from atom.models.common.promoted import float_weight

__all__ = ["Expert", "MoEGate", "MoE", "configure_grouped_mm", "grouped_mm_enabled"]


def _act_identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Expert(nn.Module):
    """Clamped SwiGLU: down(w * silu(min(gate, L)) * clamp(up, -L, L)), the product taken in
    float32 and rounded to the input dtype once, before ``down``. ``w`` (a routed expert's
    routing weight, [N, 1] float32) scales the product *before* the down projection, as both
    published references do: with the FP8 input rounding that projection applies, weighting
    its output instead is a different function (the rounding blocks see other values).
    ``act`` rounds the inputs of the three projections (the published FP8/FP4 linears
    quantize their input activations; ``MoE`` sets it; identity by default)."""

    def __init__(self, d: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.act = _act_identity
        self.gate_proj = linear(d, inter, dtype)
        self.up_proj = linear(d, inter, dtype)
        self.down_proj = linear(inter, d, dtype)

    def forward(self, x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        x = self.act(x)
        h = swiglu(self.gate_proj(x), self.up_proj(x), self.limit, dtype, w)
        return self.down_proj(self.act(h))


class MoEGate(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size, dtype=dtype)
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )


class MoE(nn.Module):
    """Routed experts (top-k on sqrt(softplus) scores + bias) plus shared experts.

    Two ways to run the routed experts, same math: *routed* sends each expert its tokens (one
    host sync per layer, for the counts); *dense* runs every expert on every token as three
    batched matmuls and weights the outputs by the (mostly zero) routing matrix. Dense is used
    for small batches that would touch most experts anyway (``n * top_k >= experts`` and
    ``n <= DENSE_MAX_TOKENS``: decode), where it reads the same weights with no sync and a
    handful of launches instead of ten per expert. On CUDA bf16 the routed experts run as
    grouped GEMMs with no sync instead (``_grouped``, same math).
    """

    DENSE_MAX_TOKENS = 64

    def __init__(
        self, config: Any, dtype: torch.dtype, gate_temp: float = 1.0, act_fp8: bool = False
    ):
        super().__init__()
        d, inter = config.hidden_size, config.moe_intermediate_size
        self.top_k, self.scale = config.num_experts_per_tok, config.routed_scaling_factor
        self.gate_temp = gate_temp  # the router divides its logits by it (``route``)
        self.limit = config.swiglu_limit
        self.gate = MoEGate(config, dtype)
        self.experts = nn.ModuleList(
            Expert(d, inter, config.swiglu_limit, dtype) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = Expert(d, inter * config.n_shared_experts, config.swiglu_limit, dtype)
        # the published FP8/FP4 experts quantize their inputs to E4M3 per 32 (``act_fp8``)
        self.act = functools.partial(fp8_act_round, block=32) if act_fp8 else _act_identity
        for expert in [*self.experts, self.shared_experts]:
            expert.act = self.act
        self._stacks = StackCell()
        # tensor parallelism (``atom.distributed``): this rank holds a slice of every expert's
        # intermediate dimension, and this sums the ranks' float32 partial outputs
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x, *self.route(x))

    def tp_splits(self) -> dict[str, int]:
        """What the ranks split (``atom.models.common.tensor_parallel``): every expert's
        intermediate dimension, routed and shared alike (gate and up rows, down columns). The
        router stays whole, so the routing, the path (dense / grouped / loop) and every
        token's expert list are the unsplit ones, and every rank does 1/N of every expert's
        work whatever the routing's skew; the shared and routed outputs share one reduce."""
        experts = [f"experts.{i}" for i in range(len(self.experts))] + ["shared_experts"]
        dims = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}
        return {f"{e}.{p}.weight": d for e in experts for p, d in dims.items()}

    def tp_narrow(self, world: int, reduce: Callable[[torch.Tensor], torch.Tensor], gather) -> None:
        """Restack from this rank's slices; sum the ranks' float32 partial outputs."""
        self._stack = None
        self.reduce_output = reduce

    @region
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, top_k], weights [N, top_k] float32) of each token."""
        logits = invariant.linear(x.float(), float_weight(self.gate))
        bias = self.gate.e_score_correction_bias
        return route(logits, bias, self.gate_temp, self.top_k, self.scale)

    def path(self, n: int, x: torch.Tensor) -> str:
        """How ``mix`` runs the routed experts of ``n`` tokens like ``x`` (dtype, device):
        "dense", "grouped" (both without host sync) or "loop" (one host sync per layer). The
        batch-invariant mode (``atom.kernels.invariant``) runs the loop whatever ``n``: each
        token's expert outputs are then added in expert order, each product row-tiled; on CUDA
        "fixed" instead (no host sync): grouped GEMMs of one fixed kernel configuration
        (``atom.kernels._invariant_gemm_triton``), each token's slots summed in slot order.
        FP4 experts (``Fp4Linear``) run "fp4" where its kernel does (CUDA), in either mode:
        grouped products that dequantize the codes in registers, no host sync; else the loop."""
        if self.fp4_experts():  # in either mode (in the mode its launch is fixed whatever n)
            return "fp4" if fp4_usable(x) and not torch.is_grad_enabled() else "loop"
        if invariant.enabled():
            return "fixed" if self._fixed_usable(x) else "loop"
        if n * self.top_k >= len(self.experts) and n <= self.DENSE_MAX_TOKENS:
            return "dense"
        return "grouped" if _grouped_mm_usable(x) else "loop"

    def mix(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The shared expert plus the routed experts ``idx`` weighted by ``w`` (under tensor
        parallelism: this rank's slice of each, summed over the ranks in float32)."""
        out = self._mix_float(x, idx, w)
        if self.reduce_output is not None:
            out = self.reduce_output(out)
        return out.to(x.dtype)

    def _mix_float(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        path = self.path(x.shape[0], x)
        if path == "grouped":
            try:
                y, order = self._grouped(x, idx, w)
            except RuntimeError as e:  # an unsupported shape or build: the loop, from now on
                _GROUPED_MM["failed"] = f"{type(e).__name__}: {e}"
            else:
                # each token's top_k weighted outputs summed in slot order: an ``index_add_``
                # of the sorted rows would add them with atomics, in an order that changes from
                # run to run (and with it, in bfloat16, an output now and then)
                return moe_combine(shared, y, order)
        if path == "fixed":
            return moe_combine(shared, *self._fixed(x, idx, w))
        if path == "fp4":
            return moe_combine(shared, *self._fp4(x, idx, w))
        if path == "dense":  # float32 + x's dtype adds in float32: shared.float()'s bits, no cast
            return self._dense(x, idx, w) + shared
        out = shared.float()
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # token rows grouped by expert, rows ascending
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # the one sync
        rows, slot = order // self.top_k, order % self.top_k
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                r = rows[start : start + count]
                y = expert(x.index_select(0, r), w[r, slot[start : start + count], None])
                out.index_add_(0, r, y.float())
                start += count
        return out

    def _fixed_usable(self, x: torch.Tensor) -> bool:
        """The mode's sync-free path: the fixed-configuration kernel runs for ``x``, and the
        experts hold plain weights of x's dtype (quantized experts run the loop)."""
        if not invariant.fixed_gemm(x) or torch.is_grad_enabled():
            return False
        return self.experts[0].gate_proj.weight.dtype == x.dtype

    def _fixed(
        self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts in the batch-invariant mode without a host sync: the token rows
        sorted by expert, three grouped GEMMs of the fixed kernel. Returns (the weighted
        outputs [N * top_k, d] in expert order, order), as ``_grouped`` does. A row's result
        depends only on its own token and expert, whatever the other rows and their experts."""
        from atom.kernels._invariant_gemm_triton import group_tiles, invariant_grouped_linear

        gate, up, down = self.stacked_weights()
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # token rows grouped by expert, rows ascending
        counts = torch.zeros(gate.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # integer adds: exact in any order
        ends = torch.cumsum(counts, 0)
        tiles = group_tiles(ends, flat.shape[0], x.dtype)
        xs = self.act(x).index_select(0, order // self.top_k)
        g = invariant_grouped_linear(xs, gate, ends, tiles).float().clamp(max=self.limit)
        u = invariant_grouped_linear(xs, up, ends, tiles).float().clamp(-self.limit, self.limit)
        h = invariant.pointwise(F.silu, g) * u * w.flatten()[order, None]
        h = self.act(h.to(x.dtype))
        return invariant_grouped_linear(h, down, ends, tiles), order

    def fp4_experts(self) -> bool:
        """Whether the routed experts hold packed FP4 weights (``Fp4Linear``)."""
        return isinstance(self.experts[0].gate_proj, Fp4Linear)

    def _fp4(
        self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP4 routed experts without a host sync: the token rows sorted by expert, three
        grouped FP4 products (``fp4_grouped_linear``). Returns (the weighted outputs
        [N * top_k, d] in expert order, order), as ``_grouped`` does."""
        (gp, gs), (up, us), (dp, ds) = self.stacked_fp4()
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # token rows grouped by expert, rows ascending
        counts = torch.zeros(gp.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # integer adds: exact in any order
        ends = torch.cumsum(counts, 0)
        first = self.experts[0]  # every expert's linears round their inputs alike
        xs = first.gate_proj.round_input(self.act(x)).index_select(0, order // self.top_k)
        tiles = fp4_tiles(ends, flat.shape[0], xs)
        g = fp4_grouped_linear(xs, gp, gs, ends, tiles).float().clamp(max=self.limit)
        u = fp4_grouped_linear(xs, up, us, ends, tiles).float().clamp(-self.limit, self.limit)
        h = invariant.pointwise(F.silu, g) * u * w.flatten()[order, None]
        h = first.down_proj.round_input(self.act(h.to(x.dtype)))
        return fp4_grouped_linear(h, dp, ds, ends, tiles), order

    def stacked_fp4(self):
        """The FP4 experts' (codes, scales) of gate, up and down, each as an [E, ...] tensor
        (``_stacked``)."""
        s = self._stacked([(p, b) for p in _PROJS for b in ("weight", "weight_scale")])
        return (s[0], s[1]), (s[2], s[3]), (s[4], s[5])

    def _grouped(
        self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts as three grouped GEMMs over the token rows sorted by expert
        (``torch._grouped_mm``): the group offsets stay on the device, so no host sync.
        Returns (outputs [N * top_k, d] in expert order, already weighted by ``w``, order:
        row i is token order[i] // top_k's slot order[i] % top_k), for ``moe_combine`` (one
        kernel on CUDA)."""
        gate, up, down = self.stacked_weights()
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)  # token rows grouped by expert, rows ascending
        counts = torch.zeros(gate.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = order // self.top_k
        xs = self.act(x).index_select(0, rows)
        g = torch._grouped_mm(xs, gate.transpose(1, 2), offs=offs)
        u = torch._grouped_mm(xs, up.transpose(1, 2), offs=offs)
        h = self.act(swiglu(g, u, self.limit, x.dtype, w, order))
        return torch._grouped_mm(h, down.transpose(1, 2), offs=offs), order

    def _dense(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, the unrouted ones weighted 0 (few tokens: the weights
        are read once either way). Gate and up are one product each over all the experts (the
        [E, I, d] stack seen as [E * I, d]: no copy of x per expert); the product rows are
        (token, expert) pairs, each scaled by its routing weight (``swiglu``); the down
        projection runs per expert over those rows read in place, and the experts' outputs
        are summed in float32. Returns [N, d] float32."""
        gate, up, down = self.stacked_weights()
        e, inter, d = gate.shape
        n = x.shape[0]
        xa = self.act(x)
        g = F.linear(xa, gate.reshape(e * inter, d)).view(n * e, inter)
        u = F.linear(xa, up.reshape(e * inter, d)).view(n * e, inter)
        route = torch.zeros(n, e, dtype=torch.float32, device=x.device)
        route.scatter_(1, idx, w)
        h = self.act(swiglu(g, u, self.limit, x.dtype, route))  # [(token, expert), inter]
        y = torch.bmm(h.view(n, e, inter).transpose(0, 1), down.transpose(1, 2))  # [E, n, d]
        return y.sum(0, dtype=torch.float32)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert weights as [E, ...] tensors (``_stacked``; under autograd, a differentiable
        stack instead)."""
        if torch.is_grad_enabled() and self.experts[0].gate_proj.weight.requires_grad:
            return tuple(
                torch.stack([getattr(e, p).weight for e in self.experts]) for p in _PROJS
            )  # training
        return self._stacked([(p, "weight") for p in _PROJS])

    @property
    def _stack(self) -> tuple[torch.Tensor, ...] | None:
        """The experts' stacked tensors (``_stacked``); None: stack on next use."""
        return self._stacks.stack

    @_stack.setter
    def _stack(self, value: tuple[torch.Tensor, ...] | None) -> None:
        self._stacks.stack = value

    def share_stacks(self, other: MoE) -> None:
        """Hold the stacked expert tensors in ``other``'s cell, whose experts' parameters are
        these experts' (engines sharing one copy of the weights:
        ``benchmarks/shared_weights.py``). With a cell each, each module would find the
        parameters stacked by the other, restack them and free the other's stack, which CUDA
        graphs captured on the other still read."""
        mine = [p for e in self.experts for p in e.parameters()]
        theirs = [p for e in other.experts for p in e.parameters()]
        if len(mine) != len(theirs) or any(a is not b for a, b in zip(mine, theirs)):
            raise ValueError("share_stacks needs the same expert parameters in both modules")
        self._stacks = other._stacks

    def _stacked(self, fields: list[tuple[str, str]]) -> tuple[torch.Tensor, ...]:
        """One [E, ...] tensor per (projection, tensor name) of the experts; the experts'
        tensors are made views of them (no second copy; loads and in-place updates show
        through), restacked if they were replaced (a load, ``.to()``, a new ``.data``)."""
        per = [[getattr(getattr(e, proj), name) for e in self.experts] for proj, name in fields]
        stack = self._stack
        if (
            stack is None
            or len(stack) != len(per)
            or any(
                t.data_ptr() != s[i].data_ptr() or t.device != s.device
                for ts, s in zip(per, stack)
                for i, t in enumerate(ts)
            )
        ):
            stack = tuple(torch.stack([t.detach() for t in ts]) for ts in per)
            for ts, s in zip(per, stack):
                for i, t in enumerate(ts):
                    t.data = s[i]
            self._stack = stack
        return stack


class StackCell:
    """Where a ``MoE`` keeps its experts' stacked tensors: one per module, or one for the
    modules of several engines that share the experts' parameters (``MoE.share_stacks``)."""

    __slots__ = ("stack",)

    def __init__(self) -> None:
        self.stack: tuple[torch.Tensor, ...] | None = None


_PROJS = ("gate_proj", "up_proj", "down_proj")
