"""Train-step model FLOP utilisation (MFU) of T5 1.1 on one accelerator (the goal: T5 1.1-large,
bf16 activations, float32 params, one H100; goal >= 45 %).

Model FLOPs per step are counted analytically (`model_flops_per_step`: every matrix product
of the forward pass, attention included, times 3 for forward + backward); XLA's GPU cost
analysis leaves out the cuBLAS products, so it cannot be used there (on CPU the two agree,
`--check_flops` prints both). MFU is reported against the chip's dense bf16 peak given by
`--peak_tflops` (H100 SXM: 989.4) and, beside it, against the bf16 matrix-product rate
measured in the same run (an 8192^3 `jnp.dot`), which is what this GPU really delivers.

  python bench/bench_train_mfu.py --size large --batch 32 --inputs 512 --targets 128

`--compare cudnn,pallas_gpu` builds one train step per attention_impl in the same process,
starts each from the same initial state (same key, same weights) on the same batch, checks
that their first-step losses agree, and times `--rounds` interleaved rounds of `--steps` steps
(impl A, impl B, impl A, ...), reporting each impl's median round and the ratio. An entry
`pallas_gpu:opt+opt` sets options of the Triton kernels while that step is traced: `diagonals`
(the T5Config field `gpu_bias_as_diagonals`) and `field=value` (`gpu_attention.DEFAULT_BLOCK_SIZES`),
e.g. `--compare cudnn,pallas_gpu,pallas_gpu:dkv_rows=2+block_k_dkv=32`. T5Config overrides
of one entry follow it after '/': `--compare cudnn,cudnn/dtype=float16`.

Two options measure what the position bias costs, and so bound what any kernel for its path
can gain; they change the gradient (not a way to train): `nobiasgrad` keeps the bias in the
forward pass but holds it constant (the relative-position embeddings get no gradient; whether
cuDNN then skips computing it depends on the jax version, see the option's code), `nobias`
drops the bias from fused attention.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
try:  # A private module; only the `nobiasgrad` diagnostic patches it.
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
except ImportError:
  cudnn_attention = None

from jaxmoral import runtime
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import losses, optimizers, partitioning, trainer as trainer_lib
from jaxmoral.models import config as config_lib
from jaxmoral.backends import gpu_attention
from jaxmoral.models import ops as ops_lib
from jaxmoral.models import t5

from bench_train_step import make_batch, parse_override  # bench/bench_train_step.py


def measured_matmul_tflops(size: int = 8192, repeats: int = 20) -> float:
  """bf16 TFLOP/s of a size^3 matrix product (random data), mean of `repeats` after warm-up."""
  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.bfloat16)
  b = jax.random.normal(jax.random.PRNGKey(1), (size, size), jnp.bfloat16)
  product = jax.jit(lambda a, b: a @ b)
  for _ in range(3):
    product(a, b).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    out = product(a, b)
  out.block_until_ready()
  return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12


def model_flops_per_step(cfg: config_lib.T5Config, batch: int, inputs: int,
                         targets: int) -> float:
  """Forward + backward FLOPs of the matrix products of one training step (3 x forward)."""
  d, joined, ff = cfg.d_model, cfg.num_heads * cfg.d_kv, cfg.d_ff
  mlp = (3 if cfg.is_gated else 2) * d * ff
  enc_tokens, dec_tokens = batch * inputs, batch * targets
  per_encoder_token = cfg.num_encoder_layers * (4 * d * joined + mlp)
  # Decoder: self-attention q/k/v/o, cross-attention q/o, MLP, and the logits projection;
  # cross-attention keys/values are projected from the encoder tokens.
  per_decoder_token = cfg.num_decoder_layers * (6 * d * joined + mlp) + d * cfg.vocab_size
  cross_kv = cfg.num_decoder_layers * 2 * d * joined * enc_tokens
  products = 2 * (per_encoder_token * enc_tokens + per_decoder_token * dec_tokens + cross_kv)
  # Scores and weighted values: 2 products of (q x k x joined) per layer and sequence.
  attention = 4 * joined * batch * (cfg.num_encoder_layers * inputs * inputs
                                    + cfg.num_decoder_layers * (targets * targets
                                                                + targets * inputs))
  return 3.0 * (products + attention)


def add_step_args(parser: argparse.ArgumentParser) -> None:
  """The flags that choose the benchmarked train step."""
  parser.add_argument("--size", default="large")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--optimizer", default="adafactor")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--inputs", type=int, default=512)
  parser.add_argument("--targets", type=int, default=128)
  parser.add_argument("--group_same_shapes", choices=("default", "true", "false"),
                      default="default",
                      help="Adafactor per group of same-shaped leaves (make_optimizer's default: "
                           "yes without momentum) or optax's leaf by leaf")
  parser.add_argument("--microbatches", type=int, default=1,
                      help="gradient accumulation: the batch in this many microbatches, one "
                           "optimizer update per step")
  parser.add_argument("--override", action="append", default=[],
                      help="T5Config field=value, e.g. attention_impl=cudnn (repeatable)")
  parser.add_argument("--pallas_gpu_options", default="",
                      help="options of attention_impl=pallas_gpu's kernels: 'diagonals' and "
                           "BlockSizes field=value, separated by ',' or '+'")
  parser.add_argument("--peak_tflops", type=float, default=989.4,
                      help="dense bf16 peak of the chip (H100 SXM 989.4, H200 989.4)")


def build_step(args: argparse.Namespace) -> tuple[config_lib.T5Config, trainer_lib.Trainer,
                                                  dict, float]:
  """(config, single-device trainer, batch, model FLOPs per step) from `add_step_args` flags."""
  overrides = dict(parse_override(o) for o in args.override)
  overrides.update(kernel_option_overrides(args.pallas_gpu_options))
  apply_kernel_options(args.pallas_gpu_options)
  cfg = config_lib.t5_config(size=args.size, dtype=args.dtype, **overrides)
  model = t5.T5(cfg)
  batch = make_batch(cfg, args.batch, args.inputs, args.targets)
  grouped = {"default": None, "true": True, "false": False}[args.group_same_shapes]
  optimizer = optimizers.make_optimizer(name=args.optimizer, learning_rate=1e-3,
                                        group_same_shapes=grouped)
  trainer = trainer_lib.Trainer(
      init_params_fn=lambda rng: t5.init_params(model, rng),
      loss_fn=losses.seq2seq_loss_fn(model), optimizer=optimizer,
      partitioner=partitioning.PjitPartitioner(devices=jax.devices()[:1]),
      num_microbatches=args.microbatches)
  tokens = args.batch * (args.inputs + args.targets)
  print(f"T5 1.1-{args.size} {overrides}: {cfg.num_params() / 1e6:.1f}M params (float32), "
        f"activations {args.dtype}, {args.optimizer} "
        f"(group_same_shapes: {args.group_same_shapes}); "
        f"batch {args.batch} x ({args.inputs} + {args.targets}) = {tokens} tokens/step "
        f"in {args.microbatches} microbatch(es); "
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  return cfg, trainer, batch, model_flops_per_step(cfg, args.batch, args.inputs, args.targets)


def _kernel_options(options: str) -> list[str]:
  return list(filter(None, options.replace("+", ",").split(",")))


def kernel_option_overrides(options: str) -> dict[str, object]:
  """The T5Config overrides among kernel options: `diagonals` (`gpu_bias_as_diagonals`)."""
  return {"gpu_bias_as_diagonals": True} if "diagonals" in _kernel_options(options) else {}


def apply_kernel_options(options: str) -> None:
  """Sets BlockSizes `field=value` options of the Triton kernels (attention_impl="pallas_gpu")
  and the `nobias`/`nobiasgrad` patches for the steps traced from now on (`diagonals` is a
  config field: `kernel_option_overrides`)."""
  fields = {}
  for option in _kernel_options(options):
    if option == "diagonals":
      continue
    elif option == "nobiasgrad":
      # jax 0.10 asks cuDNN for the bias gradient whenever there is a bias (patched here);
      # jax 0.11.2 has no such hook, and holding the bias constant did not make its step
      # faster.
      if hasattr(cudnn_attention, "should_export_dbias"):
        cudnn_attention.should_export_dbias = lambda *args: False
      ops_lib.fused_attention = _with_constant_position_bias
    elif option == "nobias":
      ops_lib.fused_attention = _without_position_bias
    else:
      name, _, value = option.partition("=")
      fields[name] = int(value)
  gpu_attention.DEFAULT_BLOCK_SIZES = dataclasses.replace(
      gpu_attention.DEFAULT_BLOCK_SIZES, **fields)


def _without_position_bias(query, key, value, masking, _fused=ops_lib.fused_attention,
                           **kernel):
  """ops.fused_attention with the relative-position bias dropped (option `nobias`)."""
  return _fused(query, key, value, masking.replace(position_bias=None), **kernel)


def _with_constant_position_bias(query, key, value, masking, _fused=ops_lib.fused_attention,
                                 **kernel):
  """ops.fused_attention with no gradient into the position bias (option `nobiasgrad`)."""
  bias = masking.position_bias
  return _fused(query, key, value, masking.replace(
      position_bias=None if bias is None else jax.lax.stop_gradient(bias)), **kernel)


# What `apply_kernel_options` may set: (module, attribute), restored by `kernel_options`.
_KERNEL_OPTION_ATTRIBUTES = ((gpu_attention, "DEFAULT_BLOCK_SIZES"),
                             (ops_lib, "fused_attention"),
                             (cudnn_attention, "should_export_dbias"))


@contextlib.contextmanager
def kernel_options(options: str):
  """`apply_kernel_options` while the with-block runs (a step is traced by its first call)."""
  saved = [(module, name, getattr(module, name))
           for module, name in _KERNEL_OPTION_ATTRIBUTES if hasattr(module, name)]
  apply_kernel_options(options)
  try:
    yield
  finally:
    for module, name, value in saved:
      setattr(module, name, value)


def compare(args: argparse.Namespace) -> None:
  """`--compare`: interleaved rounds of train steps, one attention_impl (with kernel options
  after ':' and T5Config overrides after '/') per train step."""
  impls = args.compare.split(",")
  runs = {}
  for spec in impls:
    head, *entry_overrides = spec.split("/")
    impl, _, options = head.partition(":")
    impl_args = argparse.Namespace(**vars(args))
    impl_args.override = (list(args.override) + [f"attention_impl={impl}"]
                          + [f"{k}={v}" for k, v in kernel_option_overrides(options).items()]
                          + list(entry_overrides))
    _, trainer, batch, flops = build_step(impl_args)
    start = time.perf_counter()
    state = trainer.init_state(jax.random.PRNGKey(0))
    device_batch = trainer.shard_batch(batch)
    rng = jax.random.PRNGKey(1)
    with kernel_options(options):  # The step is traced and compiled by its first call.
      state, metrics = trainer.train_step(state, device_batch, rng)
    first_loss = float(metrics["loss"])
    state, metrics = trainer.train_step(state, device_batch, rng)
    jax.block_until_ready(metrics)
    impl = spec
    print(f"{impl}: init + compile + 2 warm-up steps {time.perf_counter() - start:.0f} s; "
          f"first-step loss {first_loss:.6f}, second {float(metrics['loss']):.6f}", flush=True)
    runs[impl] = dict(trainer=trainer, state=state, batch=device_batch, rng=rng,
                      first_loss=first_loss, rounds=[])
  tokens = args.batch * (args.inputs + args.targets)
  for r in range(args.rounds):
    for impl in impls:
      run = runs[impl]
      state = run["state"]
      start = time.perf_counter()
      for _ in range(args.steps):
        state, metrics = run["trainer"].train_step(state, run["batch"], run["rng"])
      jax.block_until_ready((state, metrics))
      per_step = (time.perf_counter() - start) / args.steps
      run["state"] = state
      run["rounds"].append(per_step)
      print(f"round {r} {impl:16s} {per_step * 1e3:7.1f} ms/step  MFU "
            f"{100 * flops / per_step / 1e12 / args.peak_tflops:5.1f} %  loss "
            f"{float(metrics['loss']):.4f}", flush=True)
  measured = measured_matmul_tflops(args.matmul_size)
  base = impls[0]
  base_ms = statistics.median(runs[base]["rounds"])
  print(f"\n{args.matmul_size}^3 bf16 product: {measured:.0f} TFLOP/s; model FLOPs "
        f"{flops / 1e12:.4f} TFLOP/step; median of {args.rounds} rounds x {args.steps} steps")
  for impl in impls:
    run = runs[impl]
    ms = statistics.median(run["rounds"])
    achieved = flops / ms / 1e12
    loss_diff = run["first_loss"] - runs[base]["first_loss"]
    print(f"{impl:16s} {ms * 1e3:7.1f} ms/step  {tokens / ms:9,.0f} tokens/s  MFU "
          f"{100 * achieved / args.peak_tflops:5.1f} % ({100 * achieved / measured:.1f} % of "
          f"the product)  vs {base}: {base_ms / ms:.3f}x faster; first-step loss "
          f"{run['first_loss']:.6f} ({loss_diff:+.2e} vs {base})")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_step_args(parser)
  parser.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up)")
  parser.add_argument("--matmul_size", type=int, default=8192)
  parser.add_argument("--check_flops", action="store_true",
                      help="also print XLA's cost analysis (one more compile)")
  parser.add_argument("--compare", default="",
                      help="comma-separated attention_impl[:options][/field=value...] "
                           "entries to time against each other")
  parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (--compare)")
  args = parser.parse_args()
  if args.compare:
    compare(args)
    return

  cfg, trainer, batch, flops = build_step(args)
  tokens = args.batch * (args.inputs + args.targets)
  print(f"model FLOPs {flops / 1e12:.4f} TFLOP/step (6 * params * tokens: "
        f"{6 * cfg.num_params() * tokens / 1e12:.2f}, over-counts an encoder-decoder)",
        flush=True)
  if args.check_flops:
    cost = trainer.lower_train_step({k: v.shape for k, v in batch.items()}).compile()
    cost = cost.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    print(f"XLA cost analysis {float(cost['flops']) / 1e12:.4f} TFLOP/step", flush=True)
  start = time.perf_counter()
  state = trainer.init_state(jax.random.PRNGKey(0))
  jax.block_until_ready(state)
  print(f"init_state: {time.perf_counter() - start:.0f} s", flush=True)
  device_batch = trainer.shard_batch(batch)
  rng = jax.random.PRNGKey(1)
  start = time.perf_counter()
  for _ in range(2):
    state, metrics = trainer.train_step(state, device_batch, rng)
  jax.block_until_ready(metrics)
  print(f"compile + 2 warm-up steps: {time.perf_counter() - start:.0f} s", flush=True)
  start = time.perf_counter()
  for _ in range(args.steps):
    state, metrics = trainer.train_step(state, device_batch, rng)
  jax.block_until_ready((state, metrics))
  per_step = (time.perf_counter() - start) / args.steps
  achieved = flops / per_step / 1e12
  measured = measured_matmul_tflops(args.matmul_size)
  print(f"loss {float(metrics['loss']):.3f}; {per_step * 1e3:.1f} ms/step, "
        f"{tokens / per_step:,.0f} tokens/s, {achieved:.0f} TFLOP/s")
  print(f"MFU {100 * achieved / args.peak_tflops:.1f} % of the {args.peak_tflops} TFLOP/s "
        f"dense bf16 peak; {100 * achieved / measured:.1f} % of the {measured:.0f} TFLOP/s "
        f"a {args.matmul_size}^3 bf16 matrix product reached in this run")


if __name__ == "__main__":
  main()
