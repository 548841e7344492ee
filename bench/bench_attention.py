"""T5 attention forward + backward on a GPU: XLA's unfused softmax, cuDNN's fused attention and
the Pallas Triton kernels of `jaxmoral.models.flash_attention_gpu` (attention_impl="pallas_gpu").

T5 attention has no 1/sqrt(d) scale and adds a learned relative-position bias, whose gradient
training needs. This times, at T5 1.1-large shapes, the gradient with respect to query, key,
value and bias (and, beside it, the forward pass alone) of (a) the einsum + float32 softmax
form, (b) `jax.nn.dot_product_attention` with `implementation="cudnn"` and a boolean padding
mask, (c) the same with per-row key lengths instead of a mask, (d) causal decoder
self-attention, and (e) the Pallas kernels with the same masks as segment ids, given the full
bias or (as T5 gives it) its diagonals; each fused result is checked against (a) on the same
inputs. The bias is Toeplitz, as T5's relative-position bias is (random diagonals); for the
"diagonals" rows the bias gradient compared is its sums along the diagonals (what the
diagonals' gradient is). `--pallas_blocks` adds full-bias rows with other tile sizes
(`flash_attention_gpu.BlockSizes` fields, e.g. "block_q_dkv=32,block_k_dkv=128"; with the
word "diagonals" among them, a diagonals row).

  python bench/bench_attention.py [--batch 32 --length 512 --heads 16 --d_kv 64]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import runtime
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral.models import flash_attention_gpu


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
  parser.add_argument("--pallas_blocks", action="append", default=[],
                      help="extra Pallas rows: comma-separated BlockSizes field=value pairs")
  args = parser.parse_args()
  b, t, n, h = args.batch, args.length, args.heads, args.d_kv
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q, k, v, g = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys[:4])
  diagonals = jax.random.normal(keys[4], (1, n, 2 * t - 1), jnp.float32)
  bias = diagonals[:, :, jnp.arange(t)[None, :] - jnp.arange(t)[:, None] + t - 1]
  lengths = jnp.asarray(np.random.RandomState(0).randint(t // 2, t + 1, b), jnp.int32)
  mask = (jnp.arange(t)[None, None, None, :] < lengths[:, None, None, None])
  mask = jnp.broadcast_to(mask, (b, 1, t, t))
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
  query_ids = jnp.ones((b, t), jnp.int32)
  key_ids = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.int32)

  def pallas(blocks=flash_attention_gpu.BlockSizes(), use_bias=True, is_causal=False,
             as_diagonals=True):
    def attention(q, k, v, bias):
      full = bias if use_bias and not as_diagonals else None
      diagonals = flash_attention_gpu.bias_diagonals(bias) if use_bias and as_diagonals else None
      out = flash_attention_gpu.flash_attention(
          q, k, v, full, query_ids, query_ids if is_causal else key_ids,
          bias_diagonals=diagonals, causal=is_causal, block_sizes=blocks)
      return out if use_bias else out + 0 * bias[0, 0, :1, :1, None].astype(q.dtype)
    return attention

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
      "pallas_gpu, full bias + key ids": pallas(as_diagonals=False),
      "pallas_gpu, diagonals + key ids": pallas(),
      "pallas_gpu, key ids, no bias": pallas(use_bias=False),
      "pallas_gpu, diagonals + causal": pallas(is_causal=True),
  }
  for text in args.pallas_blocks:
    options = text.split(",")
    fields = {field: int(value) for field, value in (o.split("=") for o in options if "=" in o)}
    variants[f"pallas_gpu {text}"] = pallas(flash_attention_gpu.BlockSizes(**fields),
                                            as_diagonals="diagonals" in options)
  reference = {}
  print(f"batch {b}, length {t}, heads {n}, d_kv {h}; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}; gradient wrt q, k, v, bias")
  for name, attention in variants.items():
    try:
      fn = grads_of(attention)
      forward = jax.jit(attention)
      forward_ms = timed(forward, q, k, v, bias)
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
      if "diagonals" in name:
        diagonal_sums = flash_attention_gpu._diagonal_sums  # pylint: disable=protected-access
        grads, ref = (x[:3] + (diagonal_sums(x[3]),) for x in (grads, ref))
      rel = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)))
                   / (float(jnp.max(jnp.abs(r.astype(jnp.float32)))) + 1e-30))
             for a, r in zip(grads, ref)]
      note = "max |diff| / max |ref| (dq, dk, dv, dbias): " + ", ".join(f"{x:.1e}" for x in rel)
    print(f"{name:36s} {ms:8.2f} ms (forward {forward_ms:6.2f})  {note}", flush=True)


if __name__ == "__main__":
  main()
