"""CPU kernels for decoding steps: a product over column-panel-packed weights, and attention.

A decoding step multiplies a handful of rows by every decoder weight once, so it is bound by how
fast the weights stream from memory. XLA:CPU's dot reads a row-major (K, N) kernel in strided
pieces; stored as contiguous panels of 64 columns (`pack_columns`), `packed_matmul` (an XLA FFI
custom call, `kernels.cc`, split over XLA's intra-op threads) streams them close to the memory's
bandwidth. `decode_attention` is a step's attention as one custom call, where XLA:CPU runs
batched one-row dots. `decoding.PackedKernelBackend` ("cpu_packed") runs them.

The kernels are compiled on first use against jaxlib's XLA FFI headers, `-march=native`, and
cached under `$JAXMORAL_KERNEL_CACHE` (default `~/.cache/jaxmoral/kernels`), keyed by the
source, jaxlib's version, the compiler and the CPU. Where they cannot be built, `available()`
warns once and returns False, and decoding keeps XLA's dot. `JAXMORAL_CPU_KERNELS=0` turns them
off.

Loading a library runs its code, so only a cache this user alone can write is used (else a
private temporary one, with a warning), and a cached library is loaded only while it is this
user's own file matching the SHA-256 recorded when it was built (else it is rebuilt).
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
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
  return next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)


class _Untrusted(Exception):
  """A cache entry another user could have written; its message says why."""


_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_FALLBACK_DIRS: dict[str, str] = {}  # Refused cache folder -> this process's private one.


def _owner_problem(st: os.stat_result) -> Optional[str]:
  """Why another user could have written the file or folder `st` describes, or None."""
  if st.st_uid != os.geteuid():
    return f"is owned by uid {st.st_uid}, not this user ({os.geteuid()})"
  if st.st_mode & _OTHERS_WRITE:
    return f"is writable by group/others (mode {stat.S_IMODE(st.st_mode):#o})"
  return None


def _folder_problem(folder: str) -> Optional[str]:
  """Why another user could replace what the real folder `folder` holds, or None.

  Each parent must be root's or this user's, and writable by group/others only when sticky
  (/tmp): otherwise they could rename the folder and put theirs there.
  """
  st = os.stat(folder)
  if not stat.S_ISDIR(st.st_mode):
    return "is not a folder"
  problem = _owner_problem(st)
  if problem:
    return problem
  parent = os.path.dirname(folder)
  while True:
    st = os.stat(parent)
    if st.st_uid not in (0, os.geteuid()):
      return f"its parent {parent} is owned by uid {st.st_uid}"
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
      return (f"its parent {parent} is writable by group/others and not sticky "
              f"(mode {stat.S_IMODE(st.st_mode):#o})")
    if os.path.dirname(parent) == parent:
      return None
    parent = os.path.dirname(parent)


def _cache_dir() -> str:
  """The kernel cache folder, real path; a private temporary one (warned once) where it is
  not safe or not usable."""
  root = os.environ.get("JAXMORAL_KERNEL_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxmoral", "kernels")
  real = root
  try:
    os.makedirs(root, mode=0o700, exist_ok=True)
    real = os.path.realpath(root)  # Check the folder a symlink leads to, and use that one.
    problem = _folder_problem(real)
    if problem is None and not os.access(real, os.W_OK):
      problem = "is not writable"
  except OSError as e:
    problem = f"cannot be used ({e.strerror or e})"
  if problem is None:
    return real
  if root not in _FALLBACK_DIRS:
    _FALLBACK_DIRS[root] = tempfile.mkdtemp(prefix="jaxmoral_kernels_")  # Mode 0o700.
    # This process's only: removed at exit (a loaded library's file may be unlinked).
    atexit.register(shutil.rmtree, _FALLBACK_DIRS[root], ignore_errors=True)
    where = root if real == root else f"{root} ({real})"
    warnings.warn(f"jaxmoral.backends.cpu_kernels: not using kernel cache {where}: it {problem}; "
                  f"building in {_FALLBACK_DIRS[root]} instead (removed at exit)",
                  RuntimeWarning, stacklevel=3)
  return _FALLBACK_DIRS[root]


def _read_own_file(path: str, what: str) -> bytes:
  """`path`'s bytes, where it is a regular file only this user can write (not a symlink); else
  `_Untrusted` (FileNotFoundError where it is missing)."""
  if os.path.islink(path):
    raise _Untrusted(f"{what} {path} is a symlink")
  # O_NOFOLLOW and fstat: what is checked is what is read, even if the name was swapped.
  flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
  try:
    fd = os.open(path, flags)
  except OSError as e:
    if e.errno in (errno.ELOOP, errno.EMLINK):
      raise _Untrusted(f"{what} {path} is a symlink") from e
    raise
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
      raise _Untrusted(f"{what} {path} is not a regular file")
    problem = _owner_problem(st)
    if problem:
      raise _Untrusted(f"{what} {path} {problem}")
    return f.read()


def _untrusted(path: str) -> Optional[str]:
  """Why the library at `path` must not be loaded, or None when it may: it and its recorded
  SHA-256 are this user's own regular files and its bytes match."""
  try:
    data = _read_own_file(path, "library")
    recorded = _read_own_file(path + ".sha256", "hash file").split()
  except _Untrusted as e:
    return str(e)
  except OSError as e:
    return f"{e.filename or path} cannot be read ({e.strerror or e})"
  digest = hashlib.sha256(data).hexdigest()
  if not recorded or recorded[0] != digest.encode():
    found = recorded[0][:16].decode("ascii", "replace") if recorded else "nothing"
    return (f"its SHA-256 {digest[:16]}... does not match the {found}... recorded when it "
            f"was built (changed since)")
  return None


def _write_atomically(path: str, data: bytes, mode: int) -> None:
  """Writes `path` through an unpredictable temporary name beside it, then renames it."""
  fd, partial = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                                 dir=os.path.dirname(path))
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      os.fchmod(f.fileno(), mode)
    os.replace(partial, path)
  except BaseException:
    if os.path.lexists(partial):
      os.remove(partial)
    raise


def _cpu_signature() -> str:
  """What `-march=native` depends on: the CPU's model and feature flags, where readable."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      lines = [line for line in f
               if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


# -march=native first; compilers that reject it (some clang on arm64) get a portable build.
_FLAG_SETS = (["-O3", "-std=c++17", "-shared", "-fPIC", "-march=native"],
              ["-O3", "-std=c++17", "-shared", "-fPIC"])


def _install(partial: str, path: str) -> None:
  """Records the SHA-256 of the freshly built `partial`, then renames it to `path` (else a
  BuildError)."""
  try:
    # A fixed mode: mkstemp's is 0o600, and a linker's own follows the umask (group-writable
    # under umask 002, which loading would then refuse).
    os.chmod(partial, 0o755)
    with open(partial, "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()
    # The hash first: a reader that finds the new library finds its hash too.
    _write_atomically(path + ".sha256", f"{digest}  {os.path.basename(path)}\n".encode(), 0o644)
    os.replace(partial, path)  # Atomic: concurrent builders (test workers) never see half.
  except OSError as e:
    raise BuildError(f"could not cache {path}: {e}") from e


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
  cache = _cache_dir()
  errors = []
  for flags in _FLAG_SETS:
    key = hashlib.sha256(b"\0".join([
        source, jaxlib.__version__.encode(), compiler.encode(), " ".join(flags).encode(),
        platform.machine().encode(), _cpu_signature().encode()])).hexdigest()[:20]
    path = os.path.join(cache, f"cpu_kernels_{key}.so")
    if not force and os.path.lexists(path):
      problem = _untrusted(path)
      if problem is None:
        return path
      warnings.warn(f"jaxmoral.backends.cpu_kernels: not loading cached {path}: {problem}; "
                    f"rebuilding it", RuntimeWarning, stacklevel=2)
    # An unpredictable name that mkstemp creates as ours: nobody can plant it (a symlink the
    # compiler would write through) or load it before it is renamed into place.
    fd, partial = tempfile.mkstemp(prefix=f"cpu_kernels_{key}.", suffix=".so.tmp", dir=cache)
    os.close(fd)
    _LOG.info("compiling %s for this machine (once; cached as %s)", SOURCE, path)
    command = [compiler, *flags, "-I", include, SOURCE, "-o", partial]
    try:
      result = subprocess.run(command, capture_output=True, text=True, check=False)
      if result.returncode == 0:
        _install(partial, path)
        return path
    finally:
      if os.path.lexists(partial):
        os.remove(partial)
    errors.append(f"$ {' '.join(command)}\n{result.stderr.strip()[-2000:]}")
  raise BuildError("compiling " + SOURCE + " failed:\n" + "\n".join(errors))


@functools.cache
def _load() -> Optional[str]:
  """Builds, loads and registers the FFI targets once per process; the library's path, or
  None (warned once) on failure."""
  try:
    import ctypes  # pylint: disable=import-outside-toplevel
    path = build()
    problem = _untrusted(path)  # Verified right before loading: it may have changed since.
    if problem is not None:
      warnings.warn(f"jaxmoral.backends.cpu_kernels: not loading {path}: {problem}; rebuilding it",
                    RuntimeWarning, stacklevel=3)
      path = build(force=True)
      problem = _untrusted(path)
      if problem is not None:
        raise BuildError(f"not loading {path} even after rebuilding it: {problem}")
    library = ctypes.cdll.LoadLibrary(path)
    for target, symbol in ((MATMUL_TARGET, library.JaxmoralPackedMatmul),
                           (ATTENTION_TARGET, library.JaxmoralDecodeAttention)):
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    return path
  except (BuildError, OSError, AttributeError) as e:
    warnings.warn(f"jaxmoral.backends.cpu_kernels: CPU decoding kernels unavailable, decoding uses "
                  f"XLA's ops instead: {e}", RuntimeWarning, stacklevel=3)
    return None


@functools.lru_cache(maxsize=1)
def has_avx512() -> bool:
  """Whether this CPU has AVX-512 (Linux's /proc/cpuinfo flags; False where unreadable): with
  it the packed kernels decoded a batch of 8 faster than XLA's dots, without it they lost at
  every batch (bench/RESULTS.md)."""
  return "avx512f" in _cpu_signature().split()


def available() -> bool:
  """Whether the kernels can run here: enabled, built and registered (builds once)."""
  return enabled() and _load() is not None


def _require(name: str) -> None:
  if _load() is None:
    raise RuntimeError(f"jaxmoral.backends.cpu_kernels.{name}: the CPU kernels are not available")


def pack_columns(kernel: Array) -> Array:
  """(K, *features) -> (P, K, PANEL): the flattened columns as contiguous panels.

  Columns past the last multiple of PANEL are zero-padded; `packed_matmul` drops them.
  """
  k = kernel.shape[0]
  flat = kernel.reshape(k, -1).astype(jnp.float32)
  flat = jnp.pad(flat, ((0, 0), (0, -flat.shape[1] % PANEL)))
  return flat.reshape(k, flat.shape[1] // PANEL, PANEL).transpose(1, 0, 2)


def packed_matmul(x: Array, packed: Array, features: int) -> Array:
  """(..., K) @ kernel -> (..., features) float32, from `packed = pack_columns(kernel)` and
  the kernel's (flattened) column count; `x` is cast to float32.

  Raises:
    RuntimeError: When the kernel is not `available()`.
  """
  _require("packed_matmul")
  if packed.ndim != 3 or packed.shape[2] != PANEL or packed.shape[1] != x.shape[-1]:
    raise ValueError(f"packed_matmul: x {x.shape} does not fit packed kernel {packed.shape}")
  rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  out_type = jax.ShapeDtypeStruct((rows.shape[0], packed.shape[0] * PANEL), jnp.float32)
  out = jax.ffi.ffi_call(MATMUL_TARGET, out_type, vmap_method="sequential")(rows, packed)
  return out[:, :features].reshape(*x.shape[:-1], features)


def decode_attention(query: Array, key: Array, value: Array, bias: Array) -> Array:
  """softmax(query . key + bias) . value for one query per (row, head), (G * R, H, D) float32.

  Args:
    query: (G * R, H, D): G rows (samples or beams) per key/value row; row r reads r // G.
    key, value: (R, H, L, D).
    bias: Broadcastable to (R, H, L): relative-position bias and masks (-1e10 where masked).

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
