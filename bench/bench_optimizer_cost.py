"""What jaxmoral's AdamW update costs inside the CPU train step: AdamW against SGD.

The same Trainer, model, weights and batch as `bench_train_step.py` (T5 1.1-small float32,
batch 8 x (128 + 64)); one side updates with `optimizers.make_optimizer(name="adamw")`, the
other with "sgd" (one multiply-add per weight), interleaved rounds, every round printed. The
difference of the best rounds is the AdamW update's share of the step; no PyTorch side.

  python bench/bench_optimizer_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

import bench_train_step  # noqa: E402  (bench/bench_train_step.py)
from jaxmoral import losses, optimizers, partitioning, trainer as trainer_lib  # noqa: E402
from jaxmoral.models import config as config_lib  # noqa: E402
from jaxmoral.models import t5  # noqa: E402


class Side(bench_train_step.JaxSide):
  """bench_train_step's jaxmoral side with the optimizer given by name."""

  def __init__(self, cfg, batch, params0, optimizer):  # pylint: disable=super-init-not-called
    model = t5.T5(cfg)
    self.trainer = trainer_lib.Trainer(
        init_params_fn=functools.partial(t5.init_params, model),
        loss_fn=losses.seq2seq_loss_fn(model, z_loss=0.0), optimizer=optimizer,
        partitioner=partitioning.PjitPartitioner(devices=jax.devices()[:1]))
    self.batch = self.trainer.shard_batch(batch)
    self.state = self.trainer.init_state_from_params(params0)
    self.rng = jax.random.PRNGKey(1)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
  args = parser.parse_args()
  cfg = config_lib.t5_config(size="small", dropout_rate=0.0)
  batch = bench_train_step.make_batch(cfg, 8, 128, 64)
  params0 = jax.device_get(nn.meta.unbox(t5.init_params(t5.T5(cfg), jax.random.PRNGKey(0))))
  hp = dict(learning_rate=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
  sides = {"adamw": Side(cfg, batch, params0, optimizers.make_optimizer(name="adamw", **hp)),
           "sgd": Side(cfg, batch, params0,
                       optimizers.make_optimizer(name="sgd", learning_rate=1e-4))}
  for side in sides.values():  # compile and warm up
    side.step()
    side.step()
  times: dict[str, list[float]] = {name: [] for name in sides}
  for r in range(args.rounds):
    for name, side in sides.items():
      start = time.perf_counter()
      for _ in range(args.steps):
        side.step()
      times[name].append((time.perf_counter() - start) / args.steps)
      print(f"  round {r + 1}/{args.rounds}  {name:<5} {times[name][-1]:.4f} s/step", flush=True)
  best = {name: min(t) for name, t in times.items()}
  print(f"best: adamw {best['adamw']:.4f} s/step, sgd {best['sgd']:.4f} s/step; the AdamW "
        f"update costs {1000 * (best['adamw'] - best['sgd']):.0f} ms of a step")


if __name__ == "__main__":
  main()
