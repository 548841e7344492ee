"""CPU kernels for decoding steps: a product over column-panel-packed weights, and attention.

A decoding step multiplies a handful of rows (batch x samples) by every decoder weight matrix
once, so it is bound by how fast the weights stream from memory. XLA:CPU's dot reads a
row-major (K, N) kernel in strided pieces: it streamed T5 1.1-small's cold kernels at 9–17
GB/s at 8 rows on a 2-core VM whose memory delivers 23–26 GB/s. Stored as contiguous panels
of 64 columns (`pack_columns`), the same kernels stream at up to 28 GB/s through
`packed_matmul`, an XLA FFI custom call (`kernels.cc`) that splits the panels over XLA's
intra-op threads (bench/bench_decode_products.py). `decode_attention` is a step's attention
(one query per row and head) as one custom call, where XLA:CPU ran batched one-row dots.

The kernels are compiled from source on first use with the machine's C++ compiler
(`$CXX`, else `c++`/`g++`/`clang++`) against the XLA FFI headers jaxlib ships, for this
machine's instruction set (`-march=native`), and cached under `$JAXMORAL_KERNEL_CACHE`
(default `~/.cache/jaxmoral/kernels`), keyed by the source, jaxlib's version, the compiler and
the CPU. Where it cannot be built, `available()` warns once and returns False, and decoding
keeps XLA's dot. `JAXMORAL_CPU_KERNELS=0` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import jaxlib

Array = jax.Array

PANEL = 64  # Columns per packed panel (the kernel's J).
MATMUL_TARGET = "jaxmoral_packed_matmul"
ATTENTION_TARGET = "jaxmoral_decode_attention"
SOURCE = os.path.join(os.path.dirname(__file__), "kernels.cc")
_ENV_SWITCH = "JAXMORAL_CPU_KERNELS"
_LOG = logging.getLogger(__name__)


class BuildError(RuntimeError):
  """The CPU kernels could not be compiled."""


def enabled() -> bool:
  """False when `JAXMORAL_CPU_KERNELS` is set to 0/false/off/no."""
  return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def _compiler() -> Optional[str]:
  """`$CXX` when set (None if it is not a program), else the first of c++, g++, clang++."""
  if os.environ.get("CXX"):
    return shutil.which(os.environ["CXX"])
  for name in ("c++", "g++", "clang++"):
    if shutil.which(name):
      return shutil.which(name)
  return None


def _cache_dir() -> str:
  root = os.environ.get("JAXMORAL_KERNEL_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxmoral", "kernels")
  try:
    os.makedirs(root, exist_ok=True)
    if os.access(root, os.W_OK):
      return root
  except OSError:
    pass
  return tempfile.mkdtemp(prefix="jaxmoral_kernels_")


def _cpu_signature() -> str:
  """What `-march=native` depends on: the CPU's model and feature flags, where readable."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      lines = [l for l in f if l.startswith(("model name", "flags", "Features", "CPU part"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def _flag_sets() -> list[list[str]]:
  base = ["-O3", "-std=c++17", "-shared", "-fPIC"]
  # -march=native first; compilers that reject it (some clang on arm64) get a portable build.
  return [base + ["-march=native"], base]


def build(*, force: bool = False) -> str:
  """Compiles the kernel (or finds it in the cache); returns the shared library's path.

  Raises:
    BuildError: No compiler, no FFI headers in jaxlib, or every compile attempt failed; the
      message carries the compiler's output.
  """
  compiler = _compiler()
  if compiler is None:
    raise BuildError(f"no C++ compiler: $CXX={os.environ.get('CXX')!r} is not a program"
                     if os.environ.get("CXX") else "no C++ compiler (c++, g++, clang++)")
  include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
  if not os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
    raise BuildError(f"jaxlib {jaxlib.__version__} ships no XLA FFI headers under {include}")
  with open(SOURCE, "rb") as f:
    source = f.read()
  errors = []
  for flags in _flag_sets():
    key = hashlib.sha256(b"\0".join([
        source, jaxlib.__version__.encode(), compiler.encode(), " ".join(flags).encode(),
        platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:20]
    path = os.path.join(_cache_dir(), f"cpu_kernels_{key}.so")
    if os.path.exists(path) and not force:
      return path
    partial = f"{path}.{os.getpid()}.tmp"
    _LOG.info("compiling %s for this machine (once; cached as %s)", SOURCE, path)
    command = [compiler, *flags, "-I", include, SOURCE, "-o", partial]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode == 0:
      os.replace(partial, path)  # Atomic: concurrent builders (test workers) never see half.
      return path
    if os.path.exists(partial):
      os.remove(partial)
    errors.append(f"$ {' '.join(command)}\n{result.stderr.strip()[-2000:]}")
  raise BuildError("compiling " + SOURCE + " failed:\n" + "\n".join(errors))


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
  """Builds, loads and registers the FFI targets once per process; the library's path, or
  None (warned once) on failure."""
  try:
    import ctypes  # pylint: disable=import-outside-toplevel
    path = build()
    library = ctypes.cdll.LoadLibrary(path)
    for target, symbol in ((MATMUL_TARGET, library.JaxmoralPackedMatmul),
                           (ATTENTION_TARGET, library.JaxmoralDecodeAttention)):
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    return path
  except (BuildError, OSError, AttributeError) as e:
    warnings.warn(f"jaxmoral.cpu_kernels: CPU decoding kernels unavailable, decoding uses "
                  f"XLA's ops instead: {e}", RuntimeWarning, stacklevel=3)
    return None


def available() -> bool:
  """Whether the kernels can run here: enabled, built and registered (builds once)."""
  return enabled() and _load() is not None


def _require(name: str) -> None:
  if _load() is None:
    raise RuntimeError(f"jaxmoral.cpu_kernels.{name}: the CPU kernels are not available")


def pack_columns(kernel: Array) -> Array:
  """(K, *features) -> (P, K, PANEL): the flattened columns as contiguous panels.

  Columns past the last multiple of PANEL are zero-padded; `packed_matmul` drops them.
  """
  k = kernel.shape[0]
  flat = kernel.reshape(k, -1).astype(jnp.float32)
  n = flat.shape[1]
  panels = -(-n // PANEL)
  if panels * PANEL != n:
    flat = jnp.pad(flat, ((0, 0), (0, panels * PANEL - n)))
  return flat.reshape(k, panels, PANEL).transpose(1, 0, 2)


def packed_matmul(x: Array, packed: Array, features: int) -> Array:
  """(..., K) @ kernel -> (..., features) float32, from `pack_columns(kernel)`.

  Args:
    x: Activations; cast to float32.
    packed: `pack_columns` of a (K, features) kernel (features may be any flattened shape).
    features: The kernel's column count before padding.

  Raises:
    RuntimeError: When the kernel is not `available()`.
  """
  _require("packed_matmul")
  if packed.ndim != 3 or packed.shape[2] != PANEL or packed.shape[1] != x.shape[-1]:
    raise ValueError(f"packed_matmul: x {x.shape} does not fit packed kernel {packed.shape}")
  rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  out_type = jax.ShapeDtypeStruct((rows.shape[0], packed.shape[0] * PANEL), jnp.float32)
  out = jax.ffi.ffi_call(MATMUL_TARGET, out_type, vmap_method="sequential")(rows, packed)
  if out.shape[1] != features:
    out = out[:, :features]
  return out.reshape(*x.shape[:-1], features)


def decode_attention(query: Array, key: Array, value: Array, bias: Array) -> Array:
  """softmax(query . key + bias) . value for one query per (row, head), float32.

  Query rows may come in groups of G that share one key/value row (G samples or beams of one
  input against its cross-attention keys): query row r reads key row r // G.

  Args:
    query: (G * R, H, D).
    key, value: (R, H, L, D).
    bias: Broadcastable to (R, H, L): relative-position bias and masks (-1e10 where masked).

  Returns:
    (G * R, H, D) float32.

  Raises:
    RuntimeError: When the kernels are not `available()`.
  """
  _require("decode_attention")
  rows, heads, keys, depth = key.shape
  if (query.ndim != 3 or rows == 0 or query.shape[0] % rows
      or query.shape[1:] != (heads, depth) or value.shape != key.shape):
    raise ValueError(f"decode_attention: query {query.shape}, key {key.shape} and value "
                     f"{value.shape} do not fit (G*R, H, D), (R, H, L, D), (R, H, L, D)")
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  bias = jnp.broadcast_to(f32(bias), (rows, heads, keys))
  out_type = jax.ShapeDtypeStruct(query.shape, jnp.float32)
  return jax.ffi.ffi_call(ATTENTION_TARGET, out_type, vmap_method="sequential")(
      f32(query), f32(key), f32(value), bias)
