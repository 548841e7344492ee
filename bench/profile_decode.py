"""Where a CPU decoding step spends its time: op time per step from a `jax.profiler` trace.

Traces one `decoding.sample` call (T5 1.1-small, random weights; greedy unless --top_p or
--temperature say otherwise), maps every traced XLA op to its source (`op_name` in the
compiled HLO) and prints milliseconds per decoding step by source (layers merged), plus the
time of ops outside the decoding loop (encoder, cache set-up).
Ops that run concurrently on the two threads both count, so the sum can exceed the wall time.

  python bench/profile_decode.py --batch 8                          # packed CPU kernels
  JAXMORAL_CPU_KERNELS=0 python bench/profile_decode.py --batch 8   # XLA's dot
  python bench/profile_decode.py --batch 16 --top_p 0.6 --temperature 0.7   # sampled
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from profile_train_step import perfetto_trace  # noqa: E402  (bench/profile_train_step.py)
from jaxmoral import runtime  # noqa: E402
runtime.configure()  # The XLA flags and malloc settings the CLI runs with.
from jaxmoral import decoding  # noqa: E402
from jaxmoral.models.config import t5_config  # noqa: E402
from jaxmoral.models.t5 import T5, init_params  # noqa: E402

_RUNTIME_EVENTS = ("ThunkExecutor", "SlinkyThread", "$", "end:", "Threadpool", "while",
                   "PjitFunction", "CommonPjRt")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="small")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--input_length", type=int, default=64)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--top_p", type=float, default=1.0, help="< 1: sample with top-p")
  parser.add_argument("--temperature", type=float, default=1.0,
                      help="!= 1: sample with this temperature")
  args = parser.parse_args()
  config = t5_config(size=args.size)
  model = T5(config)
  params = nn.unbox(init_params(model, jax.random.PRNGKey(0)))
  steps = args.new_tokens
  inputs = np.random.default_rng(0).integers(2, config.vocab_size,
                                             size=(args.batch, args.input_length),
                                             dtype=np.int32)
  greedy = args.top_p == 1.0 and args.temperature == 1.0
  sampler = decoding.make_sampler(model, max_decode_length=steps, greedy=greedy,
                                  temperature=args.temperature, top_p=args.top_p,
                                  min_length=steps, eos_id=config.eos_token_id)
  rng = jax.random.PRNGKey(0)
  hlo = sampler.lower(params, inputs, rng=rng).compile().as_text()
  sources = dict(re.findall(r"%([\w.\-]+) = [^\n]*?metadata=\{op_name=\"([^\"]+)\"", hlo))
  run = lambda: jax.block_until_ready(sampler(params, inputs, rng=rng).tokens)  # noqa: E731
  run()
  run()
  out = tempfile.mkdtemp(prefix="jaxmoral_decode_profile_")
  with jax.profiler.trace(out, create_perfetto_trace=True):
    run()
  path, events = perfetto_trace(out)
  events = [e for e in events
            if e.get("ph") == "X" and not e["name"].startswith(_RUNTIME_EVENTS)]
  calls = collections.Counter(e["name"] for e in events)
  per_step: dict[str, float] = collections.defaultdict(float)
  outside = 0.0
  for e in events:
    if calls[e["name"]] < steps:  # Runs fewer times than there are steps: outside the loop.
      outside += e["dur"]
      continue
    source = sources.get(e["name"], e["name"])
    source = re.sub(r"layers_\d+", "layers_*", source.split("/while/body/")[-1])
    per_step[source] += e["dur"] / steps
  how = "greedy" if greedy else f"top_p {args.top_p}, temperature {args.temperature}"
  print(f"{args.size}, batch {args.batch}, {args.input_length} input -> {steps} tokens, {how}; "
        f"packed CPU kernels: {decoding.use_packed_kernels(model, params)}; trace {path}")
  print(f"outside the decoding loop: {outside / 1e3:8.2f} ms")
  print(f"decoding step, all ops:    {sum(per_step.values()) / 1e3:8.3f} ms per step")
  for source, us in sorted(per_step.items(), key=lambda kv: -kv[1])[:args.top]:
    print(f"  {us / 1e3:7.3f} ms  {source}")


if __name__ == "__main__":
  main()
