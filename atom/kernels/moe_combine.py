"""The MoE's output: the shared expert's plus each token's routed experts' outputs (already
weighted by their routing weights, which scale the expert's input to its down projection),
in one kernel.

The routed experts' grouped GEMMs leave their rows sorted by expert ([tokens x top_k, d]). The
torch expression casts them to float32, puts each back at (token, slot) and sums the slots,
then adds the shared expert's output: four float32 passes over [tokens x top_k, d]
(a 4096-token chunk of v41-bench: ~170 MB each, per layer). The kernel reads each row once in
its stored dtype and writes the float32 sum once, with the same operations in the same order
(the slots one by one, then the shared output), so the result is the torch expression's, and
the same bits on every run (no atomics).
"""

from __future__ import annotations

import torch

from atom.kernels import invariant, use_triton


def slots(shared: torch.Tensor, y: torch.Tensor) -> int:
    """k, the routed slots per token: y holds N * k rows for shared's N."""
    n = shared.shape[0]
    if n == 0 or y.shape[0] % n:
        raise ValueError(f"y has {y.shape[0]} rows, not a multiple of the {n} tokens")
    return y.shape[0] // n


def moe_combine_torch(shared: torch.Tensor, y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """shared [N, d]; y [N * k, d] the (weighted) routed outputs, row i belonging to (token,
    slot) = divmod(order[i], k) -> float32 [N, d]: shared + sum over slots (in slot order) of
    y (``invariant.sum``: in the batch-invariant mode on CUDA, added one by one)."""
    if shared.shape[0] == 0:
        return torch.empty(shared.shape, dtype=torch.float32, device=shared.device)
    n, k = shared.shape[0], slots(shared, y)
    per_slot = torch.empty(y.shape, dtype=torch.float32, device=y.device)
    per_slot[order] = y.float()
    return shared.float() + invariant.sum(per_slot.view(n, k, -1), 1)


def moe_combine_usable(y: torch.Tensor) -> bool:
    """The kernel runs on CUDA (``use_triton``: unless ``triton_off`` names it), without
    gradients."""
    if torch.is_grad_enabled() and y.requires_grad:
        return False
    return use_triton(y, "moe_combine")


def moe_combine(shared: torch.Tensor, y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``moe_combine_torch`` in one kernel where ``moe_combine_usable(y)``, else the torch
    expression."""
    if not moe_combine_usable(y) or shared.shape[0] == 0:
        return moe_combine_torch(shared, y, order)
    from atom.kernels._moe_combine_triton import moe_combine_triton

    return moe_combine_triton(shared, y, order, slots(shared, y))
