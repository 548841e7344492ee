"""The CPU train step's matrix products alone: XLA:CPU's `dot` vs PyTorch's `matmul`.

`bench_train_step.py` times whole steps; this times the products that are most of a step's
FLOPs (T5 1.1-small, batch 8 x (128 + 64): encoder rows 1,024, decoder rows 512), forward and
the two gradient products of each, so a gap between the frameworks can be placed: in the
matrix library or around it. Same float32 inputs on both sides, PyTorch flushing denormals
with XLA's thread count (`fair.py`), results compared at float32 tolerance, rounds
interleaved, GFLOP/s against `machine.py`'s measured peak.

  python bench/bench_gemm.py
  python bench/bench_gemm.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fair  # noqa: E402  (bench/fair.py)
import machine  # noqa: E402  (bench/machine.py)

# (name, m, k, n, layout): out (m, n) = a (m, k) @ b (k, n), with a stored transposed ("tn":
# a is (k, m)) or b stored transposed ("nt": b is (n, k)) as the step's gradient products
# read them. Forward products of T5 1.1-small's step and the gradient products of the
# largest (dW = a^T dOut, dX = dOut W^T).
SHAPES = (
    ("logits fwd (dec 512 x d 512 -> vocab 32128)", 512, 512, 32128, "nn"),
    ("logits dW (d 512 x dec 512 -> vocab 32128)", 512, 512, 32128, "tn"),
    ("logits dX (dec 512 x vocab 32128 -> d 512)", 512, 32128, 512, "nt"),
    ("enc ffn wi fwd (1024 x 512 -> 1024)", 1024, 512, 1024, "nn"),
    ("enc ffn wo fwd (1024 x 1024 -> 512)", 1024, 1024, 512, "nn"),
    ("enc attn q fwd (1024 x 512 -> 384)", 1024, 512, 384, "nn"),
    ("dec ffn wi fwd (512 x 512 -> 1024)", 512, 512, 1024, "nn"),
)
# layout: (a's stored shape, b's stored shape, the product; `@` and `.T` read the same on
# jax arrays and torch tensors).
LAYOUTS = {
    "nn": (lambda m, k, n: (m, k), lambda m, k, n: (k, n), lambda a, b: a @ b),
    "tn": (lambda m, k, n: (k, m), lambda m, k, n: (k, n), lambda a, b: a.T @ b),
    "nt": (lambda m, k, n: (m, k), lambda m, k, n: (n, k), lambda a, b: a @ b.T),
}

def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=20, help="products per round and side")
  parser.add_argument("--tiny", action="store_true", help="smoke test: small shapes")
  fair.add_arguments(parser, rounds=5)
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top
  setup = fair.prepare(args.torch_threads)
  peak = machine.measured_peak()
  fair.print_header("matrix products: XLA:CPU dot vs torch.matmul (float32)", setup,
                    [f"peak      : {peak.note}",
                     f"timing    : {args.rounds} interleaved rounds x {args.calls} products"])
  shapes = SHAPES if not args.tiny else (("tiny", 64, 32, 48, "nn"),)
  rng = np.random.default_rng(0)
  ok = True
  for name, m, k, n, layout in shapes:
    a_shape, b_shape, product = LAYOUTS[layout]
    a_np = rng.standard_normal(a_shape(m, k, n), np.float32)
    b_np = rng.standard_normal(b_shape(m, k, n), np.float32)
    ours, theirs = jax.jit(product), product
    a_j, b_j = jnp.asarray(a_np), jnp.asarray(b_np)
    a_t, b_t = torch.from_numpy(a_np), torch.from_numpy(b_np)
    out_j = np.asarray(ours(a_j, b_j))
    with torch.no_grad():
      out_t = theirs(a_t, b_t).numpy()
    check = fair.compare(name, out_j, out_t, rtol=1e-4, atol=1e-3 * float(np.abs(out_t).max()))
    ok &= check.ok
    flops = 2.0 * m * k * n
    print(f"\n{name}: {flops / 1e9:.2f} GFLOP\n{check.line()}", flush=True)

    def run_ours():
      ours(a_j, b_j).block_until_ready()

    def run_theirs():
      with torch.no_grad():
        theirs(a_t, b_t)

    times = fair.interleave({"xla": run_ours, "torch": run_theirs}, args.rounds,
                            calls_per_round=args.calls, label="s/product")
    best = {side: min(t) for side, t in times.items()}
    print(f"  best: xla {flops / best['xla'] / 1e9:.1f} GFLOP/s "
          f"({100 * flops / best['xla'] / peak.flops:.1f} % of peak), torch "
          f"{flops / best['torch'] / 1e9:.1f} GFLOP/s "
          f"({100 * flops / best['torch'] / peak.flops:.1f} %); torch time / xla time "
          f"{best['torch'] / best['xla']:.3f}" if check.ok else "  (no ratio: results differ)",
          flush=True)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
