"""The MoE router after its projection, one kernel per decode step's layer instead of about
twelve: sqrt(softplus(logits / temp)) scores, the top-k experts of scores + bias (ties to the
smaller expert id), their scores normalized and scaled. V4.1's router (``MoE.route``) and V4's
(``V4MoE.route_ids`` on its score-routed layers: temperature 1, the sum without V4.1's 1e-20)
both run through it.

The kernel picks the top k by k rounds of arg-max (the first index among equal values wins),
which is what a stable descending sort's first k are, so the expert ids are the torch
expression's. Scores keep torch's CUDA bits (IEEE division and square root, libdevice's
``log1p`` and ``expf``, torch's softplus threshold of 20, no fused multiply-add); the weights'
normalizing sum adds k values in the kernel's order, so they match to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels import invariant, use_triton


def route_torch(
    logits: torch.Tensor,
    bias: torch.Tensor,
    temp: float,
    top_k: int,
    scale: float,
    eps: float = 1e-20,
    normalize_one: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] float32 -> (expert ids [N, top_k] int64, weights [N, top_k] float32).
    The weights are divided by their sum + ``eps`` where top_k > 1 (V4.1's published router:
    eps 1e-20), or always with ``normalize_one`` (V4's: eps 0, the division alone)."""
    scores = torch.sqrt(invariant.pointwise(F.softplus, logits / temp))
    biased = scores + bias
    # ties go to the smaller expert id, identically in every path
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = scores.gather(1, idx)
    if top_k > 1 or normalize_one:  # V4.1's published router adds 1e-20 (not rms_norm_eps)
        w = w / (invariant.sum(w, -1, keepdim=True) + eps)
    return idx, w * scale


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    temp: float,
    top_k: int,
    scale: float,
    eps: float = 1e-20,
    normalize_one: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_torch``; one Triton kernel where it can run (kernel ``route``; row-local; up to
    1,024 experts: a row's scores are held in one program's registers)."""
    wants_grad = torch.is_grad_enabled() and (logits.requires_grad or bias.requires_grad)
    usable = use_triton(logits, "route", row_local=True) and logits.dtype == torch.float32
    if wants_grad or not usable or logits.shape[1] > 1024 or top_k > logits.shape[1]:
        return route_torch(logits, bias, temp, top_k, scale, eps, normalize_one)
    from atom.kernels._route_triton import route_triton

    bias = bias.float().contiguous()
    return route_triton(logits, bias, temp, top_k, scale, eps, top_k > 1 or normalize_one)
