"""Per-chip memory of a sharded parameter + optimizer-state init on a TPU pod topology, compiled
from this CPU (libtpu): `t5.init_params` (one normal block per distinct (shape, logical axes))
against flax's per-parameter draws (`model.init`), same model, mesh, rules and optimizer.

  python bench/bench_init_memory.py --size xxl --topology v5e:8x8 --model_parallel 4
"""

from __future__ import annotations

import argparse
import time

import jax

from jaxmoral import runtime
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import aot, losses, optimizers, partitioning, trainer as trainer_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5

GiB = 1024 ** 3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="xxl")
  parser.add_argument("--topology", default="v5e:8x8")
  parser.add_argument("--model_parallel", type=int, default=4)
  args = parser.parse_args()
  topology = aot.get_topology(args.topology)
  cfg = config_lib.t5_config(size=args.size, dtype="bfloat16")
  model = t5.T5(cfg)
  enc = jax.numpy.ones((1, 8), jax.numpy.int32)
  inits = {
      "init_params (pooled)": lambda rng: t5.init_params(model, rng),
      "model.init (per parameter)": lambda rng: model.init({"params": rng, "dropout": rng},
                                                           enc, enc)["params"],
  }
  rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
  partitioner = partitioning.PjitPartitioner(num_partitions=args.model_parallel,
                                             logical_axis_rules=rules,
                                             devices=topology.devices)
  print(f"T5 1.1-{args.size}: {cfg.num_params() / 1e9:.2f}B params; {args.topology}, mesh "
        f"{dict(partitioner.mesh.shape)}; Adafactor state; jax {jax.__version__}", flush=True)
  for name, init in inits.items():
    trainer = trainer_lib.Trainer(
        init_params_fn=init, loss_fn=losses.seq2seq_loss_fn(model),
        optimizer=optimizers.make_optimizer(name="adafactor", learning_rate=1e-3),
        partitioner=partitioner)
    start = time.perf_counter()
    rng = jax.ShapeDtypeStruct((2,), jax.numpy.uint32)
    compiled = trainer.initializer._init_jit.lower(rng).compile()  # pylint: disable=protected-access
    memory = compiled.memory_analysis()
    print(f"{name:28s} compile {time.perf_counter() - start:6.1f} s; per chip: outputs "
          f"{memory.output_size_in_bytes / GiB:6.2f} GiB, temporaries "
          f"{memory.temp_size_in_bytes / GiB:6.2f} GiB, peak "
          f"{getattr(memory, 'peak_memory_in_bytes', 0) / GiB:6.2f} GiB", flush=True)


if __name__ == "__main__":
  main()
