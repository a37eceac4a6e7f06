"""The checks a V4.1 config's DSpark keys must pass (``dspark_stages`` > 0 builds the stages)."""

from __future__ import annotations

from typing import Any

from atom.models.common.config import fail


def check_dspark(c: Any) -> None:
    """Refuse DSpark keys the stages cannot be built from, naming the key and the fix."""
    if c.dspark_stages < 0:
        fail("dspark_stages", c.dspark_stages, "must be >= 0")
    if c.dspark_stages == 0:
        return
    if c.num_nextn_predict_layers:
        fail(
            "num_nextn_predict_layers",
            c.num_nextn_predict_layers,
            "must be 0 with DSpark stages (dspark_stages > 0): a model drafts with one of them",
        )
    if c.dspark_block_size < 1:
        fail("dspark_block_size", c.dspark_block_size, "DSpark drafts blocks of >= 1 token")
    if c.dspark_noise_token_id is None or not 0 <= c.dspark_noise_token_id < c.vocab_size:
        fail("dspark_noise_token_id", c.dspark_noise_token_id, f"must be in [0, {c.vocab_size})")
    ids = list(c.dspark_target_layer_ids)
    if not ids or sorted(set(ids)) != ids or not all(0 <= i < c.num_hidden_layers for i in ids):
        fail(
            "dspark_target_layer_ids",
            ids,
            f"must be strictly increasing layer ids in [0, {c.num_hidden_layers}), at least one",
        )
    if not c.dspark_markov_rank or c.dspark_markov_rank < 1:
        fail("dspark_markov_rank", c.dspark_markov_rank, "must be a positive integer")
    experts = c.dspark_n_routed_experts or c.n_routed_experts
    top_k = c.dspark_num_experts_per_tok or c.num_experts_per_tok
    if top_k > experts:
        fail("dspark_num_experts_per_tok", top_k, f"<= dspark_n_routed_experts ({experts})")
