"""jaxmoral: T5X-style JAX/Flax library for socially-aware language models.

Importing it sets no runtime state (malloc, XLA flags): programs call
`jaxmoral.runtime.configure()` first (the CLI does). It only keeps the import as quiet as the
command line, through environment defaults a user's own setting overrides.
"""

import os as _os

# Before JAX or TensorFlow is imported: where libtpu is installed but no TPU is attached, JAX
# would start the TPU runtime and print its failure (runtime.platforms_without_absent_tpu), and
# TensorFlow (seqio's input pipelines) logs only errors. A JAX_PLATFORMS or
# TF_CPP_MIN_LOG_LEVEL the user set is kept.
from jaxmoral import runtime as _runtime

_runtime.platforms_without_absent_tpu()
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
