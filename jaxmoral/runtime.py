"""Process-wide settings jaxmoral wants before JAX starts a backend: `configure()`.

Importing jaxmoral changes nothing outside its own modules. A program that runs jaxmoral's
models (the `jaxmoral` CLI does this itself; a notebook or script calls it once, first thing)
calls `jaxmoral.runtime.configure()` before its first JAX computation, which

- adds the XLA:CPU reduction workaround to `XLA_FLAGS` (`jaxmoral.xla_flags`: without it some
  XLA:CPU reductions compute wrong values), unless the user set that flag;
- sets glibc's malloc to keep and reuse the memory XLA:CPU frees between steps
  (`jaxmoral.host_memory`; `JAXMORAL_HOST_MALLOC` chooses), before the backend starts its
  threads.

Both are read when JAX starts its backend, so calling `configure()` later has no effect on
the running process (`xla_flags` warns).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxmoral import host_memory
from jaxmoral import xla_flags


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
  """What `configure()` set in this process.

  Attributes:
    xla_flags_added: The XLA:CPU workaround was added to `XLA_FLAGS` (False: already there,
      or the user chose their own value).
    malloc_keeps_freed_memory: glibc's malloc now keeps and reuses freed memory.
  """
  xla_flags_added: bool
  malloc_keeps_freed_memory: bool


_SETTINGS: Optional[RuntimeSettings] = None


def configure() -> RuntimeSettings:
  """Sets the XLA flags and malloc settings jaxmoral's programs run with; idempotent.

  Call once, before the first JAX computation (the CLI's `main` does). Later calls return the
  first call's settings and change nothing.

  Returns:
    What the first call set.
  """
  global _SETTINGS
  if _SETTINGS is None:
    _SETTINGS = RuntimeSettings(xla_flags_added=xla_flags.apply_workarounds(),
                                malloc_keeps_freed_memory=host_memory.keep_freed_memory())
  return _SETTINGS
