"""What jaxmoral's AdamW update costs inside the CPU train step: AdamW against SGD.

The same Trainer, model, weights and batch as `bench_train_step.py` (T5 1.1-small float32,
batch 8 x (128 + 64)); one side updates with `optimizers.make_optimizer(name="adamw")`, the
other with "sgd" (one multiply-add per weight), interleaved rounds, every round printed. The
difference of the best rounds is the AdamW update's share of the step; no PyTorch side.

  python bench/bench_optimizer_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train_step  # noqa: E402  (bench/bench_train_step.py)
import fair  # noqa: E402  (bench/fair.py)
from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import optimizers  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
  args = parser.parse_args()
  cfg, batch, params0, hp = bench_train_step.step_inputs()
  sides = {"adamw": bench_train_step.JaxSide(cfg, batch, params0, hp),
           "sgd": bench_train_step.JaxSide(
               cfg, batch, params0, hp,
               optimizer=optimizers.make_optimizer(name="sgd", learning_rate=1e-4))}
  for side in sides.values():  # compile and warm up
    side.step()
    side.step()
  times = fair.interleave({name: side.step for name, side in sides.items()}, args.rounds,
                          calls_per_round=args.steps, label="s/step")
  best = {name: min(t) for name, t in times.items()}
  print(f"best: adamw {best['adamw']:.4f} s/step, sgd {best['sgd']:.4f} s/step; the AdamW "
        f"update costs {1000 * (best['adamw'] - best['sgd']):.0f} ms of a step")


if __name__ == "__main__":
  main()
