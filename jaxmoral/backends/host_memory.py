"""Host memory: glibc's malloc as it is by default, or kept for reuse on a CPU training host.

XLA:CPU allocates each execution's temporaries as one block (843 MB for a T5 1.1-small train
step at batch 8 x (128 + 64)), which glibc maps fresh and unmaps when the step ends: every page
faults in again, zeroed, on every step (8-16 % of a CPU step on a 2-core VM).
`JAXMORAL_HOST_MALLOC=reuse` has `mallopt` keep what is freed (`SETTINGS`): one arena, so every
thread reuses every freed block; no block mapped on its own; the arena's top never given back,
grown in 64 MiB steps.

`system` (leave malloc as it is) is the default because `reuse` does not bound memory by the
step: the heap grows over the first tens of steps by a timing-dependent amount and keeps its
peak (2.2 GiB vs 2.4-3.1 GiB RSS for a T5 1.1-small train step; `bench/RESULTS.md`), and on an
accelerator host one arena would serialise the input pipeline's allocations. Arena limits only
affect threads that have not allocated yet, so `jaxmoral.runtime.configure()` applies them
before the backend starts its threads.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from typing import Callable, Mapping, Optional

ENV_VAR = "JAXMORAL_HOST_MALLOC"
CHOICES = ("system", "reuse")
DEFAULT = "system"

# mallopt parameters from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# mallopt takes an int; the largest one means "never trim".
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1),
            (M_TOP_PAD, 64 << 20))


def _glibc_mallopt() -> Optional[Callable[[int, int], int]]:
  """glibc's `mallopt`, or None on another C library or system."""
  if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
    return None
  try:
    # The process's own symbols (glibc's among them): no `find_library`, which runs
    # `ldconfig` in a subprocess on every `import jaxmoral`.
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return None
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  mallopt.restype = ctypes.c_int
  return mallopt


def choice(environ: Mapping[str, str] = os.environ) -> str:
  """The value of `JAXMORAL_HOST_MALLOC` (DEFAULT when unset or not one of CHOICES)."""
  value = environ.get(ENV_VAR, DEFAULT).strip().lower() or DEFAULT
  if value not in CHOICES:
    logging.warning("%s=%r is not one of %s; using %r", ENV_VAR, environ[ENV_VAR],
                    ", ".join(CHOICES), DEFAULT)
    return DEFAULT
  return value


def keep_freed_memory(*, environ: Mapping[str, str] = os.environ,
                      mallopt: Optional[Callable[[int, int], int]] = None) -> bool:
  """Sets glibc's malloc to keep and reuse freed memory when `environ` says
  `JAXMORAL_HOST_MALLOC=reuse`, through `mallopt` (glibc's by default; tests pass a recorder).
  True when every setting was applied."""
  if choice(environ) != "reuse":
    return False
  mallopt = mallopt or _glibc_mallopt()
  if mallopt is None:
    logging.warning("%s=reuse needs glibc's malloc; leaving malloc as it is", ENV_VAR)
    return False
  applied = [mallopt(param, value) == 1 for param, value in SETTINGS]
  if not all(applied):
    logging.warning("glibc refused some malloc settings (%s); XLA:CPU may fault its "
                    "temporaries in again on every step", applied)
  return all(applied)
