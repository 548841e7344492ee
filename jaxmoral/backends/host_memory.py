"""Host memory: glibc's malloc as it is by default, or kept for reuse on a CPU training host.

XLA:CPU allocates each execution's temporaries as one block (843 MB for a T5 1.1-small train
step at batch 8 x (128 + 64)). glibc maps a block that large fresh and unmaps it when the step
ends, so every page of it faults in again, zeroed by the kernel, on every step: 223k page
faults per step, 8-16 % of a CPU step on a 2-core VM. `JAXMORAL_HOST_MALLOC=reuse` tells
malloc (through `mallopt`) to keep what it frees:

- one arena (`M_ARENA_MAX`), so blocks freed by any thread are reused by every thread;
- never map a block on its own (`M_MMAP_MAX` 0), so large blocks come from that arena;
- never give the arena's top back (`M_TRIM_THRESHOLD`), and grow it in 64 MiB steps
  (`M_TOP_PAD`).

It is not the default because its memory is not bounded by the step. XLA's aligned requests
are a little larger than the block the previous call freed, and small allocations of other
threads land between freed blocks, so the heap grows over the first tens of steps until freed
neighbours have merged, by an amount that depends on the threads' timing, and keeps its peak
until the process exits. T5 1.1-small at batch 8 x (64 + 16): a bare train step peaked at
2,218-2,248 MiB of RSS with the default malloc, and at 2,368 or 3,146 MiB (run to run) with
`reuse`; the training loop at 2,210-2,332 MiB and 3,632-3,697 MiB (`bench/RESULTS.md`). On an
accelerator host one arena would also serialise the allocations of the input pipeline's
threads.

`JAXMORAL_HOST_MALLOC` chooses: `system` (the default: leave malloc as it is) or `reuse`
(the settings above; a CPU host that trains for hours and has the memory to spare). Arena
limits only affect threads that have not allocated yet, so `jaxmoral.runtime.configure()`
(which the CLI calls first thing) applies them before the backend starts its threads.
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

TOP_PAD_BYTES = 64 << 20
# mallopt takes an int; the largest one means "never trim".
NEVER_TRIM = 2**31 - 1
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM),
            (M_TOP_PAD, TOP_PAD_BYTES))


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
  """Sets glibc's malloc to keep and reuse freed memory when `JAXMORAL_HOST_MALLOC=reuse`.

  Args:
    environ: where `JAXMORAL_HOST_MALLOC` is read.
    mallopt: the C function to call (tests pass a recorder); glibc's by default.

  Returns:
    True when every setting was applied.
  """
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
