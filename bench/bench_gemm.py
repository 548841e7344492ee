"""The CPU train step's matrix products alone: XLA:CPU's `dot` vs PyTorch's `matmul`.

`bench_train_step.py` times whole steps; this times the products that are most of a step's
FLOPs (T5 1.1-small, batch 8 x (128 + 64): encoder rows 1,024, decoder rows 512), forward and
the two gradient products of each, so a gap between the frameworks can be placed: in the
matrix library or around it. Same float32 inputs on both sides, PyTorch flushing denormals
with XLA's thread count (`fair.py`), results compared at float32 tolerance, rounds
interleaved, GFLOP/s against `machine.py`'s measured peak.

`--step` times every product of the whole train step instead: the `dot_general`s of
`jax.value_and_grad` of the step's loss (forward and backward), read from its jaxpr, grouped by
shape and contraction, each run alone on both sides (PyTorch through `torch.einsum` with the
same contraction) and summed with its count per step. That sum is a floor under either
framework's step made of these products: no step can take less than its products.

  python bench/bench_gemm.py
  python bench/bench_gemm.py --step
  python bench/bench_gemm.py --tiny
  python bench/bench_gemm.py --tiny --step
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import collections  # noqa: E402
import string  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fair  # noqa: E402  (bench/fair.py)
import machine  # noqa: E402  (bench/machine.py)
import bench_train_step  # noqa: E402  (bench/bench_train_step.py)
from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import losses  # noqa: E402
from jaxmoral.models import config as config_lib  # noqa: E402
from jaxmoral.models import t5  # noqa: E402

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


# A product of the step: (lhs shape, rhs shape, ((lhs contracting, rhs contracting),
# (lhs batch, rhs batch))), as `lax.dot_general` takes it.
Product = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[tuple[int, ...], ...], ...]]


def _dots(jaxpr: Any, times: int = 1) -> Iterator[tuple[Product, int]]:
  """(product, executions) of every float32 dot_general in a jaxpr and its sub-jaxprs."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      lhs, rhs = (v.aval for v in eqn.invars)
      if lhs.dtype != np.float32 or rhs.dtype != np.float32:
        raise ValueError(f"--step: a non-float32 product {lhs} x {rhs}")
      (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
      yield (tuple(lhs.shape), tuple(rhs.shape),
             ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))), times)
    # Loops repeat their body (a scanned stack of layers): count each pass.
    repeat = times * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else times
    if eqn.primitive.name == "while":
      raise ValueError("--step: a while loop's trip count is unknown to a jaxpr walk")
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _dots(sub.jaxpr, repeat)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _dots(sub, repeat)


def step_products(cfg: config_lib.T5Config, feats: dict, params: dict) -> dict[Product, int]:
  """{product: executions per step} of the train step's loss and gradient (jaxmoral's T5)."""
  loss_fn = losses.seq2seq_loss_fn(t5.T5(cfg), z_loss=0.0)
  jaxpr = jax.make_jaxpr(jax.value_and_grad(lambda p: loss_fn(p, feats, None), has_aux=True))(
      params)
  counts: dict[Product, int] = collections.Counter()
  for lhs, rhs, dims, times in _dots(jaxpr.jaxpr):
    counts[(lhs, rhs, dims)] += times
  return dict(counts)


def product_flops(product: Product) -> float:
  """2 x every lhs element x every free rhs element (each output sums lhs x rhs pairs)."""
  lhs, rhs, ((_, rc), (_, rb)) = product
  return 2.0 * float(np.prod(lhs)) * float(np.prod(
      [d for j, d in enumerate(rhs) if j not in rc + rb]))


def einsum_spec(product: Product) -> str:
  """The `torch.einsum` subscripts of a dot_general (output: batch, lhs free, rhs free)."""
  lhs, rhs, ((lc, rc), (lb, rb)) = product
  letters = iter(string.ascii_letters)
  lhs_sub = [next(letters) for _ in lhs]
  rhs_sub: list[str] = [""] * len(rhs)
  for i, j in zip(lc + lb, rc + rb):
    rhs_sub[j] = lhs_sub[i]
  rhs_sub = [c or next(letters) for c in rhs_sub]
  out = ([lhs_sub[i] for i in lb] + [c for i, c in enumerate(lhs_sub) if i not in lc + lb]
         + [c for j, c in enumerate(rhs_sub) if j not in rc + rb])
  return f"{''.join(lhs_sub)},{''.join(rhs_sub)}->{''.join(out)}"


def time_step_products(args, torch, peak) -> bool:
  """Times every product of the step on both sides; prints the per-step sums."""
  size, batch, inputs, targets = (("tiny", 2, 16, 8) if args.tiny
                                  else ("small", args.batch, args.inputs, args.targets))
  cfg, feats, params0, hp = bench_train_step.step_inputs(size, batch, inputs, targets)
  counts = step_products(cfg, feats, params0)
  total_flops = sum(n * product_flops(p) for p, n in counts.items())
  print(f"step: T5 {size}, batch {batch} x ({inputs} + {targets}); {sum(counts.values())} "
        f"products of {len(counts)} kinds, {total_flops / 1e9:.2f} GFLOP per step", flush=True)
  rng = np.random.default_rng(0)
  ok, totals = True, {"xla": 0.0, "torch": 0.0}
  for product, count in sorted(counts.items(), key=lambda kv: -kv[1] * product_flops(kv[0])):
    lhs, rhs, dims = product
    a_np = rng.standard_normal(lhs, np.float32)
    b_np = rng.standard_normal(rhs, np.float32)
    ours = jax.jit(lambda a, b, dims=dims: jax.lax.dot_general(a, b, dims))
    spec = einsum_spec(product)
    a_j, b_j = jnp.asarray(a_np), jnp.asarray(b_np)
    a_t, b_t = torch.from_numpy(a_np), torch.from_numpy(b_np)
    out_j = np.asarray(ours(a_j, b_j))
    with torch.no_grad():
      out_t = torch.einsum(spec, a_t, b_t).numpy()
    name = f"{spec} {lhs} x {rhs}"
    check = fair.compare(name, out_j, out_t, rtol=1e-4, atol=1e-3 * float(np.abs(out_t).max()))
    ok &= check.ok

    def run_ours():
      ours(a_j, b_j).block_until_ready()

    def run_theirs():
      with torch.no_grad():
        torch.einsum(spec, a_t, b_t)

    # Rounds of ~0.1 s or more: a product of a few milliseconds timed twice per round reads
    # the pool's wake-up, not the product.
    calls = max(3, min(200, int(2e10 / product_flops(product))))
    times = fair.interleave({"xla": run_ours, "torch": run_theirs}, args.rounds,
                            calls_per_round=calls, label="s/product", quiet=True)
    best = {side: min(t) for side, t in times.items()}
    for side in totals:
      totals[side] += count * best[side]
    flops = product_flops(product)
    print(f"  x{count:<3} {name}: {flops / 1e9:6.3f} GFLOP; xla "
          f"{flops / best['xla'] / 1e9:6.1f} GFLOP/s, torch {flops / best['torch'] / 1e9:6.1f}; "
          f"per step xla {count * best['xla']:.4f} s, torch {count * best['torch']:.4f} s "
          f"(rounds, ms: xla {' '.join(f'{1e3 * x:.2f}' for x in times['xla'])}; torch "
          f"{' '.join(f'{1e3 * x:.2f}' for x in times['torch'])})"
          + ("" if check.ok else "  RESULTS DIFFER"), flush=True)
  for side, t in totals.items():
    print(f"products of one step, each alone, summed: {side:<5} {t:.4f} s = "
          f"{total_flops / t / 1e9:.1f} GFLOP/s ({100 * total_flops / t / peak.flops:.1f} % of "
          "the measured peak)")
  print(f"torch time / xla time: {totals['torch'] / totals['xla']:.3f}" if ok
        else "(no ratio: some results differ)")
  # The whole steps of bench_train_step.py (its checks and ratio are its own), for the floor:
  # a step at `speedup` x PyTorch's must fit its products in PyTorch's step / speedup.
  sides = {"jaxmoral step": bench_train_step.JaxSide(cfg, feats, params0, hp).step,
           "pytorch step (fused AdamW)": bench_train_step.TorchSide(
               cfg, feats, params0, hp, 0.0, "fused").step}
  for step in sides.values():
    step()
  print("whole train steps, interleaved (for the floor; bench_train_step.py checks them):")
  steps = {name: min(t) for name, t in fair.interleave(sides, args.rounds, calls_per_round=2,
                                                       label="s/step").items()}
  goal = steps["pytorch step (fused AdamW)"] / args.speedup
  above = [side for side, t in totals.items() if t > goal]
  print(f"{args.speedup:g}x PyTorch's best step ({steps['pytorch step (fused AdamW)']:.4f} s) "
        f"is {goal:.4f} s; the step's products alone take {totals['xla']:.4f} s in XLA:CPU and "
        f"{totals['torch']:.4f} s in PyTorch (above it: {', '.join(above) or 'neither'}); "
        f"jaxmoral's best step {steps['jaxmoral step']:.4f} s")
  return ok


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=20, help="products per round and side")
  parser.add_argument("--tiny", action="store_true", help="smoke test: small shapes")
  parser.add_argument("--step", action="store_true",
                      help="every product of the train step (bench_train_step.py's), summed")
  parser.add_argument("--batch", type=int, default=8, help="--step: batch size")
  parser.add_argument("--inputs", type=int, default=128, help="--step: input tokens")
  parser.add_argument("--targets", type=int, default=64, help="--step: target tokens")
  parser.add_argument("--speedup", type=float, default=1.25,
                      help="--step: the goal against PyTorch's whole step the floor is read at")
  fair.add_arguments(parser, rounds=5)
  args = parser.parse_args()
  import torch  # pylint: disable=g-import-not-at-top
  setup = fair.prepare(args.torch_threads)
  peak = machine.measured_peak()
  fair.print_header("matrix products: XLA:CPU dot vs torch.matmul (float32)", setup,
                    [f"peak      : {peak.note}",
                     f"timing    : {args.rounds} interleaved rounds x {args.calls} products"])
  if args.step:
    sys.exit(0 if time_step_products(args, torch, peak) else 1)
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
