"""jaxmoral.losses against NumPy re-computations (log-softmax, soft targets, z-loss)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import losses
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5 as t5_lib


def np_log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  m = logits.max(-1, keepdims=True)
  return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def np_token_nll(logits, targets, weights, label_smoothing=0.0, z_loss=0.0):
  """Reference with a full one-hot soft target, float64."""
  logits = np.asarray(logits, np.float64)
  vocab = logits.shape[-1]
  logp = np_log_softmax(logits)
  soft = np.full(logits.shape, label_smoothing / (vocab - 1))
  np.put_along_axis(soft, targets[..., None], 1.0 - label_smoothing, axis=-1)
  ent = np.where(soft > 0, soft * np.log(np.where(soft > 0, soft, 1.0)), 0.0).sum(-1)
  loss = -(soft * logp).sum(-1) + ent
  log_z = np.log(np.exp(logits).sum(-1))
  z = z_loss * log_z ** 2
  return ((loss + z) * weights).sum(), weights.sum(), (z * weights).sum()


@pytest.fixture
def data():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
  targets = rng.integers(0, 11, size=(3, 5)).astype(np.int32)
  weights = (rng.random((3, 5)) > 0.3).astype(np.float32)
  return logits, targets, weights


def test_token_logprobs_and_sequence_logprob(data):
  logits, targets, weights = data
  ref = np.take_along_axis(np_log_softmax(logits), targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(losses.token_logprobs(logits, targets), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(losses.sequence_logprob(logits, targets, weights),
                             (ref * weights).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("label_smoothing,z_loss", [(0.0, 0.0), (0.0, 1e-2), (0.1, 1e-4)])
def test_token_nll_matches_numpy(data, label_smoothing, z_loss):
  logits, targets, weights = data
  got = jax.jit(lambda l, t, w: losses.token_nll(l, t, w, label_smoothing=label_smoothing,
                                                 z_loss=z_loss))(logits, targets, weights)
  ref = np_token_nll(logits, targets, weights, label_smoothing, z_loss)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(float(g), r, rtol=1e-5, atol=1e-5)


def test_token_nll_gradient_matches_numpy(data):
  logits, targets, weights = data
  z = 1e-2
  grad = jax.grad(lambda l: losses.token_nll(l, targets, weights, z_loss=z)[0])(logits)
  probs = np.exp(np_log_softmax(logits))
  onehot = np.eye(logits.shape[-1])[targets]
  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  ref = (probs - onehot + 2 * z * log_z * probs) * weights[..., None]
  np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-6)


def test_label_smoothed_gradient_matches_numpy(data):
  # The target-logit gather has a custom VJP (a fused one-hot); check it with smoothing on,
  # where the gradient is softmax minus the smoothed target distribution.
  logits, targets, weights = data
  s = 0.1
  grad = jax.grad(lambda l: losses.token_nll(l, targets, weights, label_smoothing=s)[0])(logits)
  vocab = logits.shape[-1]
  probs = np.exp(np_log_softmax(logits))
  soft = np.full(logits.shape, s / (vocab - 1))
  np.put_along_axis(soft, targets[..., None], 1.0 - s, axis=-1)
  ref = (probs - soft) * weights[..., None]
  np.testing.assert_allclose(grad, ref, rtol=1e-4, atol=1e-6)


def test_bfloat16_logits_use_float32_math(data):
  logits, targets, weights = data
  bf16 = jnp.asarray(logits * 20, jnp.bfloat16)
  got = losses.token_nll(bf16, targets, weights, z_loss=1e-4)
  assert got[0].dtype == jnp.float32
  ref = np_token_nll(np.asarray(bf16.astype(jnp.float32)), targets, weights, 0.0, 1e-4)
  np.testing.assert_allclose(float(got[0]), ref[0], rtol=1e-5)


def test_token_nll_bad_arguments(data):
  logits, targets, weights = data
  with pytest.raises(ValueError, match="label_smoothing"):
    losses.token_nll(logits, targets, weights, label_smoothing=1.0)
  with pytest.raises(ValueError, match="z_loss"):
    losses.token_nll(logits, targets, weights, z_loss=-1.0)


def _tiny_batch(rng):
  enc = rng.integers(2, 64, size=(2, 7)).astype(np.int32)
  enc[1, 5:] = 0
  tgt = rng.integers(2, 64, size=(2, 6)).astype(np.int32)
  tgt[0, 4:] = 0
  tgt[0, 3] = 1
  dec_in = np.asarray(t5_lib.shift_right(jnp.asarray(tgt)))
  return {"encoder_input_tokens": enc, "decoder_input_tokens": dec_in,
          "decoder_target_tokens": tgt, "decoder_loss_weights": (tgt > 0).astype(np.int32)}


def test_seq2seq_loss_fn_matches_manual_numpy():
  cfg = config_lib.t5_config(size="tiny", dropout_rate=0.1, num_encoder_layers=1,
                            num_decoder_layers=1)
  model = t5_lib.T5(cfg)
  params = nn.meta.unbox(t5_lib.init_params(model, jax.random.PRNGKey(0)))
  batch = _tiny_batch(np.random.default_rng(1))
  loss_fn = jax.jit(losses.seq2seq_loss_fn(model, label_smoothing=0.1, z_loss=1e-3))
  loss, metrics = loss_fn(params, batch, None)

  logits = np.asarray(jax.jit(model.apply)({"params": params}, batch["encoder_input_tokens"],
                                           batch["decoder_input_tokens"]), np.float64)
  tgt = batch["decoder_target_tokens"]
  w = batch["decoder_loss_weights"].astype(np.float64)
  loss_sum, weight_sum, z_sum = np_token_nll(logits, tgt, w, 0.1, 1e-3)
  logp = np.take_along_axis(np_log_softmax(logits), tgt[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), loss_sum / weight_sum, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["nll"]), -(logp * w).sum() / weight_sum, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["z_loss"]), z_sum / weight_sum, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["accuracy"]),
                             ((logits.argmax(-1) == tgt) * w).sum() / weight_sum, rtol=1e-6)
  assert float(metrics["num_tokens"]) == w.sum() == 10
  assert set(metrics) == {"loss", "nll", "z_loss", "accuracy", "num_tokens"}

  # Fixed normaliser: summed loss / constant.
  fixed = jax.jit(losses.seq2seq_loss_fn(model, label_smoothing=0.1, z_loss=1e-3,
                                         loss_normalizing_factor=4.0))
  np.testing.assert_allclose(float(fixed(params, batch, None)[0]), loss_sum / 4.0, rtol=1e-5)

  # Default weights (targets != 0) equal the explicit ones here.
  no_w = {k: v for k, v in batch.items() if k != "decoder_loss_weights"}
  np.testing.assert_allclose(float(loss_fn(params, no_w, None)[0]), float(loss), rtol=1e-6)

  # Segment ids are passed to the model: one segment per row (0 on padding) changes nothing.
  packed = dict(batch, encoder_segment_ids=(batch["encoder_input_tokens"] > 0).astype(np.int32),
                decoder_segment_ids=(batch["decoder_target_tokens"] > 0).astype(np.int32))
  np.testing.assert_allclose(float(loss_fn(params, packed, None)[0]), float(loss), rtol=1e-5)
  shuffled = dict(packed, encoder_segment_ids=packed["encoder_segment_ids"] * 2)
  assert abs(float(loss_fn(params, shuffled, None)[0]) - float(loss)) > 1e-4

  # Dropout: on with an rng (differs from deterministic), reproducible for the same rng.
  key = jax.random.PRNGKey(3)
  d1, d2 = loss_fn(params, batch, key)[0], loss_fn(params, batch, key)[0]
  assert float(d1) == float(d2)
  assert abs(float(d1) - float(loss)) > 1e-4

  grads = jax.grad(lambda p: loss_fn(p, batch, None)[0])(params)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))

  with pytest.raises(KeyError, match="decoder_target_tokens"):
    loss_fn(params, {"encoder_input_tokens": batch["encoder_input_tokens"],
                     "decoder_input_tokens": batch["decoder_input_tokens"]}, None)
  with pytest.raises(ValueError, match="loss_normalizing_factor"):
    losses.seq2seq_loss_fn(model, loss_normalizing_factor=0.0)


def test_pairwise_logistic_matches_numpy_and_is_stable():
  rng = np.random.default_rng(2)
  better, worse = rng.normal(size=20) * 5, rng.normal(size=20) * 5
  ref = -np.log(1.0 / (1.0 + np.exp(-(better - worse))))
  np.testing.assert_allclose(losses.pairwise_logistic(better, worse), ref, rtol=1e-5, atol=1e-6)
  extreme = losses.pairwise_logistic(jnp.array([1000.0, -1000.0]), jnp.array([0.0, 0.0]))
  np.testing.assert_allclose(extreme, [0.0, 1000.0], rtol=1e-6)


def test_entropy_and_kl(data):
  logits, _, _ = data
  logp = np_log_softmax(logits)
  ref = -(np.exp(logp) * logp).sum(-1)
  np.testing.assert_allclose(losses.entropy_from_logits(logits), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(losses.kl_from_logprobs(jnp.array([-1.0, -2.0]),
                                                     jnp.array([-1.5, -2.0])), [0.5, 0.0])


def test_masked_mean_and_whiten():
  rng = np.random.default_rng(4)
  values = rng.normal(size=(3, 6)).astype(np.float32) * 4 + 2
  mask = (rng.random((3, 6)) > 0.4).astype(np.float32)
  sel = values[mask > 0].astype(np.float64)
  np.testing.assert_allclose(float(losses.masked_mean(values, mask)), sel.mean(), rtol=1e-5)
  np.testing.assert_allclose(losses.masked_mean(values, mask, axis=1),
                             [(values[i] * mask[i]).sum() / max(mask[i].sum(), 1) if mask[i].any()
                              else 0.0 for i in range(3)], rtol=1e-5)
  assert float(losses.masked_mean(values, np.zeros_like(mask))) == 0.0
  white = np.asarray(losses.masked_whiten(values, mask))
  np.testing.assert_allclose(white[mask > 0], (sel - sel.mean()) / sel.std(), rtol=1e-4)
  assert (white[mask == 0] == 0).all()
  scaled = np.asarray(losses.masked_whiten(values, mask, shift_mean=False))
  np.testing.assert_allclose(scaled[mask > 0], (sel - sel.mean()) / sel.std() + sel.mean(),
                             rtol=1e-4)
