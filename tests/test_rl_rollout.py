"""jaxmoral.rl.rollout against NumPy re-computations from the model's teacher-forced outputs."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral.models.config import t5_config
from jaxmoral.models.t5 import T5, init_params, shift_right
from jaxmoral.rl import ppo, rollout

CFG = t5_config(size="tiny", vocab_size=32, d_model=32, d_ff=64, num_heads=2,
                num_encoder_layers=1, num_decoder_layers=1)
B, L, T = 8, 6, 5


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def models():
  policy, value = T5(CFG), T5(CFG, with_scalar_head=True)
  init = jax.jit(functools.partial(init_params, policy))
  params = nn.meta.unbox(init(jax.random.PRNGKey(0)))
  ref = nn.meta.unbox(init(jax.random.PRNGKey(1)))
  # The value model: another T5 body plus a random scalar head.
  rng = np.random.default_rng(0)
  value_params = dict(ref)
  value_params["scalar_head"] = {
      "kernel": jnp.asarray(rng.normal(size=(CFG.d_model, 1)) / np.sqrt(CFG.d_model),
                            jnp.float32),
      "bias": jnp.asarray([0.3], jnp.float32)}
  prompts = np.asarray(rng.integers(2, CFG.vocab_size, size=(B, L)), np.int32)
  prompts[:, -1] = 1
  prompts[0, 3:] = 0  # a short prompt
  prompts[0, 2] = 1
  return policy, value, params, ref, value_params, prompts


def teacher_forced(model, params, prompts, responses):
  """(logits, hidden) of the plain model call (independent of rollout.py)."""
  return _teacher_forced(model)(params, prompts, responses)


@functools.lru_cache(maxsize=None)
def _teacher_forced(model):
  # Compiled once per model: op by op, every op of the model would compile on its own.
  return jax.jit(lambda params, prompts, responses: model.apply(
      {"params": params}, prompts, shift_right(responses), return_hidden=True))


def test_generate_rollout_masks_and_logprobs(models):
  policy, _, params, _, _, prompts = models
  gen = jax.jit(functools.partial(rollout.generate_rollout, policy, max_response_length=T,
                                  temperature=0.7))
  tokens, sampler_lp, mask = gen(params, prompts, jax.random.PRNGKey(3))
  tokens, sampler_lp, mask = map(np.asarray, (tokens, sampler_lp, mask))
  assert tokens.shape == sampler_lp.shape == mask.shape == (B, T)
  for b in range(B):
    eos = np.flatnonzero(tokens[b] == 1)
    n = eos[0] + 1 if len(eos) else T
    np.testing.assert_array_equal(mask[b], (np.arange(T) < n).astype(np.float32))
    assert np.all(tokens[b, n:] == 0) and np.all(sampler_lp[b, n:] == 0)
  # The sampler draws from the untruncated temperature-scaled model: its log-probs are the
  # teacher-forced ones.
  logits, _ = teacher_forced(policy, params, prompts, tokens)
  want = np.take_along_axis(np_log_softmax(np.asarray(logits) / 0.7), tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(sampler_lp, want * mask, atol=2e-5)


@pytest.mark.parametrize("share", [False, True])
def test_score_rollout_matches_independent_forward(models, share):
  policy, value, params, ref, value_params, prompts = models
  temperature, kl_coef = 0.7, 0.3
  rng = np.random.default_rng(1)
  tokens = np.asarray(rng.integers(2, CFG.vocab_size, size=(B, T)), np.int32)
  lengths = np.array([5, 3, 1, 4, 5, 2, 5, 3])
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  tokens = np.where(mask > 0, tokens, 0).astype(np.int32)
  tokens[np.arange(B), lengths - 1] = 1
  scores = np.asarray(rng.normal(size=(B,)), np.float32)
  sampler_lp = np.zeros((B, T), np.float32)
  vparams = dict(value_params)
  if share:
    vparams.pop("encoder")
  fn = jax.jit(functools.partial(
      rollout.score_rollout, policy_model=policy, value_model=value, temperature=temperature,
      share_value_encoder=share, gamma=1.0, lam=0.95, whiten_advantages=False))
  out, metrics = fn(policy_params=params, ref_params=ref, value_params=vparams,
                    prompt_tokens=prompts, response_tokens=tokens, response_mask=mask,
                    sampler_logprobs=sampler_lp, scores=scores, kl_coef=kl_coef)

  def logp(p):
    logits, _ = teacher_forced(policy, p, prompts, tokens)
    lp = np_log_softmax(np.asarray(logits) / temperature)
    return np.take_along_axis(lp, tokens[..., None], -1)[..., 0] * mask

  want_lp, want_ref = logp(params), logp(ref)
  np.testing.assert_allclose(out.old_logprobs, want_lp, atol=2e-5)
  np.testing.assert_allclose(out.ref_logprobs, want_ref, atol=2e-5)
  # Values: the scalar head on the value model's decoder states, the encoder being the
  # policy's when shared.
  if share:
    encoded = jax.jit(lambda p: policy.apply({"params": p}, prompts, method=T5.encode))(params)
    _, hidden = jax.jit(lambda p: value.apply({"params": p}, encoded, prompts != 0,
                                              shift_right(tokens), method=T5.decode))(vparams)
  else:
    _, hidden = teacher_forced(value, vparams, prompts, tokens)
  head = vparams["scalar_head"]
  want_v = (np.asarray(hidden, np.float64) @ np.asarray(head["kernel"])[:, 0]
            + float(head["bias"][0])) * mask
  np.testing.assert_allclose(out.old_values, want_v, atol=2e-5)
  # Rewards: -kl_coef * (logp - ref) per token, score added at the last valid token.
  kl = (want_lp - want_ref) * mask
  want_r = -kl_coef * kl
  want_r[np.arange(B), lengths - 1] += scores
  np.testing.assert_allclose(out.rewards, want_r, atol=5e-5)
  np.testing.assert_allclose(metrics["kl"], kl.sum(1).mean(), atol=5e-5)
  # The exact per-position KL over the vocabulary, summed over each response.
  def full_logp(p):
    logits, _ = teacher_forced(policy, p, prompts, tokens)
    return np_log_softmax(np.asarray(logits) / temperature)
  lp, lq = full_logp(params), full_logp(ref)
  full = ((np.exp(lp) * (lp - lq)).sum(-1) * mask).sum(1)
  np.testing.assert_allclose(metrics["kl_full_vocab"], full.mean(), rtol=1e-4)
  adv, ret = ppo.compute_gae(jnp.asarray(want_r), jnp.asarray(want_v, jnp.float32), mask,
                             gamma=1.0, lam=0.95)
  np.testing.assert_allclose(out.advantages, adv, atol=5e-5)
  np.testing.assert_allclose(out.returns, ret, atol=5e-5)
  ret, valid = np.asarray(ret, np.float64)[mask > 0], mask > 0
  want_ev = 1 - np.var(ret - want_v[valid]) / np.var(ret)
  np.testing.assert_allclose(metrics["value_explained_variance"], want_ev, atol=1e-4)
  assert np.all(np.asarray(out.advantages)[mask == 0] == 0)


def test_values_see_only_earlier_tokens(models):
  """V[:, t] is the state before token t: changing token t leaves V[:, :t+1] unchanged."""
  policy, value, _, _, value_params, prompts = models
  rng = np.random.default_rng(2)
  tokens = np.asarray(rng.integers(2, CFG.vocab_size, size=(B, T)), np.int32)
  changed = tokens.copy()
  changed[:, 2] = (changed[:, 2] + 1) % CFG.vocab_size
  values_of = jax.jit(functools.partial(rollout.values_of, value))
  v1 = np.asarray(values_of(value_params, prompts, tokens))
  v2 = np.asarray(values_of(value_params, prompts, changed))
  np.testing.assert_allclose(v1[:, :3], v2[:, :3], atol=1e-6)
  assert np.max(np.abs(v1[:, 3:] - v2[:, 3:])) > 1e-4
  del policy
