"""Trace time of a T5 train step's gradient: parameters read by `param_init.param` against
flax's own `Module.param` (which re-traces each parameter's initializer in `apply` to check
its shape). Same model and batch, rounds interleaved, each a fresh `jax.jit(...).trace`.

  python bench/bench_trace.py --sizes tiny,small,base --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import runtime

runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral.models import config as config_lib  # noqa: E402
from jaxmoral.models import param_init  # noqa: E402
from jaxmoral.models import t5  # noqa: E402


@contextlib.contextmanager
def _flax_param() -> Iterator[None]:
  """`param_init.param` replaced by flax's `Module.param` (the peer)."""
  ours = param_init.param
  param_init.param = lambda module, name, init, shape, dtype=jnp.float32: module.param(
      name, init, shape, dtype)
  try:
    yield
  finally:
    param_init.param = ours


def _trace_seconds(model: t5.T5, params: Any, batch: dict[str, np.ndarray]) -> float:
  def loss(p):
    logits = model.apply({"params": p}, batch["inputs"], t5.shift_right(batch["targets"]))
    return jnp.mean(logits)
  start = time.perf_counter()
  jax.jit(lambda p: jax.value_and_grad(loss)(p)).trace(params)  # A new function: no cache.
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="tiny,small,base")
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| size | param_init.param (ms) | flax Module.param (ms) | ratio |")
  print("|---|---|---|---|")
  for size in args.sizes.split(","):
    model = t5.T5(config_lib.t5_config(size=size))
    # Tracing needs shapes only: zeros in the parameters' shapes, no initialiser compiled.
    shapes = nn.meta.unbox(jax.eval_shape(lambda r, m=model: t5.init_params(m, r),
                                          jax.random.PRNGKey(0)))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    batch = {k: np.ones((8, 64), np.int32) for k in ("inputs", "targets")}
    ours, peer = [], []
    for _ in range(args.rounds):
      ours.append(_trace_seconds(model, params, batch))
      with _flax_param():
        peer.append(_trace_seconds(model, params, batch))
    a, b = statistics.median(ours), statistics.median(peer)
    print(f"| {size} | {1e3 * a:.0f} | {1e3 * b:.0f} | {b / a:.2f}x |")


if __name__ == "__main__":
  main()
