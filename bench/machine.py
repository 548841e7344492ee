"""This machine's float32 peak, measured: cores x clock x FMA throughput per cycle.

`measured_peak()` compiles `peak_flops.c` (needs a C compiler) and runs it on every core at
once: it times independent vector FMA chains (bound by FMA throughput only) and the core clock
(a chain of dependent one-cycle adds). The product of cores, clock and the measured FLOPs per
cycle is the peak that an ideal program could reach on this machine, which is what "% of peak"
in the benchmarks is measured against. Where no compiler is found it falls back to the
ISA-width estimate and says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Peak:
  flops: float  # float32 FLOP/s, all cores
  note: str


def _estimate() -> Peak:
  text = open("/proc/cpuinfo").read()
  flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())
  mhz = [float(x) for x in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)]
  cores = len(os.sched_getaffinity(0))
  lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
  ghz = max(mhz) / 1000 if mhz else 2.0
  peak = cores * ghz * 1e9 * lanes * 2 * 2
  return Peak(peak, f"ESTIMATE (no C compiler): {cores} cores x {ghz:.2f} GHz x {lanes} lanes "
                    f"x 2 FMA ports x 2 = {peak / 1e9:.0f} GFLOP/s")


def measured_peak(iterations: int = 20_000_000, repeats: int = 3) -> Peak:
  """Measured all-core float32 peak (see the module doc): the best of `repeats` runs, since
  a noisy neighbour on a shared VM can only slow a run down."""
  compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
  if not compiler:
    return _estimate()
  cores = len(os.sched_getaffinity(0))
  cpuinfo = open("/proc/cpuinfo").read()
  model = re.search(r"^model name\s*:(.*)$", cpuinfo, re.M)
  flags = re.search(r"^flags\s*:(.*)$", cpuinfo, re.M)
  # The widest vector the CPU has: 64-byte vectors on a CPU without AVX-512 would need twice
  # the 16 registers the FMA chains can live in (gcc: "impossible constraint in asm").
  vector_bytes = 64 if flags and "avx512f" in flags.group(1).split() else 32
  with tempfile.TemporaryDirectory() as tmp:
    binary = os.path.join(tmp, "peak_flops")
    subprocess.run([compiler, "-O2", "-march=native", "-ffp-contract=fast", "-pthread",
                    f"-DVECTOR_BYTES={vector_bytes}", str(HERE / "peak_flops.c"), "-o",
                    binary], check=True)
    runs = [json.loads(subprocess.run([binary, str(cores), str(iterations)], check=True,
                                      capture_output=True, text=True).stdout)
            for _ in range(repeats)]
    out = max(runs, key=lambda r: r["gflops"])
  per_cycle = out["flops_per_cycle_per_core"]
  peak = out["gflops"] * 1e9
  name = model.group(1).strip() if model else "CPU"
  return Peak(peak, f"{name}: {cores} cores x {out['ghz']:.2f} GHz x {per_cycle:.1f} FLOP/cycle "
                    f"({out['vector_bits']}-bit FMA, measured) = {peak / 1e9:.0f} GFLOP/s")
