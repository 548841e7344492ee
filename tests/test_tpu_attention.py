"""The Pallas flash-attention kernels (interpret mode on CPU) against XLA's einsum attention:
forward and gradients of query, key, value and the position bias, with padding, packing,
causal masks, lengths off the block size, a device mesh, and a whole tiny T5."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import losses
from jaxmoral.backends import attention
from jaxmoral.backends import tpu_attention as fa
from jaxmoral.models import ops
from jaxmoral.models import t5
from jaxmoral.models.config import T5Config, t5_config

from attention_reference import reference_attention

# 128-wide tiles, so the lengths below (100 to 300) span several tiles and a padded one.
BLOCKS = fa.BlockSizes(block_q=128, block_k=128, block_q_dkv=128, block_k_dkv=128)


def _einsum_attention(query, key, value, bias, query_ids, key_ids, causal):
  """t5.MultiHeadAttention's einsum path: the mask folded into the bias as T5's -1e10."""
  q_len, k_len = query.shape[1], key.shape[1]
  mask = (query_ids[:, None, :, None] > 0) & (query_ids[:, None, :, None]
                                              == key_ids[:, None, None, :])
  if causal:
    mask = mask & (jnp.arange(k_len)[None, :] <= jnp.arange(q_len)[:, None])
  scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
  weights = jax.nn.softmax(scores + bias + ops.mask_to_bias(mask), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


def _inputs(seed, *, batch, q_len, k_len, heads=2, d_kv=16, bias_rows=1):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return (normal(batch, q_len, heads, d_kv), normal(batch, k_len, heads, d_kv),
          normal(batch, k_len, heads, d_kv), normal(bias_rows, heads, q_len, k_len))


def _packed_ids(length):
  """Row 0: two packed segments then padding; row 1: one segment then padding."""
  ids = np.zeros((2, length), np.int32)
  ids[0, :length // 3] = 1
  ids[0, length // 3:length - 17] = 2
  ids[1, :length - 40] = 1
  return jnp.asarray(ids)


def _output_and_grads(attend):
  """jit of (args, cotangent) -> (output, gradients of sum(output * cotangent) w.r.t. args):
  one compilation serves every cotangent."""
  def run(args, cotangent):
    out, vjp = jax.vjp(attend, *args)
    return out, vjp(cotangent)
  return jax.jit(run)


def _assert_close(got, want, tol):
  scale = float(jnp.max(jnp.abs(want))) + 1e-12
  assert float(jnp.max(jnp.abs(got - want))) <= tol * scale


CASES = {
    # Encoder self-attention: packed and padded rows, 200 = one full and one padded tile.
    "packed": dict(q_len=200, k_len=200, causal=False, bias_rows=1, query_ids=True),
    # Decoder self-attention: causal, packed and padded.
    "causal_packed": dict(q_len=200, k_len=200, causal=True, bias_rows=1, query_ids=True),
    # Cross-attention shape (q != k), key padding only, one bias per batch row.
    "cross_per_row_bias": dict(q_len=100, k_len=300, causal=False, bias_rows=2,
                               query_ids=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_einsum_forward_and_backward(case):
  spec = CASES[case]
  query, key, value, bias = _inputs(0, batch=2, q_len=spec["q_len"], k_len=spec["k_len"],
                                    bias_rows=spec["bias_rows"])
  key_ids = _packed_ids(spec["k_len"])
  query_ids = (_packed_ids(spec["q_len"]) if spec["query_ids"]
               else jnp.ones((2, spec["q_len"]), jnp.int32))
  causal = spec["causal"]
  flash = lambda q, k, v, b: fa.flash_attention(
      q, k, v, b, query_ids if spec["query_ids"] else None, key_ids, causal=causal,
      block_sizes=BLOCKS, interpret=True)
  einsum = lambda q, k, v, b: _einsum_attention(q, k, v, b, query_ids, key_ids, causal)
  reference = lambda q, k, v, b: reference_attention(
      q, k, v, b, query_ids, key_ids, causal=causal)
  args = (query, key, value, bias)

  flash, einsum, reference = map(_output_and_grads, (flash, einsum, reference))
  valid = np.asarray(query_ids > 0)
  # Gradients through valid outputs only (padded rows differ by definition and reach nothing
  # in T5): equal to einsum's for q, k, v and the bias, summed over the batch when shared.
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=query.shape), jnp.float32)
  cotangent = cotangent * valid[:, :, None, None]
  out, grads = flash(args, cotangent)
  want_out, want_grads = einsum(args, cotangent)
  np.testing.assert_allclose(out[valid], want_out[valid], atol=2e-6, rtol=1e-5)
  np.testing.assert_array_equal(out[~valid], 0.0)  # Padded queries see no key.
  for got, want in zip(grads, want_grads):
    assert got.shape == want.shape
    _assert_close(got, want, 1e-5)
  assert float(jnp.max(jnp.abs(grads[3]))) > 0
  # Any cotangent: equal to the jnp reference of the kernel's semantics, padded rows included.
  cotangent = jnp.asarray(np.random.default_rng(2).normal(size=query.shape), jnp.float32)
  for got, want in zip(jax.tree.leaves(flash(args, cotangent)),
                       jax.tree.leaves(reference(args, cotangent))):
    _assert_close(got, want, 1e-5)


def test_sharded_kernel_sums_bias_gradient_over_batch_shards():
  """On a (data 2, model 2) mesh each device runs its shard; the shared bias's gradient is the
  sum over both batch shards. Causal with unequal q and k tiles (skipped tiles differ)."""
  query, key, value, bias = _inputs(3, batch=2, q_len=500, k_len=500)
  ids = _packed_ids(500)
  blocks = fa.BlockSizes(block_q=128, block_k=256, block_q_dkv=256, block_k_dkv=128)
  mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  flash = lambda q, k, v, b: fa.sharded_flash_attention(
      q, k, v, b, ids, ids, causal=True, batch_axes="data", head_axes="model",
      block_sizes=blocks, interpret=True)
  reference = lambda q, k, v, b: reference_attention(q, k, v, b, ids, ids, causal=True)
  args = (query, key, value, bias)
  cotangent = jnp.asarray(np.random.default_rng(4).normal(size=query.shape), jnp.float32)
  with jax.sharding.set_mesh(mesh):
    got = _output_and_grads(flash)(args, cotangent)
  for g, w in zip(jax.tree.leaves(got),
                  jax.tree.leaves(_output_and_grads(reference)(args, cotangent))):
    _assert_close(g, w, 1e-5)


def test_tiny_t5_with_pallas_attention_matches_einsum(monkeypatch):
  """Loss and every parameter gradient (the relative-position embeddings' included) of a tiny
  T5 on a packed, padded batch: encoder and decoder self-attention and cross-attention."""
  monkeypatch.setattr(attention, "INTERPRET", True)
  # One layer each side has all three attentions.
  einsum_cfg = t5_config(size="tiny", attention_impl="einsum", num_encoder_layers=1,
                         num_decoder_layers=1)
  pallas_cfg = einsum_cfg.replace(attention_impl="pallas")
  params = flax.core.meta.unbox(t5.init_params(t5.T5(einsum_cfg), jax.random.PRNGKey(0)))
  rng = np.random.default_rng(5)
  enc_seg, dec_seg = np.asarray(_packed_ids(140)), np.asarray(_packed_ids(60))
  targets = np.where(dec_seg > 0, rng.integers(2, 512, dec_seg.shape), 0).astype(np.int32)
  starts = np.concatenate([np.ones((2, 1), bool), dec_seg[:, 1:] != dec_seg[:, :-1]], axis=1)
  decoder_inputs = np.where(starts, 0, np.roll(targets, 1, axis=1)).astype(np.int32)
  batch = {"encoder_input_tokens": np.where(enc_seg > 0, rng.integers(2, 512, enc_seg.shape),
                                            0).astype(np.int32),
           "decoder_input_tokens": decoder_inputs, "decoder_target_tokens": targets,
           "decoder_loss_weights": (dec_seg > 0).astype(np.float32),
           "encoder_segment_ids": enc_seg, "decoder_segment_ids": dec_seg}
  results = {}
  for name, cfg in (("einsum", einsum_cfg), ("pallas", pallas_cfg)):
    loss_fn = losses.seq2seq_loss_fn(t5.T5(cfg))
    results[name] = jax.jit(jax.grad(lambda p: loss_fn(p, batch, None), has_aux=True))(params)
  (grads_e, metrics_e), (grads_p, metrics_p) = results["einsum"], results["pallas"]
  np.testing.assert_allclose(float(metrics_p["loss"]), float(metrics_e["loss"]), rtol=1e-6)
  flat_e = flax.traverse_util.flatten_dict(grads_e, sep="/")
  flat_p = flax.traverse_util.flatten_dict(grads_p, sep="/")
  assert flat_p.keys() == flat_e.keys()
  for path, want in flat_e.items():
    scale = float(np.abs(want).max()) + 1e-12
    assert float(np.abs(flat_p[path] - want).max()) <= 1e-5 * scale, path
  for side in ("encoder", "decoder"):
    assert float(np.abs(flat_p[f"{side}/relpos_bias/rel_embedding"]).max()) > 0


def test_pallas_selection_and_validation(monkeypatch):
  cfg = t5_config(size="tiny", attention_impl="pallas", dtype="bfloat16")
  assert ops.ModelOps.for_config(cfg).use_fused_attention(deterministic=False, query_length=7,
                                                          key_length=9)
  with pytest.raises(ValueError, match="dropout"):
    T5Config(attention_impl="pallas", dropout_rate=0.1)
  # Off a TPU the Mosaic kernels need interpret mode; the error says how to get it.
  monkeypatch.setattr(attention, "INTERPRET", False)
  query, key, value, bias = _inputs(6, batch=1, q_len=8, k_len=8)
  with pytest.raises(ValueError, match="INTERPRET"):
    fa.sharded_flash_attention(query, key, value, bias)
  with pytest.raises(ValueError, match="bias"):
    fa.flash_attention(query, key, value, bias[:, :1], interpret=True)
  with pytest.raises(ValueError, match="block_k"):
    fa.BlockSizes(block_k=100)
