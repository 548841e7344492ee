"""The Pallas Triton flash-attention kernels (interpret mode on CPU) against the einsum
reference: forward and gradients of query, key, value and the batch-shared position bias (whole,
or as the diagonals of a Toeplitz bias), with padding segment ids, lengths off the tile sizes,
a causal mask, and attention_impl="pallas_gpu" wiring in T5Config and models/ops.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral.backends import attention
from jaxmoral.backends import gpu_attention as fg
from jaxmoral.models import ops
from jaxmoral.models.config import T5Config, t5_config

from attention_reference import reference_attention

# 16-row tiles and a 32-wide dk/dv column, so the lengths below span several tiles and a
# padded one; dkv_programs=1 puts the whole batch in one group, so the dk/dv kernel adds later
# batch rows (one at a time, or summed in pairs) into the bias-gradient column the first wrote.
BLOCKS = fg.BlockSizes(block_q=16, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=16,
                       block_k_dkv=32, dkv_programs=1, dkv_rows=1)
# Unoptimised XLA:CPU code: the interpreted kernels compile in half the time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _case(seed, *, batch, q_len, k_len, heads, d_kv, causal):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q_ids = np.ones((batch, q_len), np.int32)
  k_ids = np.ones((batch, k_len), np.int32)
  q_ids[1, q_len - 9:] = 0  # Right padding.
  k_ids[1, k_len - 13:] = 0
  q_ids[0, :7] = k_ids[0, :7] = 2  # A packed second segment.
  if causal:
    k_ids = q_ids
  args = (normal(batch, q_len, heads, d_kv), normal(batch, k_len, heads, d_kv),
          normal(batch, k_len, heads, d_kv), normal(1, heads, q_len, k_len))
  cotangent = normal(batch, q_len, heads, d_kv)
  return args, jnp.asarray(q_ids), jnp.asarray(k_ids), cotangent


def _output_and_grads(attend, args, cotangent):
  out, vjp = jax.vjp(attend, *args)
  return out, vjp(cotangent)


def _toeplitz(diagonals, q_len, k_len):
  """bias[..., q, k] = diagonals[..., k - q + q_len - 1]."""
  return diagonals[..., jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None] + q_len - 1]


def test_kernels_match_reference_forward_and_gradients():
  """Encoder-like (Toeplitz bias as diagonals, padding, k_len != q_len, dk/dv rows in pairs)
  and decoder-like (causal, whole bias, head width 24 padded to 32) cases, in one compilation.
  """
  cases = [dict(batch=4, q_len=40, k_len=72, heads=2, d_kv=16, causal=False),
           dict(batch=2, q_len=40, k_len=40, heads=1, d_kv=24, causal=True)]
  inputs = [_case(i, **c) for i, c in enumerate(cases)]
  # The first case's last argument is the bias's diagonals.
  diagonals = jnp.asarray(np.random.default_rng(9).normal(size=(1, 2, 40 + 72 - 1)),
                          jnp.float32)
  inputs[0] = (inputs[0][0][:3] + (diagonals,),) + inputs[0][1:]
  assert np.array_equal(fg.bias_diagonals(_toeplitz(diagonals, 40, 72)), diagonals)

  def run(kernel):
    results = []
    for case, (args, q_ids, k_ids, cotangent) in zip(cases, inputs):
      causal = case["causal"]
      if kernel and not causal:
        blocks = dataclasses.replace(BLOCKS, dkv_rows=2)
        attend = lambda q, k, v, d, qi=q_ids, ki=k_ids: fg.flash_attention(
            q, k, v, None, qi, ki, bias_diagonals=d, block_sizes=blocks, interpret=True)
      elif kernel:
        attend = lambda q, k, v, b, qi=q_ids, ki=k_ids: fg.flash_attention(
            q, k, v, b, qi, ki, causal=True, block_sizes=BLOCKS, interpret=True)
      elif not causal:
        attend = lambda q, k, v, d, qi=q_ids, ki=k_ids: reference_attention(
            q, k, v, _toeplitz(d, 40, 72), qi, ki)
      else:
        attend = lambda q, k, v, b, qi=q_ids, ki=k_ids: reference_attention(
            q, k, v, b, qi, ki, causal=True)
      results.append(_output_and_grads(attend, args, cotangent))
    return results

  got = jax.jit(lambda: run(True), compiler_options=FAST_COMPILE)()
  want = jax.jit(lambda: run(False), compiler_options=FAST_COMPILE)()
  for case, g, w in zip(cases, got, want):
    names = ("out", "dq", "dk", "dv", "dbias")  # dbias: of the diagonals in case 0.
    for name, a, b in zip(names, jax.tree.leaves(g), jax.tree.leaves(w)):
      assert a.shape == b.shape, (case, name)
      scale = float(jnp.max(jnp.abs(b)))
      assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale, (case, name)
    # Fully padded query rows output zeros, and the bias gradient is not all zero.
    assert float(jnp.max(jnp.abs(g[0][1, -9:]))) == 0.0
    assert float(jnp.max(jnp.abs(g[1][3]))) > 0.0


def test_batch_groups_and_block_fitting():
  assert fg._batch_groups(64, 128, 512) == 4  # 16 rows per group, 512 programs.
  assert fg._batch_groups(6, 10, 1000) == 6  # Never more groups than rows.
  assert fg._fit(128, 40) == 64 and fg._fit(64, 3) == fg.MIN_BLOCK and fg._fit(64, 512) == 64
  with pytest.raises(ValueError, match="power of two"):
    fg.BlockSizes(block_q=48)


def test_pallas_gpu_selection_and_validation(monkeypatch):
  cfg = t5_config(size="tiny", attention_impl="pallas_gpu", dtype="bfloat16")
  model_ops = ops.ModelOps.for_config(cfg)
  assert model_ops.use_fused_attention(deterministic=False, query_length=7, key_length=9)
  mask = model_ops.attention_masking(jnp.ones((1, 4), bool), jnp.ones((1, 4), bool), None, None)
  assert mask.gpu_kernel and mask.query_ids is not None
  assert not ops.ModelOps.for_config(cfg.replace(attention_impl="pallas")).attention_masking(
      jnp.ones((1, 4), bool), jnp.ones((1, 4), bool), None, None).gpu_kernel
  with pytest.raises(ValueError, match="dropout"):
    T5Config(attention_impl="pallas_gpu", dropout_rate=0.1)
  # Off a GPU the Triton kernels need interpret mode; the error says how to get it.
  monkeypatch.setattr(attention, "INTERPRET", False)
  (query, key, value, bias), _, _, _ = _case(0, batch=2, q_len=8, k_len=8, heads=2, d_kv=16,
                                             causal=False)
  with pytest.raises(ValueError, match="INTERPRET"):
    fg.sharded_flash_attention(query, key, value, bias)
  with pytest.raises(ValueError, match="shared by the batch"):
    fg.flash_attention(query, key, value, jnp.concatenate([bias, bias]), interpret=True)
