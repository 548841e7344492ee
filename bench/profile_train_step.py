"""Where a T5 train step spends its accelerator time: a kernel-time table from `jax.profiler`.

Builds the same step as `bench_train_mfu.py`, times it, then traces `--trace_steps` steps with
`jax.profiler.trace` (a Perfetto trace is written beside the TensorBoard profile) and prints,
per step, the device time of each kernel grouped into matrix products, attention-shaped
element-wise work and the rest, with the largest kernels by name. The optimized HLO of the
step is written too (`train_step.hlo.txt.gz`), so a fusion's name can be looked up.

  python bench/profile_train_step.py --size large --batch 32 --out /tmp/prof
  python bench/profile_train_step.py --size large --override attention_impl=cudnn
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import time

import jax

from bench_train_mfu import add_step_args, build_step  # bench/bench_train_mfu.py

_MATMUL_MARKS = ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "dot", "triton_gemm")
# Attention kernels: cuDNN's fused attention and the Pallas Triton ones (attention_impl
# "cudnn" / "pallas_gpu").
_ATTENTION_MARKS = ("fmha", "cudnn", "flash_attention", "sdpa")


def perfetto_trace(trace_dir: str) -> tuple[str, list[dict]]:
  """(path, events) of the newest Perfetto trace `jax.profiler.trace` wrote under trace_dir."""
  paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  path = sorted(paths)[-1]
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  return path, trace["traceEvents"] if isinstance(trace, dict) else trace


def kernel_table(trace_dir: str) -> tuple[dict[str, float], int]:
  """{kernel name: total microseconds} over the device streams of the Perfetto trace."""
  _, events = perfetto_trace(trace_dir)
  process_names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"}
  device_pids = {pid for pid, name in process_names.items()
                 if "/device:" in name and "CPU" not in name and "Megascale" not in name}
  print(f"trace processes: {sorted(set(process_names.values()))}")
  totals: dict[str, float] = collections.defaultdict(float)
  count = 0
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in device_pids:
      totals[e["name"]] += float(e.get("dur", 0.0))
      count += 1
  print(f"trace: {len(events)} events, {count} on devices "
        f"{sorted(process_names[p] for p in device_pids)}")
  return dict(totals), count


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_step_args(parser)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--trace_steps", type=int, default=2)
  parser.add_argument("--top", type=int, default=40)
  parser.add_argument("--out", default="/tmp/jaxmoral_profile")
  args = parser.parse_args()

  _, trainer, batch, flops = build_step(args)
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  state = trainer.init_state(jax.random.PRNGKey(0))
  jax.block_until_ready(state)
  print(f"init_state {time.perf_counter() - start:.0f} s", flush=True)
  start = time.perf_counter()
  compiled = trainer.lower_train_step(
      {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}).compile()
  print(f"compile {time.perf_counter() - start:.0f} s", flush=True)
  with gzip.open(os.path.join(args.out, "train_step.hlo.txt.gz"), "wt") as f:
    f.write(compiled.as_text())
  device_batch = dict(trainer.shard_batch(batch))
  rng = jax.random.PRNGKey(1)
  step = compiled  # The step compiled above (trainer.train_step would compile it again).
  for _ in range(2):
    state, metrics = step(state, device_batch, rng)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(args.steps):
    state, metrics = step(state, device_batch, rng)
  jax.block_until_ready((state, metrics))
  per_step = (time.perf_counter() - start) / args.steps
  print(f"loss {float(metrics['loss']):.3f}; {per_step * 1e3:.1f} ms/step; "
        f"MFU {100 * flops / per_step / 1e12 / args.peak_tflops:.1f} %", flush=True)

  trace_dir = os.path.join(args.out, "trace")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(args.trace_steps):
      state, metrics = step(state, device_batch, rng)
    jax.block_until_ready((state, metrics))
  totals, _ = kernel_table(trace_dir)
  per_step_us = {name: t / args.trace_steps for name, t in totals.items()}
  busy = sum(per_step_us.values())
  matmul = sum(t for n, t in per_step_us.items() if any(m in n.lower() for m in _MATMUL_MARKS))
  attention = {n: t for n, t in per_step_us.items()
               if any(m in n.lower() for m in _ATTENTION_MARKS)}
  matmul -= sum(t for n, t in attention.items()
                if any(m in n.lower() for m in _MATMUL_MARKS))
  print(f"device busy {busy / 1e3:.1f} ms/step of {per_step * 1e3:.1f} ms wall; matrix "
        f"products {matmul / 1e3:.1f} ms; attention kernels "
        f"{sum(attention.values()) / 1e3:.1f} ms; other kernels "
        f"{(busy - matmul - sum(attention.values())) / 1e3:.1f} ms")
  for name, t in sorted(attention.items(), key=lambda kv: -kv[1]):
    print(f"  attention {t / 1e3:8.2f} ms/step  {name[:120]}")
  print(f"{'ms/step':>8} {'%busy':>6}  kernel")
  for name, t in sorted(per_step_us.items(), key=lambda kv: -kv[1])[:args.top]:
    print(f"{t / 1e3:8.2f} {100 * t / busy:6.1f}  {name[:150]}")
  with open(os.path.join(args.out, "kernels.json"), "w") as f:
    json.dump(per_step_us, f)


if __name__ == "__main__":
  main()
