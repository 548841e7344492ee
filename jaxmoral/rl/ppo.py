"""PPO math for sequence policies: KL-shaped rewards, GAE, KL control, clipped losses.

Pure `jnp` functions over (batch, length) per-token arrays with a 0/1 `mask` for the valid
(generated) tokens; the rollout and the update step that use them live elsewhere. Conventions
follow Ziegler et al. (2019) "Fine-Tuning Language Models from Human Preferences" and PPO2:
the sequence score is paid at the last valid token, every token pays `kl_coef * (log pi -
log pi_ref)`, advantages come from GAE over the valid tokens, and both the policy and the value
losses are clipped.
"""

from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp

from jaxmoral import losses
from jaxmoral.models import heads

Array = jax.Array


def kl_penalized_rewards(score: Array, logprobs: Array, ref_logprobs: Array, mask: Array, *,
                         kl_coef: float | Array) -> tuple[Array, Array]:
  """Per-token rewards: -kl_coef * KL estimate everywhere, plus `score` at the last valid token.

  Args:
    score: (B,) sequence-level reward.
    logprobs: (B, T) log pi(token) of the sampled tokens under the rollout policy.
    ref_logprobs: (B, T) the same tokens under the frozen reference policy.

  Returns:
    (rewards, kl), both (B, T) float32 and 0 outside the mask.
  """
  mask = mask.astype(jnp.float32)
  kl = losses.kl_from_logprobs(logprobs, ref_logprobs) * mask
  last = jax.nn.one_hot(heads.last_token_index(mask), mask.shape[1], dtype=jnp.float32) * mask
  rewards = -kl_coef * kl + score.astype(jnp.float32)[:, None] * last
  return rewards, kl


def full_vocab_kl(logits: Array, ref_logits: Array) -> Array:
  """Exact per-position KL(pi(.|s_t) || pi_ref(.|s_t)) over the vocabulary, (B, T) float32,
  from the (B, T, V) logits of the policy and of the reference (at the same temperature).

  Summed over a sampled response, it estimates the sequence KL(pi || pi_ref) with less
  variance than the sampled-token `log pi - log pi_ref` (it is that estimate's expectation
  over the token at each position, given the sampled prefix).
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def explained_variance(values: Array, returns: Array, mask: Array) -> Array:
  """1 - Var[returns - values] / Var[returns] over the mask of (B, T) arrays, a float32 scalar
  (1: perfect values, <= 0: none; 0 when the returns do not vary)."""
  mask = mask.astype(jnp.float32)
  returns = returns.astype(jnp.float32)
  var = losses.masked_var(returns, mask)
  residual = losses.masked_var(returns - values.astype(jnp.float32), mask)
  return jnp.where(var > 0, 1.0 - residual / jnp.where(var > 0, var, 1.0), 0.0)


def compute_gae(rewards: Array, values: Array, mask: Array, *, gamma: float = 1.0,
                lam: float = 0.95, whiten_rewards: bool = False,
                whiten_advantages: bool = False) -> tuple[Array, Array]:
  """Generalised advantage estimation, a backward `lax.scan` over time.

  Masked-out steps are skipped: the successor of a valid step is the next *valid* step (so
  right padding, left padding and holes all work), the value after the last valid step is 0,
  and masked steps get advantage and return 0.

  Args:
    rewards, values: (B, T) per-token rewards and value estimates V(s_t).
    whiten_rewards: Scale rewards to unit variance over the mask first (mean kept).
    whiten_advantages: Whiten advantages over the mask after computing the returns (the
      returns stay advantages + values of the unwhitened advantages).

  Returns:
    (advantages, returns), (B, T) float32, gradient-stopped (they are regression targets).
  """
  mask = mask.astype(jnp.float32)
  rewards = rewards.astype(jnp.float32) * mask
  values = values.astype(jnp.float32) * mask
  if whiten_rewards:
    rewards = losses.masked_whiten(rewards, mask, shift_mean=False)

  def step(carry, inputs):
    next_value, next_adv = carry
    reward, value, valid = inputs
    delta = reward + gamma * next_value - value
    adv = delta + gamma * lam * next_adv
    valid_b = valid > 0
    carry = (jnp.where(valid_b, value, next_value), jnp.where(valid_b, adv, next_adv))
    return carry, jnp.where(valid_b, adv, 0.0)

  init = (jnp.zeros(rewards.shape[:1], jnp.float32),) * 2  # (next value, next advantage)
  _, adv_t = jax.lax.scan(step, init, (rewards.T, values.T, mask.T), reverse=True)
  advantages = adv_t.T
  returns = (advantages + values) * mask
  if whiten_advantages:
    advantages = losses.masked_whiten(advantages, mask, shift_mean=True)
  return jax.lax.stop_gradient(advantages), jax.lax.stop_gradient(returns)


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveKLController:
  """Ziegler et al.'s proportional controller of the KL coefficient.

  `new = coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)`: the coefficient
  grows while the measured KL is above `target` and shrinks while below.

  Attributes:
    init_kl_coef: Starting coefficient.
    target: Target KL (nats per sequence, as measured by the caller).
    horizon: Steps (samples) over which the error is corrected.
  """
  init_kl_coef: float = 0.2
  target: float = 6.0
  horizon: float = 10000.0

  def __post_init__(self):
    if self.init_kl_coef < 0:
      raise ValueError(f"AdaptiveKLController.init_kl_coef must be >= 0, got {self.init_kl_coef}")
    for name in ("target", "horizon"):
      if not getattr(self, name) > 0:
        raise ValueError(f"AdaptiveKLController.{name} must be > 0, got {getattr(self, name)}")

  def update(self, kl_coef: float | Array, current_kl: float | Array,
             n_steps: int | Array) -> Array:
    """The next coefficient (pure; jittable)."""
    error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / self.target - 1.0, -0.2, 0.2)
    return jnp.asarray(kl_coef, jnp.float32) * (1.0 + error * n_steps / self.horizon)


@gin.configurable
@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedKLController:
  """A constant KL coefficient (same interface as `AdaptiveKLController`)."""
  init_kl_coef: float = 0.2

  def __post_init__(self):
    if self.init_kl_coef < 0:
      raise ValueError(f"FixedKLController.init_kl_coef must be >= 0, got {self.init_kl_coef}")

  def update(self, kl_coef: float | Array, current_kl: float | Array,
             n_steps: int | Array) -> Array:
    del current_kl, n_steps
    return jnp.asarray(kl_coef, jnp.float32)


def ppo_policy_terms(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array, *,
                     clip_ratio: float = 0.2) -> dict[str, losses.Term]:
  """PPO's clipped surrogate and its diagnostics as per-token terms (sums over `mask`).

  Args:
    logprobs: (B, T) log-probs of the taken tokens under the current policy (differentiated).
    old_logprobs, advantages: (B, T) the same under the rollout policy, and the advantages.
    clip_ratio: c.

  Returns:
    `policy_loss` (max(-A r, -A clip(r, 1 - c, 1 + c)) per token), and, gradient-stopped,
    `ratio_mean`, `clipfrac` (tokens where the clipped term is active) and `approx_kl`
    (0.5 (log r)^2 per token); each a `losses.Term.tokens` over the valid tokens.
  """
  if not clip_ratio > 0:
    raise ValueError(f"ppo_policy_loss: clip_ratio must be > 0, got {clip_ratio}")
  mask = mask.astype(jnp.float32)
  tokens = jnp.sum(mask)
  log_ratio = logprobs.astype(jnp.float32) - old_logprobs.astype(jnp.float32)
  ratio = jnp.exp(log_ratio)
  advantages = advantages.astype(jnp.float32)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
  stop = jax.lax.stop_gradient
  return {
      "policy_loss": losses.Term.tokens(jnp.sum(jnp.maximum(unclipped, clipped) * mask), tokens),
      "ratio_mean": losses.Term.tokens(stop(jnp.sum(ratio * mask)), tokens),
      "clipfrac": losses.Term.tokens(
          stop(jnp.sum((clipped > unclipped).astype(jnp.float32) * mask)), tokens),
      "approx_kl": losses.Term.tokens(stop(jnp.sum(0.5 * jnp.square(log_ratio) * mask)), tokens),
  }


def ppo_policy_loss(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array, *,
                    clip_ratio: float = 0.2) -> tuple[Array, dict[str, Array]]:
  """(masked-mean `policy_loss`, gradient-stopped masked means of every term) of
  `ppo_policy_terms` (see there)."""
  return _loss_and_metrics(
      ppo_policy_terms(logprobs, old_logprobs, advantages, mask, clip_ratio=clip_ratio),
      "policy_loss")


def _loss_and_metrics(terms: dict[str, losses.Term], loss: str) -> tuple[Array, dict[str, Array]]:
  return terms[loss].value, jax.lax.stop_gradient({k: t.value for k, t in terms.items()})


def ppo_value_terms(values: Array, old_values: Array, returns: Array, mask: Array, *,
                    clip_value: float = 0.2) -> dict[str, losses.Term]:
  """PPO2's clipped value loss and its clip fraction as per-token terms.

  `value_loss` is 0.5 * max((v - R)^2, (v_clipped - R)^2) per valid token, with
  `v_clipped = old_v + clip(v - old_v, -clip_value, clip_value)`; `vf_clipfrac` (gradient-
  stopped) the tokens where the clipped error is the larger one.
  """
  if not clip_value > 0:
    raise ValueError(f"ppo_value_loss: clip_value must be > 0, got {clip_value}")
  mask = mask.astype(jnp.float32)
  tokens = jnp.sum(mask)
  values, old_values, returns = (x.astype(jnp.float32) for x in (values, old_values, returns))
  clipped_values = old_values + jnp.clip(values - old_values, -clip_value, clip_value)
  error = jnp.square(values - returns)
  clipped_error = jnp.square(clipped_values - returns)
  clipped_more = (clipped_error > error).astype(jnp.float32)
  return {
      "value_loss": losses.Term.tokens(0.5 * jnp.sum(jnp.maximum(error, clipped_error) * mask),
                                       tokens),
      "vf_clipfrac": losses.Term.tokens(jax.lax.stop_gradient(jnp.sum(clipped_more * mask)),
                                        tokens),
  }


def ppo_value_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
                   clip_value: float = 0.2) -> tuple[Array, dict[str, Array]]:
  """(masked-mean `value_loss`, gradient-stopped masked means of every term) of
  `ppo_value_terms` (see there)."""
  return _loss_and_metrics(
      ppo_value_terms(values, old_values, returns, mask, clip_value=clip_value), "value_loss")
