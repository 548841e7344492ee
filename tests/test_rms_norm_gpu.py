"""The Pallas Triton RMS norm (interpret mode on CPU) against the XLA form: output and the
autodiff gradients of input and scale, over several programs and steps, in float32 and
bfloat16, on a device mesh, and wired into a tiny T5 by T5Config.norm_impl."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import losses
from jaxmoral.models import flash_attention_gpu as fg
from jaxmoral.models import rms_norm_gpu as rn
from jaxmoral.models import t5
from jaxmoral.models.config import T5Config, t5_config

# 8 rows per forward program, 2 rows per backward step, at most 5 backward programs: 48 rows
# run as 6 forward programs and 4 backward programs of 3 steps (each sums a partial row).
BLOCKS = rn.NormBlockSizes(block_rows=8, block_rows_bwd=2, programs_bwd=5)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _inputs(seed, shape, dtype):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=shape) * 3.0, dtype)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, size=shape[-1]), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=shape), dtype)
  return x, scale, cotangent


def _output_and_grads(norm, x, scale, cotangent):
  out, vjp = jax.vjp(norm, x, scale)
  return (out,) + vjp(cotangent)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_kernels_match_xla_form_and_its_gradients(dtype, tolerance):
  """(2, 24, 64): several forward programs and backward programs of several steps each; and
  12 rows, which take 4-row blocks (the largest power of two dividing them)."""
  cases = [_inputs(0, (2, 24, 64), dtype), _inputs(1, (12, 32), dtype)]

  def run(kernel):
    if kernel:
      norm = lambda x, s: rn.rms_norm(x, s, epsilon=1e-6, out_dtype=dtype, block_sizes=BLOCKS,
                                      interpret=True)
    else:
      norm = lambda x, s: rn.reference_rms_norm(x, s, epsilon=1e-6, out_dtype=dtype)
    return [_output_and_grads(norm, *case) for case in cases]

  got = jax.jit(lambda: run(True), compiler_options=FAST_COMPILE)()
  want = jax.jit(lambda: run(False), compiler_options=FAST_COMPILE)()
  for g_case, w_case in zip(got, want):
    for name, g, w in zip(("y", "dx", "dscale"), g_case, w_case):
      assert g.shape == w.shape and g.dtype == w.dtype, name
      g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
      assert np.max(np.abs(g32 - w32)) <= tolerance * np.max(np.abs(w32)), name


def test_forward_matches_numpy():
  x, scale, _ = _inputs(2, (16, 64), jnp.float32)
  got = rn.rms_norm(x, scale, epsilon=1e-6, out_dtype=jnp.float32, block_sizes=BLOCKS,
                    interpret=True)
  x64 = np.asarray(x, np.float64)
  want = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-6) * np.asarray(scale)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_other_widths_take_the_xla_form():
  x, scale, _ = _inputs(3, (4, 48), jnp.float32)
  assert not rn.kernels_apply(4, 48) and rn.kernels_apply(4, 64)
  got = rn.rms_norm(x, scale, epsilon=1e-6, out_dtype=jnp.float32, interpret=True)
  want = rn.reference_rms_norm(x, scale, epsilon=1e-6, out_dtype=jnp.float32)
  assert np.array_equal(np.asarray(got), np.asarray(want))


def test_sharded_norm_sums_scale_gradient_over_batch_shards():
  x, scale, cotangent = _inputs(4, (4, 8, 32), jnp.float32)
  mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharded = lambda x, s: rn.sharded_rms_norm(x, s, epsilon=1e-6, out_dtype=jnp.float32,
                                             batch_axes="data", block_sizes=BLOCKS,
                                             interpret=True)
  with jax.sharding.set_mesh(mesh):
    got = _output_and_grads(sharded, x, scale, cotangent)
  want = _output_and_grads(lambda x, s: rn.reference_rms_norm(
      x, s, epsilon=1e-6, out_dtype=jnp.float32), x, scale, cotangent)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_tiny_t5_with_pallas_norm_matches_xla(monkeypatch):
  """Loss and every parameter gradient of a tiny T5: all 13 norms through the kernels."""
  monkeypatch.setattr(fg, "INTERPRET", True)
  xla_cfg = t5_config(size="tiny", attention_impl="einsum")
  pallas_cfg = xla_cfg.replace(norm_impl="pallas_gpu")
  params = flax.core.meta.unbox(t5.init_params(t5.T5(xla_cfg), jax.random.PRNGKey(0)))
  rng = np.random.default_rng(5)
  targets = rng.integers(2, 512, (2, 8)).astype(np.int32)
  batch = {"encoder_input_tokens": rng.integers(2, 512, (2, 16)).astype(np.int32),
           "decoder_input_tokens": np.asarray(t5.shift_right(targets)),
           "decoder_target_tokens": targets,
           "decoder_loss_weights": np.ones(targets.shape, np.float32)}
  results = []
  for cfg in (pallas_cfg, xla_cfg):
    loss_fn = losses.seq2seq_loss_fn(t5.T5(cfg))
    results.append(jax.jit(jax.grad(lambda p: loss_fn(p, batch, None), has_aux=True),
                           compiler_options=FAST_COMPILE)(params))
  (grads_got, metrics_got), (grads_want, metrics_want) = results
  got = (metrics_got["loss"], grads_got)
  want = (metrics_want["loss"], grads_want)
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
  flat_got = flax.traverse_util.flatten_dict(got[1])
  flat_want = flax.traverse_util.flatten_dict(want[1])
  assert flat_got.keys() == flat_want.keys()
  for path, w in flat_want.items():
    g = np.asarray(flat_got[path])
    w = np.asarray(w)
    assert np.max(np.abs(g - w)) <= 1e-5 * max(np.max(np.abs(w)), 1e-6), path


def test_norm_impl_validation(monkeypatch):
  with pytest.raises(ValueError, match="T5Config.norm_impl"):
    T5Config(norm_impl="fused")
  assert "norm_impl" in t5_config(size="tiny", norm_impl="pallas_gpu").__dataclass_fields__
  monkeypatch.setattr(fg, "INTERPRET", False)
  x, scale, _ = _inputs(6, (2, 4, 32), jnp.float32)
  with pytest.raises(ValueError, match="norm_impl='pallas_gpu' runs Triton kernels on GPUs"):
    rn.sharded_rms_norm(x, scale, epsilon=1e-6, out_dtype=jnp.float32)
