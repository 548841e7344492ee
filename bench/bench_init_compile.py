"""Compile time of a T5's parameter initialiser: `t5.init_params` (one normal draw per
distinct (shape, logical axes), `models.param_init`) against flax's per-parameter draws
(`model.init`), same model, rounds interleaved, each round a fresh trace and compile (no
persistent cache).

  python bench/bench_init_compile.py --sizes tiny,small,base --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jaxmoral import runtime
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral.models import config as config_lib  # noqa: E402
from jaxmoral.models import t5  # noqa: E402


def _compile_seconds(fn, rng) -> float:
  start = time.perf_counter()
  jax.jit(fn).lower(rng).compile()
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="tiny,small,base")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  rng = jax.random.PRNGKey(0)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| size | params | init_params (s) | model.init (s) | ratio |")
  print("|---|---|---|---|---|")
  for size in args.sizes.split(","):
    model = t5.T5(config_lib.t5_config(size=size))
    tokens = jnp.ones((1, 8), jnp.int32)
    times: dict[str, list[float]] = {"ours": [], "flax": []}
    for _ in range(args.rounds):
      # New closures each round: nothing is reused from the round before.
      times["ours"].append(_compile_seconds(lambda r: t5.init_params(model, r), rng))
      times["flax"].append(_compile_seconds(
          lambda r: model.init({"params": r, "dropout": r}, tokens, tokens)["params"], rng))
      print(f"<!-- {size} round {len(times['ours'])}: init_params {times['ours'][-1]:.2f} s, "
            f"model.init {times['flax'][-1]:.2f} s -->", flush=True)
    count = len(jax.tree.leaves(jax.eval_shape(lambda r: t5.init_params(model, r), rng)))
    ours, flax = statistics.median(times["ours"]), statistics.median(times["flax"])
    print(f"| {size} | {count} | {ours:.2f} | {flax:.2f} | {flax / ours:.1f}x |", flush=True)


if __name__ == "__main__":
  main()
