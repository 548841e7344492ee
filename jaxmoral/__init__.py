"""jaxmoral: T5X-style JAX/Flax library for socially-aware language models.

Importing it has no process-wide effects; programs call `jaxmoral.runtime.configure()` first
(the CLI does).
"""
