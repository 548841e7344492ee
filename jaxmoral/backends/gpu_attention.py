"""T5 flash attention for GPUs in Pallas (Triton), with the batch-summed gradient of the bias.

cuDNN's fused attention (attention_impl="cudnn") takes T5's (1, heads, q_len, k_len) float32
position bias but, through JAX, returns its gradient per batch row and leaves the batch sum to
XLA, which costs about as much as the attention itself at T5 1.1-large shapes. These three
Triton kernels stream over tiles and keep only per-row statistics:

  forward  grid (batch, q blocks, heads): online softmax; out and the base-2 log-sum-exp.
  dq       grid (batch, q blocks, heads): dq, and the softmax backward's row term
           di = rowsum(dO * O) for the dk/dv kernel (no separate pass over O).
  dk/dv    grid (k blocks, heads, batch groups): each program walks its group's batch rows,
           `dkv_rows` at a time, over the q blocks, and adds their summed dScores tile into
           the group's (q_len, block_k) bias-gradient column, which it alone owns (a plain
           read-add-write in L2, no atomics); XLA sums the few group partials.

On an H100 at T5 1.1-large's encoder shape these kernels are still slower than cuDNN's (the
float32 bias tiles and the bias-gradient column cost them more; the `bias_diagonals` form is
slower still), so attention_impl="auto" keeps cuDNN. Inputs stay in the model's (batch, length,
heads, d_kv) layout (no transposes); lengths are padded to the tiles and the head width to a
power of two, as Triton needs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmoral import validation
from jaxmoral.backends import attention

Array = jax.Array
MeshAxes = attention.MeshAxes

MASK_VALUE = attention.MASK_VALUE
LOG2E = math.log2(math.e)
MIN_BLOCK = 16  # Triton's smallest tile side for a matrix product.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two, capped at the rounded length) and Triton launch parameters.

  Attributes:
    block_q, block_k: Tile of the forward kernel (queries per program, keys per step).
    block_q_dq, block_k_dq: Tile of the dq kernel.
    block_q_dkv, block_k_dkv: Tile of the dk/dv kernel (keys per program, queries per step);
      block_k_dkv is also the width of the bias-gradient column a program owns.
    num_warps, num_stages: Forward kernel launch parameters.
    num_warps_bwd, num_stages_bwd: Both backward kernels' launch parameters.
    dkv_programs: With a bias, the batch is split into the fewest groups (a divisor of the
      batch) that give the dk/dv kernel at least this many programs, to fill the GPU.
    dkv_rows: With a bias, the dk/dv kernel steps through this many batch rows at a time
      (where it divides a group's rows): 1/dkv_rows of the bias-gradient read-add-writes, for
      dkv_rows times the dk/dv accumulators in registers.
  """
  block_q: int = 64
  block_k: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 32
  num_warps: int = 4
  num_stages: int = 2
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2
  dkv_programs: int = 512
  dkv_rows: int = 2

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      validation.positive_int(value, f"BlockSizes.{field.name}")
      if field.name.startswith("block_") and (value & (value - 1) or value < MIN_BLOCK):
        raise ValueError(f"BlockSizes.{field.name} must be a power of two >= {MIN_BLOCK}, "
                         f"got {value}")


DEFAULT_BLOCK_SIZES = BlockSizes()  # attention_impl="pallas_gpu"'s.


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static parameters of one attention call (hashable: the custom_vjp's nondiff argument)."""
  causal: bool
  blocks: BlockSizes  # Fitted to this call: tiles within its lengths, dkv_rows dividing a group.
  groups: int
  interpret: bool
  diagonals: bool = False  # The bias comes as its diagonals (see `flash_attention`).
  q_pad: int = 0  # Padded query length (indexes the diagonals).


def _next_power_of_2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _fit(block: int, length: int) -> int:
  """`block`, capped at `length` rounded up to a power of two (at least MIN_BLOCK)."""
  return min(block, max(MIN_BLOCK, _next_power_of_2(length)))


def _batch_groups(batch: int, programs_per_group: int, target: int) -> int:
  """The fewest groups (a divisor of `batch`) giving at least `target` programs, else `batch`."""
  return next((groups for groups in range(1, batch + 1)
               if batch % groups == 0 and groups * programs_per_group >= target), batch)


def _params(plan: _Plan, backward: bool) -> Any:
  b = plan.blocks
  if backward:
    return plgpu.CompilerParams(num_warps=b.num_warps_bwd, num_stages=b.num_stages_bwd)
  return plgpu.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages)


def _tile_mask(q_ids: Array, k_ids: Array, q_start: Any, k_start: Any, causal: bool) -> Array:
  """(block_q, block_k) bool: same segment id and, if causal, key position <= query position."""
  mask = q_ids[:, None] == k_ids[None, :]
  if causal:
    rows = q_start + jnp.arange(q_ids.shape[0], dtype=jnp.int32)
    cols = k_start + jnp.arange(k_ids.shape[0], dtype=jnp.int32)
    mask = jnp.logical_and(mask, cols[None, :] <= rows[:, None])
  return mask


def _scores(q: Array, k: Array, bias: Optional[Array], mask: Array) -> Array:
  """Masked base-2 scores (q k^T + bias) * log2(e) of a tile, float32."""
  s = plgpu.dot(q, k, trans_b=True)
  if bias is not None:
    s = s + bias
  return jnp.where(mask, s * LOG2E, MASK_VALUE)


def _slice(start: Any, size: int) -> Any:
  return pl.ds(pl.multiple_of(start * size, size), size)


def _bias_tile(bias_ref: Any, rows: Any, cols: Any, q_start: Any, k_start: Any,
               shape: tuple[int, int], plan: _Plan) -> Optional[Array]:
  """The (block_q, block_k) float32 bias tile at (q_start, k_start) (None without a bias): a
  slice of a full bias ref, or gathered from a diagonals ref, bias[q, k] = diagonals[k - q +
  q_len - 1] (bq + bk - 1 values that stay in L1 instead of bq * bk through L2)."""
  if bias_ref is None:
    return None
  if not plan.diagonals:
    return bias_ref[rows, cols]
  offset = k_start - q_start + plan.q_pad - 1
  index = (offset + jnp.arange(shape[1], dtype=jnp.int32)[None, :]
           - jnp.arange(shape[0], dtype=jnp.int32)[:, None])
  return bias_ref[index]


def _num_k_blocks(k_len: int, i: Any, bq: int, bk: int, causal: bool) -> Any:
  """The k blocks q block `i` sees: all, or (causal) those up to its last query."""
  num_k = k_len // bk
  return jnp.minimum(num_k, lax.div((i + 1) * bq + bk - 1, bk)) if causal else num_k


# -- kernels --------------------------------------------------------------------------------------
def _forward_kernel(*refs: Any, has_bias: bool, plan: _Plan) -> None:
  """One (batch row, q block, head): the online softmax over the k blocks."""
  q_ref, k_ref, v_ref, bias_ref, qid_ref, kid_ref, o_ref, lse_ref = attention.kernel_refs(
      refs, has_bias)
  bq, bk = plan.blocks.block_q, plan.blocks.block_k
  i = pl.program_id(1)
  q, q_ids = q_ref[...], qid_ref[...]

  def body(j, carry):
    acc, m_prev, l_prev = carry
    ks = _slice(j, bk)
    mask = _tile_mask(q_ids, kid_ref[ks], i * bq, j * bk, plan.causal)
    bias = _bias_tile(bias_ref, slice(None), ks, i * bq, j * bk, (bq, bk), plan)
    s = _scores(q, k_ref[ks, :], bias, mask)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp2(s - m_next[:, None]), 0.0)  # See attention.MASK_VALUE.
    alpha = jnp.exp2(m_prev - m_next)
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    v = v_ref[ks, :]
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_next, l_next

  num_k = _num_k_blocks(k_ref.shape[0], i, bq, bk, plan.causal)
  acc, m, l = lax.fori_loop(
      0, num_k, body,
      (jnp.zeros((bq, q.shape[1]), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
       jnp.zeros((bq,), jnp.float32)))
  l = jnp.where(l > 0.0, l, 1.0)  # Rows that saw no key: acc is 0, so the output is 0.
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def _dq_kernel(*refs: Any, has_bias: bool, plan: _Plan) -> None:
  """One (batch row, q block, head): dq over the k blocks, and di = rowsum(dO * O)."""
  (q_ref, k_ref, v_ref, bias_ref, qid_ref, kid_ref, o_ref, do_ref, lse_ref, dq_ref,
   di_ref) = attention.kernel_refs(refs, has_bias)
  bq, bk = plan.blocks.block_q_dq, plan.blocks.block_k_dq
  i = pl.program_id(1)
  q, q_ids, do = q_ref[...], qid_ref[...], do_ref[...]
  di = jnp.sum(o_ref[...].astype(jnp.float32) * do.astype(jnp.float32), axis=1)
  di_ref[...] = di
  lse = lse_ref[...]

  def body(j, dq):
    ks = _slice(j, bk)
    mask = _tile_mask(q_ids, kid_ref[ks], i * bq, j * bk, plan.causal)
    bias = _bias_tile(bias_ref, slice(None), ks, i * bq, j * bk, (bq, bk), plan)
    s = _scores(q, k_ref[ks, :], bias, mask)
    p = jnp.where(mask, jnp.exp2(s - lse[:, None]), 0.0)
    dp = plgpu.dot(do, v_ref[ks, :], trans_b=True)
    ds = p * (dp - di[:, None])
    k = k_ref[ks, :]
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  num_k = _num_k_blocks(k_ref.shape[0], i, bq, bk, plan.causal)
  dq = lax.fori_loop(0, num_k, body, jnp.zeros((bq, q.shape[1]), jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(*refs: Any, has_bias: bool, plan: _Plan) -> None:
  """One (k block, head, batch group): dk and dv of each row of the group, and the group's
  (q_len, block_k) column of the bias gradient."""
  (q_ref, k_ref, v_ref, bias_ref, qid_ref, kid_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
   dbias_ref) = attention.kernel_refs(refs, has_bias, dbias_at=11)
  bq, bk = plan.blocks.block_q_dkv, plan.blocks.block_k_dkv
  rows_per_group, q_len, width = q_ref.shape
  num_q = q_len // bq
  j = pl.program_id(0)
  first_q = lax.div(j * bk, bq) if plan.causal else 0  # Causal: q blocks before see nothing.

  step_rows = plan.blocks.dkv_rows

  def batch_rows(step, first: bool):
    """Rows step * step_rows, ...: their dScores tiles are summed before the bias-gradient
    column is read and written, once per step."""
    rows = [step * step_rows + r for r in range(step_rows)]
    kvs = [(k_ref[b, :, :], v_ref[b, :, :], kid_ref[b, :]) for b in rows]

    def body(i, carry):
      qs = _slice(i, bq)
      bias = _bias_tile(bias_ref, qs, slice(None), i * bq, j * bk, (bq, bk), plan)
      out, ds_sum = [], None
      for b, (k, v, k_ids), (dk, dv) in zip(rows, kvs, carry, strict=True):
        q, do = q_ref[b, qs, :], do_ref[b, qs, :]
        mask = _tile_mask(qid_ref[b, qs], k_ids, i * bq, j * bk, plan.causal)
        s = _scores(q, k, bias, mask)
        p = jnp.where(mask, jnp.exp2(s - lse_ref[b, qs][:, None]), 0.0)
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        dp = plgpu.dot(do, v, trans_b=True)
        ds = p * (dp - di_ref[b, qs][:, None])
        dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
        out.append((dk, dv))
        ds_sum = ds if ds_sum is None else ds_sum + ds
      if dbias_ref is not None:
        dbias_ref[qs, :] = ds_sum if first else dbias_ref[qs, :] + ds_sum
      return tuple(out)

    zeros = jnp.zeros((bk, width), jnp.float32)
    carry = lax.fori_loop(first_q, num_q, body, tuple((zeros, zeros) for _ in rows))
    for b, (dk, dv) in zip(rows, carry, strict=True):
      dk_ref[b, :, :] = dk.astype(dk_ref.dtype)
      dv_ref[b, :, :] = dv.astype(dv_ref.dtype)

  if dbias_ref is not None and plan.causal:
    # Tiles above the diagonal have no gradient, but the column must still be written.
    def zero(i, carry):
      dbias_ref[_slice(i, bq), :] = jnp.zeros((bq, bk), jnp.float32)
      return carry
    lax.fori_loop(0, first_q, zero, 0)
  batch_rows(0, first=True)

  def other_rows(step, carry):
    if dbias_ref is not None and not plan.interpret:
      # Orders the previous step's bias-gradient stores before this step's loads of the same
      # tiles, which other threads of the program may hold.
      plgpu.debug_barrier()
    batch_rows(step, first=False)
    return carry

  lax.fori_loop(1, rows_per_group // step_rows, other_rows, 0)


# -- pallas_call wrappers (padded arrays, (batch, length, heads, d) layout) ----------------------
def _bias_spec(bias: Array, plan: _Plan, block: tuple[Any, ...], index_map: Any,
               diagonals_index_map: Any) -> pl.BlockSpec:
  """A full bias's tile, or one head's whole diagonals vector."""
  if plan.diagonals:
    return pl.BlockSpec((None, None, bias.shape[-1]), diagonals_index_map)
  return pl.BlockSpec(block, index_map)


def _diagonal_sums(x: Array) -> Array:
  """(..., q, k) -> (..., q + k): out[..., k - i + q - 1] = sum of x[..., i, k] (last one 0).

  The transpose of the diagonals-to-bias gather: rows reversed, sheared by a reshape of the
  zero-padded rows, then summed.
  """
  *lead, q, k = x.shape
  x = jnp.pad(x[..., ::-1, :], [(0, 0)] * len(lead) + [(0, 0), (0, q)])
  x = x.reshape(*lead, q * (k + q))[..., :q * (k + q - 1)].reshape(*lead, q, k + q - 1)
  return jnp.pad(jnp.sum(x, axis=-2), [(0, 0)] * len(lead) + [(0, 1)])


def _row_block_call(kernel: Any, name: str, plan: _Plan, bq: int, backward: bool, q: Array,
                    k: Array, v: Array, bias: Optional[Array], *rest: Array) -> Any:
  """A pallas_call on a (batch, q blocks, heads) grid of q, k, v, [bias] and `rest` (q_ids,
  k_ids, then (batch, length, heads, d) rows or (batch, heads, length) statistics), giving a
  q-like array and a (batch, heads, q_len) float32 statistic."""
  batch, q_len, heads, width = q.shape
  k_len = k.shape[1]
  row_spec = pl.BlockSpec((None, bq, None, width), lambda b, i, h: (b, i, h, 0))
  stat_spec = pl.BlockSpec((None, None, bq), lambda b, i, h: (b, h, i))
  kv_spec = pl.BlockSpec((None, k_len, None, width), lambda b, i, h: (b, 0, h, 0))
  in_specs, args = [row_spec, kv_spec, kv_spec], [q, k, v]
  if bias is not None:
    in_specs.append(_bias_spec(bias, plan, (None, None, bq, k_len), lambda b, i, h: (0, h, i, 0),
                               lambda b, i, h: (0, h, 0)))
    args.append(bias)
  in_specs += [pl.BlockSpec((None, bq), lambda b, i, h: (b, i)),
               pl.BlockSpec((None, k_len), lambda b, i, h: (b, 0))]
  in_specs += [row_spec if x.ndim == 4 else stat_spec for x in rest[2:]]
  return pl.pallas_call(
      functools.partial(kernel, has_bias=bias is not None, plan=plan),
      grid=(batch, q_len // bq, heads),
      in_specs=in_specs,
      out_specs=[row_spec, stat_spec],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)],
      compiler_params=_params(plan, backward),
      interpret=plan.interpret,
      name=name,
  )(*args, *rest)


def _forward(q: Array, k: Array, v: Array, bias: Optional[Array], q_ids: Array, k_ids: Array,
             plan: _Plan) -> tuple[Array, Array]:
  """out (batch, q_len, heads, d) and the base-2 log-sum-exp (batch, heads, q_len) float32."""
  # Batch is the fastest grid axis, so the programs running together share a bias tile in L2.
  return _row_block_call(_forward_kernel, "t5_flash_attention_gpu_fwd", plan,
                         plan.blocks.block_q, False, q, k, v, bias, q_ids, k_ids)


def _backward(q: Array, k: Array, v: Array, bias: Optional[Array], q_ids: Array, k_ids: Array,
              out: Array, lse: Array, do: Array,
              plan: _Plan) -> tuple[Array, Array, Array, Optional[Array]]:
  """dq, dk, dv and (with a bias) the batch-summed bias gradient, in the padded shapes."""
  batch, q_len, heads, width = q.shape
  k_len = k.shape[1]
  has_bias = bias is not None

  # dq and di: grid (batch, q blocks, heads).
  dq, di = _row_block_call(_dq_kernel, "t5_flash_attention_gpu_dq", plan,
                           plan.blocks.block_q_dq, True, q, k, v, bias, q_ids, k_ids, out, do,
                           lse)

  # dk, dv and the bias gradient: grid (k blocks, heads, batch groups).
  bk, groups = plan.blocks.block_k_dkv, plan.groups
  rows = batch // groups
  q_spec = pl.BlockSpec((rows, q_len, None, width), lambda j, h, g: (g, 0, h, 0))
  kv_spec = pl.BlockSpec((rows, bk, None, width), lambda j, h, g: (g, j, h, 0))
  stat_spec = pl.BlockSpec((rows, None, q_len), lambda j, h, g: (g, h, 0))
  in_specs, args = [q_spec, kv_spec, kv_spec], [q, k, v]
  if bias is not None:
    in_specs.append(_bias_spec(bias, plan, (None, None, q_len, bk), lambda j, h, g: (0, h, 0, j),
                               lambda j, h, g: (0, h, 0)))
    args.append(bias)
  in_specs += [pl.BlockSpec((rows, q_len), lambda j, h, g: (g, 0)),
               pl.BlockSpec((rows, bk), lambda j, h, g: (g, j)),
               q_spec, stat_spec, stat_spec]
  args += [q_ids, k_ids, do, lse, di]
  out_specs = [kv_spec, kv_spec]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  if has_bias:
    out_specs.append(pl.BlockSpec((None, None, q_len, bk), lambda j, h, g: (g, h, 0, j)))
    out_shape.append(jax.ShapeDtypeStruct((groups, heads, q_len, k_len), jnp.float32))
  # k blocks are the fastest grid axis: the programs running together read the same q rows.
  results = pl.pallas_call(
      functools.partial(_dkv_kernel, has_bias=has_bias, plan=plan),
      grid=(k_len // bk, heads, groups),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_params(plan, backward=True),
      interpret=plan.interpret,
      name="t5_flash_attention_gpu_dkv",
  )(*args)
  dbias = None
  if has_bias:
    dbias = jnp.sum(results[2], axis=0, keepdims=True)
    if plan.diagonals:
      dbias = _diagonal_sums(dbias)
  return dq, results[0], results[1], dbias


_attention = attention.custom_vjp(_forward, _backward)


# -- public API -----------------------------------------------------------------------------------
def bias_diagonals(bias: Array) -> Array:
  """The diagonals (1, heads, q_len + k_len - 1) of a Toeplitz bias (1, heads, q_len, k_len):
  out[..., k - q + q_len - 1] = bias[..., q, k], read off the first column and row; exact
  (values and gradient) only for a bias that depends on k - q alone, as T5's does."""
  return jnp.concatenate([bias[:, :, ::-1, 0], bias[:, :, 0, 1:]], axis=-1)


def flash_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                    query_segment_ids: Optional[Array] = None,
                    key_segment_ids: Optional[Array] = None, *,
                    bias_diagonals: Optional[Array] = None, causal: bool = False,
                    block_sizes: Optional[BlockSizes] = None,
                    interpret: Optional[bool] = None) -> Array:
  """T5 attention, `softmax(q k^T + bias) v` without scaling, through the Triton kernels.

  Differentiable in query, key, value and bias, whose gradient the kernels sum over the batch.
  Arguments and result as `tpu_attention.flash_attention`, except:

  Args:
    bias: (1, heads, q_len, k_len), shared by the batch (computed in float32), or None.
    bias_diagonals: Instead of `bias`, a Toeplitz bias given by its diagonals,
      (1, heads, q_len + k_len - 1) (`bias_diagonals(bias)`); its gradient is the bias
      gradient summed along each diagonal.
    block_sizes: Tile sizes and launch parameters; None: `DEFAULT_BLOCK_SIZES` (read when
      traced).
  """
  attention.check_shapes("gpu_attention.flash_attention", query, key, value, bias,
                         query_segment_ids, key_segment_ids, per_row_bias=False,
                         bias_diagonals=bias_diagonals)
  interpret = attention.interpret_mode(interpret)
  batch, q_len, heads, width = query.shape
  k_len = key.shape[1]
  b = DEFAULT_BLOCK_SIZES if block_sizes is None else block_sizes
  b = dataclasses.replace(
      b, block_q=_fit(b.block_q, q_len), block_q_dq=_fit(b.block_q_dq, q_len),
      block_q_dkv=_fit(b.block_q_dkv, q_len), block_k=_fit(b.block_k, k_len),
      block_k_dq=_fit(b.block_k_dq, k_len), block_k_dkv=_fit(b.block_k_dkv, k_len))
  q_pad = attention.round_up(q_len, max(b.block_q, b.block_q_dq, b.block_q_dkv))
  k_pad = attention.round_up(k_len, max(b.block_k, b.block_k_dq, b.block_k_dkv))
  width_pad = max(MIN_BLOCK, _next_power_of_2(width))
  has_bias = bias is not None or bias_diagonals is not None
  groups = (_batch_groups(batch, (k_pad // b.block_k_dkv) * heads, b.dkv_programs)
            if has_bias else batch)
  dkv_rows = b.dkv_rows if has_bias and (batch // groups) % b.dkv_rows == 0 else 1
  plan = _Plan(causal=causal, blocks=dataclasses.replace(b, dkv_rows=dkv_rows), groups=groups,
               interpret=bool(interpret), diagonals=bias_diagonals is not None, q_pad=q_pad)

  def pad(x: Array, length: int) -> Array:
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, width_pad - width)))

  if bias is not None:
    bias = jnp.pad(bias.astype(jnp.float32),
                   ((0, 0), (0, 0), (0, q_pad - q_len), (0, k_pad - k_len)))
  elif bias_diagonals is not None:  # Padded to q_pad + k_pad, indexed by k - q + q_pad - 1.
    bias = jnp.pad(bias_diagonals.astype(jnp.float32),
                   ((0, 0), (0, 0), (q_pad - q_len, k_pad - k_len + 1)))
  out = _attention(pad(query, q_pad), pad(key.astype(query.dtype), k_pad),
                   pad(value.astype(query.dtype), k_pad), bias,
                   attention.kernel_ids(query_segment_ids, batch, q_len, q_pad, -1),
                   attention.kernel_ids(key_segment_ids, batch, k_len, k_pad, -2), (plan,))
  return out[:, :q_len, :, :width]


def sharded_flash_attention(query: Array, key: Array, value: Array,
                            bias: Optional[Array] = None,
                            query_segment_ids: Optional[Array] = None,
                            key_segment_ids: Optional[Array] = None, *,
                            bias_diagonals: Optional[Array] = None, causal: bool = False,
                            batch_axes: MeshAxes = None, head_axes: MeshAxes = None,
                            block_sizes: Optional[BlockSizes] = None,
                            interpret: Optional[bool] = None) -> Array:
  """`flash_attention` on every device of the current mesh (`jax.set_mesh`), each on its shard
  (`attention.sharded`: the batch split over `batch_axes`, heads over `head_axes`).

  Raises:
    ValueError: The mesh (or default backend) is not a GPU and interpret mode is off.
  """
  interpret = attention.interpret_mode(interpret)
  attention.check_platform("pallas_gpu", "Triton", ("gpu", "cuda", "rocm"), interpret)

  def attend(q: Array, k: Array, v: Array, bias_: Optional[Array], q_ids: Optional[Array],
             k_ids: Optional[Array], diagonals: Optional[Array]) -> Array:
    return flash_attention(q, k, v, bias_, q_ids, k_ids, bias_diagonals=diagonals,
                           causal=causal, block_sizes=block_sizes, interpret=interpret)

  return attention.sharded(attend, query, key, value,
                           [bias, query_segment_ids, key_segment_ids, bias_diagonals],
                           batch_axes=batch_axes, head_axes=head_axes)
