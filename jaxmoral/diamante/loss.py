"""Diamante's joint loss: NLL of the human response + preference estimation (PE) loss.

L = NLL(r_H | c) + pe_weight * L_PE, with

  L_PE = -(1/3) [log σ(s_H - s_M) + log σ(s_H - s_R) + log σ(s_M - s_R)],

the human response preferred to the model's, both preferred to a random one (Lu et al., 2023,
eq. 2). `pe_weight=0` is the NLL-only ablation (the head then gets no gradient).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import gin
import jax
import jax.numpy as jnp

from jaxmoral import losses
from jaxmoral.diamante import data
from jaxmoral.diamante.model import forward_responses

Array = jax.Array


def pe_loss(human: Array, model: Array, random: Array) -> Array:
  """Per-example PE loss from the three scores, each (B,) -> (B,) float32."""
  return (losses.pairwise_logistic(human, model) + losses.pairwise_logistic(human, random)
          + losses.pairwise_logistic(model, random)) / 3.0


def preference_terms(scores: Array) -> dict[str, losses.Term]:
  """Per-example terms of (B, 3) scores ordered human, model, random: `rank_accuracy` (the
  fraction of the three pairs in the right order), `order_accuracy` (all three), `gap_*`."""
  scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
  h, m, r = scores[:, data.HUMAN], scores[:, data.MODEL], scores[:, data.RANDOM]
  pairs = jnp.stack([h > m, h > r, m > r], axis=-1).astype(jnp.float32)
  per_example = {
      "rank_accuracy": jnp.mean(pairs, axis=-1),
      "order_accuracy": jnp.all(pairs > 0, axis=-1).astype(jnp.float32),
      "gap_human_model": h - m,
      "gap_human_random": h - r,
      "gap_model_random": m - r,
  }
  return {k: losses.Term.examples(jnp.sum(v), scores.shape[0]) for k, v in per_example.items()}


@gin.configurable
def diamante_loss_fn(model: Any, *, pe_weight: float = 1.0,
                     z_loss: float = 0.0) -> losses.TermsLoss:
  """The joint loss, declared as terms: NLL per human-response token, PE per example.

  Args:
    model: `T5(config, with_scalar_head=True)`.
    pe_weight: Weight of the PE loss; 0 trains with NLL only (the ablation).
    z_loss: T5X z-loss coefficient on the NLL.

  Returns:
    A `losses.TermsLoss`, `loss_fn(params, batch, rng) -> (loss, metrics)`, of
    `data.quadruple_features` batches (responses ordered human, model, random, through one
    batched forward pass). Terms: `nll` (per human token), `pe_loss` and `preference_terms`
    (per example), `num_tokens` (a sum); metric `loss` = nll + pe_weight * pe_loss.
    Microbatches combine exactly: the PE term is weighted by examples, not by tokens.
  """
  if pe_weight < 0:
    raise ValueError(f"diamante_loss_fn: pe_weight must be >= 0, got {pe_weight}")
  if not getattr(model, "with_scalar_head", False):
    raise ValueError("diamante_loss_fn: the model needs with_scalar_head=True")

  def terms_fn(params: Any, batch: Mapping[str, Array],
               rng: Optional[Array]) -> dict[str, losses.Term]:
    targets = batch["decoder_target_tokens"]
    if targets.ndim != 3 or targets.shape[1] != 3:
      raise ValueError("diamante_loss_fn: decoder_target_tokens must be (batch, 3, length) "
                       f"(human, model, random), got shape {targets.shape}")
    weights = batch.get("decoder_loss_weights")
    weights = (targets > 0) if weights is None else weights
    logits, scores = forward_responses(model, params, batch["encoder_input_tokens"],
                                       batch["decoder_input_tokens"], weights, rng=rng)
    human_weights = weights[:, data.HUMAN].astype(jnp.float32)
    loss_sum, weight_sum, _ = losses.token_nll(logits[:, data.HUMAN], targets[:, data.HUMAN],
                                               human_weights, z_loss=z_loss)
    pe = pe_loss(scores[:, data.HUMAN], scores[:, data.MODEL], scores[:, data.RANDOM])
    return {"nll": losses.Term.tokens(loss_sum, weight_sum),
            "pe_loss": losses.Term.examples(jnp.sum(pe), targets.shape[0]),
            "num_tokens": losses.Term.sum(weight_sum),
            **preference_terms(scores)}

  return losses.TermsLoss(terms_fn, weights={"nll": 1.0, "pe_loss": pe_weight},
                          name="diamante_loss_fn")
