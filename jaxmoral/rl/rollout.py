"""PPO rollouts for a T5 policy: sample responses, then score them by teacher forcing.

Pure, jittable functions; `jaxmoral.rl.ppo_trainer` compiles and shards them over the mesh.

The policy is the distribution that was sampled: `jaxmoral.decoding.sample` draws from the
untruncated pi(a|s) = softmax(logits / tau) -- no top-k, no top-p -- and the same distribution,
by teacher forcing, gives the ratio, the entropy and (with the frozen reference's logits at the
same tau) the KL penalty. `score_rollout` computes the old log-probs with exactly the function
the update step differentiates, so on the first minibatch of the first PPO epoch the ratio is
exactly 1 and the approximate KL exactly 0; the sampler's own log-probs are kept as
`sampler_logprobs`, their gap to `old_logprobs` logged as a check (float rounding only). A
truncated sampler would break this: the KL estimate log pi - log pi_ref then sees only tokens
of the nucleus, never the probability an update moves into the unsampled tail, which can grow
unpenalised; `PPOConfig` refuses it (evaluation decodes with settings of its own).

KL to the reference, two ways: `kl` is the per-token sample estimate log pi - log pi_ref (what
the reward pays, Ziegler et al.); `kl_full_vocab` sums the exact per-position KL over the
vocabulary (`ppo.full_vocab_kl`: also unbiased, with less variance).

Time convention: position t of every (B, T) array is response token t; `old_values[:, t]` is
V(prompt, response[:t]) (the decoder inputs are the shifted-right response), the value of the
state in which token t is chosen, as GAE expects.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp

from jaxmoral import decoding
from jaxmoral import losses
from jaxmoral.models.t5 import T5
from jaxmoral.models.t5 import shift_right
from jaxmoral.rl import ppo

Array = jax.Array
Params = Any


@flax.struct.dataclass
class Rollout:
  """One PPO batch; every leaf has the batch as its leading dim.

  Attributes:
    prompt_tokens: (B, L) int32 encoder inputs (0-padded, EOS-terminated).
    response_tokens: (B, T) int32 sampled tokens (EOS included, 0 after it).
    response_mask: (B, T) float32, 1 on generated tokens (EOS included).
    sampler_logprobs: (B, T) log-probs under the sampler's processed distribution.
    old_logprobs: (B, T) teacher-forced temperature-scaled policy log-probs at rollout time.
    ref_logprobs: (B, T) the same under the frozen reference policy.
    old_values: (B, T) value estimates at rollout time.
    scores: (B,) sequence score actually paid (normalised when reward normalisation is on).
    rewards: (B, T) KL-penalised per-token rewards.
    kl: (B, T) per-token KL estimate log pi - log pi_ref.
    advantages: (B, T) GAE advantages (whitened if configured).
    returns: (B, T) value targets.
  """
  prompt_tokens: Array
  response_tokens: Array
  response_mask: Array
  sampler_logprobs: Array
  old_logprobs: Array
  ref_logprobs: Array
  old_values: Array
  scores: Array
  rewards: Array
  kl: Array
  advantages: Array
  returns: Array


# Rank of every `Rollout` field, for its batch shardings (a Rollout of ints).
ROLLOUT_NDIMS = Rollout(**{f.name: 1 if f.name == "scores" else 2  # type: ignore[arg-type]
                           for f in dataclasses.fields(Rollout)})


def generate_rollout(model: T5, params: Params, prompt_tokens: Array, rng: Array, *,
                     max_response_length: int,
                     temperature: float = 0.7) -> tuple[Array, Array, Array]:
  """Samples one response per (B, L) prompt from softmax(logits / temperature), untruncated
  (jittable): (response_tokens int32, sampler_logprobs, response_mask), each (B, T) with T =
  `max_response_length` (EOS included)."""
  out = decoding.sample(model, params, encoder_input_tokens=prompt_tokens, rng=rng,
                        max_decode_length=max_response_length, num_samples=1,
                        temperature=temperature, top_k=0, top_p=1.0,
                        eos_id=model.config.eos_token_id)
  return out.tokens[:, 0], out.logprobs[:, 0], out.mask[:, 0]


def _decode_and_score(module: T5, encoded: Array, encoder_mask: Array,
                      decoder_input_tokens: Array) -> Array:
  """Value head on the decoder states (used as an `apply` method)."""
  _, hidden = module.decode(encoded, encoder_mask, decoder_input_tokens)
  return module.score(hidden)


def _encode(model: T5, params: Params, prompt_tokens: Array) -> tuple[Array, Array]:
  mask = prompt_tokens != model.config.pad_token_id
  encoded = model.apply({"params": params}, prompt_tokens, encoder_mask=mask, method=T5.encode)
  return typing.cast(Array, encoded), mask


def _teacher_forced(model: T5, params: Params, prompt_tokens: Array, response_tokens: Array,
                    encoded: Optional[tuple[Array, Array]], method: Callable[..., Any]) -> Any:
  """`method` of `model` on the decoder reading the shifted-right response."""
  if encoded is None:
    encoded = _encode(model, params, prompt_tokens)
  decoder_inputs = shift_right(response_tokens, model.config.decoder_start_token_id)
  return model.apply({"params": params}, *encoded, decoder_inputs, method=method)


def policy_logits(model: T5, params: Params, prompt_tokens: Array, response_tokens: Array, *,
                  temperature: float, encoded: Optional[tuple[Array, Array]] = None) -> Array:
  """Teacher-forced logits / temperature of every response position, (B, T, V) float32.

  Position t holds the logits of pi(.|prompt, response[:t]): softmax of it is the
  distribution token t was sampled from. `params` are the policy's or the reference's;
  `encoded` is a precomputed `(encoded, encoder_mask)` of their encoder.
  """
  logits, _ = _teacher_forced(model, params, prompt_tokens, response_tokens, encoded,
                              T5.decode)
  return logits.astype(jnp.float32) / temperature


def values_of(value_model: T5, value_params: Params, prompt_tokens: Array,
              response_tokens: Array, *, encoded: Optional[tuple[Array, Array]] = None) -> Array:
  """Per-token values V(prompt, response[:t]) from the value model's scalar head, (B, T).

  `encoded` is `(encoded, encoder_mask)` of another encoder (the policy's, when shared;
  `value_params` may then lack `encoder`).
  """
  return typing.cast(Array, _teacher_forced(value_model, value_params, prompt_tokens,
                                            response_tokens, encoded, _decode_and_score))


def policy_and_values(policy_model: T5, value_model: T5, policy_params: Params,
                      value_params: Params, prompt_tokens: Array, response_tokens: Array, *,
                      temperature: float, share_value_encoder: bool,
                      with_entropy: bool) -> tuple[Array, Optional[Array], Array]:
  """Policy log-probs (and entropy) and values, as the update differentiates them."""
  logits, values = _logits_and_values(policy_model, value_model, policy_params, value_params,
                                      prompt_tokens, response_tokens, temperature=temperature,
                                      share_value_encoder=share_value_encoder)
  entropy = losses.entropy_from_logits(logits) if with_entropy else None
  return losses.token_logprobs(logits, response_tokens), entropy, values


def _logits_and_values(policy_model: T5, value_model: T5, policy_params: Params,
                       value_params: Params, prompt_tokens: Array, response_tokens: Array, *,
                       temperature: float, share_value_encoder: bool) -> tuple[Array, Array]:
  """`policy_logits` and `values_of`; the encoder runs once when it is shared."""
  encoded = _encode(policy_model, policy_params, prompt_tokens)
  logits = policy_logits(policy_model, policy_params, prompt_tokens, response_tokens,
                         temperature=temperature, encoded=encoded)
  return logits, values_of(value_model, value_params, prompt_tokens, response_tokens,
                           encoded=encoded if share_value_encoder else None)


def score_rollout(*, policy_model: T5, value_model: T5, policy_params: Params,
                  ref_params: Params, value_params: Params, prompt_tokens: Array,
                  response_tokens: Array, response_mask: Array, sampler_logprobs: Array,
                  scores: Array, kl_coef: Array | float, temperature: float,
                  share_value_encoder: bool = False, gamma: float = 1.0, lam: float = 0.95,
                  whiten_rewards: bool = False, whiten_advantages: bool = True
                  ) -> tuple[Rollout, dict[str, Array]]:
  """Old log-probs, reference log-probs and values in one pass, then rewards and GAE (jittable).

  Args:
    policy_params, ref_params, value_params: Rollout-time parameters.
    prompt_tokens, response_tokens, response_mask, sampler_logprobs: From `generate_rollout`.
    scores: (B,) sequence scores to pay at the last token (already normalised).
    temperature: Sampling temperature (applied to policy and reference logits alike).
    share_value_encoder: Values read the policy's encoder output.
    gamma, lam, whiten_rewards, whiten_advantages: See `jaxmoral.rl.ppo.compute_gae`.

  Returns:
    (rollout, metrics): metrics are scalars `kl` (mean per-sequence KL, the sampled-token
    estimate the reward pays), `kl_per_token`, `kl_full_vocab` (the same of `ppo.full_vocab_kl`),
    `entropy`, `non_score_reward` (mean per-sequence KL penalty), `score_mean`/`score_std`,
    `value_mean`, `value_explained_variance` (of the returns by the rollout-time values),
    `response_length`, `sampler_logprob_gap` (mean |old - sampler| log-prob).
  """
  mask = response_mask.astype(jnp.float32)
  logits, values = _logits_and_values(policy_model, value_model, policy_params, value_params,
                                      prompt_tokens, response_tokens, temperature=temperature,
                                      share_value_encoder=share_value_encoder)
  logprobs = losses.token_logprobs(logits, response_tokens)
  entropy = losses.entropy_from_logits(logits)
  ref_logits = policy_logits(policy_model, ref_params, prompt_tokens, response_tokens,
                             temperature=temperature)
  ref_logprobs = losses.token_logprobs(ref_logits, response_tokens)
  kl_full = ppo.full_vocab_kl(logits, ref_logits) * mask
  values = values * mask
  rewards, kl = ppo.kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=kl_coef)
  advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=gamma, lam=lam,
                                        whiten_rewards=whiten_rewards,
                                        whiten_advantages=whiten_advantages)
  rollout = Rollout(prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                    response_mask=mask, sampler_logprobs=sampler_logprobs * mask,
                    old_logprobs=logprobs * mask, ref_logprobs=ref_logprobs * mask,
                    old_values=values, scores=scores.astype(jnp.float32), rewards=rewards, kl=kl,
                    advantages=advantages, returns=returns)
  seq_kl = jnp.sum(kl, axis=1)
  metrics = {
      "kl": jnp.mean(seq_kl),
      "kl_per_token": losses.masked_mean(kl, mask),
      "kl_full_vocab": jnp.mean(jnp.sum(kl_full, axis=1)),
      "entropy": losses.masked_mean(entropy, mask),
      "non_score_reward": -jnp.mean(jnp.asarray(kl_coef, jnp.float32) * seq_kl),
      "score_mean": jnp.mean(rollout.scores),
      "score_std": jnp.std(rollout.scores),
      "value_mean": losses.masked_mean(values, mask),
      "value_explained_variance": ppo.explained_variance(values, returns, mask),
      "response_length": jnp.mean(jnp.sum(mask, axis=1)),
      "sampler_logprob_gap": losses.masked_mean(jnp.abs(rollout.old_logprobs
                                                        - rollout.sampler_logprobs), mask),
  }
  return rollout, metrics

