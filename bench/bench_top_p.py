"""One top-p sampling step: `decoding.sample_logits` vs transformers' top-p warper + multinomial.

Same logits (random normal x `--scale`, rows x vocab) on every side, same machine, same
process, timed in rounds of `--repeats` calls per side (not call by call: right after a
PyTorch call its OpenMP threads still spin, which doubled the next millisecond-scale JAX
call):
  - jaxmoral: `sample_logits(top_p=..., temperature=...)`: `nucleus_mask`, a threshold search
    without a sort;
  - jaxmoral sorting first: the same call with `top_k=vocab`, i.e. `jax.lax.top_k` over the
    whole vocabulary, then the cumulative mass (how `sample_logits` did top-p before);
  - PyTorch: transformers' `TemperatureLogitsWarper` + `TopPLogitsWarper` (a sort and a
    cumulative sum), softmax and `torch.multinomial`, as `generate(do_sample=True)` runs them.
Runs under `bench/fair.py`'s rules (PyTorch with denormals flushed and XLA:CPU's thread count,
interleaved rounds, every round printed, ratios of the best rounds). Agreement, checked before
any ratio: the threshold search must keep the same tokens as transformers' warper in every row
(before drawing), except tokens whose place in the nucleus float32 cannot decide: those whose
probability mass ranked above them is within `BOUNDARY_TOL` of top_p; and the renormalised
distributions drawn from must agree within float32 tolerance (`fair.FLOAT32_RTOL`). The draws
themselves come from different generators and are not compared.

  python bench/bench_top_p.py --rows 1,16,64
  python bench/bench_top_p.py --tiny   # smoke test, seconds
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import fair  # noqa: E402  (bench/fair.py)
from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import decoding  # noqa: E402

# Float32 sums of a 32k-entry distribution are good to ~1e-6; a token whose preceding mass is
# this close to top_p may fall on either side of it.
BOUNDARY_TOL = 1e-5


def kept_agreement(rows: int, logits: np.ndarray, temp: float, p: float, ours: np.ndarray,
                   theirs: np.ndarray) -> fair.Agreement:
  """Kept sets agree where identical, or where they differ only in tokens on the boundary."""
  z = logits.astype(np.float64) / temp
  probs = np.exp(z - z.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  order = np.argsort(-probs, axis=-1, kind="stable")
  before = np.cumsum(np.take_along_axis(probs, order, -1), -1) - np.take_along_axis(
      probs, order, -1)
  mass_before = np.empty_like(before)
  np.put_along_axis(mass_before, order, before, -1)
  differ = ours != theirs
  undecided = np.abs(mass_before - p) <= BOUNDARY_TOL
  bad = differ & ~undecided
  same_rows = int((~differ).all(-1).sum())
  detail = (f"{same_rows}/{rows} rows identical; {int(differ.sum())} token(s) differ, "
            f"{int(bad.sum())} of them not on the nucleus boundary (tolerance {BOUNDARY_TOL:g})")
  return fair.Agreement("kept tokens, threshold search vs transformers' warper", not bad.any(),
                        detail)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="1,16,64", help="comma list of row counts")
  parser.add_argument("--vocab", type=int, default=32128)
  parser.add_argument("--top_p", type=float, default=0.6)
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--scale", type=float, default=3.0, help="logits = normal * scale")
  parser.add_argument("--repeats", type=int, default=7, help="calls per side per round")
  parser.add_argument("--tiny", action="store_true",
                      help="smoke test: rows 1,4, vocab 1024, 2 rounds x 2 calls")
  fair.add_arguments(parser, rounds=3)
  args = parser.parse_args()
  if args.tiny:
    args.rows, args.vocab, args.repeats, args.rounds = "1,4", 1024, 2, 2
  setup = fair.prepare(args.torch_threads)
  p, temp = args.top_p, args.temperature
  warpers = transformers.LogitsProcessorList([
      transformers.TemperatureLogitsWarper(temp), transformers.TopPLogitsWarper(p)])
  fair.print_header(
      "one top-p sampling step: decoding.sample_logits vs transformers' warpers", setup,
      [f"work      : top_p {p}, temperature {temp}, vocab {args.vocab}, logits normal x "
       f"{args.scale}",
       f"timing    : {args.rounds} interleaved rounds x {args.repeats} calls per side; best "
       "round (mean per call) counts"])
  all_ok = True
  for rows in [int(r) for r in args.rows.split(",")]:
    logits_np = (np.random.default_rng(rows).normal(size=(rows, args.vocab))
                 * args.scale).astype(np.float32)
    logits = jnp.asarray(logits_np)
    logits_torch = torch.from_numpy(logits_np)
    if args.perturb_torch:  # the agreement check's own check
      noise = np.random.default_rng(1).normal(size=logits_np.shape)
      logits_torch = torch.from_numpy(
          (logits_np * (1 + args.perturb_torch * noise)).astype(np.float32))
    key = jax.random.PRNGKey(0)
    search = jax.jit(lambda k, x: decoding.sample_logits(k, x, top_p=p, temperature=temp))
    sort = jax.jit(lambda k, x: decoding.sample_logits(k, x, top_p=p, temperature=temp,
                                                       top_k=args.vocab))

    def run_torch():
      with torch.inference_mode():
        warped = warpers(None, logits_torch)
        return torch.multinomial(torch.softmax(warped, dim=-1), 1)

    # The kept sets, before any draw: the search, the sorted mass, the warper.
    kept_search = np.asarray(decoding.nucleus_mask(
        jax.nn.softmax(logits / temp, axis=-1), p))
    with torch.inference_mode():
      warped = warpers(None, logits_torch)
      kept_torch = torch.isfinite(warped).numpy()
      dist_torch = torch.softmax(warped, dim=-1).numpy()
    # The distribution each side draws from: softmax(logits / temperature) on the kept set,
    # renormalised.
    probs = np.asarray(jax.nn.softmax(logits / temp, axis=-1))
    dist_search = np.where(kept_search, probs, 0.0)
    dist_search /= dist_search.sum(-1, keepdims=True)
    sorted_greedy = decoding.sample_logits(None, logits, top_p=p, temperature=temp,
                                           top_k=args.vocab, greedy=True)[1]
    search_greedy = decoding.sample_logits(None, logits, top_p=p, temperature=temp,
                                           greedy=True)[1]
    timed = {"search": lambda: jax.block_until_ready(search(key, logits)),
             "sort": lambda: jax.block_until_ready(sort(key, logits)),
             "torch": run_torch}
    for fn in timed.values():
      fn()
    print(f"rows {rows}: kept tokens per row {kept_search.sum(-1).min()}-"
          f"{kept_search.sum(-1).max()}; search and sorted mass agree on the top token's "
          f"log-prob: {bool(np.allclose(sorted_greedy, search_greedy, atol=1e-6))}", flush=True)
    # Rounds of `repeats` calls per side (not call by call: right after a PyTorch call its
    # OpenMP threads still spin, which doubled the next millisecond-scale JAX call).
    times = fair.interleave(timed, args.rounds, calls_per_round=args.repeats)
    checks = [kept_agreement(rows, logits_np, temp, p, kept_search, kept_torch),
              fair.compare("the distribution drawn from (kept, renormalised)", dist_search,
                           dist_torch)]
    all_ok &= fair.report(times, checks, ours="search", theirs="torch")
  if not all_ok:
    sys.exit(1)


if __name__ == "__main__":
  main()
