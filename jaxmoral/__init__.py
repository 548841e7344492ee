"""jaxmoral: T5X-style JAX/Flax library for socially-aware language models."""

from jaxmoral import xla_flags as _xla_flags

# Before any computation starts a backend (see xla_flags: an XLA:CPU miscompilation).
_xla_flags.apply_workarounds()
