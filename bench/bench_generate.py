"""Greedy generation throughput: jaxmoral.decoding vs transformers' PyTorch `generate`.

Same random T5 1.1-small weights in both (our params converted to a HF state dict), same
inputs, same machine, same process. Both decode exactly `--new_tokens` tokens (EOS banned
until then: `min_length` here, `min_new_tokens` there) so they do equal work. Prints tokens/s
for each, the ratio, and whether the greedy outputs agree.

  python bench/bench_generate.py --batch 1,8,32   # 64 input tokens, 32 new tokens
  python bench/bench_generate.py --batch 16 --top_p 0.6 --temperature 0.7   # sampled
  python bench/bench_generate.py --batch 2 --num_samples 16 --temperature 0.7 --input_length 256

With `--top_p` below 1 or `--temperature` other than 1 both sample (`do_sample=True`,
`top_k=0` there) instead of taking the argmax; the draws then differ, so only the rates are
compared. `--num_samples N` (sampling only) draws N continuations per input
(`num_return_sequences` there).

On a GPU (`JAX_PLATFORMS=cuda`), PyTorch runs on the same GPU; `--dtype bfloat16` gives both
sides bf16 weights and activations (ours: the params cast once, as `jaxmoral export
--dtype bfloat16` stores them), and each row also reports the decoder's weight reads per second
against the device's memory bandwidth measured in the same run (a large on-device copy):
a decoding step at small batch reads every decoder weight once and little else.

On a CPU jaxmoral decodes float32 through `jaxmoral.cpu_kernels.packed_matmul` (see
`decoding.use_packed_kernels`); `--also_xla_dot` times the same sampler with
`JAXMORAL_CPU_KERNELS=0` (XLA's dot) in the same run. Timed calls are interleaved (ours,
XLA's dot, PyTorch, then again), so drifts in machine load hit every side alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import machine  # noqa: E402  (bench/machine.py)
from jaxmoral import decoding  # noqa: E402
from jaxmoral.models.config import T5Config, t5_config  # noqa: E402
from jaxmoral.models.t5 import T5, init_params  # noqa: E402


def to_hf_state_dict(params, config: T5Config) -> dict[str, torch.Tensor]:
  """T5X-named params -> HF `T5ForConditionalGeneration` state dict (kernels transposed)."""
  def t(x):
    return torch.from_numpy(np.array(x, np.float32))  # A writable copy.

  sd = {"shared.weight": t(params["token_embedder"]["embedding"])}
  attn_names = {"query": "q", "key": "k", "value": "v", "out": "o"}
  for side in ("encoder", "decoder"):
    stack = params[side]
    sd[f"{side}.embed_tokens.weight"] = sd["shared.weight"]
    num_layers = config.num_encoder_layers if side == "encoder" else config.num_decoder_layers
    for i in range(num_layers):
      layer = stack[f"layers_{i}"]
      prefix = f"{side}.block.{i}.layer"
      if side == "encoder":
        blocks = [("attention", "pre_attention_layer_norm", "SelfAttention")]
      else:
        blocks = [("self_attention", "pre_self_attention_layer_norm", "SelfAttention"),
                  ("encoder_decoder_attention", "pre_cross_attention_layer_norm",
                   "EncDecAttention")]
      for j, (ours, norm, theirs) in enumerate(blocks):
        for a, b in attn_names.items():
          sd[f"{prefix}.{j}.{theirs}.{b}.weight"] = t(layer[ours][a]["kernel"]).T
        sd[f"{prefix}.{j}.layer_norm.weight"] = t(layer[norm]["scale"])
      j = len(blocks)
      for name in ("wi_0", "wi_1", "wo") if config.is_gated else ("wi", "wo"):
        sd[f"{prefix}.{j}.DenseReluDense.{name}.weight"] = t(layer["mlp"][name]["kernel"]).T
      sd[f"{prefix}.{j}.layer_norm.weight"] = t(layer["pre_mlp_layer_norm"]["scale"])
    sd[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = t(
        stack["relpos_bias"]["rel_embedding"]).T
    sd[f"{side}.final_layer_norm.weight"] = t(
        stack["encoder_norm" if side == "encoder" else "decoder_norm"]["scale"])
  if config.tie_word_embeddings:
    sd["lm_head.weight"] = sd["shared.weight"]
  else:
    sd["lm_head.weight"] = t(params["decoder"]["logits_dense"]["kernel"]).T
  return {k: v.contiguous() for k, v in sd.items()}


def hf_model(params, config: T5Config) -> transformers.T5ForConditionalGeneration:
  hf_config = transformers.T5Config(
      vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv, d_ff=config.d_ff,
      num_layers=config.num_encoder_layers, num_decoder_layers=config.num_decoder_layers,
      num_heads=config.num_heads,
      relative_attention_num_buckets=config.relative_attention_num_buckets,
      relative_attention_max_distance=config.relative_attention_max_distance,
      dropout_rate=0.0, layer_norm_epsilon=config.layer_norm_epsilon,
      feed_forward_proj=config.feed_forward_proj,
      tie_word_embeddings=config.tie_word_embeddings, pad_token_id=config.pad_token_id,
      eos_token_id=config.eos_token_id, decoder_start_token_id=config.decoder_start_token_id)
  # transformers 5 T5Config.__init__ consumes `tie_word_embeddings` into
  # `scale_decoder_outputs` and leaves the attribute at its default (True), which would tie
  # lm_head to the embedding; set it again so T5 1.1's separate head survives loading.
  hf_config.tie_word_embeddings = config.tie_word_embeddings
  assert getattr(hf_config, "scale_decoder_outputs",
                 config.tie_word_embeddings) == config.tie_word_embeddings
  model = transformers.T5ForConditionalGeneration(hf_config).eval()
  missing, unexpected = model.load_state_dict(to_hf_state_dict(params, config), strict=False)
  if missing or unexpected:
    raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
  if not config.tie_word_embeddings and model.lm_head.weight is model.shared.weight:
    raise ValueError("HF model tied lm_head to the embedding; untied weights would be lost")
  return model


def generation_flops(config: T5Config, batch: int, input_length: int, new_tokens: int,
                     samples: int = 1) -> float:
  """Matrix-product FLOPs of one call: encoder and cross-attention keys/values once per
  input, and `new_tokens` cached decoder steps (each over the whole cache, as both
  implementations compute it) for each of its `samples` rows, logits projection included."""
  d, ff, inner = config.d_model, config.d_ff, config.num_heads * config.d_kv
  mlp = (3 if config.is_gated else 2) * d * ff
  encoder_per_token = config.num_encoder_layers * (
      2 * (4 * d * inner + mlp) + 4 * input_length * inner)
  cross_kv_per_token = config.num_decoder_layers * 2 * 2 * d * inner
  step_per_row = (config.num_decoder_layers * (
      2 * (6 * d * inner + mlp) + 4 * (new_tokens + input_length) * inner)
                  + 2 * d * config.vocab_size)
  return (batch * input_length * (encoder_per_token + cross_kv_per_token)
          + batch * samples * new_tokens * step_per_row)


def measured_copy_bandwidth(gigabytes: float = 2.0, repeats: int = 10) -> float:
  """Bytes read + written per second by an on-device `x + 1` over a large float32 array."""
  x = jnp.zeros(int(gigabytes * 2 ** 30) // 4, jnp.float32)
  add = jax.jit(lambda x: x + 1)
  add(x).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    y = add(x)
  y.block_until_ready()
  return 2 * x.size * 4 * repeats / (time.perf_counter() - start)


def _time(fn, repeats: int) -> list[float]:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="small")
  parser.add_argument("--batch", default="8", help="comma list of batch sizes, one row each")
  parser.add_argument("--input_length", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--torch_threads", type=int, default=2)
  parser.add_argument("--top_p", type=float, default=1.0, help="< 1: sample with top-p")
  parser.add_argument("--temperature", type=float, default=1.0,
                      help="!= 1: sample with this temperature")
  parser.add_argument("--num_samples", type=int, default=1,
                      help="continuations per input (sampling only)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="weights and activations of both sides")
  parser.add_argument("--also_xla_dot", action="store_true",
                      help="also time jaxmoral with JAXMORAL_CPU_KERNELS=0 (XLA's dot)")
  args = parser.parse_args()
  torch.set_num_threads(args.torch_threads)

  config = t5_config(size=args.size, dtype=args.dtype)
  model = T5(config)
  params = nn.unbox(init_params(model, jax.random.PRNGKey(0)))
  hf = hf_model(params, config)
  on_gpu = jax.default_backend() == "gpu"
  torch_device = "cuda" if on_gpu else "cpu"
  if args.dtype == "bfloat16":
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    hf = hf.to(torch.bfloat16)
  hf = hf.to(torch_device)
  decoder_weight_bytes = sum(x.size * x.dtype.itemsize
                             for x in jax.tree_util.tree_leaves(params["decoder"]))
  new = args.new_tokens
  greedy = args.top_p == 1.0 and args.temperature == 1.0
  samples = args.num_samples
  if greedy and samples > 1:
    parser.error("--num_samples > 1 needs sampling (--top_p < 1 or --temperature != 1)")
  sampler = decoding.make_sampler(model, max_decode_length=new, greedy=greedy,
                                  num_samples=samples,
                                  temperature=args.temperature, top_p=args.top_p,
                                  min_length=new, eos_id=config.eos_token_id)
  how = ("greedy" if greedy else
         f"sampled (top_p {args.top_p}, temperature {args.temperature}, {samples} per input)")
  if on_gpu:
    bandwidth = measured_copy_bandwidth()
    print(f"device memory bandwidth (copy, bytes read + written): {bandwidth / 1e12:.2f} TB/s; "
          f"decoder weights: {decoder_weight_bytes / 1e6:.0f} MB ({args.dtype})")
  else:
    peak = machine.measured_peak()
    print(f"machine peak: {peak.note}")
  print(f"T5 1.1 {args.size} random weights, {args.input_length} input tokens, {new} new "
        f"tokens, {how}; {args.repeats} timed runs each (median); jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, torch {torch.__version__} ({args.torch_threads} "
        f"threads), transformers {transformers.__version__}")
  for batch in [int(b) for b in args.batch.split(",")]:
    rng = np.random.default_rng(0)
    inputs = rng.integers(2, config.vocab_size, size=(batch, args.input_length),
                          dtype=np.int32)
    work = batch * samples * new
    input_ids = torch.from_numpy(inputs.astype(np.int64)).to(torch_device)
    attention_mask = torch.ones_like(input_ids)

    def run_torch():
      with torch.inference_mode():
        if greedy:
          return hf.generate(input_ids=input_ids, attention_mask=attention_mask,
                             do_sample=False, num_beams=1, max_new_tokens=new,
                             min_new_tokens=new).cpu()
        return hf.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                           top_k=0, top_p=args.top_p, temperature=args.temperature,
                           num_beams=1, num_return_sequences=samples, max_new_tokens=new,
                           min_new_tokens=new).cpu()  # .cpu() waits for the GPU.

    def run_jax():
      return jax.block_until_ready(sampler(params, inputs, rng=jax.random.PRNGKey(0)).tokens)

    def run_xla_dot():
      os.environ["JAXMORAL_CPU_KERNELS"] = "0"
      try:
        return run_jax()
      finally:
        del os.environ["JAXMORAL_CPU_KERNELS"]

    packed = decoding.use_packed_kernels(model, params)
    start = time.perf_counter()
    ours = np.asarray(run_jax())[:, 0]
    compile_s = time.perf_counter() - start
    xla_tokens = np.asarray(run_xla_dot())[:, 0] if args.also_xla_dot else None
    theirs = run_torch()[:, 1:].numpy()  # Drop the decoder start token; also the warm-up.
    # Interleaved (ours, XLA's dot, PyTorch; then again), so drifts in the machine's load hit
    # every side alike.
    jax_times, xla_times, torch_times = [], [], []
    for _ in range(args.repeats):
      jax_times += _time(run_jax, 1)
      if args.also_xla_dot:
        xla_times += _time(run_xla_dot, 1)
      torch_times += _time(run_torch, 1)

    jax_tps = work / statistics.median(jax_times)
    torch_tps = work / statistics.median(torch_times)
    print(f"batch {batch}:")
    print(f"  jaxmoral.decoding.sample : {jax_tps:8.1f} tokens/s  "
          f"(runs {', '.join(f'{x:.3f}' for x in jax_times)} s; first call incl. compile "
          f"{compile_s:.1f} s; packed CPU kernels: {'yes' if packed else 'no'})")
    if args.also_xla_dot:
      xla_tps = work / statistics.median(xla_times)
      print(f"  same, XLA's dot          : {xla_tps:8.1f} tokens/s  "
            f"(runs {', '.join(f'{x:.3f}' for x in xla_times)} s; packed/XLA "
            f"{jax_tps / xla_tps:.2f}x; tokens identical: {(xla_tokens == ours).all()})")
    print(f"  HF torch generate        : {torch_tps:8.1f} tokens/s  "
          f"(runs {', '.join(f'{x:.3f}' for x in torch_times)} s)")
    print(f"  speed-up                 : {jax_tps / torch_tps:8.2f}x")
    flops = generation_flops(config, batch, args.input_length, new, samples)
    rates = [flops / statistics.median(t) for t in (jax_times, torch_times)]
    if on_gpu:
      print(f"  work per call            : {flops / 1e9:.1f} GFLOP (matrix products); jaxmoral "
            f"{rates[0] / 1e12:.2f} TFLOP/s, PyTorch {rates[1] / 1e12:.2f} TFLOP/s")
      # Every step reads all decoder weights (self/cross attention, MLP, logits) once.
      reads = [decoder_weight_bytes * new / statistics.median(t) for t in (jax_times, torch_times)]
      print(f"  decoder weight reads     : jaxmoral {reads[0] / 1e9:.0f} GB/s = "
            f"{reads[0] / bandwidth:.0%} of the copy bandwidth, PyTorch {reads[1] / 1e9:.0f} "
            f"GB/s = {reads[1] / bandwidth:.0%}", flush=True)
    else:
      print(f"  work per call            : {flops / 1e9:.1f} GFLOP (matrix products); jaxmoral "
            f"{rates[0] / 1e9:.1f} GFLOP/s = {rates[0] / peak.flops:.0%} of peak, PyTorch "
            f"{rates[1] / 1e9:.1f} GFLOP/s = {rates[1] / peak.flops:.0%}; at peak a call "
            f"takes >= {flops / peak.flops:.3f} s")
    if not greedy:
      print("  outputs                  : sampled, so not compared", flush=True)
      continue
    agree = (ours == theirs).all(axis=1)
    first_diff = [-1 if a else int(np.argmax(o != h)) for o, h, a in zip(ours, theirs, agree)]
    print(f"  greedy outputs agree     : {int(agree.sum())}/{len(agree)} rows identical"
          + ("" if agree.all() else f"; first differing position per row {first_diff}"),
          flush=True)


if __name__ == "__main__":
  main()
