"""Float32 dense products traced for CPUs, whose weight gradient XLA:CPU runs as a plain product
(`models/ops.matmul_last_axis`, with `T5Config.cpu_weight_gradients="plain"`)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxmoral import backends

Array = jax.Array


def tracing_for_cpu() -> bool:
  """Whether the program being traced runs on CPUs (`backends.traced_platform`)."""
  return backends.traced_platform() == "cpu"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def cpu_rows_matmul(rows: Array, kernel: Array, preferred_element_type: Any) -> Array:
  """(R, d) @ (d, *f) in float32, whose weight gradient XLA:CPU runs as a plain product.

  Autodiff's weight gradient rows^T @ g contracts both operands' first axis, which XLA:CPU
  leaves to its slower dot emitter instead of YNNPACK. The backward pass here transposes `rows`
  into a buffer of its own (the barrier stops XLA folding it back), so YNNPACK gets
  (d, R) @ (R, f): the same sums, for a small copy. Reverse mode only (`jax.jvp` needs
  `T5Config.cpu_weight_gradients="autodiff"`).
  """
  return jnp.tensordot(rows, kernel, axes=1, preferred_element_type=preferred_element_type)


def _cpu_rows_matmul_fwd(rows: Array, kernel: Array, preferred_element_type: Any
                         ) -> tuple[Array, tuple[Array, Array]]:
  return cpu_rows_matmul(rows, kernel, preferred_element_type), (rows, kernel)


def _cpu_rows_matmul_bwd(preferred_element_type: Any, residuals: tuple[Array, Array],
                         grad: Array) -> tuple[Array, Array]:
  del preferred_element_type  # float32 operands: the gradients are float32 either way
  rows, kernel = residuals
  grad = grad.reshape(grad.shape[0], -1)
  kernel_2d = kernel.reshape(kernel.shape[0], -1)
  d_rows = jax.lax.dot_general(grad, kernel_2d, (((1,), (1,)), ((), ())))
  rows_t = jax.lax.optimization_barrier(rows.T)
  d_kernel = jax.lax.dot_general(rows_t, grad, (((1,), (0,)), ((), ())))
  return d_rows, d_kernel.reshape(kernel.shape)


cpu_rows_matmul.defvjp(_cpu_rows_matmul_fwd, _cpu_rows_matmul_bwd)
