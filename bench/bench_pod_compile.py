"""Compiles every TPU pod config for its topology from this CPU (libtpu) and tabulates the reports.

For each pod config the full sharded train step is lowered from abstract inputs and compiled by
the TPU compiler (`jaxmoral compile`, one subprocess per config so gin state and compiler memory
do not leak between them). The table gives per-chip memory (arguments, temporaries, outputs,
peak vs HBM), FLOPs per step per chip (XLA cost analysis), the analytic model FLOPs, the minimum
step time at 100% of the chip's bf16 peak, and MFU only for a step time you pass.

  python bench/bench_pod_compile.py [--only large,xl] [--step_time 0.5] [--out DIR]

Configs: the core pod configs below plus any `configs/*/*tpu_pod*.gin` whose comments name a
topology (`--topology=v5e:8x8`); a config that binds neither `runs.train_run` nor
`aot.compile_for_topology.target` is listed as not compiled, with the reason.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 1024 ** 3

# (name, gin file, topology, extra gin bindings)
CORE = [
    ("large", "configs/core/large_tpu_pod.gin", "v5e:8x8", []),
    ("xl", "configs/core/xl_tpu_pod.gin", "v5p:4x4x4", []),
    ("prompt-xxl", "configs/core/prompt_tuning_xxl_tpu_pod.gin", "v5e:8x8", []),
]
# Method configs bind their own compile target (`aot.compile_for_topology.target`); the
# topology of one whose comments name none:
METHOD_TOPOLOGY = {"configs/clarify/tpu_pod.gin": "v5p:4x4x4"}


def discover() -> list[tuple[str, str, str, list[str]]]:
  """Core entries plus method pod configs (topology from their comments or the table above)."""
  entries = list(CORE)
  core_files = {f for _, f, _, _ in CORE}
  for path in sorted(glob.glob(str(ROOT / "configs" / "*" / "*tpu_pod*.gin"))):
    rel = os.path.relpath(path, ROOT)
    if rel in core_files:
      continue
    text = pathlib.Path(path).read_text()
    match = re.search(r"--topology[= ](\S+)", text)
    topology = METHOD_TOPOLOGY.get(rel) or (match.group(1) if match else "v5e:8x8")
    name = rel.replace("configs/", "").replace(".gin", "")
    entries.append((name, rel, topology, []))
  return entries


def compile_one(name: str, gin_file: str, topology: str, bindings: list[str], out_dir: str,
                step_time: Optional[float], timeout: int) -> dict:
  report = os.path.join(out_dir, f"{name.replace('/', '_')}.json")
  cmd = [sys.executable, "-m", "jaxmoral.cli", "compile", f"--gin_file={gin_file}",
         f"--topology={topology}", f"--report={report}"]
  cmd += [f"--gin_bindings={b}" for b in bindings]
  if step_time is not None:
    cmd.append(f"--gin.aot.compile_for_topology.step_time_s={step_time}")
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  tick = time.time()
  try:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"name": name, "gin_file": gin_file, "topology": topology,
            "error": f"timed out after {timeout} s"}
  wall = time.time() - tick
  result = {"name": name, "gin_file": gin_file, "topology": topology, "wall_s": wall,
            "exit": proc.returncode}
  if os.path.exists(report):
    result.update(json.load(open(report)))
  if proc.returncode < 0:  # The kernel's OOM killer sends SIGKILL: say so, not a log line.
    result["error"] = (f"killed by signal {-proc.returncode}"
                       + (" (out of host memory?)" if proc.returncode == -9 else ""))
  elif proc.returncode != 0:
    lines = [l for l in proc.stderr.splitlines() if "error" in l.lower()]
    lines = lines or proc.stderr.strip().splitlines() or ["?"]
    result["error"] = lines[-1]
  return result


def fmt_table(results: list[dict]) -> str:
  head = ("| config | topology | mesh | args GiB | temp GiB | out GiB | peak GiB | HBM GiB | fits "
          "| XLA TFLOPs/chip | model TFLOPs (all) | min step ms | MFU | compile s |")
  rows = [head, "|" + "---|" * 14]
  for r in results:
    if "peak_bytes" not in r:
      rows.append(f"| {r['name']} | {r['topology']} | not compiled: {r.get('error')} |"
                  + " |" * 11)
      continue
    mesh = "x".join(str(v) for v in r["mesh"].values())
    mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%} / {r['model_mfu']:.1%}"
    rows.append(
        f"| {r['name']} | {r['topology']} | {mesh} | {r['argument_bytes'] / GiB:.2f} | "
        f"{r['temp_bytes'] / GiB:.2f} | {r['output_bytes'] / GiB:.2f} | "
        f"{r['peak_bytes'] / GiB:.2f} | {r['hbm_bytes'] / GiB:.0f} | "
        f"{'yes' if r['fits'] else 'NO'} | {r['flops_per_chip'] / 1e12:.2f} | "
        f"{r['model_flops_per_step'] / 1e12:.1f} | {r['min_step_time_s'] * 1e3:.1f} | {mfu} | "
        f"{r['compile_seconds']:.0f} |")
  return "\n".join(rows)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", default=None, help="comma list of config names")
  parser.add_argument("--step_time", type=float, default=None,
                      help="measured/assumed step time in seconds (for MFU)")
  parser.add_argument("--out", default="/tmp/jaxmoral_pod_compile")
  parser.add_argument("--timeout", type=int, default=3600, help="seconds per config")
  parser.add_argument("--gin", action="append", default=[],
                      help="extra gin binding for every config, e.g. "
                           "\"aot.compile_for_topology.stages = ('update',)\"")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  entries = discover()
  if args.only:
    wanted = set(args.only.split(","))
    entries = [e for e in entries if e[0] in wanted]
  results = []
  for name, gin_file, topology, bindings in entries:
    print(f"compiling {name}: {gin_file} for {topology} ...", flush=True)
    results.append(compile_one(name, gin_file, topology, bindings + args.gin, args.out,
                               args.step_time, args.timeout))
    print(fmt_table(results[-1:]).splitlines()[-1], flush=True)
  print()
  print(fmt_table(results))
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  return 0 if all("peak_bytes" in r and r["fits"] for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
