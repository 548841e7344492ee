"""Salience time per example: jaxmoral vs inseq's input_x_gradient, same weights, same device.

T5 1.1 small (8+8 layers, d_model 512, gated GELU), random weights converted to a Hugging Face
model (`bench/fair.py`), an NPOV input of 256 tokens and a 64-token response (T5 vocabulary
from ../shared/vocab/t5_tokenizer). inseq attributes with `attributed_fn="logit"`; its
per-embedding-dimension scores are summed over the last axis (= gradient . embedding), which
is exactly `token_salience(method="grad_x_input")`.

Runs under `bench/fair.py`'s rules: PyTorch with denormals flushed and XLA:CPU's thread count,
one untimed call of every side first (XLA compilation, PyTorch's first-call set-up; printed),
then interleaved timed rounds (inseq, each chunk size of ours, then again), every round
printed, and the ratio of the best rounds. Agreement: every chunk size's attributions must
match inseq's within `ATTRIBUTION_RTOL` x max |attribution| (elementwise; an attribution near
zero has no meaningful relative error, so the bound is relative to the largest), or no ratio
is printed and the script exits 1.

  python bench/bench_salience.py [--chunk_sizes 8,16,32]
  python bench/bench_salience.py --tiny            # smoke test: size tiny, 32 + 8 tokens
  JAX_PLATFORMS=cuda python bench/bench_salience.py --shared DIR   # both on the GPU

On a GPU both sides compute in exact float32 (PyTorch's default; JAX's matrix products are
set to full precision here, not TF32), PyTorch on the same GPU.

Needs `pip install inseq==0.7.1` (the `bench` extra), and `vocab/t5_tokenizer` and
`data/perspectrum/perspective_pool_v1.0.json` under `--shared` (default ../shared).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral.models.config import t5_config  # noqa: E402
from jaxmoral.models.t5 import T5, init_params  # noqa: E402
from jaxmoral import token_rows  # noqa: E402
from jaxmoral.npov.detectors import salience  # noqa: E402
import flax.linen as nn  # noqa: E402

import fair  # noqa: E402  (bench/fair.py)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"  # the default of --shared
# Attributions (gradient . embedding, float32): |ours - inseq| <= ATTRIBUTION_RTOL x the
# largest |attribution| of the example.
ATTRIBUTION_RTOL = 1e-4


def _texts(tokenizer, n_in: int, n_out: int, shared: pathlib.Path) -> tuple[str, str]:
  """Input / response texts that tokenise to exactly n_in / n_out ids (EOS included)."""
  data = json.loads((shared / "data/perspectrum/perspective_pool_v1.0.json").read_text())
  words = " ".join(p["text"] for p in data[:400]).split()

  def fit(prefix: str, n: int, offset: int) -> str:
    k = 1
    while len(tokenizer(prefix + " ".join(words[offset:offset + k])).input_ids) < n:
      k += 1
    text = prefix + " ".join(words[offset:offset + k])
    while len(tokenizer(text).input_ids) > n:  # trim characters until it fits exactly
      text = text[:-1]
    return text

  source = fit("{query: Should vaccination be compulsory?} {pro 1: ", n_in, 0)
  target = fit("People disagree. ", n_out, 1000)
  return source, target


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--input_tokens", type=int, default=256)
  parser.add_argument("--output_tokens", type=int, default=64)
  parser.add_argument("--chunk_sizes", default="8,16,32",
                      help="output positions per batched pass; each is timed and checked")
  parser.add_argument("--size", default="small")
  parser.add_argument("--shared", default=str(SHARED),
                      help="folder with vocab/t5_tokenizer and data/perspectrum")
  parser.add_argument("--tiny", action="store_true",
                      help="smoke test: size tiny, 32 input + 8 output tokens, chunk 8, 1 round")
  fair.add_arguments(parser, rounds=2)
  args = parser.parse_args()
  if args.tiny:
    args.size, args.input_tokens, args.output_tokens, args.chunk_sizes, args.rounds = (
        "tiny", 32, 8, "8", 1)
  shared = pathlib.Path(args.shared)
  on_gpu = jax.default_backend() == "gpu"
  if on_gpu:  # Exact float32 products, as PyTorch computes them by default.
    jax.config.update("jax_default_matmul_precision", "highest")
  if not (shared / "vocab/t5_tokenizer").is_dir():
    sys.exit(f"bench_salience: {shared}/vocab/t5_tokenizer not found")
  try:
    import inseq  # pylint: disable=g-import-not-at-top
  except ImportError:
    sys.exit("bench_salience: needs inseq (pip install inseq==0.7.1)")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  setup = fair.prepare(args.torch_threads)
  config = t5_config(size=args.size, vocab_size=32128)  # the T5 vocabulary's ids
  model = T5(config)
  params = nn.meta.unbox(init_params(model, jax.random.PRNGKey(0)))
  tokenizer = transformers.T5TokenizerFast.from_pretrained(str(shared / "vocab/t5_tokenizer"))
  source, target = _texts(tokenizer, args.input_tokens, args.output_tokens, shared)

  hf_model = fair.hf_model(params, config, perturb=args.perturb_torch)
  hf_model.config.bos_token_id = config.pad_token_id  # inseq needs it under transformers 5
  device = "cuda" if on_gpu else "cpu"
  attribution_model = inseq.load_model(hf_model, "input_x_gradient", tokenizer=tokenizer,
                                       device=device)

  def attribute():
    return attribution_model.attribute(input_texts=source, generated_texts=target,
                                       attributed_fn="logit", show_progress=False)

  where = (f"{torch.cuda.get_device_name()} (both sides)" if on_gpu
           else f"{setup.affinity_cores} CPU cores")
  chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
  fair.print_header(
      "salience: jaxmoral token_salience(grad_x_input) vs inseq input_x_gradient", setup,
      [f"model     : T5 {args.size}, random weights, float32, same in both (jaxmoral's init "
       f"-> HF state dict); {where}; inseq {importlib.metadata.version('inseq')}",
       f"timing    : one untimed call per side, then {args.rounds} interleaved rounds; "
       f"chunk sizes {chunk_sizes}",
       f"agreement : |ours - inseq| <= {ATTRIBUTION_RTOL:g} x max |attribution|, elementwise"])

  start = time.perf_counter()
  out = attribute()
  inseq_first_seconds = time.perf_counter() - start
  attr = out.sequence_attributions[0]
  theirs = attr.source_attributions.float().numpy().sum(-1)  # (source, target) tokens
  input_ids = [t.id for t in attr.source]
  target_ids = [t.id for t in attr.target][-theirs.shape[1]:]  # drop the decoder start
  theirs = theirs[:len(input_ids)]
  print(f"example: {len(input_ids)} input tokens, {len(target_ids)} output tokens; inseq "
        f"first call {inseq_first_seconds:.3f} s")
  scale = float(np.abs(theirs).max())

  sides = {"inseq": attribute}
  checks = []
  for chunk_size in chunk_sizes:
    def ours(chunk_size=chunk_size) -> np.ndarray:
      return salience.token_salience(model, params, input_ids=input_ids,
                                     target_ids=target_ids, chunk_size=chunk_size)
    start = time.perf_counter()
    mine = ours()
    print(f"jaxmoral chunk {chunk_size}: first call incl. compilation "
          f"{time.perf_counter() - start:.2f} s", flush=True)
    corr = np.corrcoef(mine.ravel(), theirs.ravel())[0, 1]
    check = fair.compare(f"attributions, chunk {chunk_size} (correlation {corr:.6f})", mine,
                         theirs, rtol=0.0, atol=ATTRIBUTION_RTOL * scale)
    checks.append(check)
    sides[f"jaxmoral chunk {chunk_size}"] = ours
  times = fair.interleave(sides, args.rounds, label="s/example")
  ok = fair.report(times, checks, ours="jaxmoral", theirs="inseq")
  if on_gpu or not ok:  # The floor below is a CPU argument (bench/machine.py measures a CPU).
    if not ok:
      sys.exit("bench_salience: attributions disagree")
    return
  # The floor: the program's FLOPs (XLA's cost analysis; one chunk spanning every output
  # position, so the loop body is the whole backward work) at this machine's measured peak.
  import machine  # pylint: disable=g-import-not-at-top  (bench/machine.py)
  n_out = len(target_ids)
  fn = salience._salience_fn(config, "grad_x_input", n_out, False)  # pylint: disable=protected-access
  encoder = np.zeros((1, token_rows.bucket(len(input_ids), 64)), np.int32)  # pylint: disable=protected-access
  encoder[0, :len(input_ids)] = input_ids
  cost = fn.lower(params, encoder, np.asarray([target_ids], np.int32), np.int32(1),
                  None).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  peak = machine.measured_peak()
  floor = cost["flops"] / peak.flops
  inseq_best = min(times["inseq"])
  print(f"work per example: {cost['flops'] / 1e9:.1f} GFLOP (XLA cost analysis: one forward "
        f"pass + {n_out} input-gradient backward passes); machine peak {peak.note}; at 100% "
        f"of peak that takes {floor:.3f} s, so no float32 implementation doing this work on "
        f"this machine can beat inseq's best {inseq_best:.3f} s by more than "
        f"{inseq_best / floor:.1f}x")


if __name__ == "__main__":
  main()
