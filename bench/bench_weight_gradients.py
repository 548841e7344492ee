"""The CPU train step with and without the model's plain-product weight gradients.

On CPU, `ops.cpu_rows_matmul` gives every dense layer a backward pass whose weight gradient
is a plain product that XLA:CPU hands to YNNPACK, where autodiff's form (rows^T @ g)
goes to XLA's own dot emitter. This times the same Trainer, weights and batch as
`bench_train_step.py` (T5 1.1-small float32, AdamW, batch 8 x (128 + 64)) traced both ways
(`T5Config.cpu_weight_gradients` "autodiff", then "plain"), checks that the two steps agree (loss and
gradient norm of step 1 at float32 tolerance), and interleaves their rounds; no PyTorch side.

  python bench/bench_weight_gradients.py --rounds 6
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import bench_train_step  # noqa: E402  (bench/bench_train_step.py)
import fair  # noqa: E402  (bench/fair.py)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
  parser.add_argument("--tiny", action="store_true", help="smoke test: tiny model, seconds")
  args = parser.parse_args()
  size, batch, inputs, targets = ("tiny", 2, 16, 8) if args.tiny else ("small", 8, 128, 64)
  cfg, feats, params0, hp = bench_train_step.step_inputs(size, batch, inputs, targets)
  print(f"T5 {size}, batch {batch} x ({inputs} + {targets}), float32, AdamW; "
        f"{fair.machine_line()}")
  sides, first = {}, {}
  for name, form in (("autodiff weight gradients", "autodiff"),
                     ("plain-product weight gradients", "plain")):
    side = bench_train_step.JaxSide(cfg.replace(cpu_weight_gradients=form), feats, params0, hp)
    first[name] = jax.device_get(side.step())
    side.step()
    sides[name] = side.step
  (a_name, a), (b_name, b) = first.items()
  checks = [fair.compare(f"{key} of step 1", a[key], b[key]) for key in ("loss", "grad_norm")]
  times = fair.interleave(sides, args.rounds, calls_per_round=args.steps, label="s/step")
  fair.report(times, checks, ours=b_name, theirs=a_name)


if __name__ == "__main__":
  main()
