"""The platform-specific code, in one place; the portable core chooses it through its config.

Nothing here changes what a program computes, only how fast it runs on one platform, or (the
XLA:CPU workaround) that it computes right there:

- `cpu_products`: CPU float32 products with a plain-product weight gradient
  (`T5Config.cpu_weight_gradients`);
- `tpu_attention`, `gpu_attention`: Pallas flash attention for TPUs (Mosaic) and GPUs (Triton)
  (`T5Config.attention_impl`), sharing `attention` (checks, mesh wrapper);
- `cpu_kernels`: C++ XLA FFI kernels of a float32 decoding step ("cpu_packed" decoding);
- `xla_flags`, `host_memory`: XLA:CPU's flag workaround and glibc malloc settings, applied by
  `jaxmoral.runtime.configure()`.

Nothing here imports the model or decoding: they reach these modules through
`models/ops.ModelOps` and a `decoding.DecodeBackend`, never the reverse.
"""

from __future__ import annotations


def traced_platform() -> str:
  """The platform of the program being traced: that of the mesh it is traced under (a TPU
  topology compiled ahead of time from a CPU host is "tpu"), else the default backend's."""
  # Imported here: `runtime.configure()` reads `backends.xla_flags` before JAX may start (and
  # `--help` starts none), so importing the package must not import JAX.
  import jax  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.abstract_device.platform if not mesh.empty else jax.default_backend()
