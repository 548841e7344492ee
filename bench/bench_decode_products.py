"""A decoding step's matrix products on the CPU: XLA's dot against `cpu_kernels.packed_matmul`.

Each product multiplies a few rows (batch x samples) by a T5 1.1-small kernel. The kernels are
cold, as in decoding, where every step streams all decoder weights once: each shape is timed
over a chain of distinct kernels totalling `--megabytes` (far more than the caches), inside
one jitted loop, and reported per product with the bytes of weights read per second.

  python bench/bench_decode_products.py --rows 1,8,32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import cpu_kernels  # noqa: E402

# (K, N) of T5 1.1-small's decode-step products: stacked q/k/v, stacked wi_0/wi_1, wo,
# attention out, cross-attention query, logits.
SHAPES = [(512, 1152), (512, 2048), (1024, 512), (384, 512), (512, 384), (512, 32128)]


def time_chain(rows: int, k: int, n: int, packed: bool, megabytes: float,
               repeats: int) -> float:
  """Seconds per product over a chain of distinct (k, n) kernels."""
  count = max(2, int(megabytes * 1e6 / (k * n * 4)))
  rng = np.random.default_rng(0)
  kernels = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.01) for _ in range(count)]
  if packed:
    kernels = [cpu_kernels.pack_columns(w) for w in kernels]
  x = jnp.asarray(rng.standard_normal((rows, k), np.float32) * 0.01)

  def chain(x, kernels):
    for w in kernels:
      y = cpu_kernels.packed_matmul(x, w, n) if packed else x @ w
      # Feed the product into the next input, so products run in order, not overlapped.
      x = x + 1e-3 * jnp.resize(y, x.shape)
    return x

  passes = 4
  run = jax.jit(lambda x, ks: jax.lax.fori_loop(0, passes, lambda i, x: chain(x, ks), x))
  run(x, kernels).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run(x, kernels).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times) / (passes * count)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="1,8,32")
  parser.add_argument("--megabytes", type=float, default=160.0)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  if not cpu_kernels.available():
    raise SystemExit("cpu_kernels are not available here (see the warning above)")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; cold kernels "
        f"({args.megabytes:.0f} MB per chain), median of {args.repeats}")
  for rows in [int(r) for r in args.rows.split(",")]:
    for k, n in SHAPES:
      cells = []
      for packed in (False, True):
        t = time_chain(rows, k, n, packed, args.megabytes, args.repeats)
        cells.append((t, k * n * 4 / t / 1e9, 2 * rows * k * n / t / 1e9))
      (tx, bx, fx), (tp, bp, fp) = cells
      print(f"rows {rows:3d}  {k:5d} x {n:5d}:  XLA dot {tx * 1e6:8.1f} us {bx:5.1f} GB/s "
            f"{fx:6.1f} GFLOP/s | packed {tp * 1e6:8.1f} us {bp:5.1f} GB/s {fp:6.1f} GFLOP/s"
            f" | {tx / tp:4.2f}x", flush=True)


if __name__ == "__main__":
  main()
