"""XLA flags jaxmoral sets before JAX starts a backend: a workaround for an XLA:CPU bug.

jaxlib 0.10.2's CPU compiler hands reductions to YNNPACK fusions, some of which compute wrong
values: a salience program (an encoder VJP vmapped over 16 output positions) returned gradients
uncorrelated with `jax.grad`'s until `--xla_cpu_experimental_ynn_fusion_type=-reduce` took
reductions back from YNNPACK (tests/test_npov_salience.py holds that case). `XLA_FLAGS` is read
when the backend starts, so `jaxmoral.runtime.configure()` adds the flag first thing; a value
the user set for it is kept.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import MutableMapping

YNN_REDUCE_WORKAROUND = "--xla_cpu_experimental_ynn_fusion_type=-reduce"


def _backend_started() -> bool:
  """Whether JAX has already created a backend (then new XLA_FLAGS have no effect)."""
  if "jax" not in sys.modules:  # Not imported, so not started; importing it costs ~2 s.
    return False
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(getattr(xla_bridge, "_backends", {}))
  except ImportError:  # A JAX without that module: assume not started.
    return False


def apply_workarounds(environ: MutableMapping[str, str] = os.environ) -> bool:
  """Adds the YNNPACK-reduce workaround to `XLA_FLAGS` unless the user set that flag; True
  when it was added."""
  flags = environ.get("XLA_FLAGS", "")
  if "xla_cpu_experimental_ynn_fusion_type" in flags:
    return False
  environ["XLA_FLAGS"] = f"{flags} {YNN_REDUCE_WORKAROUND}".strip()
  if environ is os.environ and _backend_started():
    logging.warning("jaxmoral.runtime.configure() ran after JAX started its backend, so %s "
                    "cannot take effect in this process; call it before the first JAX "
                    "computation (some XLA:CPU reductions may compute wrong values without "
                    "it)", YNN_REDUCE_WORKAROUND)
  return True
