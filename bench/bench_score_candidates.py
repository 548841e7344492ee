"""Teacher-forced scoring of several candidates per input: jaxmoral vs transformers' PyTorch T5.

What Diamante's ranking, the judges' class labels and `Model.score` do: each input has C
candidate targets whose log-likelihoods are wanted. Both sides encode each input once; the
PyTorch side then repeats the encoder states C times (`repeat_interleave`) and runs the
decoder over the B*C rows, which is how that is written with `T5ForConditionalGeneration`.
jaxmoral's `decoding.score_sequences` takes (B, C, T) targets and lets the C rows of an input
share one projection of its cross-attention keys/values. Same random T5 1.1 weights, same
inputs, float32, one process; scores must agree.

  python bench/bench_score_candidates.py --batch 4 --candidates 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_generate import hf_model  # noqa: E402  (bench/bench_generate.py)
from jaxmoral import decoding  # noqa: E402
from jaxmoral.models.config import t5_config  # noqa: E402
from jaxmoral.models.t5 import T5, init_params  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="small")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--candidates", type=int, default=10)
  parser.add_argument("--input_length", type=int, default=64)
  parser.add_argument("--target_length", type=int, default=24)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--torch_threads", type=int, default=2)
  args = parser.parse_args()
  torch.set_num_threads(args.torch_threads)

  config = t5_config(size=args.size)
  model = T5(config)
  params = nn.unbox(init_params(model, jax.random.PRNGKey(0)))
  hf = hf_model(params, config)
  rng = np.random.default_rng(0)
  b, c, t = args.batch, args.candidates, args.target_length
  inputs = rng.integers(2, config.vocab_size, (b, args.input_length)).astype(np.int32)
  targets = rng.integers(2, config.vocab_size, (b, c, t)).astype(np.int32)

  def ours() -> np.ndarray:
    return np.asarray(decoding.score_sequences(model, params, encoder_input_tokens=inputs,
                                               targets=targets))

  input_ids = torch.from_numpy(inputs.astype(np.int64))
  labels = torch.from_numpy(targets.reshape(b * c, t).astype(np.int64))

  def theirs() -> np.ndarray:
    with torch.inference_mode():
      encoded = hf.encoder(input_ids=input_ids).last_hidden_state
      encoded = encoded.repeat_interleave(c, dim=0)
      logits = hf(encoder_outputs=(encoded,), labels=labels).logits
      logprobs = torch.log_softmax(logits.float(), dim=-1)
      picked = logprobs.gather(-1, labels[..., None])[..., 0]
      return picked.sum(-1).reshape(b, c).numpy()

  start = time.perf_counter()
  mine = ours()
  compile_s = time.perf_counter() - start
  ref = theirs()
  jax_times, torch_times = [], []
  for _ in range(args.repeats):  # Interleaved, so drifts in load hit both sides alike.
    start = time.perf_counter()
    ours()
    jax_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    theirs()
    torch_times.append(time.perf_counter() - start)
  ours_s, theirs_s = statistics.median(jax_times), statistics.median(torch_times)
  rows = b * c
  print(f"T5 1.1 {args.size}, {b} inputs x {c} candidates, {args.input_length} input + {t} "
        f"target tokens, float32; jax {jax.__version__} on {jax.devices()[0].platform}, torch "
        f"{torch.__version__} ({args.torch_threads} threads); median of {args.repeats}")
  print(f"  jaxmoral score_sequences : {ours_s * 1e3:8.1f} ms ({rows / ours_s:7.1f} candidates/s; "
        f"first call incl. compile {compile_s:.1f} s)")
  print(f"  PyTorch, encoder once    : {theirs_s * 1e3:8.1f} ms ({rows / theirs_s:7.1f} "
        f"candidates/s)")
  diff = np.abs(mine - ref).max()
  print(f"  speed-up                 : {theirs_s / ours_s:8.2f}x; max |score diff| "
        f"{diff:.2e} (scores ~{np.abs(ref).mean():.0f})")
  if diff > 1e-5 * np.abs(ref).max() + 1e-4:
    sys.exit("bench_score_candidates: scores disagree")


if __name__ == "__main__":
  main()
