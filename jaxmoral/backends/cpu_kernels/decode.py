"""The CPU kernels as a decoding backend ("cpu_packed"), registered with `jaxmoral.decoding`.

Float32 decoding on one CPU device: every product of a step multiplies by a kernel packed into
contiguous column panels (`pack_columns`) through `packed_matmul`, and the step's attention is
one `decode_attention` call. "auto" picks it only on a CPU with AVX-512, where it has beaten
XLA's dots (bench/RESULTS.md); elsewhere it is chosen by name
(`decoding.prepare_decode_weights.backend = 'cpu_packed'` in gin, or `backend="cpu_packed"`),
and `bench/bench_generate.py --backend cpu_packed --also_xla_dot` measures both.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax

from jaxmoral import decoding
from jaxmoral.backends import cpu_kernels
from jaxmoral.models import ops as ops_lib
from jaxmoral.models import t5

Array = jax.Array


def _is_concrete_on_one_cpu(x: Any) -> bool:
  return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
          and len(x.devices()) == 1 and next(iter(x.devices())).platform == "cpu")


class PackedKernelBackend(decoding.DecodeBackend):
  """Products over column-panel packed kernels and a fused step attention (C++, XLA FFI)."""
  name = "cpu_packed"

  @property
  def automatic(self) -> bool:  # type: ignore[override]
    return cpu_kernels.has_avx512()

  def applies(self, model: t5.T5, params: Any) -> bool:
    """Float32 models whose parameters are concrete arrays on one CPU device, where the
    kernels build (`cpu_kernels.available()`; `JAXMORAL_CPU_KERNELS=0` turns them off)."""
    if model.config.dtype != "float32" or not cpu_kernels.enabled():
      return False
    if not all(_is_concrete_on_one_cpu(x) for x in jax.tree.leaves(nn.unbox(params))):
      return False
    return cpu_kernels.available()

  def prepare(self, model: t5.T5, params: Any) -> dict[str, Array]:
    del model
    return {key: cpu_kernels.pack_columns(kernels[0] if len(kernels) == 1
                                          else jax.numpy.stack(kernels, axis=1))
            for key, kernels in decoding.decoder_step_kernels(params).items()}

  def step_ops(self, kernels: Mapping[str, Array]) -> ops_lib.DecodeStepOps:
    return _PackedOps(kernels)


class _PackedOps(ops_lib.DecodeStepOps):
  """A decoding step through `packed_matmul` and `decode_attention` (float32)."""

  def __init__(self, kernels: Mapping[str, Array]):
    self._kernels = kernels

  def products(self, path, names, x, kernels, *, preferred_element_type=None):
    packed = self._kernels.get(decoding.kernel_key(path, names))
    if packed is None:
      return super().products(path, names, x, kernels,
                              preferred_element_type=preferred_element_type)
    widths = [int(k.shape[-1]) for k in kernels]
    out = cpu_kernels.packed_matmul(x, packed, sum(widths))
    parts, start = [], 0
    for width in widths:
      parts.append(out[..., start:start + width])
      start += width
    return parts

  def attention(self, path, query, key, value, bias):
    del path
    return cpu_kernels.decode_attention(query, key, value, bias)


decoding.register_backend(PackedKernelBackend())
