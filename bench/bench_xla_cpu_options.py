"""XLA:CPU compiler options A/B on the train step, in one process, rounds interleaved.

`XLA_FLAGS` is read once per process, so comparing flags across processes mixes them with
the VM's speed changes between processes. Here the step of
`bench_train_step.py` is lowered once and compiled once per option set
(`Lowered.compile(compiler_options=...)`, XLA's DebugOptions by name). A variant whose
optimized HLO is the default's is marked: an option that acts on the HLO, such as a library
rewrite of the dots, did nothing then (code-generation options such as
`xla_backend_optimization_level` change the machine code, not the HLO). Every variant takes
one step from the same state (losses printed), then the variants' timed rounds alternate.

  python bench/bench_xla_cpu_options.py \
      --variant "onednn=xla_cpu_use_onednn:true" \
      --variant "custom_call=xla_cpu_experimental_onednn_custom_call:true"
  python bench/bench_xla_cpu_options.py --tiny --variant "x=xla_cpu_use_onednn:true"
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_train_step  # noqa: E402  (bench/bench_train_step.py)
import fair  # noqa: E402  (bench/fair.py)


def parse_variant(spec: str) -> tuple[str, dict[str, object]]:
  """"name=key:value;key:value" -> (name, {key: value}); true/false become booleans."""
  name, sep, body = spec.partition("=")
  if not sep or not name:
    raise SystemExit(f"--variant {spec!r}: expected NAME=option:value[;option:value...]")
  options: dict[str, object] = {}
  for item in filter(None, body.split(";")):
    key, sep, value = item.partition(":")
    if not sep:
      raise SystemExit(f"--variant {spec!r}: {item!r} is not option:value")
    options[key] = {"true": True, "false": False}.get(value.lower(), value)
  return name, options


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variant", action="append", default=[],
                      help="NAME=option:value[;option:value...] (repeatable); 'default' "
                           "(no options) always runs first")
  parser.add_argument("--size", default="small")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--inputs", type=int, default=128)
  parser.add_argument("--targets", type=int, default=64)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per round and variant")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--tiny", action="store_true", help="smoke test: tiny model, seconds")
  args = parser.parse_args()
  if args.tiny:
    args.size, args.batch, args.inputs, args.targets, args.steps, args.rounds = (
        "tiny", 2, 16, 8, 1, 2)
  variants = dict([("default", {})] + [parse_variant(v) for v in args.variant])

  cfg, batch, params0, hp = bench_train_step.step_inputs(args.size, args.batch, args.inputs,
                                                         args.targets)
  print(f"== XLA:CPU compiler options, train step (bench_train_step.py's), T5 {args.size}, "
        f"batch {args.batch} x ({args.inputs} + {args.targets}), AdamW ==")
  print(f"machine   : {fair.machine_line()}")
  print(f"command   : python {' '.join(sys.argv)}")
  print(f"software  : jax {jax.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  side = bench_train_step.JaxSide(cfg, batch, params0, hp)
  lowered = side.trainer.lower_train_step(side.shapes)
  compiled = {}
  for name, options in variants.items():
    try:
      compiled[name] = lowered.compile(compiler_options=options or None)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name:12s} {options}: compile failed: {str(e).splitlines()[0][:200]}")
      continue
    same = name != "default" and compiled[name].as_text() == compiled["default"].as_text()
    print(f"{name:12s} {options}" + ("  (optimized HLO identical to default's)" if same else ""))
  if "default" not in compiled:
    raise SystemExit("the default compile failed")

  # The state is donated by every call: each step hands its output to the next (`current`).
  current = [side.state]
  fresh = lambda: jax.tree.map(lambda x: x.copy(), current[0])  # noqa: E731
  first = {}
  for name, fn in compiled.items():  # one step each from the same state: same program?
    _, metrics = fn(fresh(), side.batch, side.rng)
    first[name] = float(jax.device_get(metrics["loss"]))
  print("loss of one step from the same state: " +
        ", ".join(f"{n} {v:.9f}" + (" (bit-identical to default)"
                                    if n != "default" and v == first["default"] else "")
                  for n, v in first.items()))

  def stepper(fn):
    def step():
      current[0], metrics = fn(current[0], side.batch, side.rng)
      jax.block_until_ready((current[0], metrics))
    return step

  times = fair.interleave({n: stepper(fn) for n, fn in compiled.items()}, args.rounds,
                          calls_per_round=args.steps, label="s/step")
  base = min(times["default"])
  for name, t in times.items():
    print(f"{name:12s} best {min(t):.4f}  median {np.median(t):.4f} s/step  "
          f"default best / this best {base / min(t):.3f}")


if __name__ == "__main__":
  main()
