"""The platform-specific code, in one place; the portable core chooses it through its config.

Nothing here changes what a program computes, only how fast it runs on one platform, or (the
XLA:CPU workaround) that it computes right there. Who chooses each part:

- `cpu_products`: float32 dense products traced for CPUs, whose weight gradient runs as a plain
  product; chosen by `T5Config.cpu_weight_gradients` (`models/ops.ModelOps.dense`).
- `tpu_attention`: Pallas (Mosaic) flash attention for TPUs, with the position bias's
  gradient; `T5Config.attention_impl="pallas"` (`ModelOps.fused_attention`).
- `gpu_attention`: Pallas (Triton) flash attention for GPUs, the same contract;
  `T5Config.attention_impl="pallas_gpu"`.
- `attention`: what the two kernel sets share: the shape check, the mesh wrapper, the
  reference and the interpret switch.
- `cpu_kernels`: C++ XLA FFI kernels of a float32 decoding step on one CPU, which
  `decoding.PackedKernelBackend` ("cpu_packed") runs; chosen by
  `decoding.prepare_decode_weights(backend=...)` ("auto": on CPUs with AVX-512).
- `xla_flags`: the XLA:CPU reduction workaround in `XLA_FLAGS`, set by
  `jaxmoral.runtime.configure()`.
- `host_memory`: glibc malloc settings that keep XLA:CPU's freed temporaries, chosen by
  `JAXMORAL_HOST_MALLOC` and applied by `runtime.configure()`.

The model (`models/t5.py`) imports none of these: its products and attention go through
`models/ops.ModelOps`, which its `T5Config` selects, and its cached decoding steps through
the ops of a `decoding.DecodeBackend`. Nothing here imports the model or decoding: the layers
above choose and call these modules, never the reverse.
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
