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
Checks that all three keep the same tokens (before drawing) and prints ms per step and ratios.

  python bench/bench_top_p.py --rows 1,16,64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jaxmoral import decoding  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="1,16,64", help="comma list of row counts")
  parser.add_argument("--vocab", type=int, default=32128)
  parser.add_argument("--top_p", type=float, default=0.6)
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--scale", type=float, default=3.0, help="logits = normal * scale")
  parser.add_argument("--repeats", type=int, default=7, help="calls per side per round")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--torch_threads", type=int, default=2)
  args = parser.parse_args()
  torch.set_num_threads(args.torch_threads)
  p, temp = args.top_p, args.temperature
  warpers = transformers.LogitsProcessorList([
      transformers.TemperatureLogitsWarper(temp), transformers.TopPLogitsWarper(p)])
  print(f"top_p {p}, temperature {temp}, vocab {args.vocab}, logits normal x {args.scale}; "
        f"median of {args.rounds} x {args.repeats} calls; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, torch {torch.__version__} ({args.torch_threads} "
        f"threads), transformers "
        f"{transformers.__version__}")
  for rows in [int(r) for r in args.rows.split(",")]:
    logits_np = (np.random.default_rng(rows).normal(size=(rows, args.vocab))
                 * args.scale).astype(np.float32)
    logits = jnp.asarray(logits_np)
    logits_torch = torch.from_numpy(logits_np)
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
      kept_torch = torch.isfinite(warpers(None, logits_torch)).numpy()
    sorted_greedy = decoding.sample_logits(None, logits, top_p=p, temperature=temp,
                                           top_k=args.vocab, greedy=True)[1]
    search_greedy = decoding.sample_logits(None, logits, top_p=p, temperature=temp,
                                           greedy=True)[1]
    timed = {"search": lambda: jax.block_until_ready(search(key, logits)),
             "sort": lambda: jax.block_until_ready(sort(key, logits)),
             "torch": run_torch}
    for fn in timed.values():
      fn()
    times = {name: [] for name in timed}
    for _ in range(args.rounds):  # Rounds, so load drifts hit every side alike.
      for name, fn in timed.items():
        for _ in range(args.repeats):
          start = time.perf_counter()
          fn()
          times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f"rows {rows}: kept tokens per row {kept_search.sum(-1).min()}-"
          f"{kept_search.sum(-1).max()}; same kept set as transformers' warper: "
          f"{int((kept_search == kept_torch).all(-1).sum())}/{rows} rows; as the sorted "
          f"mass (top token's log-prob): "
          f"{bool(np.allclose(sorted_greedy, search_greedy, atol=1e-6))}")
    print(f"  jaxmoral, threshold search : {ms['search']:8.3f} ms")
    print(f"  jaxmoral, full sort        : {ms['sort']:8.3f} ms  "
          f"({ms['sort'] / ms['search']:.1f}x the search)")
    print(f"  transformers warper        : {ms['torch']:8.3f} ms  "
          f"({ms['torch'] / ms['search']:.1f}x the search)", flush=True)


if __name__ == "__main__":
  main()
