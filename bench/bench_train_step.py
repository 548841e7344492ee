"""Train-step throughput: jaxmoral (JAX/XLA) vs transformers' PyTorch T5, same shapes, same CPU.

T5 1.1-small sizes (random weights, float32), AdamW, batch 8, 128 input and 64 target tokens by
default. Prints tokens/s (input + target tokens) for both, their ratio, and the achieved FLOP/s
against the machine's float32 peak, measured by `bench/machine.py` (cores x clock x FMA
throughput per cycle, timed by a small C kernel). FLOPs per step come from XLA's cost analysis
of the compiled step (the same model, so it is used for both frameworks), with the
6 * params * tokens rule alongside.

  python bench/bench_train_step.py [--steps 3] [--size small] [--batch 8]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoral import losses, optimizers, partitioning, trainer as trainer_lib
from jaxmoral.models import config as config_lib
from jaxmoral.models import t5

import machine  # bench/machine.py


def make_batch(cfg: config_lib.T5Config, batch: int, inputs: int, targets: int) -> dict:
  rs = np.random.RandomState(0)
  enc = rs.randint(2, cfg.vocab_size, (batch, inputs)).astype(np.int32)
  dec = rs.randint(2, cfg.vocab_size, (batch, targets)).astype(np.int32)
  return {"encoder_input_tokens": enc, "decoder_target_tokens": dec,
          "decoder_input_tokens": np.asarray(t5.shift_right(jnp.asarray(dec))),
          "decoder_loss_weights": np.ones_like(dec)}


def bench_jax(cfg, batch, steps: int, lr: float) -> tuple[float, float]:
  """(seconds per step, XLA FLOPs per step)."""
  model = t5.T5(cfg)
  trainer = trainer_lib.Trainer(
      init_params_fn=functools.partial(t5.init_params, model),
      loss_fn=losses.seq2seq_loss_fn(model, z_loss=0.0),
      optimizer=optimizers.make_optimizer(name="adamw", learning_rate=lr),
      partitioner=partitioning.PjitPartitioner(devices=jax.devices()[:1]))
  compiled = trainer.lower_train_step({k: v.shape for k, v in batch.items()}).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float(cost["flops"])
  state = trainer.init_state(jax.random.PRNGKey(0))
  rng = jax.random.PRNGKey(1)
  device_batch = trainer.shard_batch(batch)
  state, metrics = trainer.train_step(state, device_batch, rng)  # compile + warm-up
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = trainer.train_step(state, device_batch, rng)
  jax.block_until_ready((state, metrics))
  per_step = (time.perf_counter() - start) / steps
  print(f"jax   loss after {steps + 1} steps: {float(metrics['loss']):.4f}")
  return per_step, flops


def bench_torch(cfg, batch, steps: int, lr: float, threads: int) -> float:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  hf_cfg = transformers.T5Config(
      vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_kv, d_ff=cfg.d_ff,
      num_layers=cfg.num_encoder_layers, num_decoder_layers=cfg.num_decoder_layers,
      num_heads=cfg.num_heads, relative_attention_num_buckets=cfg.relative_attention_num_buckets,
      relative_attention_max_distance=cfg.relative_attention_max_distance, dropout_rate=0.0,
      feed_forward_proj=cfg.feed_forward_proj, tie_word_embeddings=cfg.tie_word_embeddings,
      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  model = transformers.T5ForConditionalGeneration(hf_cfg).train()
  opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
  inputs, labels, dec_in = (torch.tensor(np.array(batch[k]), dtype=torch.long) for k in (
      "encoder_input_tokens", "decoder_target_tokens", "decoder_input_tokens"))

  def step():
    opt.zero_grad(set_to_none=True)
    out = model(input_ids=inputs, attention_mask=inputs != 0, decoder_input_ids=dec_in,
                labels=labels)
    out.loss.backward()
    opt.step()
    return out.loss.detach()

  step()  # warm-up
  start = time.perf_counter()
  for _ in range(steps):
    loss = step()
  per_step = (time.perf_counter() - start) / steps
  # HF initialises the untied lm_head with std 1 (jaxmoral: d_model**-0.5), hence a larger
  # starting loss; the work per step is the same.
  print(f"torch loss after {steps + 1} steps: {float(loss):.4f}")
  return per_step


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="small")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--inputs", type=int, default=128)
  parser.add_argument("--targets", type=int, default=64)
  parser.add_argument("--steps", type=int, default=3, help="timed steps (after 1 warm-up)")
  parser.add_argument("--torch_threads", type=int, default=2)
  parser.add_argument("--skip_torch", action="store_true")
  args = parser.parse_args()

  cfg = config_lib.t5_config(size=args.size)
  batch = make_batch(cfg, args.batch, args.inputs, args.targets)
  tokens = args.batch * (args.inputs + args.targets)
  n_params = cfg.num_params()
  peak_info = machine.measured_peak()
  peak, note = peak_info.flops, peak_info.note
  print(f"model T5 1.1-{args.size}: {n_params / 1e6:.1f}M params, float32, AdamW; batch "
        f"{args.batch} x (inputs {args.inputs} + targets {args.targets}) = {tokens} tokens/step")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; peak: {note}")
  print(f"load average before: {os.getloadavg()}")

  jax_s, flops = bench_jax(cfg, batch, args.steps, 1e-4)
  rule = 6.0 * n_params * tokens
  # 6 * params * tokens over-counts an encoder-decoder: encoder weights see only input tokens,
  # decoder weights only target tokens, and the embedding lookup costs no FLOPs.
  print(f"FLOPs/step: XLA cost analysis {flops / 1e9:.1f} G (used below); 6*params*tokens "
        f"{rule / 1e9:.1f} G (over-counts enc-dec)")
  print(f"jaxmoral : {jax_s:.2f} s/step  {tokens / jax_s:8.1f} tokens/s  "
        f"{flops / jax_s / 1e9:6.1f} GFLOP/s ({100 * flops / jax_s / peak:.1f}% of peak)")
  if not args.skip_torch:
    torch_s = bench_torch(cfg, batch, args.steps, 1e-4, args.torch_threads)
    print(f"pytorch  : {torch_s:.2f} s/step  {tokens / torch_s:8.1f} tokens/s  "
          f"{flops / torch_s / 1e9:6.1f} GFLOP/s ({100 * flops / torch_s / peak:.1f}% of peak)"
          f"  [torch.set_num_threads({args.torch_threads})]")
    print(f"ratio jaxmoral/pytorch tokens/s: {torch_s / jax_s:.2f}x")
  print(f"load average after: {os.getloadavg()}  (shared machine: other jobs were running)")


if __name__ == "__main__":
  main()
