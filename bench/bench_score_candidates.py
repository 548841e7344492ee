"""Teacher-forced scoring of several candidates per input: jaxmoral vs transformers' PyTorch T5.

What Diamante's ranking, the judges' class labels and `Model.score` do: each input has C
candidate targets whose log-likelihoods are wanted. Both sides encode each input once; the
PyTorch side then repeats the encoder states C times (`repeat_interleave`) and runs the
decoder over the B*C rows, which is how that is written with `T5ForConditionalGeneration`.
jaxmoral's `decoding.score_sequences` takes (B, C, T) targets and lets the C rows of an input
share one projection of its cross-attention keys/values.

Runs under `bench/fair.py`'s rules: the same random T5 1.1 weights on both sides (ours
converted to a HF state dict), float32, one process, PyTorch with denormals flushed and
XLA:CPU's thread count, interleaved timed rounds (every round printed, ratio of the best).
Agreement: every candidate's score (summed token log-probs) must match PyTorch's within
float32 tolerance (`fair.FLOAT32_RTOL`) or no ratio is printed and the script exits 1.

  python bench/bench_score_candidates.py --batch 4 --candidates 10
  python bench/bench_score_candidates.py --tiny   # smoke test, seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import fair  # noqa: E402  (bench/fair.py)
from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
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
  parser.add_argument("--tiny", action="store_true",
                      help="smoke test: size tiny, 2 inputs x 3 candidates, 16 + 8 tokens")
  fair.add_arguments(parser, rounds=5)
  parser.add_argument("--repeats", dest="rounds", type=int, help=argparse.SUPPRESS)  # old name
  args = parser.parse_args()
  if args.tiny:
    args.size, args.batch, args.candidates, args.input_length, args.target_length = (
        "tiny", 2, 3, 16, 8)
    args.rounds = 2
  setup = fair.prepare(args.torch_threads)

  config = t5_config(size=args.size)
  model = T5(config)
  params = nn.unbox(init_params(model, jax.random.PRNGKey(0)))
  hf = fair.hf_model(params, config, perturb=args.perturb_torch)
  rng = np.random.default_rng(0)
  b, c, t = args.batch, args.candidates, args.target_length
  inputs = rng.integers(2, config.vocab_size, (b, args.input_length)).astype(np.int32)
  targets = rng.integers(2, config.vocab_size, (b, c, t)).astype(np.int32)

  def ours() -> np.ndarray:
    return np.asarray(decoding.score_sequences(model, params, encoder_input_tokens=inputs,
                                               targets=targets))

  input_ids = torch.from_numpy(inputs.astype(np.int64))
  labels = torch.from_numpy(targets.reshape(b * c, t).astype(np.int64))
  # Decoder inputs given directly: `labels=` would also make HF compute a loss we do not use.
  decoder_input_ids = torch.cat(
      [torch.full((b * c, 1), config.decoder_start_token_id, dtype=torch.long), labels[:, :-1]],
      dim=1)

  def theirs() -> np.ndarray:
    with torch.inference_mode():
      encoded = hf.encoder(input_ids=input_ids).last_hidden_state
      encoded = encoded.repeat_interleave(c, dim=0)
      logits = hf(encoder_outputs=(encoded,), decoder_input_ids=decoder_input_ids).logits
      logprobs = torch.log_softmax(logits.float(), dim=-1)
      picked = logprobs.gather(-1, labels[..., None])[..., 0]
      return picked.sum(-1).reshape(b, c).numpy()

  rows = b * c
  fair.print_header(
      "teacher-forced candidate scoring: jaxmoral score_sequences vs PyTorch T5", setup,
      [f"model     : T5 1.1 {args.size}, random weights, float32, same in both (jaxmoral's "
       "init -> HF state dict)",
       f"work      : {b} inputs x {c} candidates, {args.input_length} input + {t} target "
       f"tokens; PyTorch encodes once and repeats the encoding {c} times",
       f"timing    : {args.rounds} interleaved rounds per side, best round counts"])
  start = time.perf_counter()
  mine = ours()
  compile_s = time.perf_counter() - start
  ref = theirs()
  print(f"first jaxmoral call incl. compile {compile_s:.1f} s", flush=True)
  checks = [fair.compare(f"scores of {rows} candidates (sum of target log-probs)", mine, ref)]
  times = fair.interleave({"jaxmoral": ours, "pytorch": theirs}, args.rounds)
  ok = fair.report(times, checks, ours="jaxmoral", theirs="pytorch", work=rows,
                   unit="candidates")
  if not ok:
    sys.exit("bench_score_candidates: scores disagree")


if __name__ == "__main__":
  main()
