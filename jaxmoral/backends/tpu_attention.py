"""T5 flash attention for TPUs in Pallas (Mosaic), with the gradient of the position bias.

The einsum path materialises (batch, heads, q_len, k_len) scores, weights and their gradients;
here three kernels stream over tiles and keep only per-row statistics:

  forward   grid (batch, heads, q blocks, k blocks): online softmax; out and the row
            log-sum-exp (the backward's only residual besides the inputs and out).
  dk/dv     grid (heads, k blocks, batch, q blocks): dk and dv over q blocks, and the bias
            gradient over the batch.
  dq        grid (batch, heads, q blocks, k blocks): dq over k blocks.

With the batch as the dk/dv grid's second-innermost axis, the (q_len, block_k) float32 column of
the bias gradient stays in VMEM across every batch row and q block and is written to HBM once
(VMEM proportional to q_len: 1 MiB, double-buffered, at 2,048 x 128); reducing in the dq kernel
would need dynamic lane offsets, a separate kernel two more products per tile. JAX's own
`pallas.ops.tpu.flash_attention` returns a (batch, heads, q, k) bias gradient and needs the
bias broadcast to the batch: the memory this module exists to avoid. Lengths are padded to
multiples of 128; the head width stays as it is (a block equal to the whole last dimension is a
legal Mosaic block).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxmoral.backends import attention

Array = jax.Array
MeshAxes = attention.MeshAxes

NUM_LANES = 128
NUM_SUBLANES = 8
MASK_VALUE = attention.MASK_VALUE
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Largest tile sizes (multiples of 128); each kernel takes the largest multiple of 128 up to
  its maximum that divides the padded length.

  Attributes:
    block_q, block_k: Query and key rows per tile of the forward and dq kernels.
    block_q_dkv, block_k_dkv: Query and key rows per tile of the dk/dv kernel; block_k_dkv is
      also the width of the bias-gradient column it keeps in VMEM (4 * q_len * block_k_dkv
      bytes).
  """
  block_q: int = 512
  block_k: int = 512
  block_q_dkv: int = 512
  block_k_dkv: int = 128

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or value <= 0 or value % NUM_LANES:
        raise ValueError(f"BlockSizes.{field.name} must be a positive multiple of {NUM_LANES}, "
                         f"got {value!r}")


def _fit_block(block: int, length: int) -> int:
  """The largest multiple of 128 that is <= `block` and divides `length` (a multiple of 128)."""
  for size in range(min(block, length), 0, -NUM_LANES):
    if length % size == 0:
      return size
  raise AssertionError(f"{length} is not a multiple of {NUM_LANES}")


def _lanes(x: Array, width: int) -> Array:
  """(rows, 128) lane-replicated values -> (rows, width)."""
  return jnp.tile(x, (1, pl.cdiv(width, NUM_LANES)))[:, :width]


def _tile_mask(qid_ref: Any, kid_ref: Any, i: Any, j: Any, causal: bool, block_q: int,
               block_k: int) -> Array:
  """(block_q, block_k) bool for tile (i, j): same segment id (the query ids' block is
  (block_q, 128), lane-replicated; the key ids' (8, block_k)) and, if causal, key position <=
  query position."""
  shape = (block_q, block_k)
  mask = jnp.tile(qid_ref[...], (1, block_k // NUM_LANES)) == kid_ref[:1, :]
  if causal:
    rows = i * block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = j * block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = jnp.logical_and(mask, cols <= rows)
  return mask


def _last_k_block(q_index: Any, block_q: int, block_k: int) -> Any:
  """Index of the last k block a causal q block sees."""
  return (q_index * block_q + block_q - 1) // block_k


def _unless_past_diagonal(tile: Any, causal: bool, q_index: Any, k_index: Any, block_q: int,
                          block_k: int) -> None:
  """Runs `tile`, except (causal) where k block `k_index` lies past q block `q_index`'s
  last key."""
  if causal:
    pl.when(k_index <= _last_k_block(q_index, block_q, block_k))(tile)
  else:
    tile()


def _first_q_block(k_index: Any, block_q: int, block_k: int) -> Any:
  """Index of the first q block that sees a causal k block."""
  return (k_index * block_k) // block_q


# -- kernels --------------------------------------------------------------------------------------
def _forward_kernel(*refs: Any, has_bias: bool, causal: bool, block_q: int,
                    block_k: int) -> None:
  """One (q block, k block) tile of the online softmax; k blocks are the innermost axis."""
  (q_ref, k_ref, v_ref, bias_ref, qid_ref, kid_ref, o_ref, lse_ref, m_ref, l_ref,
   acc_ref) = attention.kernel_refs(refs, has_bias)
  i, j = pl.program_id(2), pl.program_id(3)
  width = acc_ref.shape[-1]

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def _tile():
    s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=jnp.float32)
    if bias_ref is not None:
      s = s + bias_ref[...]
    mask = _tile_mask(qid_ref, kid_ref, i, j, causal, block_q, block_k)
    s = jnp.where(mask, s, MASK_VALUE)
    m_prev, l_prev = m_ref[...], l_ref[...]  # (block_q, 128), lanes equal
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1)[:, None])
    # Masked entries zeroed explicitly (see attention.MASK_VALUE).
    p = jnp.where(mask, jnp.exp(s - jnp.tile(m_next, (1, block_k // NUM_LANES))), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = alpha * l_prev + lax.broadcast_in_dim(jnp.sum(p, axis=-1), l_prev.shape, (0,))
    m_ref[...] = m_next
    pv = lax.dot_general(p.astype(v_ref.dtype), v_ref[...], _NN,
                         preferred_element_type=jnp.float32)
    acc_ref[...] = _lanes(alpha, width) * acc_ref[...] + pv

  _unless_past_diagonal(_tile, causal, i, j, block_q, block_k)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    l = l_ref[...]
    l = jnp.where(l > 0.0, l, 1.0)  # Rows that saw no key: acc is 0, so the output is 0.
    o_ref[...] = (acc_ref[...] * _lanes(1.0 / l, width)).astype(o_ref.dtype)
    lse_ref[...] = m_ref[...] + jnp.log(l)


def _probabilities_and_ds(q: Array, k: Array, v: Array, bias: Optional[Array], mask: Array,
                          lse: Array, do: Array, di: Array) -> tuple[Array, Array]:
  """Recomputed probabilities p and dScores = p * (dO v^T - rowsum(dO * O)) of a tile."""
  s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
  if bias is not None:
    s = s + bias
  p = jnp.where(mask, jnp.exp(s - lse), 0.0)
  dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
  return p, p * (dp - di)


def _dkv_kernel(*refs: Any, has_bias: bool, per_row_bias: bool, causal: bool, block_q: int,
                block_k: int) -> None:
  """dk, dv (accumulated over q blocks, the innermost axis) and the bias gradient (over the
  batch, the next axis: its (q_len, block_k) column stays in VMEM across both)."""
  (q_ref, k_ref, v_ref, bias_ref, qid_ref, kid_ref, lse_ref, do_ref, di_ref, dk_ref, dv_ref,
   dbias_ref, dk_acc, dv_acc) = attention.kernel_refs(refs, has_bias, dbias_at=11)
  j, b, i = pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)

  def _store_dbias(ds: Array) -> None:
    assert dbias_ref is not None  # Called only with a bias.
    # A per-row bias has its own gradient per batch row; a shared one is written by batch row 0
    # and added to by the others (the block stays in VMEM across the batch axis).
    if per_row_bias:
      dbias_ref[rows, :] = ds
      return

    @pl.when(b == 0)
    def _write():
      dbias_ref[rows, :] = ds

    @pl.when(b > 0)
    def _add():
      dbias_ref[rows, :] += ds

  def _tile():
    q, do = q_ref[...], do_ref[...]
    mask = _tile_mask(qid_ref, kid_ref, i, j, causal, block_q, block_k)
    p, ds = _probabilities_and_ds(
        q, k_ref[...], v_ref[...], None if bias_ref is None else bias_ref[...], mask,
        lse_ref[0][:, None], do, di_ref[0][:, None])
    dv_acc[...] += lax.dot_general(p.T.astype(do.dtype), do, _NN,
                                   preferred_element_type=jnp.float32)
    dk_acc[...] += lax.dot_general(ds.T.astype(q.dtype), q, _NN,
                                   preferred_element_type=jnp.float32)
    if dbias_ref is not None:
      _store_dbias(ds)

  if causal:
    visible = i >= _first_q_block(j, block_q, block_k)
    pl.when(visible)(_tile)
    if dbias_ref is not None:
      # Tiles above the diagonal have no gradient, but their block must still be written.
      pl.when(jnp.logical_not(visible))(
          lambda: _store_dbias(jnp.zeros((block_q, block_k), jnp.float32)))
  else:
    _tile()

  @pl.when(i == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs: Any, has_bias: bool, causal: bool, block_q: int, block_k: int) -> None:
  """dq of one q block, accumulated over k blocks (the innermost axis)."""
  (q_ref, k_ref, v_ref, bias_ref, qid_ref, kid_ref, lse_ref, do_ref, di_ref, dq_ref,
   dq_acc) = attention.kernel_refs(refs, has_bias)
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  def _tile():
    k = k_ref[...]
    mask = _tile_mask(qid_ref, kid_ref, i, j, causal, block_q, block_k)
    _, ds = _probabilities_and_ds(
        q_ref[...], k, v_ref[...], None if bias_ref is None else bias_ref[...], mask,
        lse_ref[0][:, None], do_ref[...], di_ref[0][:, None])
    dq_acc[...] += lax.dot_general(ds.astype(k.dtype), k, _NN,
                                   preferred_element_type=jnp.float32)

  _unless_past_diagonal(_tile, causal, i, j, block_q, block_k)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


# -- pallas_call wrappers (padded, heads-first arrays) ------------------------------------------
_SQ = pl.Squeezed()


def _compiler_params(*semantics: Literal["parallel", "arbitrary"]) -> Any:
  return pltpu.CompilerParams(dimension_semantics=semantics)


def _cost(flops: int, transcendentals: int, arrays: Sequence[Any]) -> pl.CostEstimate:
  """For XLA's scheduler: a kernel's FLOPs, exps, and the bytes of its inputs and outputs."""
  return pl.CostEstimate(
      flops=int(flops), transcendentals=int(transcendentals),
      bytes_accessed=int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)))


def _lane_ids(ids: Array) -> Array:
  """(batch, q) -> (batch, q, 128): a query's id along the lanes, read as a column in tiles."""
  return lax.broadcast_in_dim(ids, ids.shape + (NUM_LANES,), (0, 1))


def _sublane_ids(ids: Array) -> Array:
  """(batch, k) -> (batch, 8, k): a key's id down the sublanes, read as a row in tiles."""
  return lax.broadcast_in_dim(ids, (ids.shape[0], NUM_SUBLANES, ids.shape[1]), (0, 2))


def _q_block_inputs(q: Array, k: Array, v: Array, bias: Optional[Array], lane_q_ids: Array,
                    sublane_k_ids: Array, causal: bool, bq: int,
                    bk: int) -> tuple[list[Any], list[Array]]:
  """In-specs and arguments of a (batch, heads, q blocks, k blocks) grid: q, k, v, [bias] and
  the ids. Causal tiles past the diagonal are skipped: they keep the last block, copy nothing."""
  width = q.shape[-1]
  per_row_bias = bias is not None and bias.shape[0] > 1

  def k_index(i: Any, j: Any) -> Any:
    return jnp.minimum(j, _last_k_block(i, bq, bk)) if causal else j

  kv_spec = pl.BlockSpec((_SQ, _SQ, bk, width), lambda b, h, i, j: (b, h, k_index(i, j), 0))
  in_specs = [pl.BlockSpec((_SQ, _SQ, bq, width), lambda b, h, i, j: (b, h, i, 0)),
              kv_spec, kv_spec]
  args = [q, k, v]
  if bias is not None:
    in_specs.append(pl.BlockSpec((_SQ, _SQ, bq, bk), lambda b, h, i, j: (
        b if per_row_bias else 0, h, i, k_index(i, j))))
    args.append(bias)
  in_specs += [pl.BlockSpec((_SQ, bq, NUM_LANES), lambda b, h, i, j: (b, i, 0)),
               pl.BlockSpec((_SQ, NUM_SUBLANES, bk), lambda b, h, i, j: (b, 0, k_index(i, j)))]
  return in_specs, args + [lane_q_ids, sublane_k_ids]


def _forward(q: Array, k: Array, v: Array, bias: Optional[Array], q_ids: Array, k_ids: Array,
             causal: bool, blocks: BlockSizes, interpret: bool) -> tuple[Array, Array]:
  """Padded (batch, heads, len, d) inputs -> out (batch, heads, q_len, d) and the row
  log-sum-exp (batch, heads, q_len) float32."""
  batch, heads, q_len, width = q.shape
  k_len = k.shape[2]
  bq, bk = _fit_block(blocks.block_q, q_len), _fit_block(blocks.block_k, k_len)
  in_specs, args = _q_block_inputs(q, k, v, bias, _lane_ids(q_ids), _sublane_ids(k_ids),
                                   causal, bq, bk)
  kernel = functools.partial(_forward_kernel, has_bias=bias is not None, causal=causal,
                             block_q=bq, block_k=bk)
  flops = 4 * batch * heads * q_len * k_len * width
  out, lse = pl.pallas_call(
      kernel,
      grid=(batch, heads, q_len // bq, k_len // bk),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((_SQ, _SQ, bq, width), lambda b, h, i, j: (b, h, i, 0)),
                 pl.BlockSpec((_SQ, _SQ, bq, NUM_LANES), lambda b, h, i, j: (b, h, i, 0))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, q_len, NUM_LANES), jnp.float32)],
      scratch_shapes=[pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                      pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                      pltpu.VMEM((bq, width), jnp.float32)],
      compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
      cost_estimate=_cost(flops // (2 if causal else 1),
                          batch * heads * q_len * k_len // (2 if causal else 1), args + [q]),
      interpret=interpret,
      name="t5_flash_attention_fwd",
  )(*args)
  return out, lse[..., 0]


def _backward(q: Array, k: Array, v: Array, bias: Optional[Array], q_ids: Array, k_ids: Array,
              out: Array, lse: Array, do: Array, causal: bool, blocks: BlockSizes,
              interpret: bool) -> tuple[Array, Array, Array, Optional[Array]]:
  """dq, dk, dv and (with a bias) the bias gradient, in the inputs' padded shapes."""
  batch, heads, q_len, width = q.shape
  k_len = k.shape[2]
  has_bias = bias is not None
  per_row_bias = bias is not None and bias.shape[0] > 1
  # rowsum(dO * O), the softmax backward's per-row term; (batch, heads, 1, q_len) like lse.
  di = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)[:, :, None, :]
  lse = lse[:, :, None, :]
  lane_q_ids, sublane_k_ids = _lane_ids(q_ids), _sublane_ids(k_ids)
  flops = 4 * batch * heads * q_len * k_len * width // (2 if causal else 1)
  transcendentals = batch * heads * q_len * k_len // (2 if causal else 1)

  # dk, dv and the bias gradient: grid (heads, k blocks, batch, q blocks).
  bq, bk = _fit_block(blocks.block_q_dkv, q_len), _fit_block(blocks.block_k_dkv, k_len)

  def q_index(h, j, b, i):
    if causal:  # Tiles above the diagonal are skipped: keep the first visible q block.
      i = jnp.maximum(i, _first_q_block(j, bq, bk))
    return i

  qd_spec = pl.BlockSpec((_SQ, _SQ, bq, width), lambda h, j, b, i: (b, h, q_index(h, j, b, i), 0))
  kv_spec = pl.BlockSpec((_SQ, _SQ, bk, width), lambda h, j, b, i: (b, h, j, 0))
  row_spec = pl.BlockSpec((_SQ, _SQ, 1, bq), lambda h, j, b, i: (b, h, 0, q_index(h, j, b, i)))
  in_specs, args = [qd_spec, kv_spec, kv_spec], [q, k, v]
  if bias is not None:
    in_specs.append(pl.BlockSpec((_SQ, _SQ, bq, bk), lambda h, j, b, i: (
        b if per_row_bias else 0, h, q_index(h, j, b, i), j)))
    args.append(bias)
  in_specs += [
      pl.BlockSpec((_SQ, bq, NUM_LANES), lambda h, j, b, i: (b, q_index(h, j, b, i), 0)),
      pl.BlockSpec((_SQ, NUM_SUBLANES, bk), lambda h, j, b, i: (b, 0, j)),
      row_spec, qd_spec, row_spec]
  args += [lane_q_ids, sublane_k_ids, lse, do, di]
  out_specs = [kv_spec, kv_spec]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  if bias is not None:
    out_specs.append(pl.BlockSpec((_SQ, _SQ, q_len, bk),
                                  lambda h, j, b, i: (b if per_row_bias else 0, h, 0, j)))
    out_shape.append(jax.ShapeDtypeStruct(bias.shape, jnp.float32))
  kernel = functools.partial(_dkv_kernel, has_bias=has_bias, per_row_bias=per_row_bias,
                             causal=causal, block_q=bq, block_k=bk)
  dkv = pl.pallas_call(
      kernel,
      grid=(heads, k_len // bk, batch, q_len // bq),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((bk, width), jnp.float32), pltpu.VMEM((bk, width), jnp.float32)],
      compiler_params=_compiler_params("parallel", "parallel", "arbitrary", "arbitrary"),
      cost_estimate=_cost(flops * 2, transcendentals, args + out_shape),
      interpret=interpret,
      name="t5_flash_attention_dkv",
  )(*args)
  dk, dv = dkv[0], dkv[1]
  dbias = dkv[2] if has_bias else None

  # dq: grid (batch, heads, q blocks, k blocks).
  bq, bk = _fit_block(blocks.block_q, q_len), _fit_block(blocks.block_k, k_len)
  qd_spec = pl.BlockSpec((_SQ, _SQ, bq, width), lambda b, h, i, j: (b, h, i, 0))
  row_spec = pl.BlockSpec((_SQ, _SQ, 1, bq), lambda b, h, i, j: (b, h, 0, i))
  in_specs, args = _q_block_inputs(q, k, v, bias, lane_q_ids, sublane_k_ids, causal, bq, bk)
  in_specs += [row_spec, qd_spec, row_spec]
  args += [lse, do, di]
  kernel = functools.partial(_dq_kernel, has_bias=has_bias, causal=causal, block_q=bq,
                             block_k=bk)
  dq = pl.pallas_call(
      kernel,
      grid=(batch, heads, q_len // bq, k_len // bk),
      in_specs=in_specs,
      out_specs=qd_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      scratch_shapes=[pltpu.VMEM((bq, width), jnp.float32)],
      compiler_params=_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
      cost_estimate=_cost(flops * 3 // 2, transcendentals, args + [q]),
      interpret=interpret,
      name="t5_flash_attention_dq",
  )(*args)
  return dq, dk, dv, dbias


_attention = attention.custom_vjp(_forward, _backward)


# -- public API -----------------------------------------------------------------------------------
def flash_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                    query_segment_ids: Optional[Array] = None,
                    key_segment_ids: Optional[Array] = None, *, causal: bool = False,
                    block_sizes: BlockSizes = BlockSizes(),
                    interpret: Optional[bool] = None) -> Array:
  """T5 attention, `softmax(q k^T + bias) v` without scaling, through the Pallas kernels.

  Differentiable in query, key, value and bias (`jax.custom_vjp`).

  Args:
    query, key, value: (batch, q_len or k_len, heads, d_kv).
    bias: (1 or batch, heads, q_len, k_len) additive bias (computed in float32), or None.
    query_segment_ids, key_segment_ids: (batch, q_len), (batch, k_len) int (see `attention`),
      or None: every position valid, one segment.
    causal: Queries attend only to keys at their own position or before.
    interpret: Run in Pallas interpret mode; None: `attention.INTERPRET`.

  Returns:
    (batch, q_len, heads, d_kv) in query's dtype; zero for queries that attend to no key.
  """
  attention.check_shapes("tpu_attention.flash_attention", query, key, value, bias,
                         query_segment_ids, key_segment_ids)
  interpret = attention.interpret_mode(interpret)
  batch, q_len, _, _ = query.shape
  k_len = key.shape[1]
  q_pad, k_pad = attention.round_up(q_len, NUM_LANES), attention.round_up(k_len, NUM_LANES)

  def heads_first(x: Array, padded: int) -> Array:  # (b, l, h, d) -> (b, h, padded, d)
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded - x.shape[2]), (0, 0)))

  if bias is not None:
    bias = jnp.pad(bias.astype(jnp.float32),
                   ((0, 0), (0, 0), (0, q_pad - q_len), (0, k_pad - k_len)))
  out = _attention(heads_first(query, q_pad), heads_first(key, k_pad),
                   heads_first(value.astype(query.dtype), k_pad), bias,
                   attention.kernel_ids(query_segment_ids, batch, q_len, q_pad, -1),
                   attention.kernel_ids(key_segment_ids, batch, k_len, k_pad, -2),
                   (causal, block_sizes, interpret))
  return jnp.swapaxes(out[:, :, :q_len], 1, 2)


def sharded_flash_attention(query: Array, key: Array, value: Array,
                            bias: Optional[Array] = None,
                            query_segment_ids: Optional[Array] = None,
                            key_segment_ids: Optional[Array] = None, *, causal: bool = False,
                            batch_axes: MeshAxes = None, head_axes: MeshAxes = None,
                            block_sizes: BlockSizes = BlockSizes(),
                            interpret: Optional[bool] = None) -> Array:
  """`flash_attention` on every device of the current mesh (`jax.set_mesh`), each on its shard
  (`attention.sharded`: the batch split over `batch_axes`, heads over `head_axes`).

  Raises:
    ValueError: The mesh (or default backend) is not a TPU and interpret mode is off.
  """
  interpret = attention.interpret_mode(interpret)
  attention.check_platform("pallas", "Mosaic", ("tpu",), interpret)
  attend = functools.partial(flash_attention, causal=causal, block_sizes=block_sizes,
                             interpret=interpret)
  return attention.sharded(attend, query, key, value,
                           [bias, query_segment_ids, key_segment_ids],
                           batch_axes=batch_axes, head_axes=head_axes)
