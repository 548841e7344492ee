"""jaxmoral: T5X-style JAX/Flax library for socially-aware language models."""

from jaxmoral import host_memory as _host_memory
from jaxmoral import xla_flags as _xla_flags

# Before any computation starts a backend (see xla_flags: an XLA:CPU miscompilation).
_xla_flags.apply_workarounds()
# Before the backend starts its threads (see host_memory: XLA:CPU's per-step temporaries).
_host_memory.keep_freed_memory()
