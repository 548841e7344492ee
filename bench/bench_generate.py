"""Greedy generation throughput: jaxmoral.decoding vs transformers' PyTorch `generate`.

Runs under `bench/fair.py`'s rules: the same random T5 1.1-small weights in both (our params
converted to a HF state dict), PyTorch with denormals flushed and XLA:CPU's thread count, same
inputs, same machine, same process, interleaved timed rounds (ours, [XLA's dot,] PyTorch, then
again), every round printed and the ratio of the best rounds. Both decode exactly
`--new_tokens` tokens (EOS banned until then: `min_length` here, `min_new_tokens` there) so
they do equal work.

Agreement, checked before any ratio is printed (float32 tolerance, `fair.FLOAT32_RTOL`):
  - greedy ids: rows must be identical; a row that differs passes only when, at its first
    differing position, PyTorch's own logits (teacher-forced on the shared prefix) put the two
    chosen tokens within float32 tolerance of each other (a tie that rounding breaks);
  - scores: the teacher-forced log-likelihood of every sequence jaxmoral generated, by
    `decoding.score_sequences` and by the PyTorch model, must agree (greedy and sampled).
Sampled draws cannot be compared (different random generators); only the scores are.

  python bench/bench_generate.py --batch 1,8,32   # 64 input tokens, 32 new tokens
  python bench/bench_generate.py --batch 16 --top_p 0.6 --temperature 0.7   # sampled
  python bench/bench_generate.py --batch 2 --num_samples 16 --temperature 0.7 --input_length 256
  python bench/bench_generate.py --tiny           # smoke test, seconds

With `--top_p` below 1 or `--temperature` other than 1 both sample (`do_sample=True`,
`top_k=0` there) instead of taking the argmax. `--num_samples N` (sampling only) draws N
continuations per input (`num_return_sequences` there).

On a GPU (`JAX_PLATFORMS=cuda`), PyTorch runs on the same GPU; `--dtype bfloat16` gives both
sides bf16 weights and activations (ours: the params cast once, as `jaxmoral export
--dtype bfloat16` stores them), and each row also reports the decoder's weight reads per second
against the device's memory bandwidth measured in the same run (a large on-device copy):
a decoding step at small batch reads every decoder weight once and little else. There (and
with bf16) the agreement tolerance is `fair.REDUCED_RTOL`.

jaxmoral decodes through the backend `--backend` names ("auto": XLA's ops; "cpu_packed": the
C++ kernels of `jaxmoral.backends.cpu_kernels` through `decoding.PackedKernelBackend`), its
kernels prepared once outside the timing;
`--also_xla_dot` times the same sampler with the "xla" backend's kernels in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fair  # noqa: E402  (bench/fair.py)
import machine  # noqa: E402  (bench/machine.py)
from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import decoding  # noqa: E402
from jaxmoral.models.config import T5Config, t5_config  # noqa: E402
from jaxmoral.models.t5 import T5, init_params  # noqa: E402

hf_model = fair.hf_model  # The converter lives in bench/fair.py (kept here for old imports).


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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="small")
  parser.add_argument("--batch", default="8", help="comma list of batch sizes, one row each")
  parser.add_argument("--input_length", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--top_p", type=float, default=1.0, help="< 1: sample with top-p")
  parser.add_argument("--temperature", type=float, default=1.0,
                      help="!= 1: sample with this temperature")
  parser.add_argument("--num_samples", type=int, default=1,
                      help="continuations per input (sampling only)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="weights and activations of both sides")
  parser.add_argument("--backend", default="auto",
                      help='decoding backend: "auto", "xla" or "cpu_packed"')
  parser.add_argument("--also_xla_dot", action="store_true",
                      help="also time jaxmoral with the 'xla' decoding backend (XLA's dot)")
  parser.add_argument("--tiny", action="store_true",
                      help="smoke test: size tiny, batch 2, 16 input + 8 new tokens, 2 rounds")
  fair.add_arguments(parser, rounds=3)
  parser.add_argument("--repeats", dest="rounds", type=int, help=argparse.SUPPRESS)  # old name
  args = parser.parse_args()
  if args.tiny:
    args.size, args.batch, args.input_length, args.new_tokens, args.rounds = (
        "tiny", "2", 16, 8, 2)

  setup = fair.prepare(args.torch_threads)
  config = t5_config(size=args.size, dtype=args.dtype)
  model = T5(config)
  params = nn.unbox(init_params(model, jax.random.PRNGKey(0)))
  hf = fair.hf_model(params, config, perturb=args.perturb_torch)
  on_gpu = jax.default_backend() == "gpu"
  torch_device = "cuda" if on_gpu else "cpu"
  if args.dtype == "bfloat16":
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    hf = hf.to(torch.bfloat16)
  hf = hf.to(torch_device)
  rtol, atol, tol_name = fair.tolerance(args.dtype, setup.platform)
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
  lines = [f"model     : T5 1.1 {args.size} random weights ({args.dtype}), same in both "
           f"(jaxmoral's init -> HF state dict)",
           f"work      : {args.input_length} input tokens, {new} new tokens, {how}; "
           f"{args.rounds} interleaved rounds per side, best round counts",
           f"agreement : {tol_name} tolerance {atol:g} + {rtol:g} x |theirs|"]
  if on_gpu:
    bandwidth = measured_copy_bandwidth()
    lines.append(f"device    : memory bandwidth (copy, bytes read + written) "
                 f"{bandwidth / 1e12:.2f} TB/s; decoder weights "
                 f"{decoder_weight_bytes / 1e6:.0f} MB ({args.dtype})")
  else:
    peak = machine.measured_peak()
    lines.append(f"peak      : {peak.note}")
  fair.print_header("generation: jaxmoral.decoding vs transformers generate", setup, lines)
  # The backend's kernels, prepared once per set of parameters as their owner does (outside
  # the timing, like loading the PyTorch model).
  decode_weights = decoding.prepare_decode_weights(model, params, backend=args.backend)
  xla_weights = (decoding.prepare_decode_weights(model, params, backend="xla")
                 if args.also_xla_dot else None)
  packed = decode_weights.backend
  all_ok = True
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

    def run_jax(weights=decode_weights):
      return jax.block_until_ready(sampler(params, inputs, rng=jax.random.PRNGKey(0),
                                           decode_weights=weights))

    def run_xla_dot():
      return run_jax(xla_weights)

    start = time.perf_counter()
    out = run_jax()
    compile_s = time.perf_counter() - start
    ours = np.asarray(out.tokens)  # (batch, samples, new)
    xla_tokens = np.asarray(run_xla_dot().tokens)[:, 0] if args.also_xla_dot else None
    theirs = run_torch()[:, 1:].numpy()  # Drop the decoder start token; also the warm-up.

    # Agreement. PyTorch's logits, teacher-forced on every sequence jaxmoral generated.
    rows = ours.reshape(batch * samples, new)
    lengths = np.asarray(out.lengths).reshape(-1)
    dec_in = np.concatenate([np.full((len(rows), 1), config.decoder_start_token_id), rows[:, :-1]],
                            axis=1)
    with torch.inference_mode():
      logits = hf(input_ids=input_ids.repeat_interleave(samples, dim=0),
                  attention_mask=attention_mask.repeat_interleave(samples, dim=0),
                  decoder_input_ids=torch.from_numpy(dec_in.astype(np.int64)).to(torch_device)
                  ).logits.float().cpu()
    logprobs = torch.log_softmax(logits, dim=-1).gather(
        -1, torch.from_numpy(rows.astype(np.int64))[..., None])[..., 0].numpy()
    theirs_scores = np.where(np.arange(new) < lengths[:, None], logprobs, 0.0).sum(-1)
    ours_scores = np.asarray(decoding.score_sequences(
        model, params, encoder_input_tokens=inputs, targets=ours,
        lengths=np.asarray(out.lengths))).reshape(-1)
    logits = logits.numpy()

    def gap(row, pos, a, b):
      return abs(float(logits[row, pos, a] - logits[row, pos, b])), float(
          np.abs(logits[row, pos]).max())

    checks = [fair.compare("teacher-forced log-likelihood of jaxmoral's sequences "
                           "(score_sequences vs PyTorch)", ours_scores, theirs_scores,
                           rtol=rtol, atol=atol)]
    if greedy:
      checks.append(fair.compare_greedy_ids("greedy ids, jaxmoral vs PyTorch generate",
                                            ours[:, 0], theirs, gap, tie_tol=rtol))
      if args.also_xla_dot:
        checks.append(fair.compare_greedy_ids("greedy ids, packed kernels vs XLA's dot",
                                              ours[:, 0], xla_tokens, gap, tie_tol=rtol))
    else:
      print("  (sampled: the draws come from different generators and are not compared)")

    sides = {"jaxmoral": run_jax}
    if args.also_xla_dot:
      sides["jaxmoral, XLA's dot"] = run_xla_dot
    sides["pytorch"] = run_torch
    print(f"batch {batch}: first jaxmoral call incl. compile {compile_s:.1f} s; decoding "
          f"backend {packed!r}", flush=True)
    times = fair.interleave(sides, args.rounds)
    ok = fair.report(times, checks, ours="jaxmoral", theirs="pytorch", work=work,
                     unit="tokens")
    all_ok &= ok
    flops = generation_flops(config, batch, args.input_length, new, samples)
    best = {name: min(t) for name, t in times.items()}
    if on_gpu:
      print(f"  work per call: {flops / 1e9:.1f} GFLOP (matrix products); "
            + ", ".join(f"{name} {flops / t / 1e12:.2f} TFLOP/s" for name, t in best.items()))
      # Every step reads all decoder weights (self/cross attention, MLP, logits) once.
      print("  decoder weight reads: " + ", ".join(
          f"{name} {decoder_weight_bytes * new / t / 1e9:.0f} GB/s = "
          f"{decoder_weight_bytes * new / t / bandwidth:.0%} of the copy bandwidth"
          for name, t in best.items()), flush=True)
    else:
      print(f"  work per call: {flops / 1e9:.1f} GFLOP (matrix products); at peak a call "
            f"takes >= {flops / peak.flops:.3f} s; "
            + ", ".join(f"{name} {flops / t / 1e9:.1f} GFLOP/s = {flops / t / peak.flops:.0%} "
                        "of peak" for name, t in best.items()), flush=True)
  if not all_ok:
    sys.exit(1)


if __name__ == "__main__":
  main()
