"""T5's RMS norm, forward + backward, on one GPU: XLA's fusions against `rms_norm_gpu`'s Triton
kernels (norm_impl="pallas_gpu") at T5 1.1-large's training shapes.

Each variant computes the output and the gradients of input and scale for a fixed cotangent,
bf16 activations and a float32 scale; variants are checked against the XLA form (max |diff| /
max |ref| of y, dx and dscale) and timed in interleaved rounds (mean of `--calls` calls per
round, median of the rounds). Beside each time: the bandwidth of the least traffic the work
needs (read x, write y; read x and dy, write dx: 5 activation-sized passes).

  python bench/bench_norm.py --rows 32768,8192 --width 1024 \
      --variants xla,pallas,pallas:block_rows=32+num_warps=8
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral.models import rms_norm_gpu


def parse_variant(spec: str) -> tuple[str, rms_norm_gpu.NormBlockSizes]:
  """'xla' | 'pallas[:field=value+...]' -> (kind, block sizes)."""
  kind, _, options = spec.partition(":")
  if kind not in ("xla", "pallas"):
    raise SystemExit(f"--variants: unknown {kind!r} (xla or pallas[:field=value+...])")
  fields = {}
  for option in filter(None, options.split("+")):
    name, _, value = option.partition("=")
    fields[name] = int(value)
  return kind, dataclasses.replace(rms_norm_gpu.NormBlockSizes(), **fields)


def build(kind: str, blocks: rms_norm_gpu.NormBlockSizes, epsilon: float):
  if kind == "xla":
    norm = lambda x, s: rms_norm_gpu.reference_rms_norm(x, s, epsilon=epsilon,
                                                        out_dtype=x.dtype)
  else:
    norm = lambda x, s: rms_norm_gpu.rms_norm(x, s, epsilon=epsilon, out_dtype=x.dtype,
                                              block_sizes=blocks)

  def forward_backward(x, scale, cotangent):
    y, vjp = jax.vjp(norm, x, scale)
    return (y,) + vjp(cotangent)

  return jax.jit(forward_backward)


def time_calls(fn, args, calls: int) -> float:
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="32768,8192",
                      help="tokens per step (encoder: batch 64 x 512; decoder: 64 x 128)")
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--variants", default="xla,pallas")
  parser.add_argument("--calls", type=int, default=50)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--epsilon", type=float, default=1e-6)
  args = parser.parse_args()
  variants = args.variants.split(",")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  for rows in (int(r) for r in args.rows.split(",")):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, args.width)) * 3.0, jnp.bfloat16)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, size=args.width), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(rows, args.width)), jnp.bfloat16)
    fns = {spec: build(*parse_variant(spec), args.epsilon) for spec in variants}
    reference = [np.asarray(a, np.float32)
                 for a in build("xla", rms_norm_gpu.NormBlockSizes(), args.epsilon)(
                     x, scale, cotangent)]
    for spec, fn in fns.items():
      got = [np.asarray(a, np.float32) for a in fn(x, scale, cotangent)]
      errors = ", ".join(f"{name} {np.max(np.abs(g - w)) / np.max(np.abs(w)):.1e}"
                         for name, g, w in zip(("y", "dx", "dscale"), got, reference))
      print(f"({rows}, {args.width}) {spec}: max |diff| / max |ref| vs xla: {errors}",
            flush=True)
    times = {spec: [] for spec in variants}
    for r in range(args.rounds):
      for spec, fn in fns.items():
        times[spec].append(time_calls(fn, (x, scale, cotangent), args.calls))
    least_bytes = 5 * rows * args.width * 2
    base = statistics.median(times[variants[0]])
    for spec in variants:
      ms = statistics.median(times[spec]) * 1e3
      rounds = " ".join(f"{t * 1e3:.4f}" for t in times[spec])
      print(f"({rows}, {args.width}) {spec:40s} {ms:8.4f} ms fwd+bwd  "
            f"{least_bytes / ms / 1e6:7.0f} GB/s of least traffic  {base * 1e3 / ms:5.2f}x "
            f"{variants[0]}  (rounds: {rounds})", flush=True)


if __name__ == "__main__":
  main()
