"""What the Pallas flash-attention kernels share: their contract, checks and mesh wrapper.

Both kernel sets (`tpu_attention`: Mosaic, `gpu_attention`: Triton) compute T5 attention,
`softmax(q k^T + bias) v` with no 1/sqrt(d) scale, on (batch, length, heads, d_kv) inputs with
masks factored as per-position segment ids (a query sees the keys with its own id; ids <= 0
are padding) and a causal flag; a query that sees no key gets a zero output and passes no
gradient (tests/attention_reference.py: that contract in plain jnp).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoral import backends

Array = jax.Array
MeshAxes = Union[None, str, Sequence[str]]

# Run both kernel sets through the Pallas interpreter (any backend, slow; read when traced).
INTERPRET: bool = os.environ.get("JAXMORAL_PALLAS_INTERPRET", "") not in ("", "0")

# Finite stand-in for -inf: exp(MASK_VALUE - m) is exactly 0 and no inf - inf NaN can arise.
# But in a row that has seen no key yet m is MASK_VALUE itself (exp gives 1): the kernels zero
# masked entries explicitly.
MASK_VALUE = -1e30


def interpret_mode(interpret: Optional[bool]) -> bool:
  """`interpret`, or `INTERPRET` where it is None."""
  return INTERPRET if interpret is None else interpret


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def kernel_ids(ids: Optional[Array], batch: int, length: int, padded: int, fill: int) -> Array:
  """(batch, padded) int32 ids for the kernels: padding (id <= 0, or past `length`) -> `fill`.

  Queries and keys get different fills, so a padded query matches no key, not even a padded one.
  """
  if ids is None:
    ids = jnp.ones((batch, length), jnp.int32)
  ids = jnp.where(ids > 0, ids.astype(jnp.int32), fill)
  return jnp.pad(ids, ((0, 0), (0, padded - length)), constant_values=fill)


def kernel_refs(refs: Sequence[Any], has_bias: bool, dbias_at: Optional[int] = None
                ) -> list[Any]:
  """A kernel's refs with None where the bias (after q, k, v) and, at `dbias_at` of the full
  list, its gradient would be, when there is no bias: one unpacking for both cases."""
  refs = list(refs)
  if not has_bias:
    refs.insert(3, None)
    if dbias_at is not None:
      refs.insert(dbias_at, None)
  return refs


def custom_vjp(forward: Callable[..., tuple[Array, Array]],
               backward: Callable[..., tuple[Any, ...]]) -> Callable[..., Array]:
  """`attend(q, k, v, bias, q_ids, k_ids, static)`: a kernel set's differentiable attention.

  `forward(q, k, v, bias, q_ids, k_ids, *static)` returns (out, lse), the only residuals besides
  the inputs; `backward(q, k, v, bias, q_ids, k_ids, out, lse, do, *static)` returns
  (dq, dk, dv, dbias). `static` is a hashable tuple (a nondiff argument).
  """
  @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
  def attend(q, k, v, bias, q_ids, k_ids, static):
    return forward(q, k, v, bias, q_ids, k_ids, *static)[0]

  def attend_fwd(q, k, v, bias, q_ids, k_ids, static):
    out, lse = forward(q, k, v, bias, q_ids, k_ids, *static)
    return out, (q, k, v, bias, q_ids, k_ids, out, lse)

  def attend_bwd(static, residuals, do):
    return (*backward(*residuals, do, *static), None, None)

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def check_shapes(name: str, query: Array, key: Array, value: Array, bias: Optional[Array],
                 query_segment_ids: Optional[Array], key_segment_ids: Optional[Array], *,
                 per_row_bias: bool = True, bias_diagonals: Optional[Array] = None) -> None:
  """Raises a ValueError naming the entry point `name` unless the inputs fit the contract.

  `bias` is (1, heads, q_len, k_len), or with `per_row_bias` also (batch, heads, q_len, k_len);
  `bias_diagonals`, given instead of it, (1, heads, q_len + k_len - 1).
  """
  batch, q_len, heads, width = query.shape
  k_len = key.shape[1]
  if bias_diagonals is not None and (bias is not None or bias_diagonals.shape
                                     != (1, heads, q_len + k_len - 1)):
    raise ValueError(f"{name}: bias_diagonals {bias_diagonals.shape} must be (1, {heads}, "
                     f"{q_len + k_len - 1}), and given instead of bias")
  if key.shape != (batch, k_len, heads, width) or value.shape != key.shape:
    raise ValueError(f"{name}: query {query.shape}, key {key.shape} and value "
                     f"{value.shape} must be (batch, length, heads, d_kv) alike")
  rows = (1, batch) if per_row_bias else (1,)
  if bias is not None and (bias.ndim != 4 or bias.shape[0] not in rows
                           or bias.shape[1:] != (heads, q_len, k_len)):
    shared = "" if per_row_bias else ": one bias shared by the batch"
    raise ValueError(f"{name}: bias {bias.shape} must be "
                     f"({' or '.join(map(str, dict.fromkeys(rows)))}, {heads}, {q_len}, "
                     f"{k_len}){shared}")
  for ids_name, ids, length in (("query_segment_ids", query_segment_ids, q_len),
                                ("key_segment_ids", key_segment_ids, k_len)):
    if ids is not None and ids.shape != (batch, length):
      raise ValueError(f"{name}: {ids_name} {ids.shape} must be ({batch}, {length})")


def check_platform(attention_impl: str, kernels: str, platforms: Sequence[str],
                   interpret: bool) -> str:
  """The platform the traced computation is for; a ValueError where the kernels cannot run
  there (neither one of `platforms` nor in interpret mode)."""
  platform = backends.traced_platform()
  if not interpret and platform not in platforms:
    raise ValueError(f"attention_impl={attention_impl!r} runs {kernels} kernels on "
                     f"{platforms[0].upper()}s only (this computation is for {platform!r}); set "
                     f"jaxmoral.backends.attention.INTERPRET = True (or "
                     f"JAXMORAL_PALLAS_INTERPRET=1) to interpret them")
  return platform


def _mesh_axes_for(axes: MeshAxes, size: int, mesh: Any) -> MeshAxes:
  """`axes` if they divide a dimension of `size`, else None (that dimension is replicated)."""
  if axes is None:
    return None
  names = (axes,) if isinstance(axes, str) else tuple(axes)
  return axes if size % math.prod(mesh.shape[name] for name in names) == 0 else None


def sharded(attend: Callable[..., Array], query: Array, key: Array, value: Array,
            extras: Sequence[Optional[Array]], *, batch_axes: MeshAxes,
            head_axes: MeshAxes) -> Array:
  """`attend(query, key, value, *extras)` on every device of the current mesh, each on its shard.

  A Pallas call is opaque to the SPMD partitioner (it would gather its inputs to every device),
  so under a mesh of more than one device the kernel runs in a `jax.shard_map` with the batch
  split over `batch_axes` (T5X rules: "data") and heads over `head_axes` ("model"), each only
  where it divides the dimension; None: replicated. `extras` are the optional inputs, None
  where absent: a 2-D one is per position, (batch, length); any other is per head, (rows,
  heads, ...), split over the batch only when it has a row per batch row (the transpose sums a
  shared bias's gradient over `batch_axes`).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return attend(query, key, value, *extras)
  batch, heads = query.shape[0], query.shape[2]
  batch_axes = _mesh_axes_for(batch_axes, batch, mesh)
  head_axes = _mesh_axes_for(head_axes, heads, mesh)
  qkv_spec = PartitionSpec(batch_axes, None, head_axes, None)

  def spec(x: Array) -> PartitionSpec:
    if x.ndim == 2:
      return PartitionSpec(batch_axes, None)
    return PartitionSpec(batch_axes if x.shape[0] > 1 else None, head_axes,
                         *([None] * (x.ndim - 2)))

  # shard_map takes arrays only: the optional ones travel in a list with their specs.
  present = [x for x in extras if x is not None]

  def local(q: Array, k: Array, v: Array, given: list[Array]) -> Array:
    it = iter(given)
    return attend(q, k, v, *(next(it) if x is not None else None for x in extras))

  # check_vma=False: Pallas outputs carry no varying-axes type. The transpose still sums the
  # gradient of an input not split over an axis (the bias, over the batch axes) across it.
  return jax.shard_map(
      local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, [spec(x) for x in present]),
      out_specs=qkv_spec, check_vma=False)(query, key, value, present)
