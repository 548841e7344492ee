"""T5's RMS norm for GPUs in Pallas (Triton): one pass over the rows forward, one backward.

T5's layer norm is `y = x * rsqrt(mean(x^2) + eps) * scale` over the last axis, statistics in
float32, `scale` a float32 vector. Left to XLA, its backward pass at T5 1.1-large's training
shapes runs as several fusions that each read the (tokens, d_model) activations and their
gradient again (a row reduction, the input gradient, a column reduction for the scale), so
the norms took 23 ms of a 252 ms step on one H100 (bench/RESULTS.md, session 8). Here:

  forward   grid (rows / block_rows,): y and the per-row reciprocal r = rsqrt(mean(x^2) + eps),
            float32, saved for the backward pass (4 bytes a row).
  backward  grid (programs,): each program walks its contiguous rows `block_rows_bwd` at a
            time, writes dx = r * (g - xhat * mean(g * xhat)) with g = dy * scale and
            xhat = x * r, and sums dy * xhat over its rows into one float32 row of partial
            scale gradients; XLA adds the `programs` partial rows.

So each pass reads x (and dy) once and writes one array. The feature width must be a power of
two (Triton tiles); otherwise, or where the rows do not divide into blocks, `rms_norm` is the
plain XLA form. On a CPU the kernels run in Pallas interpret mode (`flash_attention_gpu.INTERPRET`,
the environment variable JAXMORAL_PALLAS_INTERPRET=1, or `interpret=True`), which is how
tests/test_rms_norm_gpu.py checks them against the XLA form and its autodiff gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence, Union

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from jaxmoral.models.flash_attention import _mesh_axes_for, _target_platform
from jaxmoral.models import flash_attention_gpu
from jaxmoral.models.flash_attention_gpu import _CompilerParams, _next_power_of_2

Array = jax.Array
MeshAxes = Union[None, str, Sequence[str]]


@dataclasses.dataclass(frozen=True)
class NormBlockSizes:
  """Rows per step and Triton launch parameters of the two kernels (powers of two).

  Attributes:
    block_rows: Rows per forward program.
    block_rows_bwd: Rows per step of a backward program.
    programs_bwd: Backward programs (at most): each writes one row of partial scale
      gradients, so more programs fill the GPU and fewer leave less for XLA to add.
    num_warps, num_warps_bwd: Warps per program of each kernel.
  """
  block_rows: int = 16
  block_rows_bwd: int = 8
  programs_bwd: int = 528
  num_warps: int = 4
  num_warps_bwd: int = 4

  def __post_init__(self):
    for field in ("block_rows", "block_rows_bwd", "num_warps", "num_warps_bwd"):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise ValueError(f"NormBlockSizes.{field} must be a positive power of two, got {value!r}")
    if not isinstance(self.programs_bwd, int) or self.programs_bwd <= 0:
      raise ValueError(f"NormBlockSizes.programs_bwd must be a positive int, got "
                       f"{self.programs_bwd!r}")


# Read when a norm is traced, so a benchmark can try other sizes without new code.
DEFAULT_BLOCK_SIZES = NormBlockSizes()


@dataclasses.dataclass(frozen=True)
class _Plan:
  epsilon: float
  out_dtype: Any
  block_rows: int
  block_rows_bwd: int
  programs_bwd: int
  num_warps: int
  num_warps_bwd: int
  interpret: bool


def _largest_power_of_2_dividing(n: int, cap: int) -> int:
  block = cap
  while n % block:
    block //= 2
  return block


def kernels_apply(rows: int, width: int) -> bool:
  """Whether the kernels take (rows, width) activations (else `rms_norm` runs the XLA form)."""
  return rows > 0 and width >= 16 and width == _next_power_of_2(width)


def reference_rms_norm(x: Array, scale: Array, *, epsilon: float, out_dtype: Any) -> Array:
  """The XLA form (`t5.RMSNorm`'s): float32 statistics, scaled, cast to `out_dtype`."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)
  return (x32 * scale.astype(jnp.float32)).astype(out_dtype)


def _forward_kernel(x_ref: Any, scale_ref: Any, y_ref: Any, r_ref: Any, *, plan: _Plan):
  x = x_ref[...].astype(jnp.float32)  # (block_rows, width)
  r = lax.rsqrt(jnp.mean(x * x, axis=1) + plan.epsilon)
  y_ref[...] = (x * r[:, None] * scale_ref[...][None, :]).astype(y_ref.dtype)
  r_ref[...] = r


def _backward_kernel(x_ref: Any, dy_ref: Any, r_ref: Any, scale_ref: Any, dx_ref: Any,
                     dscale_ref: Any, *, plan: _Plan, steps: int):
  step_rows = plan.block_rows_bwd
  first = pl.program_id(0) * steps
  scale = scale_ref[...]

  def body(i: Any, dscale: Array) -> Array:
    rows = pl.ds(pl.multiple_of((first + i) * step_rows, step_rows), step_rows)
    x = x_ref[rows, :].astype(jnp.float32)
    dy = dy_ref[rows, :].astype(jnp.float32)
    r = r_ref[rows]
    xhat = x * r[:, None]
    g = dy * scale[None, :]
    mean_g_xhat = jnp.mean(g * xhat, axis=1)
    dx = r[:, None] * (g - xhat * mean_g_xhat[:, None])
    dx_ref[rows, :] = dx.astype(dx_ref.dtype)
    return dscale + jnp.sum(dy * xhat, axis=0)

  dscale = lax.fori_loop(0, steps, body, jnp.zeros(scale.shape, jnp.float32))
  dscale_ref[...] = dscale[None, :]


def _forward(x: Array, scale: Array, plan: _Plan) -> tuple[Array, Array]:
  rows, width = x.shape
  block = plan.block_rows
  return pl.pallas_call(
      functools.partial(_forward_kernel, plan=plan),
      grid=(rows // block,),
      in_specs=[pl.BlockSpec((block, width), lambda i: (i, 0)),
                pl.BlockSpec((width,), lambda i: (0,))],
      out_specs=[pl.BlockSpec((block, width), lambda i: (i, 0)),
                 pl.BlockSpec((block,), lambda i: (i,))],
      out_shape=[jax.ShapeDtypeStruct((rows, width), plan.out_dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32)],
      compiler_params=_CompilerParams(num_warps=plan.num_warps, num_stages=1),
      interpret=plan.interpret,
      name="rms_norm_forward",
  )(x, scale)


def _backward(x: Array, dy: Array, r: Array, scale: Array, plan: _Plan) -> tuple[Array, Array]:
  rows, width = x.shape
  step_rows = plan.block_rows_bwd
  total_steps = rows // step_rows
  # The most programs (at most programs_bwd) that split the steps evenly.
  programs = max(p for p in range(1, min(plan.programs_bwd, total_steps) + 1)
                 if total_steps % p == 0)
  whole = lambda shape: pl.BlockSpec(shape, lambda p: (0,) * len(shape))
  dx, dscale_partial = pl.pallas_call(
      functools.partial(_backward_kernel, plan=plan, steps=total_steps // programs),
      grid=(programs,),
      in_specs=[whole((rows, width)), whole((rows, width)), whole((rows,)), whole((width,))],
      out_specs=[whole((rows, width)), pl.BlockSpec((1, width), lambda p: (p, 0))],
      out_shape=[jax.ShapeDtypeStruct((rows, width), x.dtype),
                 jax.ShapeDtypeStruct((programs, width), jnp.float32)],
      compiler_params=_CompilerParams(num_warps=plan.num_warps_bwd, num_stages=1),
      interpret=plan.interpret,
      name="rms_norm_backward",
  )(x, dy, r, scale)
  return dx, jnp.sum(dscale_partial, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm_rows(x: Array, scale: Array, plan: _Plan) -> Array:
  return _forward(x, scale, plan)[0]


def _rms_norm_rows_fwd(x: Array, scale: Array, plan: _Plan) -> tuple[Array, tuple[Array, ...]]:
  y, r = _forward(x, scale, plan)
  return y, (x, r, scale)


def _rms_norm_rows_bwd(plan: _Plan, residuals: tuple[Array, ...],
                       dy: Array) -> tuple[Array, Array]:
  x, r, scale = residuals
  dx, dscale = _backward(x, dy, r, scale, plan)
  return dx, dscale.astype(scale.dtype)


_rms_norm_rows.defvjp(_rms_norm_rows_fwd, _rms_norm_rows_bwd)


def rms_norm(x: Array, scale: Array, *, epsilon: float, out_dtype: Any,
             block_sizes: Optional[NormBlockSizes] = None,
             interpret: Optional[bool] = None) -> Array:
  """T5's RMS norm of `x` over its last axis through the Triton kernels (differentiable).

  Args:
    x: (..., width) activations, any float dtype.
    scale: (width,) float32 scale.
    epsilon: Added to the mean square.
    out_dtype: Dtype of the output (the activation dtype).
    block_sizes: None: `DEFAULT_BLOCK_SIZES` (read when traced).
    interpret: Run in Pallas interpret mode; None: `flash_attention_gpu.INTERPRET`.

  Returns:
    (..., width) in `out_dtype`; the XLA form where the kernels do not apply (`kernels_apply`).
  """
  width = x.shape[-1]
  rows = x.size // width if width else 0
  if scale.shape != (width,):
    raise ValueError(f"rms_norm: scale shape {scale.shape} does not match width {width}")
  if not kernels_apply(rows, width):
    return reference_rms_norm(x, scale, epsilon=epsilon, out_dtype=out_dtype)
  blocks = DEFAULT_BLOCK_SIZES if block_sizes is None else block_sizes
  plan = _Plan(epsilon=float(epsilon), out_dtype=jnp.dtype(out_dtype),
               block_rows=_largest_power_of_2_dividing(rows, blocks.block_rows),
               block_rows_bwd=_largest_power_of_2_dividing(rows, blocks.block_rows_bwd),
               programs_bwd=blocks.programs_bwd, num_warps=blocks.num_warps,
               num_warps_bwd=blocks.num_warps_bwd,
               interpret=bool(flash_attention_gpu.INTERPRET if interpret is None else interpret))
  y = _rms_norm_rows(x.reshape(rows, width), scale.astype(jnp.float32), plan)
  return y.reshape(x.shape)


def sharded_rms_norm(x: Array, scale: Array, *, epsilon: float, out_dtype: Any,
                     batch_axes: MeshAxes = None, block_sizes: Optional[NormBlockSizes] = None,
                     interpret: Optional[bool] = None) -> Array:
  """`rms_norm` on every device of the current mesh, each on its rows.

  A Pallas call is opaque to the SPMD partitioner, so under a mesh of more than one device
  the kernels run in a `jax.shard_map` with the leading (batch) axis of `x` split over
  `batch_axes` and the features whole; the transpose sums the scale gradient over them.

  Raises:
    ValueError: The mesh (or default backend) is not a GPU and interpret mode is off.
  """
  interpret = flash_attention_gpu.INTERPRET if interpret is None else interpret
  mesh = jax.sharding.get_abstract_mesh()
  platform = _target_platform(mesh)
  if not interpret and platform not in ("gpu", "cuda", "rocm"):
    raise ValueError(f"norm_impl='pallas_gpu' runs Triton kernels on GPUs only (this "
                     f"computation is for {platform!r}); use norm_impl='xla', or set "
                     f"JAXMORAL_PALLAS_INTERPRET=1 to interpret them")
  norm = functools.partial(rms_norm, epsilon=epsilon, out_dtype=out_dtype,
                           block_sizes=block_sizes, interpret=interpret)
  if mesh.empty or mesh.size == 1:
    return norm(x, scale)
  batch_axes = _mesh_axes_for(batch_axes, x.shape[0], mesh)
  x_spec = PartitionSpec(batch_axes, *([None] * (x.ndim - 1)))
  # check_vma=False: Pallas outputs carry no varying-axes type (as in flash_attention_gpu).
  return jax.shard_map(norm, mesh=mesh, in_specs=(x_spec, PartitionSpec(None)),
                       out_specs=x_spec, check_vma=False)(x, scale)
