"""One-row (batch-1 decoding) products on CPU: plain `x @ kernel` vs `models.ops.vector_matmul`.

Each shape is timed on cold kernels: enough distinct kernels (~160 MB) are cycled through that
none is in cache when it is read again, as in a decoding step, which reads every decoder
kernel once per token. Prints microseconds per product and the kernel bytes read per second.

  JAX_PLATFORMS=cpu python bench/bench_one_row_products.py
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral.models import ops  # noqa: E402

# T5 1.1-small decoder kernels: cross-attention query, attention out, MLP wo, the stacked q/k/v
# as one (512, 1152) kernel, the stacked wi_0/wi_1 as (512, 2048), and the logits projection.
SHAPES = [(512, 384), (384, 512), (1024, 512), (512, 1152), (512, 2048), (512, 32128)]
LOOPS = 8


def time_products(k: int, n: int, split: bool) -> float:
  """Median seconds per product over 5 runs of LOOPS passes over the cold kernels."""
  count = max(4, int(160e6 // (k * n * 4)))
  rng = np.random.default_rng(0)
  kernels = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02) for _ in range(count)]
  product = ops.vector_matmul if split else jnp.dot

  @jax.jit
  def run(row, kernels):
    def one_pass(_, row):
      for kernel in kernels:
        # Each product feeds the next, so they run in order, like a decoder's.
        row = row + 1e-3 * jnp.sum(product(row, kernel))
      return row
    return jax.lax.fori_loop(0, LOOPS, one_pass, row)

  row = jnp.ones((1, k), jnp.float32)
  jax.block_until_ready(run(row, kernels))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(run(row, kernels))
    times.append(time.perf_counter() - start)
  return statistics.median(times) / (LOOPS * count)


def main() -> None:
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; one-row products on cold "
        "float32 kernels")
  for k, n in SHAPES:
    plain, split = time_products(k, n, False), time_products(k, n, True)
    gbps = lambda t: k * n * 4 / t / 1e9  # noqa: E731
    print(f"  (1, {k:4d}) @ ({k:4d}, {n:5d}): plain {plain * 1e6:7.1f} us ({gbps(plain):4.1f} GB/s)"
          f"   split {split * 1e6:7.1f} us ({gbps(split):4.1f} GB/s)   {plain / split:4.2f}x",
          flush=True)


if __name__ == "__main__":
  main()
