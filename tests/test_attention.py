"""jaxmoral.backends.attention, what both flash-attention kernel sets share: the mesh wrapper
(sharded against unsharded, gradients included), the shape check and the platform check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral.backends import attention

from attention_reference import reference_attention


def _inputs(seed, *, batch=4, q_len=12, k_len=10, heads=2, d_kv=8, bias_rows=1):
  rng = np.random.default_rng(seed)

  def normal(*shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)

  ids = np.ones((batch, q_len), np.int32)
  ids[1, 7:] = 0  # padding
  ids[2, 5:] = 2  # a second packed segment
  k_ids = np.ones((batch, k_len), np.int32)
  k_ids[1, 6:] = 0
  k_ids[2, 4:] = 2
  return (normal(batch, q_len, heads, d_kv), normal(batch, k_len, heads, d_kv),
          normal(batch, k_len, heads, d_kv), normal(bias_rows, heads, q_len, k_len),
          jnp.asarray(ids), jnp.asarray(k_ids))


def _output_and_grads(attend, args):
  def run(query, key, value, bias):
    out, vjp = jax.vjp(lambda *a: attend(*a), query, key, value, bias)
    return out, vjp(jnp.cos(out))
  return jax.jit(run)(*args)


@pytest.mark.parametrize("bias_rows", [1, 4])
def test_sharded_equals_unsharded_and_sums_a_shared_bias_gradient(bias_rows):
  """Under a (data 2, model 2) mesh the attention runs per shard (here the reference itself,
  so only the wrapper differs); a one-row bias's gradient is summed over the batch shards, a
  per-row bias keeps one gradient per row."""
  query, key, value, bias, q_ids, k_ids = _inputs(0, bias_rows=bias_rows)
  seen = []

  def attend(q, k, v, b, qi, ki):
    seen.append((q.shape, None if b is None else b.shape, qi.shape))
    return reference_attention(q, k, v, b, qi, ki)

  mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def sharded(q, k, v, b):
    return attention.sharded(attend, q, k, v, [b, q_ids, k_ids], batch_axes="data",
                             head_axes="model")

  with jax.sharding.set_mesh(mesh):
    got = _output_and_grads(sharded, (query, key, value, bias))
  want = _output_and_grads(lambda q, k, v, b: attend(q, k, v, b, q_ids, k_ids),
                           (query, key, value, bias))
  # Each device saw half the batch and half the heads; a one-row bias is not split by batch.
  assert seen[0] == ((2, 12, 1, 8), (min(bias_rows, 2), 1, 12, 10), (2, 12))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_sharded_replicates_an_axis_that_does_not_divide_and_passes_absent_inputs_as_none():
  query, key, value, _, _, _ = _inputs(1, batch=3)
  seen = []

  def attend(q, k, v, b, qi, ki):
    seen.append((q.shape, b, qi, ki))
    return reference_attention(q, k, v, b, qi, ki)

  mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.sharding.set_mesh(mesh):
    got = jax.jit(lambda q, k, v: attention.sharded(
        attend, q, k, v, [None, None, None], batch_axes="data", head_axes="model"))(
            query, key, value)
  assert seen == [((3, 12, 1, 8), None, None, None)]  # batch 3: replicated; heads split
  np.testing.assert_allclose(np.asarray(got),
                             np.asarray(jax.jit(reference_attention)(query, key, value)),
                             rtol=1e-5, atol=1e-6)


def test_reference_gives_zero_rows_to_queries_that_see_no_key():
  query, key, value, bias, q_ids, k_ids = _inputs(2)
  q_ids = q_ids.at[3, :].set(5)  # a segment no key has
  out = np.asarray(jax.jit(reference_attention)(query, key, value, bias, q_ids, k_ids))
  assert not out[3].any() and not out[1, 7:].any() and out[0].all()
  # Row 0, one segment, no padding: softmax(q k^T + bias) v recomputed in NumPy.
  q, k, v, b = (np.asarray(x, np.float64) for x in (query[0], key[0], value[0], bias[0]))
  scores = np.einsum("qhd,khd->hqk", q, k) + b
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  np.testing.assert_allclose(out[0], np.einsum("hqk,khd->qhd", weights, v), rtol=1e-4,
                             atol=1e-5)


def test_shape_check_names_the_entry_point_and_the_expected_shape():
  query, key, value, bias, q_ids, _ = _inputs(3)
  per_row = jnp.concatenate([bias] * 4)
  attention.check_shapes("k", query, key, value, per_row, q_ids, None)  # accepted
  with pytest.raises(ValueError, match=r"^k: bias \(4, 2, 12, 10\) must be \(1, 2, 12, 10\): "
                                       r"one bias shared by the batch$"):
    attention.check_shapes("k", query, key, value, per_row, q_ids, None, per_row_bias=False)
  with pytest.raises(ValueError, match=r"^k: bias \(1, 2, 10, 12\) must be \(1 or 4, 2, 12, "
                                       r"10\)$"):
    attention.check_shapes("k", query, key, value, jnp.swapaxes(bias, 2, 3), None, None)
  with pytest.raises(ValueError, match=r"^k: key_segment_ids \(4, 12\) must be \(4, 10\)$"):
    attention.check_shapes("k", query, key, value, None, None, q_ids)
  with pytest.raises(ValueError, match=r"bias_diagonals \(1, 2, 22\) must be \(1, 2, 21\)"):
    attention.check_shapes("k", query, key, value, None, None, None,
                           bias_diagonals=jnp.zeros((1, 2, 22)))


def test_platform_check_refuses_kernels_off_their_platform_unless_interpreted():
  assert attention.check_platform("pallas", "Mosaic", ("tpu",), interpret=True) == "cpu"
  with pytest.raises(ValueError, match=r"attention_impl='pallas' runs Mosaic kernels on TPUs "
                                       r"only \(this computation is for 'cpu'\).*INTERPRET"):
    attention.check_platform("pallas", "Mosaic", ("tpu",), interpret=False)
