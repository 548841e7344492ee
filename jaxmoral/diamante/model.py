"""The Diamante network pass: one context, K responses, logits and preference scores together.

The generator and the evaluator are one `T5(config, with_scalar_head=True)`: each context is
encoded once and a single decoder pass runs over its K responses (K = 3 in training: human,
model, random). The preference score s(c, r) is the scalar head on the decoder state whose
*input* is the response's EOS token, the state that has read the whole response: position
`last_token_index(weights) + 1` (targets keep it free, see `data.FeatureConfig`).
"""

from __future__ import annotations

import typing
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxmoral import losses
from jaxmoral.models import heads
from jaxmoral.models.t5 import T5

Array = jax.Array


def _forward(module: T5, encoder_input_tokens: Array, decoder_input_tokens: Array, *,
             num_responses: int, deterministic: bool) -> tuple[Array, Array]:
  """Inside `apply`: encode (B, Lc) once, decode (B*K, T); per-position logits and scores."""
  encoder_mask = encoder_input_tokens != module.config.pad_token_id
  encoded = module.encode(encoder_input_tokens, encoder_mask=encoder_mask,
                          deterministic=deterministic)
  # Row b*K + k of the decoder batch is response k of context b. Deterministic calls
  # (scoring, ranking candidates) let the K rows share one projection of the context's
  # cross-attention keys/values; training repeats the encoding, so attention dropout and the
  # fused GPU kernel apply as in any other training step.
  if not deterministic:
    encoded = jnp.repeat(encoded, num_responses, axis=0)
    encoder_mask = jnp.repeat(encoder_mask, num_responses, axis=0)
  logits, hidden = module.decode(encoded, encoder_mask, decoder_input_tokens,
                                 deterministic=deterministic)
  return logits, module.score(hidden)


def forward_responses(model: T5, params: Any, encoder_input_tokens: Array,
                      decoder_input_tokens: Array, decoder_loss_weights: Array, *,
                      rng: Optional[Array] = None) -> tuple[Array, Array]:
  """Teacher-forced logits (B, K, T, V) of K responses per context and their preference
  scores (B, K), both float32.

  Args:
    model, params: A `T5` built with `with_scalar_head=True`, and its parameters.
    encoder_input_tokens: (B, Lc) contexts.
    decoder_input_tokens: (B, K, T) responses shifted right (start id 0).
    decoder_loss_weights: (B, K, T) 1 on response tokens and EOS; the score is read one
      position after the last weighted one.
    rng: Dropout key; None runs deterministically.
  """
  batch, num_responses, length = decoder_input_tokens.shape
  flat_inputs = decoder_input_tokens.reshape(batch * num_responses, length)
  rngs = {} if rng is None else {"dropout": rng}
  logits, position_scores = typing.cast(tuple[Array, Array], model.apply(
      {"params": params}, encoder_input_tokens, flat_inputs, method=_forward, rngs=rngs,
      num_responses=num_responses, deterministic=rng is None))
  flat_weights = decoder_loss_weights.reshape(batch * num_responses, length)
  index = jnp.minimum(heads.last_token_index(flat_weights) + 1, length - 1)
  scores = heads.gather_at(position_scores, index)
  return (logits.reshape(batch, num_responses, length, -1), scores.reshape(batch, num_responses))


def score_responses(model: T5, params: Any, encoder_input_tokens: Array, response_tokens: Array,
                    lengths: Optional[Array] = None) -> tuple[Array, Array, Array]:
  """(scores, sequence log-probabilities, lengths), each (B, N), of given responses.

  Args:
    model, params, encoder_input_tokens: As `forward_responses`'.
    response_tokens: (B, N, T) response targets: tokens, EOS, zero padding (e.g. a sampler's
      `DecodeOutput.tokens`).
    lengths: (B, N) tokens per response including EOS (e.g. `DecodeOutput.lengths`); default:
      up to and including the first EOS.
  """
  response_tokens = jnp.asarray(response_tokens, jnp.int32)
  positions = jnp.arange(response_tokens.shape[-1])
  if lengths is None:
    is_eos = response_tokens == model.config.eos_token_id
    first_eos = jnp.argmax(is_eos, axis=-1)
    lengths = jnp.where(jnp.any(is_eos, axis=-1), first_eos + 1, response_tokens.shape[-1])
  weights = (positions < lengths[..., None]).astype(jnp.int32)
  targets = response_tokens * weights
  # One spare position: the input after the last token (where the score is read) always fits.
  targets = jnp.pad(targets, ((0, 0), (0, 0), (0, 1)))
  weights = jnp.pad(weights, ((0, 0), (0, 0), (0, 1)))
  inputs = jnp.pad(targets[..., :-1], ((0, 0), (0, 0), (1, 0)))
  logits, scores = forward_responses(model, params, encoder_input_tokens, inputs, weights)
  batch, num, length = targets.shape
  logprob = losses.sequence_logprob(logits.reshape(batch * num, length, -1),
                                    targets.reshape(batch * num, length),
                                    weights.reshape(batch * num, length))
  return scores, logprob.reshape(batch, num), jnp.sum(weights, axis=-1)
