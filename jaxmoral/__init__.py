"""jaxmoral: T5X-style JAX/Flax library for socially-aware language models."""

import os as _os

# A library import is as quiet as the command line, before JAX or TensorFlow is imported:
# where libtpu is installed but no TPU is attached, JAX would start the TPU runtime and print
# its failure (cli.platforms_without_absent_tpu), and TensorFlow (seqio's input pipelines)
# logs only errors. A JAX_PLATFORMS or TF_CPP_MIN_LOG_LEVEL the user set is kept.
from jaxmoral import cli as _cli

_cli.platforms_without_absent_tpu()
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from jaxmoral import host_memory as _host_memory  # noqa: E402
from jaxmoral import xla_flags as _xla_flags  # noqa: E402

# Before any computation starts a backend (see xla_flags: an XLA:CPU miscompilation).
_xla_flags.apply_workarounds()
# Before the backend starts its threads (see host_memory: XLA:CPU's per-step temporaries).
_host_memory.keep_freed_memory()
