"""Host memory jaxmoral sets up before JAX starts a backend: glibc's malloc keeps what it frees.

XLA:CPU allocates each execution's temporaries as one block (843 MB for a T5 1.1-small train
step at batch 8 x (128 + 64)). It is allocated on an executor thread, so glibc serves it from a
thread arena, which cannot hold a block that large and maps it fresh; it is unmapped when the
step ends. Every page of it then faults again, and the kernel zeroes it, on every step: 223k
page faults per step, about 10 % of the step on a 2-core VM. A process that trains does not
want its memory back between steps, so jaxmoral tells malloc (through `mallopt`, which the
package calls itself; no environment variable is needed):

- one arena (`M_ARENA_MAX`), so blocks freed by any thread are reused by every thread;
- never map a block on its own (`M_MMAP_MAX` 0), so large blocks come from that arena;
- never give the arena's top back (`M_TRIM_THRESHOLD`), and grow it in 64 MiB steps
  (`M_TOP_PAD`).

The heap takes some calls to settle: XLA's aligned requests are a little larger than the block
the previous call freed, and small allocations land between freed blocks, so the first calls
(tens of them, for one large temporary) still grow the heap until freed neighbours have merged.
The price is that the process keeps its peak heap until it exits, as a T5X trainer does anyway.
Arena limits only affect threads that have not allocated yet, so `jaxmoral.runtime.configure()`
(which the CLI calls first thing) runs this before the backend starts its threads.

`JAXMORAL_HOST_MALLOC` chooses: `auto` (the default: on where JAX computes on the CPU, i.e.
`JAX_PLATFORMS=cpu` or no GPU/TPU device node on the host; one arena would serialise the
allocations of an accelerator host's many input-pipeline threads), `reuse` (always on) or
`system` (leave malloc as it is).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import platform
import sys
from typing import Callable, Mapping, Optional

ENV_VAR = "JAXMORAL_HOST_MALLOC"
CHOICES = ("auto", "reuse", "system")

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

# Device nodes of the accelerators JAX drives: NVIDIA GPUs, TPU v4+ (accel) and v2/v3 (vfio).
ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/accel*", "/dev/vfio/[0-9]*")


def _computes_on_cpu(environ: Mapping[str, str],
                     exists: Callable[[str], bool]) -> bool:
  """Whether JAX in this process will compute on the CPU (see the module docstring)."""
  platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not any(exists(pattern) for pattern in ACCELERATOR_NODES)


def _glob_exists(pattern: str) -> bool:
  return bool(glob.glob(pattern))


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
  """The value of `JAXMORAL_HOST_MALLOC` ("auto" when unset or not one of CHOICES)."""
  value = environ.get(ENV_VAR, "auto").strip().lower() or "auto"
  if value not in CHOICES:
    logging.warning("%s=%r is not one of %s; using 'auto'", ENV_VAR, environ[ENV_VAR],
                    ", ".join(CHOICES))
    return "auto"
  return value


def keep_freed_memory(*, environ: Mapping[str, str] = os.environ,
                      mallopt: Optional[Callable[[int, int], int]] = None,
                      exists: Callable[[str], bool] = _glob_exists) -> bool:
  """Sets glibc's malloc to keep and reuse freed memory when `JAXMORAL_HOST_MALLOC` says so.

  Args:
    environ: where `JAXMORAL_HOST_MALLOC` and `JAX_PLATFORMS` are read.
    mallopt: the C function to call (tests pass a recorder); glibc's by default.
    exists: whether a device-node glob matches (tests pass a stub).

  Returns:
    True when every setting was applied.
  """
  wanted = choice(environ)
  if wanted == "system" or (wanted == "auto" and not _computes_on_cpu(environ, exists)):
    return False
  mallopt = mallopt or _glibc_mallopt()
  if mallopt is None:
    return False
  applied = [mallopt(param, value) == 1 for param, value in SETTINGS]
  if not all(applied):
    logging.warning("glibc refused some malloc settings (%s); XLA:CPU may fault its "
                    "temporaries in again on every step", applied)
  return all(applied)
