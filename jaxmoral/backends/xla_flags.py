"""XLA flags jaxmoral sets before JAX starts a backend: a workaround for an XLA:CPU bug.

jaxlib 0.10.2's CPU compiler hands reductions to YNNPACK fusions by default, and some of them
compute wrong values: a salience program (one encoder forward pass, its VJP vmapped over 16
output positions, 256 input tokens) returned gradients uncorrelated with `jax.grad`'s
(correlation -0.16) until `--xla_cpu_experimental_ynn_fusion_type=-reduce` took reductions
back from YNNPACK; the same program then matches per-token `jax.grad` to 1e-7
(tests/test_npov_salience.py holds that case). Dots and element-wise fusions keep YNNPACK.

`XLA_FLAGS` is read once, when the first computation starts the backend, so the flag is added
by `jaxmoral.runtime.configure()` (the CLI calls it first thing). A user who sets
`xla_cpu_experimental_ynn_fusion_type` in `XLA_FLAGS` keeps their value.
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
  """Adds the YNNPACK-reduce workaround to `XLA_FLAGS` unless the user set that flag.

  Returns:
    True when the flag was added.
  """
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
