"""Tests for jaxmoral.cpu_kernels: the packed-panel CPU product against NumPy, and its build."""

import os
import shutil
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoral import cpu_kernels

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.fixture(scope="module")
def kernel():
  if not HAS_COMPILER:
    pytest.skip("no C++ compiler on this machine")
  # Where a compiler exists the kernel must build: a failure here is a real failure.
  assert cpu_kernels.available(), "packed matmul failed to build with a compiler present"
  return cpu_kernels.packed_matmul


@pytest.mark.parametrize("rows,k,n", [
    (1, 64, 64), (5, 96, 100), (6, 128, 192), (7, 512, 1152), (13, 33, 64), (32, 256, 320)])
def test_packed_matmul_matches_numpy(kernel, rows, k, n):
  """Every register-block size (1-6 rows and remainders), padded and unpadded columns."""
  rng = np.random.default_rng(rows * 1000 + n)
  x = rng.standard_normal((rows, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  packed = cpu_kernels.pack_columns(jnp.asarray(w))
  assert packed.shape == (-(-n // cpu_kernels.PANEL), k, cpu_kernels.PANEL)
  got = np.asarray(jax.jit(kernel, static_argnums=2)(x, packed, n))
  want = x.astype(np.float64) @ w.astype(np.float64)
  assert got.shape == (rows, n) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_packed_matmul_keeps_leading_axes_and_feature_shape(kernel):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 3, 48)).astype(np.float32)
  w = rng.standard_normal((48, 3, 40)).astype(np.float32)  # Stacked kernels, flattened.
  got = np.asarray(kernel(x, cpu_kernels.pack_columns(jnp.asarray(w)), 120))
  want = np.tensordot(x.astype(np.float64), w.reshape(48, 120).astype(np.float64), axes=1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_packed_matmul_under_vmap(kernel):
  rng = np.random.default_rng(2)
  x = rng.standard_normal((4, 2, 64)).astype(np.float32)
  w = rng.standard_normal((64, 70)).astype(np.float32)
  packed = cpu_kernels.pack_columns(jnp.asarray(w))
  got = np.asarray(jax.vmap(lambda r: kernel(r, packed, 70))(x))
  np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_packed_matmul_rejects_mismatched_shapes(kernel):
  packed = cpu_kernels.pack_columns(jnp.ones((32, 64)))
  with pytest.raises(ValueError, match=r"does not fit packed kernel \(1, 32, 64\)"):
    kernel(jnp.ones((2, 16)), packed, 64)


def test_build_is_cached_and_reports_a_failing_compiler(tmp_path, monkeypatch):
  if not HAS_COMPILER:
    pytest.skip("no C++ compiler on this machine")
  monkeypatch.setenv("JAXMORAL_KERNEL_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("CXX", raising=False)
  first = cpu_kernels.build()
  mtime = os.stat(first).st_mtime_ns
  assert cpu_kernels.build() == first and os.stat(first).st_mtime_ns == mtime  # Not rebuilt.

  monkeypatch.setenv("CXX", str(tmp_path / "missing-c++"))
  with pytest.raises(cpu_kernels.BuildError, match="missing-c\\+\\+.*is not a program"):
    cpu_kernels.build()
  broken = tmp_path / "broken-c++"
  broken.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
  broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("CXX", str(broken))
  with pytest.raises(cpu_kernels.BuildError, match="this compiler is broken"):
    cpu_kernels.build()
  assert not [p for p in os.listdir(tmp_path / "cache") if p.endswith(".tmp")]


def test_switch_turns_the_kernel_off(monkeypatch):
  for off in ("0", "false", "OFF"):
    monkeypatch.setenv("JAXMORAL_CPU_KERNELS", off)
    assert not cpu_kernels.enabled() and not cpu_kernels.available()
  monkeypatch.setenv("JAXMORAL_CPU_KERNELS", "1")
  assert cpu_kernels.enabled()


def _np_attention(q, k, v, bias):
  scores = np.einsum("rhd,rhld->rhl", q.astype(np.float64), k) + bias
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("rhl,rhld->rhd", weights, v)


@pytest.mark.parametrize("rows,heads,keys,depth,bias_shape", [
    (8, 6, 64, 64, (8, 1, 64)),   # Cross-attention: a padding mask per row.
    (3, 4, 32, 64, (1, 4, 32)),   # Self-attention: relative-position bias per head.
    (2, 3, 7, 24, (2, 3, 7)),     # Depth not a multiple of 16, few keys.
    (1, 1, 1, 16, (1, 1, 1))])
def test_decode_attention_matches_numpy(kernel, rows, heads, keys, depth, bias_shape):
  rng = np.random.default_rng(rows * 100 + keys)
  q, k, v = (rng.standard_normal(s).astype(np.float32) for s in
             [(rows, heads, depth), (rows, heads, keys, depth), (rows, heads, keys, depth)])
  bias = rng.standard_normal(bias_shape).astype(np.float32)
  if keys > 2:
    bias[..., keys // 2:] = -1e10  # Masked positions (the model's NEG_INF) get no weight.
  got = np.asarray(jax.jit(cpu_kernels.decode_attention)(q, k, v, bias))
  want = _np_attention(q, k, v, np.broadcast_to(bias, (rows, heads, keys)))
  assert got.shape == (rows, heads, depth) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [2, 5])
def test_decode_attention_groups_of_query_rows_share_a_key_row(kernel, group):
  rng = np.random.default_rng(group)
  rows, heads, keys, depth = 3, 4, 40, 32
  q = rng.standard_normal((rows * group, heads, depth)).astype(np.float32)
  k, v = (rng.standard_normal((rows, heads, keys, depth)).astype(np.float32) for _ in "kv")
  bias = np.zeros((rows, 1, keys), np.float32)
  bias[1, :, 25:] = -1e10  # Input 1 is shorter: every sample of it must skip those keys.
  got = np.asarray(jax.jit(cpu_kernels.decode_attention)(q, k, v, bias))
  kv_row = np.arange(rows * group) // group
  want = _np_attention(q, k[kv_row], v[kv_row],
                       np.broadcast_to(bias, (rows, heads, keys))[kv_row])
  assert got.shape == q.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_rejects_mismatched_shapes(kernel):
  with pytest.raises(ValueError, match="do not fit"):
    cpu_kernels.decode_attention(jnp.ones((2, 3, 8)), jnp.ones((2, 3, 5, 16)),
                                 jnp.ones((2, 3, 5, 16)), jnp.zeros((2, 3, 5)))
  with pytest.raises(ValueError, match="do not fit"):  # 5 query rows over 2 key rows.
    cpu_kernels.decode_attention(jnp.ones((5, 3, 16)), jnp.ones((2, 3, 5, 16)),
                                 jnp.ones((2, 3, 5, 16)), jnp.zeros((2, 3, 5)))
