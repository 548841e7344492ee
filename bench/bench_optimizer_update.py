"""One Adafactor update of a T5's parameters: optax leaf by leaf vs jaxmoral's grouped version.

Times what a train step does after the gradients: the optimizer update, `apply_updates` and the
`grad_norm` metric, jitted with parameters and state donated, on T5 1.1 parameter shapes
(constant-filled arrays; the time does not depend on the values). Both versions run in the
same process, alternating, and the ratio is printed.

  python bench/bench_optimizer_update.py --size large [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxmoral import runtime
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import optimizers
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="large")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  cfg = config_lib.t5_config(size=args.size)
  shapes = nn.meta.unbox(jax.eval_shape(lambda r: t5.init_params(t5.T5(cfg), r),
                                        jax.random.PRNGKey(0)))
  leaves = jax.tree_util.tree_leaves(shapes)
  print(f"T5 1.1-{args.size}: {len(leaves)} parameter leaves, "
        f"{len({(tuple(x.shape), x.dtype) for x in leaves})} shapes, "
        f"{sum(x.size for x in leaves) / 1e6:.1f}M values; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}", flush=True)
  grads = jax.tree_util.tree_map(lambda s: jnp.full(s.shape, 1e-3, s.dtype), shapes)

  def make(group: bool):
    opt = optimizers.make_optimizer(name="adafactor", learning_rate=1e-3,
                                    group_same_shapes=group)

    def step(params, opt_state, grads):
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, optimizers.global_norm(grads)

    params = jax.tree_util.tree_map(lambda s: jnp.full(s.shape, 0.05, s.dtype), shapes)
    return jax.jit(step, donate_argnums=(0, 1)), params, opt.init(params)

  runs = {"optax.adafactor (leaf by leaf)": make(False),
          "grouped_adafactor": make(True)}
  state = {}
  for name, (step, params, opt_state) in runs.items():
    start = time.perf_counter()
    params, opt_state, norm = step(params, opt_state, grads)
    jax.block_until_ready(norm)
    print(f"{name}: compile + first call {time.perf_counter() - start:.1f} s", flush=True)
    state[name] = (params, opt_state)
  times = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name, (step, _, _) in runs.items():
      params, opt_state = state[name]
      start = time.perf_counter()
      for _ in range(args.repeats):
        params, opt_state, norm = step(params, opt_state, grads)
      jax.block_until_ready((params, norm))
      times[name].append((time.perf_counter() - start) / args.repeats * 1e3)
      state[name] = (params, opt_state)
  for name, values in times.items():
    print(f"{name}: {min(values):.2f} ms per update (rounds: "
          f"{', '.join(f'{v:.2f}' for v in values)})")
  names = list(runs)
  print(f"ratio: {min(times[names[0]]) / min(times[names[1]]):.2f}x")


if __name__ == "__main__":
  main()
