"""A persistent XLA compilation cache for `jaxmoral` commands: reruns and resumed runs skip compiling.

JAX can keep compiled executables on disk, keyed by the program, the backend, the compile options
and the XLA flags, and load them instead of compiling again. The command line turns that on by
default (MaxText does the same with its `jax_cache_dir`), so a run resumed after a crash, an
`eval` after `train`, or a second `make demo` starts from compiled steps, with the same
metrics and outputs (measurements in bench/RESULTS.md).

Where the cache goes, first match wins:
1. `--compilation_cache_dir=DIR` on the command line (`none` or an empty value: no cache);
2. JAX's own `JAX_COMPILATION_CACHE_DIR` environment variable;
3. `$JAXMORAL_COMPILATION_CACHE_DIR` (`none`: no cache);
4. `$XDG_CACHE_HOME/jaxmoral/xla`, else `~/.cache/jaxmoral/xla`.

jaxmoral's own directories (1, 3, 4) are capped (least recently used entries go first) at
`DEFAULT_MAX_BYTES`. A directory JAX's variable names keeps JAX's own settings
(`JAX_COMPILATION_CACHE_MAX_SIZE`, `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`): other JAX
programs write there, and JAX's capped cache cannot share a directory with uncapped writers (it
needs an access-time file beside every entry; one entry without it makes every later write
fail). For the same reason a directory that already holds uncapped entries is not capped. Library
users (notebooks) get no cache unless they call `enable` or set JAX's variable, as with JAX
itself. `none` turns off even a cache that JAX's variable set (`disable`). `jaxmoral compile`
runs without one: executables compiled for a compile-only TPU topology are written to the
cache but cannot be loaded back ("PjRtCompiler must be constructed with a Client"), so a
second compile would only warn.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

FLAG = "--compilation_cache_dir"
ENV_DIR = "JAXMORAL_COMPILATION_CACHE_DIR"
JAX_ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
DISABLED = ("", "none")
DEFAULT_MAX_BYTES = 4 * 1024 ** 3
# JAX's default: programs that compile faster than this are not written (loading one costs
# about as much as compiling it).
DEFAULT_MIN_COMPILE_SECONDS = 1.0
# File names of JAX's cache (jax._src.lru_cache): an entry, and the access time a capped cache
# keeps beside it.
_CACHE_SUFFIX = "-cache"
_ATIME_SUFFIX = "-atime"

_LOG = logging.getLogger(__name__)


def resolve_cache_dir(flag_value: Optional[str] = None,
                      environ: Mapping[str, str] = os.environ) -> Optional[str]:
  """The cache directory by the precedence in the module docstring; None: no cache."""
  for value in (flag_value, environ.get(JAX_ENV_DIR), environ.get(ENV_DIR)):
    if value is not None:
      return None if value.strip().lower() in DISABLED else os.path.expanduser(value)
  base = environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(base, "jaxmoral", "xla")


def configure(flag_value: Optional[str] = None,
              environ: Mapping[str, str] = os.environ) -> Optional[str]:
  """Turns the cache on or off for a command, by the precedence in the module docstring.

  Call before the first compilation.

  Args:
    flag_value: The value of `--compilation_cache_dir`, if given.
    environ: Where the variables are read.

  Returns:
    The directory in use, or None.
  """
  cache_dir = resolve_cache_dir(flag_value, environ)
  if cache_dir is None:  # Also overrides a JAX_COMPILATION_CACHE_DIR that JAX read itself.
    disable()
    return None
  if flag_value is None and environ.get(JAX_ENV_DIR) is not None:
    return cache_dir  # JAX configured it from its own variables when it was imported.
  return enable(cache_dir)


def uncapped_entries(cache_dir: str) -> list[str]:
  """Entries of a local cache directory that an uncapped JAX wrote (no access-time file)."""
  try:
    names = set(os.listdir(cache_dir))
  except OSError:
    return []
  return sorted(name for name in names if name.endswith(_CACHE_SUFFIX)
                and name[:-len(_CACHE_SUFFIX)] + _ATIME_SUFFIX not in names)


def enable(cache_dir: Optional[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
           min_compile_seconds: float = DEFAULT_MIN_COMPILE_SECONDS) -> Optional[str]:
  """Points JAX's persistent compilation cache at `cache_dir` (None: leaves it off).

  Call before the first compilation: JAX opens the cache once, at its first compile.

  Args:
    cache_dir: A local directory (created if missing) or any path JAX's cache accepts
      (e.g. `gs://...`); None does nothing.
    max_bytes: Size cap; least recently used entries are deleted beyond it (-1: no cap; also
      what a local directory that holds uncapped entries gets).
    min_compile_seconds: Programs that compiled faster than this are not written.

  Returns:
    The directory in use, or None.
  """
  if cache_dir is None:
    return None
  if max_bytes == 0 or max_bytes < -1:
    raise ValueError(f"compilation_cache.enable: max_bytes must be positive or -1 (no cap), "
                     f"got {max_bytes}")
  import jax  # pylint: disable=g-import-not-at-top  (the CLI resolves flags before JAX loads)
  local = "://" not in cache_dir
  if local:
    try:
      os.makedirs(cache_dir, exist_ok=True)
    except OSError as error:  # A read-only home: run without a cache rather than fail.
      _LOG.warning("no compilation cache: cannot create %s (%s)", cache_dir, error)
      return None
  if max_bytes != -1 and local and uncapped_entries(cache_dir):
    _LOG.info("compilation cache %s holds entries written without a cap; leaving it uncapped",
              cache_dir)
    max_bytes = -1
  if max_bytes != -1:
    try:
      import filelock  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:  # JAX needs it to cap the cache; an uncapped cache beats none.
      _LOG.warning("filelock is not installed: the compilation cache in %s is not capped",
                   cache_dir)
      max_bytes = -1
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_compilation_cache_max_size", max_bytes)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  _LOG.debug("XLA compilation cache: %s", cache_dir)
  return cache_dir


def disable() -> None:
  """Turns JAX's persistent compilation cache off for this process (even one set by
  `JAX_COMPILATION_CACHE_DIR`). Call before the first compilation."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_enable_compilation_cache", False)
