"""T5 attention forward + backward on a GPU: XLA's unfused softmax vs cuDNN's fused attention.

T5 attention has no 1/sqrt(d) scale and adds a learned relative-position bias, whose gradient
training needs. This times, at T5 1.1-large shapes, the gradient with respect to query, key,
value and bias of (a) the einsum + float32 softmax form, (b) `jax.nn.dot_product_attention`
with `implementation="cudnn"` and a boolean padding mask, (c) the same with per-row key lengths
instead of a mask, and (d) causal decoder self-attention; each cuDNN result is checked against
(a) on the same inputs.

  python bench/bench_attention.py [--batch 32 --length 512 --heads 16 --d_kv 64]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def reference_attention(q, k, v, bias, mask):
  """(b, t, n, h) inputs, (1, n, t, s) bias, (b, 1, t, s) bool mask; float32 softmax."""
  scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
  scores = scores + bias.astype(jnp.float32) + jnp.where(mask, 0.0, -1e10)
  weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bnts,bsnh->btnh", weights, v)


def timed(fn: Callable, *args, repeats: int = 20) -> float:
  out = fn(*args)
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(repeats):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--d_kv", type=int, default=64)
  args = parser.parse_args()
  b, t, n, h = args.batch, args.length, args.heads, args.d_kv
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q, k, v, g = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys[:4])
  bias = jax.random.normal(keys[4], (1, n, t, t), jnp.float32)
  lengths = jnp.asarray(np.random.RandomState(0).randint(t // 2, t + 1, b), jnp.int32)
  mask = (jnp.arange(t)[None, None, None, :] < lengths[:, None, None, None])
  mask = jnp.broadcast_to(mask, (b, 1, t, t))
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None]

  def grads_of(attention):
    def loss(q, k, v, bias):
      return jnp.sum(attention(q, k, v, bias).astype(jnp.float32) * g.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

  variants = {
      "xla einsum + f32 softmax, mask": lambda q, k, v, bias: reference_attention(
          q, k, v, bias, mask),
      "cudnn, bias + bool mask": lambda q, k, v, bias: jax.nn.dot_product_attention(
          q, k, v, bias.astype(q.dtype), mask, scale=1.0, implementation="cudnn"),
      "cudnn, bias + key lengths": lambda q, k, v, bias: jax.nn.dot_product_attention(
          q, k, v, bias.astype(q.dtype), scale=1.0, key_value_seq_lengths=lengths,
          implementation="cudnn"),
      "cudnn, key lengths, no bias": lambda q, k, v, bias: jax.nn.dot_product_attention(
          q, k, v, scale=1.0, key_value_seq_lengths=lengths,
          implementation="cudnn") + 0 * bias[0, 0, :1, :1, None].astype(q.dtype),
      "cudnn, key lengths, bias no grad": lambda q, k, v, bias: jax.nn.dot_product_attention(
          q, k, v, jax.lax.stop_gradient(bias).astype(q.dtype), scale=1.0,
          key_value_seq_lengths=lengths, implementation="cudnn"),
      "xla einsum + f32 softmax, causal": lambda q, k, v, bias: reference_attention(
          q, k, v, bias, causal),
      "cudnn, bias + is_causal": lambda q, k, v, bias: jax.nn.dot_product_attention(
          q, k, v, bias.astype(q.dtype), scale=1.0, is_causal=True, implementation="cudnn"),
  }
  reference = {}
  print(f"batch {b}, length {t}, heads {n}, d_kv {h}; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}; gradient wrt q, k, v, bias")
  for name, attention in variants.items():
    try:
      fn = grads_of(attention)
      ms = timed(fn, q, k, v, bias)
      grads = fn(q, k, v, bias)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name:36s} failed: {type(e).__name__}: {str(e)[:300]}")
      continue
    kind = "causal" if "causal" in name else "mask"
    if name.startswith("xla"):
      reference[kind] = grads
      note = ""
    elif "no bias" in name or "no grad" in name:
      note = "(timing only: no bias gradient)"
    else:
      ref = reference[kind]
      rel = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)))
                   / (float(jnp.max(jnp.abs(r.astype(jnp.float32)))) + 1e-30))
             for a, r in zip(grads, ref)]
      note = "max |diff| / max |ref| (dq, dk, dv, dbias): " + ", ".join(f"{x:.1e}" for x in rel)
    print(f"{name:36s} {ms:8.2f} ms  {note}", flush=True)


if __name__ == "__main__":
  main()
